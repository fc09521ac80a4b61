"""``LAMAPooling``: low-rank multiplicative attention pooling of a sequence to one vector per
head (a layer, not a (q, k, v) mechanism, so it is not in the registry)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnzoo._checks import check_key_padding_mask, check_module_input, check_positive_int, check_tensor
from attnzoo.backends.reference import normalize_scores


class LAMAPooling(nn.Module):
    """Low-rank multi-head attention pooling, LAMA (Mehta et al. 2019, Low Rank Factorization for
    Compact Multi-Head Self-Attention, https://arxiv.org/abs/1912.00835).

    ``s_hi = c_h^T U_h V_h^T x_i``, ``alpha_h = softmax_i(s_h)`` over real tokens,
    ``out_h = sum_i alpha_hi x_i``: a (heads x dim) sentence representation.

    Args:
        dim: width of the tokens. heads: pooled vectors. Default 4.
        rank: rank r of each head's bilinear form ``U_h V_h^T`` (U_h, V_h ``(dim, r)``). Default 8.

    Shapes:
        ``x (B, N, dim)``, ``key_padding_mask (B, N)`` bool (True = real) -> ``(B, heads, dim)``.

    Notes:
        Representative keys: none are picked; each head's one query, its learned context c_h,
        weighs all N tokens. The score is not scaled. All-padding pools to zeros (zero gradient).
    """

    def __init__(self, dim: int, heads: int = 4, rank: int = 8) -> None:
        super().__init__()
        for value, name in ((dim, "dim"), (heads, "heads"), (rank, "rank")):
            check_positive_int(value, name)
        self.dim = dim
        self.context = nn.Parameter(torch.randn(heads, dim))
        self.u = nn.Parameter(torch.randn(heads, dim, rank) * dim**-0.5)
        self.v = nn.Parameter(torch.randn(heads, dim, rank) * dim**-0.5)

    def weights(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The pooling weights ``alpha (B, heads, N)``."""
        query = torch.einsum("hd,hdr->hr", self.context, self.u).to(x.dtype)  # c_h^T U_h: (heads, r)
        keys = torch.einsum("bnd,hdr->bhnr", x, self.v.to(x.dtype))  # V_h^T x_i: (B, heads, N, r)
        visible = None if key_padding_mask is None else key_padding_mask[:, None, :]
        return normalize_scores(torch.einsum("hr,bhnr->bhn", query, keys), visible, "softmax")

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        check_tensor(x, "x", 3, f"(B, N, dim={self.dim})")
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have width dim={self.dim}, got shape {tuple(x.shape)}")
        check_module_input(self, x, "x", dtype=False)  # the parameters are cast to x's dtype
        key_padding_mask = check_key_padding_mask(key_padding_mask, x.shape[0], x.shape[1], x.device)
        return torch.einsum("bhn,bnd->bhd", self.weights(x, key_padding_mask), x)
