"""``SHARNN``: the Single Headed Attention RNN language model (Merity 2019)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnzoo._checks import check_module_input, check_positive_int, check_tensor


def _check_dropout(p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be a float in [0, 1), got {p!r}")
    return float(p)


class Boom(nn.Module):
    """Boom feed-forward (Merity 2019, §4.3): ``Linear(dim -> mult*dim)``, GELU, then split the
    hidden vector into ``mult`` chunks of width ``dim`` and sum them. One weight matrix only.

    Shapes:
        ``x (..., dim) -> (..., dim)``.
    """

    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        check_positive_int(dim, "dim")
        check_positive_int(mult, "ff_mult")
        self.dim, self.mult = dim, mult
        self.up = nn.Linear(dim, mult * dim)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(_check_dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        h = self.dropout(self.act(self.up(x)))
        return h.unflatten(-1, (self.mult, self.dim)).sum(dim=-2)


class SingleHeadAttention(nn.Module):
    """SHA-RNN's single-head causal attention in which only the query has a matrix multiply.

    With ``x`` the (already layer-normed) block input and ``g_q, g_k, g_v`` learned vectors of
    width ``dim`` (initialised to 0, so every gate starts at sigmoid(0) = 0.5)::

        q = sigmoid(g_q) * (W_q x + b_q)
        k = sigmoid(g_k) * x
        v = sigmoid(g_v) * x
        out = softmax(q k^T / sqrt(dim) + causal_mask) v        # j <= i only

    This follows the paper's design (queries get a matrix, keys/values reuse the input and are
    only rescaled per dimension by sigmoid gates); the original code's extra ``Overparam`` on the
    value and its memory of the previous segment are omitted.

    Shapes:
        ``x (B, N, dim) -> (B, N, dim)``.
    """

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        check_positive_int(dim, "dim")
        self.dim = dim
        self.q_proj = nn.Linear(dim, dim)
        self.q_gate = nn.Parameter(torch.zeros(dim))
        self.k_gate = nn.Parameter(torch.zeros(dim))
        self.v_gate = nn.Parameter(torch.zeros(dim))
        self.dropout = nn.Dropout(_check_dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        check_tensor(x, "x", 3, f"(B, N, dim={self.dim})")
        check_module_input(self, x, "x")
        q = torch.sigmoid(self.q_gate) * self.q_proj(x)
        k = torch.sigmoid(self.k_gate) * x
        v = torch.sigmoid(self.v_gate) * x
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dim)
        n = x.shape[1]
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        return self.dropout(scores.softmax(dim=-1)) @ v


class SHARNNBlock(nn.Module):
    """One SHA-RNN block: pre-LayerNorm LSTM, single-head attention and Boom, each residual."""

    def __init__(self, dim: int, ff_mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm_rnn = nn.LayerNorm(dim)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)
        self.norm_attn = nn.LayerNorm(dim)
        self.attn = SingleHeadAttention(dim, dropout)
        self.norm_ff = nn.LayerNorm(dim)
        self.ff = Boom(dim, ff_mult, dropout)
        self.dropout = nn.Dropout(_check_dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.rnn(self.norm_rnn(x))
        x = x + self.dropout(h)
        x = x + self.attn(self.norm_attn(x))
        return x + self.dropout(self.ff(self.norm_ff(x)))


class SHARNN(nn.Module):
    """Single Headed Attention RNN language model (Merity 2019, https://arxiv.org/abs/1911.11423).

    ``embedding -> depth x [x += LSTM(LN(x)); x += SHA(LN(x)); x += Boom(LN(x))] -> LN -> head``.
    Every block is causal: the LSTM runs left to right and the attention is masked to ``j <= i``
    (see ``SingleHeadAttention`` for exactly what the attention computes; ``Boom`` for the
    feed-forward). A simplification of the paper: one attention layer per block (the paper uses
    attention in only one of its four layers), no cross-segment memory / hidden-state carry.

    Args:
        vocab_size: number of token ids.
        dim: model width (embedding, LSTM hidden size, attention width).
        depth: number of blocks. Default 2.
        ff_mult: Boom expansion factor; the hidden width is ``ff_mult * dim``. Default 4.
        dropout: dropout on the embedding, each residual branch and attention weights. Default 0.
        tie_weights: if True (default) the output head reuses the embedding matrix
            (``logits = LN(x) @ E^T + b``, with its own bias ``b``); if False it is a separate
            ``Linear(dim, vocab_size)``.

    Shapes:
        ``tokens (B, N)`` integer ids in ``[0, vocab_size)`` -> logits ``(B, N, vocab_size)``.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int = 2,
        ff_mult: int = 4,
        dropout: float = 0.0,
        *,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int(vocab_size, "vocab_size")
        check_positive_int(dim, "dim")
        check_positive_int(depth, "depth")
        check_positive_int(ff_mult, "ff_mult")
        dropout = _check_dropout(dropout)
        self.vocab_size, self.dim = vocab_size, dim
        self.embed = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(SHARNNBlock(dim, ff_mult, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        if tie_weights:
            self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        if not isinstance(tokens, Tensor):
            raise TypeError(f"tokens must be a torch.Tensor of shape (B, N), got {type(tokens).__name__}")
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have 2 dimensions (B, N), got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor (e.g. torch.long), got {tokens.dtype}")
        check_module_input(self, tokens, "tokens", dtype=False)
        if tokens.shape[1] == 0:
            raise ValueError("tokens must hold at least one position (N >= 1)")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, vocab_size={self.vocab_size}), got range "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        x = self.dropout(self.embed(tokens.long()))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
