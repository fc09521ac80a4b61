"""``LAMAPooling``: low-rank bilinear attention pooling of a sequence to one vector per head (a
layer, not a (q, k, v) mechanism, so it is not in the registry)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnzoo._checks import check_key_mask, check_module_input, check_positive_int, check_tensor, renamed_key_mask
from attnzoo.backends.reference import normalize_scores

_CONTEXTS = ("learned", "mean")


class LAMAPooling(nn.Module):
    """Low-rank multi-head attention pooling, LAMA (Mehta et al. 2019, Low Rank Factorization for
    Compact Multi-Head Self-Attention, https://arxiv.org/abs/1912.00835).

    The score of token x_i for head h is a low-rank bilinear form between x_i and a context
    vector c, in the Hadamard-product form of low-rank bilinear pooling (Kim et al. 2017,
    https://arxiv.org/abs/1610.04325)::

        s_hi    = p_h^T ( tanh(U^T x_i) * tanh(V^T c) )     (* = elementwise product)
        alpha_h = softmax_i(s_h) over real tokens,    out_h = sum_i alpha_hi x_i

    U, V are ``(dim, rank)`` and shared by all heads; P = [p_1 .. p_heads] is ``(rank, heads)``:
    the heads differ only by how they weigh the rank-many products, which is where LAMA saves
    parameters over one bilinear matrix per head. The tanh is what makes this more than a linear
    probe: without it ``s_hi = (V P_h U^T c)^T x_i``, one direction per head, and the rank would
    not matter. With it, ``rank`` is the number of nonlinear features of x_i that the heads mix,
    so the heads' (centred) log-weights span at most ``rank`` dimensions.

    Args:
        dim: width of the tokens. heads: pooled vectors. Default 4.
        rank: rank r of the bilinear form (columns of U and V). Default 8.
        context: where c comes from. ``"learned"`` (default): one learned global context vector,
            which the paper queries instead of the words of the sentence. ``"mean"``: the mean of
            the real tokens of each sequence, for a context taken from the data.

    Shapes:
        ``x (B, N, dim)``, ``key_mask (B, N)`` bool (True = real) -> ``(B, heads, dim)``.

    Notes:
        Departures: no biases inside the tanh (Kim et al. allow them; the outer bias of the paper
        cancels in the softmax), and the score is not scaled. The pooled vectors are the heads'
        weighted means of x itself (no value projection). Representative keys: none are picked;
        every real token is weighed. All-padding rows pool to zeros with zero gradient.
    """

    def __init__(self, dim: int, heads: int = 4, rank: int = 8, *, context: str = "learned") -> None:
        super().__init__()
        for value, name in ((dim, "dim"), (heads, "heads"), (rank, "rank")):
            check_positive_int(value, name)
        if context not in _CONTEXTS:
            raise ValueError(f"context must be one of {_CONTEXTS}, got {context!r}")
        self.dim, self.context = dim, context
        # Unit-variance projections of unit-variance tokens keep tanh out of saturation at init.
        self.u = nn.Parameter(torch.randn(dim, rank) * dim**-0.5)
        self.v = nn.Parameter(torch.randn(dim, rank) * dim**-0.5)
        self.p = nn.Parameter(torch.randn(rank, heads) * rank**-0.5)
        self.c = nn.Parameter(torch.randn(dim)) if context == "learned" else None

    @renamed_key_mask
    def context_vector(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """The context c of each sequence, ``(B, dim)``."""
        if self.c is not None:
            return self.c.to(x.dtype).expand(x.shape[0], self.dim)
        real = x.new_ones(x.shape[:2]) if key_mask is None else key_mask.to(x.dtype)
        count = real.sum(1, keepdim=True).clamp(min=1)  # an all-padding row gets c = 0
        return torch.einsum("bn,bnd->bd", real, x) / count

    @renamed_key_mask
    def weights(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """The pooling weights ``alpha (B, heads, N)``."""
        tokens = torch.tanh(torch.einsum("bnd,dr->bnr", x, self.u.to(x.dtype)))  # tanh(U^T x_i)
        context = torch.tanh(self.context_vector(x, key_mask) @ self.v.to(x.dtype))  # (B, r)
        scores = torch.einsum("bnr,br,rh->bhn", tokens, context, self.p.to(x.dtype))
        visible = None if key_mask is None else key_mask[:, None, :]
        return normalize_scores(scores, visible, "softmax")

    @renamed_key_mask
    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        check_tensor(x, "x", 3, f"(B, N, dim={self.dim})")
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have width dim={self.dim}, got shape {tuple(x.shape)}")
        check_module_input(self, x, "x", dtype=False)  # the parameters are cast to x's dtype
        key_mask = check_key_mask(key_mask, x.shape[0], x.shape[1], x.device)
        return torch.einsum("bhn,bnd->bhd", self.weights(x, key_mask), x)
