"""``AxialAttention``: a row pass then a column pass over an image in raster order, each pass its
own multi-head softmax attention (Ho et al. 2019)."""

from __future__ import annotations

import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from attnzoo._checks import check_positive_int, check_tensor


class _AxisAttention(nn.Module):
    """Multi-head self-attention along the middle axis of ``(B', L, dim)``: own q/k/v/out."""

    def __init__(self, dim: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim, bias=bias) for _ in range(4))

    def forward(self, x: Tensor, causal: bool) -> Tensor:
        q, k, v = (
            rearrange(p(x), "b l (h d) -> b h l d", h=self.heads) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # [B', heads, L, d]
        return self.out_proj(rearrange(out, "b h l d -> b l (h d)"))


class AxialAttention(nn.Module):
    """Axial attention (Ho et al. 2019, Axial Attention in Multidimensional Transformers,
    https://arxiv.org/abs/1912.12180) on an ``h x w`` grid.

    ``y = column(row(x))``: ``row`` is multi-head softmax self-attention of each token over the
    tokens of its row, ``column`` the same over the tokens of its column, each pass with its own
    q/k/v/out projections and its own softmax, as in the paper, where each axis is a separate
    attention layer. Together they give every output the whole grid as receptive field at
    O(N (h + w)) cost instead of O(N^2).

    Args:
        dim: token width. heads: heads of each pass (``dim % heads == 0``).
        shape: ``(h, w)``, the grid; inputs must have N = h * w. causal: see Notes. Default False.
        bias: whether the projections have biases. Default True.

    Shapes:
        ``x (B, h * w, dim)`` in raster (row-major) order: token ``r * w + c`` is row r, column c,
        the order of ``attnzoo.patterns.axial`` and ``block2d`` -> ``(B, h * w, dim)``.

    Notes:
        ``causal=True``: the row pass lets (r, c) see (r, c') with c' <= c, the column pass
        (r', c) with r' <= r, so (r, c) sees exactly the (r', c') with r' <= r and c' <= c: never
        a later raster position, but not the whole raster past either (the earlier rows' columns
        right of c are missing). Ho et al.'s decoder reaches the whole past with more layers: an
        outer decoder (unmasked rows, then masked columns, shifted down one row) feeding an inner
        masked row attention; that architecture is not reproduced here.
        The paper wraps each pass in its own residual + layer-norm block: ``row_attention`` and
        ``column_attention`` are public so a caller can do that; ``forward`` composes them bare.
    """

    def __init__(
        self, dim: int, heads: int, shape: tuple[int, int], *, causal: bool = False, bias: bool = True
    ) -> None:
        super().__init__()
        check_positive_int(dim, "dim")
        check_positive_int(heads, "heads")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        if not (isinstance(shape, (tuple, list)) and len(shape) == 2):
            raise ValueError(f"shape must be a pair (h, w) of grid sizes, got {shape!r}")
        for size, name in zip(shape, ("shape[0] (h)", "shape[1] (w)")):
            check_positive_int(size, name)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.dim, self.heads, self.shape, self.causal = dim, heads, (int(shape[0]), int(shape[1])), causal
        self.row, self.column = _AxisAttention(dim, heads, bias), _AxisAttention(dim, heads, bias)

    def _check(self, x: Tensor) -> None:
        h, w = self.shape
        check_tensor(x, "x", 3, f"(B, h*w={h * w}, dim={self.dim})")
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have width dim={self.dim}, got shape {tuple(x.shape)}")
        if x.shape[1] != h * w:
            raise ValueError(
                f"shape=({h}, {w}) needs N = h*w = {h * w} tokens in raster order, got N={x.shape[1]}; "
                f"pass the grid's shape=(h, w) with h*w = N"
            )

    def row_attention(self, x: Tensor) -> Tensor:
        """Each token attends over its row (c' <= c when causal). ``(B, h*w, dim)`` -> same."""
        self._check(x)
        rows = rearrange(x, "b (r c) d -> (b r) c d", r=self.shape[0])
        return rearrange(self.row(rows, self.causal), "(b r) c d -> b (r c) d", r=self.shape[0])

    def column_attention(self, x: Tensor) -> Tensor:
        """Each token attends over its column (r' <= r when causal). ``(B, h*w, dim)`` -> same."""
        self._check(x)
        columns = rearrange(x, "b (r c) d -> (b c) r d", r=self.shape[0])
        return rearrange(self.column(columns, self.causal), "(b c) r d -> b (r c) d", c=self.shape[1])

    def forward(self, x: Tensor) -> Tensor:
        return self.column_attention(self.row_attention(x))
