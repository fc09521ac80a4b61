"""Independent test oracles for attnzoo.

Every function in this module is a deliberately slow, "obviously correct"
reference implementation written straight from the published formulas, *not*
from the library's source.  They exist so that the test-suite has something
to compare the library against that does not share its bugs.

Rules followed throughout:

* All arithmetic is done in float64 (inputs are converted with ``.to(float64)``
  first, which keeps the autograd graph, so gradients w.r.t. the original
  inputs can be compared as well).
* The loops over batch ``b``, head ``h``, query ``i`` and key ``j`` are explicit
  Python loops, so each line reads like the formula it implements.  Only the
  head dimension ``D`` inside a single (i, j) pair is vectorised (a dot product
  or a scaled vector add).
* Outputs are assembled with ``torch.stack`` of per-row results, never via
  ``.item()``, so they stay differentiable.

These oracles are meant for tiny shapes (a handful of tokens); they are far too
slow for anything else.

Conventions (shared by all attention oracles):

* ``scale`` defaults to ``1 / sqrt(D)``.
* Causal masking is aligned bottom-right: with ``Nq`` queries and ``Nk`` keys,
  query ``i`` sits at absolute position ``i + (Nk - Nq)`` and sees key ``j``
  iff ``j <= i + (Nk - Nq)``.  For ``Nq == Nk`` this is the usual ``j <= i``.
* ``key_mask`` is a bool tensor of shape ``(B, Nk)``; ``True`` marks a
  real token, a ``False`` key is never visible.
* A query row that sees no key at all outputs exactly zeros (and its weight row
  is all zeros).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

F64 = torch.float64

__all__ = [
    "lsh_union_oracle",
    "lsh_visible_sets",
    "attention_oracle",
    "attention_weights_oracle",
    "sinusoidal_oracle",
    "alibi_slopes_oracle",
    "alibi_bias_oracle",
    "shaw_relative_oracle",
    "rope_oracle",
    "full_oracle",
    "causal_oracle",
    "sliding_window_oracle",
    "dilated_oracle",
    "strided_oracle",
    "global_tokens_oracle",
    "random_oracle",
    "random_blocks_oracle",
    "block_local_oracle",
    "longformer_oracle",
    "bigbird_oracle",
    "star_oracle",
    "etc_oracle",
    "sparse_transformer_strided_oracle",
    "sparse_transformer_fixed_oracle",
    "logsparse_oracle",
    "sinks_oracle",
    "block2d_oracle",
    "axial_oracle",
    "graph_oracle",
    "per_head_oracle",
    "oracle_lama_weights",
    "oracle_axial_attention",
    "oracle_gat_attention",
]


# --------------------------------------------------------------------------
# Plain (softmax / relu-normalised) attention
# --------------------------------------------------------------------------


def _check_qk(q: Tensor, k: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, N, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B, H or D")


def _is_visible(b: int, i: int, j: int, nq: int, nk: int, causal: bool, key_mask: Tensor | None) -> bool:
    """Whether query i may attend to key j (in batch element b)."""
    if causal and j > i + (nk - nq):  # bottom-right aligned causal mask
        return False
    if key_mask is not None and not bool(key_mask[b, j]):
        return False
    return True


def _weight_rows(
    q: Tensor,
    k: Tensor,
    *,
    causal: bool,
    key_mask: Tensor | None,
    scale: float | None,
    normalizer: str,
    score_bias: Tensor | None,
) -> list[list[list[list[Tensor | None]]]]:
    """weights[b][h][i][j] as 0-dim float64 tensors, or None where w_ij is exactly 0.

    (None marks "not visible" or "row normalises to zero"; callers turn it into
    an exact 0.0.)
    """
    _check_qk(q, k)
    if normalizer not in ("softmax", "relu"):
        raise ValueError(f"unknown normalizer {normalizer!r}")
    q = q.to(F64)
    k = k.to(F64)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if score_bias is not None:
        score_bias = torch.broadcast_to(score_bias.to(F64), (B, H, Nq, Nk))
    if key_mask is not None:
        if tuple(key_mask.shape) != (B, Nk):
            raise ValueError(f"key_mask must be (B, Nk) = {(B, Nk)}, got {tuple(key_mask.shape)}")
        key_mask = key_mask.to(torch.bool)

    weights = []
    for b in range(B):
        per_b = []
        for h in range(H):
            per_h = []
            for i in range(Nq):
                # s_ij = scale * <q_i, k_j> (+ bias_ij), only for visible j
                scores: list[Tensor | None] = []
                for j in range(Nk):
                    if not _is_visible(b, i, j, Nq, Nk, causal, key_mask):
                        scores.append(None)
                        continue
                    s = scale * torch.dot(q[b, h, i], k[b, h, j])
                    if score_bias is not None:
                        s = s + score_bias[b, h, i, j]
                    scores.append(s)

                visible = [s for s in scores if s is not None]
                row: list[Tensor | None] = [None] * Nk
                if not visible:
                    per_h.append(row)  # no visible key -> all-zero weights
                    continue

                if normalizer == "softmax":
                    # subtract the row max for stability; softmax is invariant to it
                    m = max(float(s.detach()) for s in visible)
                    numer = [None if s is None else torch.exp(s - m) for s in scores]
                    denom = sum(n for n in numer if n is not None)
                    row = [None if n is None else n / denom for n in numer]
                else:  # "relu"
                    numer = [None if s is None else torch.relu(s) for s in scores]
                    denom = sum(n for n in numer if n is not None)
                    if float(denom.detach()) == 0.0:
                        row = [None] * Nk  # sum of relu scores is 0 -> all-zero weights
                    else:
                        row = [None if n is None else n / denom for n in numer]
                per_h.append(row)
            per_b.append(per_h)
        weights.append(per_b)
    return weights


def attention_weights_oracle(
    q: Tensor,
    k: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    scale: float | None = None,
    normalizer: str = "softmax",
    score_bias: Tensor | None = None,
) -> Tensor:
    """The (B, H, Nq, Nk) float64 attention weight matrix w_ij (0 where not visible).

    See :func:`attention_oracle` for the semantics.
    """
    rows = _weight_rows(
        q,
        k,
        causal=causal,
        key_mask=key_mask,
        scale=scale,
        normalizer=normalizer,
        score_bias=score_bias,
    )
    B, H, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if B * H * Nq * Nk == 0:
        return torch.zeros(B, H, Nq, Nk, dtype=F64, device=q.device)
    zero = torch.zeros((), dtype=F64, device=q.device)
    return torch.stack(
        [
            torch.stack(
                [
                    torch.stack([torch.stack([zero if w is None else w for w in row]) for row in per_h])
                    for per_h in per_b
                ]
            )
            for per_b in rows
        ]
    )


def attention_oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    scale: float | None = None,
    normalizer: str = "softmax",
    score_bias: Tensor | None = None,
) -> Tensor:
    """Reference scaled dot-product attention, float64, double loop over (i, j).

    q: (B, H, Nq, D), k: (B, H, Nk, D), v: (B, H, Nk, Dv) -> (B, H, Nq, Dv) float64.

    * s_ij = scale * <q_i, k_j> (+ score_bias[b, h, i, j]); scale defaults to 1/sqrt(D);
      score_bias must be broadcastable to (B, H, Nq, Nk).
    * causal (bottom-right aligned): key j visible iff j <= i + (Nk - Nq).
    * key_mask (B, Nk) bool, True = real token; False keys are invisible.
    * normalizer "softmax": w_ij = exp(s_ij - max) / sum_{visible j'} exp(s_ij' - max).
      normalizer "relu":    w_ij = relu(s_ij) / sum_{visible j'} relu(s_ij'),
      with an all-zero row when that sum is 0.
    * A row with no visible key outputs exactly zeros.
    * out_i = sum_j w_ij v_j.

    Differentiable w.r.t. q, k, v (and score_bias).
    """
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be (B, H, Nk, Dv) matching k {tuple(k.shape)}; got {tuple(v.shape)}")
    rows = _weight_rows(
        q,
        k,
        causal=causal,
        key_mask=key_mask,
        scale=scale,
        normalizer=normalizer,
        score_bias=score_bias,
    )
    v = v.to(F64)
    B, H, Nk, Dv = v.shape
    if B * H == 0:
        return torch.zeros(B, H, q.shape[2], Dv, dtype=F64, device=v.device)
    out_b = []
    for b in range(B):
        out_h = []
        for h in range(H):
            out_i = []
            for row in rows[b][h]:
                acc = torch.zeros(Dv, dtype=F64, device=v.device)
                for j in range(Nk):
                    w = row[j]
                    if w is None:  # invisible (or zero-normalised) key contributes nothing
                        continue
                    acc = acc + w * v[b, h, j]
                out_i.append(acc)
            out_h.append(torch.stack(out_i) if out_i else v.new_zeros((0, Dv)))
        out_b.append(torch.stack(out_h))
    return torch.stack(out_b)


# --------------------------------------------------------------------------
# Sinusoidal absolute position encoding (Vaswani et al., 2017)
# --------------------------------------------------------------------------


def sinusoidal_oracle(n: int, dim: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/dim)), PE[pos, 2i+1] = cos(pos / 10000^(2i/dim)).

    Returns an (n, dim) float64 tensor.  (An odd ``dim`` simply ends on a sin column.)
    """
    pe = torch.zeros(n, dim, dtype=F64)
    for pos in range(n):
        for c in range(dim):
            i = c // 2
            angle = pos / (10000.0 ** (2.0 * i / dim))
            pe[pos, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    return pe


# --------------------------------------------------------------------------
# ALiBi (Press, Smith & Lewis, 2022)
# --------------------------------------------------------------------------


def _alibi_slopes_power_of_2(n: int) -> list[float]:
    # start = 2^(-8/n); slope_h = start^(h+1) = 2^(-8/n * (h+1))
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]


def alibi_slopes_oracle(heads: int) -> list[float]:
    """ALiBi head slopes, as in the reference implementation's ``get_slopes``.

    For ``heads`` a power of two n: slope_h = 2^(-8/n * (h+1)), h = 0..n-1.
    Otherwise, with p the largest power of two below ``heads``: the p slopes of
    the power-of-two case, followed by every other slope (indices 0, 2, 4, ...)
    of the 2p sequence, until there are ``heads`` slopes.
    """
    if heads < 1:
        raise ValueError("heads must be >= 1")
    if heads & (heads - 1) == 0:
        return _alibi_slopes_power_of_2(heads)
    p = 1 << (heads.bit_length() - 1)  # closest power of two below heads
    extra = _alibi_slopes_power_of_2(2 * p)[0::2][: heads - p]
    return _alibi_slopes_power_of_2(p) + extra


def alibi_bias_oracle(heads: int, n: int) -> Tensor:
    """(heads, n, n) float64 with bias[h, i, j] = -slope_h * |i - j|."""
    slopes = alibi_slopes_oracle(heads)
    bias = torch.zeros(heads, n, n, dtype=F64)
    for h in range(heads):
        for i in range(n):
            for j in range(n):
                bias[h, i, j] = -slopes[h] * abs(i - j)
    return bias


# --------------------------------------------------------------------------
# Shaw, Uszkoreit & Vaswani (2018) relative position self-attention
# --------------------------------------------------------------------------


def shaw_relative_oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor,
    rel_v: Tensor,
    max_distance: int,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Relative-position self-attention of Shaw et al. (2018), float64.

    q, k: (B, H, N, D), v: (B, H, N, Dv); rel_k: (2*max_distance+1, D),
    rel_v: (2*max_distance+1, Dv), indexed by
    idx(i, j) = clip(j - i, -max_distance, max_distance) + max_distance.

    e_ij = scale * <q_i, k_j + rel_k[idx(i, j)]>        (scale defaults to 1/sqrt(D))
    w_ij = softmax over visible j (causal: j <= i)
    out_i = sum_j w_ij (v_j + rel_v[idx(i, j)])

    Differentiable w.r.t. q, k, v, rel_k, rel_v.
    """
    _check_qk(q, k)
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    rel_k, rel_v = rel_k.to(F64), rel_v.to(F64)
    B, H, N, D = q.shape
    if k.shape[2] != N or v.shape[2] != N:
        raise ValueError("shaw_relative_oracle is self-attention: Nq must equal Nk")
    if rel_k.shape[0] != 2 * max_distance + 1 or rel_v.shape[0] != 2 * max_distance + 1:
        raise ValueError("rel_k / rel_v must have 2*max_distance+1 rows")
    if scale is None:
        scale = 1.0 / math.sqrt(D)

    def idx(i: int, j: int) -> int:
        return max(-max_distance, min(max_distance, j - i)) + max_distance

    out_b = []
    for b in range(B):
        out_h = []
        for h in range(H):
            out_i = []
            for i in range(N):
                visible = [j for j in range(N) if not (causal and j > i)]
                e = [scale * torch.dot(q[b, h, i], k[b, h, j] + rel_k[idx(i, j)]) for j in visible]
                m = max(float(x.detach()) for x in e)
                numer = [torch.exp(x - m) for x in e]
                denom = sum(numer)
                acc = torch.zeros(v.shape[3], dtype=F64, device=v.device)
                for n_ij, j in zip(numer, visible):
                    acc = acc + (n_ij / denom) * (v[b, h, j] + rel_v[idx(i, j)])
                out_i.append(acc)
            out_h.append(torch.stack(out_i))
        out_b.append(torch.stack(out_h))
    return torch.stack(out_b)


# --------------------------------------------------------------------------
# Rotary position embedding (Su et al., 2021), "rotate half" convention
# --------------------------------------------------------------------------


def rope_oracle(x: Tensor, positions: Tensor | Sequence[int], base: float = 10000.0) -> Tensor:
    """Apply RoPE to x (..., N, D), D even, at integer ``positions`` (N,), float64.

    "Rotate half" convention (GPT-NeoX / HF Llama style), NOT interleaved pairs:
    for i in 0..D/2-1, theta_i = base^(-2i/D), and the pair
    (x[..., i], x[..., i + D/2]) is rotated by the angle pos * theta_i:

        out[i]       = x[i] * cos - x[i + D/2] * sin
        out[i + D/2] = x[i] * sin + x[i + D/2] * cos

    Differentiable w.r.t. x.
    """
    x = x.to(F64)
    N, D = x.shape[-2], x.shape[-1]
    if D % 2 != 0:
        raise ValueError("rope_oracle needs an even head dim")
    positions = [int(p) for p in (positions.tolist() if isinstance(positions, Tensor) else positions)]
    if len(positions) != N:
        raise ValueError(f"expected {N} positions, got {len(positions)}")
    half = D // 2
    rows = []
    for n in range(N):
        pos = positions[n]
        first, second = [], []
        for i in range(half):
            theta = base ** (-2.0 * i / D)
            c, s = math.cos(pos * theta), math.sin(pos * theta)
            a, bb = x[..., n, i], x[..., n, i + half]
            first.append(a * c - bb * s)
            second.append(a * s + bb * c)
        rows.append(torch.stack(first + second, dim=-1))  # (..., D)
    return torch.stack(rows, dim=-2)  # (..., N, D)


# --------------------------------------------------------------------------
# Sparse attention patterns
# --------------------------------------------------------------------------
#
# Every pattern oracle returns a torch.bool mask M of shape (n_q, n_kv)
# (or (heads, n_q, n_kv) where stated), True = "query i may attend key j".
# Query row i is aligned to the *end* of the keys, like the causal mask above:
# its position is p = i + (n_kv - n_q), and every condition is written in terms
# of p and the key index j.  For n_q == n_kv, p == i.  A table of random
# keys / blocks may contain -1 for "no entry"; since j >= 0 it never matches.


def _aligned(i: int, n_q: int, n_kv: int) -> int:
    """Aligned (bottom-right) position of query row i."""
    return i + (n_kv - n_q)


def _ints(x: Tensor | Sequence[int]) -> list[int]:
    """A 1-D tensor or sequence of integers as a plain list of Python ints."""
    return [int(v) for v in (x.reshape(-1).tolist() if isinstance(x, Tensor) else x)]


def _new_mask(n_q: int, n_kv: int) -> Tensor:
    if n_q < 0 or n_kv < 0:
        raise ValueError(f"n_q and n_kv must be >= 0; got {n_q}, {n_kv}")
    return torch.zeros(n_q, n_kv, dtype=torch.bool)


def _n_blocks(n_kv: int, block: int) -> int:
    return -(-n_kv // block)  # ceil(n_kv / block)


def _check_block_table(table: Tensor, n_q: int, n_kv: int, block: int) -> None:
    if block < 1:
        raise ValueError("block must be >= 1")
    if n_q > n_kv:
        # rows with p < 0 would index the table with a negative block number
        raise ValueError("block-table patterns need n_q <= n_kv")
    if table.dim() != 2 or table.shape[0] != _n_blocks(n_kv, block):
        raise ValueError(
            f"table must be (ceil(n_kv / block), r) = ({_n_blocks(n_kv, block)}, r); got {tuple(table.shape)}"
        )


# --- atomic patterns -------------------------------------------------------


def full_oracle(n_q: int, n_kv: int) -> Tensor:
    """Every query sees every key."""
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        for j in range(n_kv):
            M[i, j] = True
    return M


def causal_oracle(n_q: int, n_kv: int) -> Tensor:
    """j <= p (bottom-right aligned)."""
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = j <= p
    return M


def sliding_window_oracle(n_q: int, n_kv: int, left: int, right: int) -> Tensor:
    """p - left <= j <= p + right."""
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = p - left <= j <= p + right
    return M


def dilated_oracle(n_q: int, n_kv: int, left: int, right: int, dilation: int) -> Tensor:
    """j - p == dilation * t for some integer t with -left <= t <= right."""
    if dilation < 1:
        raise ValueError("dilation must be >= 1")
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = any(j - p == dilation * t for t in range(-left, right + 1))
    return M


def strided_oracle(n_q: int, n_kv: int, stride: int) -> Tensor:
    """(p - j) is a multiple of ``stride`` (either sign; no causal restriction)."""
    if stride < 1:
        raise ValueError("stride must be >= 1")
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = ((p - j) % stride) == 0  # Python %: non-negative for stride > 0
    return M


def global_tokens_oracle(n_q: int, n_kv: int, indices: Tensor | Sequence[int]) -> Tensor:
    """p in G or j in G, G = set(indices) (positions in the key coordinate system)."""
    G = set(_ints(indices))
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = p in G or j in G
    return M


def random_oracle(n_q: int, n_kv: int, table: Tensor) -> Tensor:
    """table (n_q, r) of key indices: row i sees key j iff j appears in table[i] (-1 = none).

    The table is indexed by the query *row* i (not by p).
    """
    if table.dim() != 2 or table.shape[0] != n_q:
        raise ValueError(f"table must be (n_q, r) = ({n_q}, r); got {tuple(table.shape)}")
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        keys = set(_ints(table[i]))
        for j in range(n_kv):
            M[i, j] = j in keys
    return M


def random_blocks_oracle(n_q: int, n_kv: int, block: int, table: Tensor) -> Tensor:
    """table (ceil(n_kv / block), r) of key blocks, indexed by query block p // block:
    (i, j) iff j // block appears in table[p // block] (-1 = none).  Needs n_q <= n_kv."""
    _check_block_table(table, n_q, n_kv, block)
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        key_blocks = set(_ints(table[p // block]))
        for j in range(n_kv):
            M[i, j] = (j // block) in key_blocks
    return M


def block_local_oracle(n_q: int, n_kv: int, size: int) -> Tensor:
    """p // size == j // size (non-overlapping local blocks)."""
    if size < 1:
        raise ValueError("size must be >= 1")
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = p // size == j // size
    return M


# --- compound patterns (each written from its own definition) --------------


def longformer_oracle(
    n_q: int, n_kv: int, window: int, global_indices: Tensor | Sequence[int], dilation: int = 1
) -> Tensor:
    """Longformer (Beltagy et al., 2020): (dilated) symmetric window plus global tokens.

    (j - p == dilation * t for some integer t in [-window, window]) or p in G or j in G.
    """
    if dilation < 1:
        raise ValueError("dilation must be >= 1")
    G = set(_ints(global_indices))
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            in_window = any(j - p == dilation * t for t in range(-window, window + 1))
            M[i, j] = in_window or p in G or j in G
    return M


def bigbird_oracle(n_q: int, n_kv: int, block: int, window_blocks: int, global_blocks: int, table: Tensor) -> Tensor:
    """BigBird (Zaheer et al., 2020), block form.

    qb = p // block, kb = j // block, n_blocks = ceil(n_kv / block);
    GB = {0, .., ceil(g/2) - 1} U {n_blocks - floor(g/2), .., n_blocks - 1}, g = global_blocks.
    (i, j) iff |qb - kb| <= window_blocks // 2, or qb in GB, or kb in GB,
    or kb appears in table[qb] (table (n_blocks, r), -1 = none).  Needs n_q <= n_kv.
    """
    _check_block_table(table, n_q, n_kv, block)
    n_blocks = _n_blocks(n_kv, block)
    g = global_blocks
    GB = set(range(0, (g + 1) // 2)) | set(range(n_blocks - g // 2, n_blocks))
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        qb = p // block
        random_blocks = set(_ints(table[qb]))
        for j in range(n_kv):
            kb = j // block
            M[i, j] = abs(qb - kb) <= window_blocks // 2 or qb in GB or kb in GB or kb in random_blocks
    return M


def star_oracle(n_q: int, n_kv: int, relay: int = 0) -> Tensor:
    """Star-Transformer (Guo et al., 2019): |p - j| <= 1 or p == relay or j == relay."""
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = abs(p - j) <= 1 or p == relay or j == relay
    return M


def etc_oracle(n_q: int, n_kv: int, window: int, n_global: int) -> Tensor:
    """ETC (Ainslie et al., 2020): |p - j| <= window or p < n_global or j < n_global."""
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = abs(p - j) <= window or p < n_global or j < n_global
    return M


def sinks_oracle(n_q: int, n_kv: int, n_sinks: int, left: int, right: int) -> Tensor:
    """Attention sinks (Xiao et al., 2023, StreamingLLM): the first n_sinks keys for every
    query, plus p - left <= j <= p + right."""
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = j < n_sinks or p - left <= j <= p + right
    return M


def logsparse_oracle(n_q: int, n_kv: int, levels: int) -> Tensor:
    """LogSparse (Li et al., 2019): key j when |p - j| is 0 or one of 1, 2, 4, ...,
    2**(levels - 1) (both directions; the paper's causal form is this & causal_oracle)."""
    distances = {0} | {2**m for m in range(levels)}
    M = _new_mask(n_q, n_kv)
    for i in range(n_q):
        p = _aligned(i, n_q, n_kv)
        for j in range(n_kv):
            M[i, j] = abs(p - j) in distances
    return M


def sparse_transformer_strided_oracle(n: int, l: int, heads: int) -> Tensor:
    """Sparse Transformer strided pattern (Child et al., 2019), (heads, n, n).

    Heads h < heads // 2 use A: p - l < j <= p; the others use B: (p - j) % l == 0 and j <= p.
    (So with heads == 1 the single head uses B.)
    """
    if l < 1:
        raise ValueError("l must be >= 1")
    M = torch.zeros(heads, n, n, dtype=torch.bool)
    for h in range(heads):
        for i in range(n):
            p = _aligned(i, n, n)
            for j in range(n):
                if h < heads // 2:
                    M[h, i, j] = p - l < j <= p
                else:
                    M[h, i, j] = (p - j) % l == 0 and j <= p
    return M


def sparse_transformer_fixed_oracle(n: int, l: int, c: int, heads: int) -> Tensor:
    """Sparse Transformer fixed pattern (Child et al., 2019), (heads, n, n).

    Heads h < heads // 2 use A: j // l == p // l and j <= p;
    the others use B: j % l >= l - c and j <= p.
    """
    if l < 1:
        raise ValueError("l must be >= 1")
    M = torch.zeros(heads, n, n, dtype=torch.bool)
    for h in range(heads):
        for i in range(n):
            p = _aligned(i, n, n)
            for j in range(n):
                if h < heads // 2:
                    M[h, i, j] = j // l == p // l and j <= p
                else:
                    M[h, i, j] = j % l >= l - c and j <= p
    return M


def block2d_oracle(h: int, w: int, query_block: Sequence[int], memory_margin: Sequence[int]) -> Tensor:
    """Image Transformer 2-D local attention (Parmar et al., 2018), (h*w, h*w), row-major.

    Position x -> (x // w, x % w).  The query at (r, c) lies in query block
    (br, bc) = (r // qh, c // qw) and sees key (r2, c2) iff
    br*qh - mh <= r2 <= (br+1)*qh - 1 + mh and bc*qw - mw <= c2 <= (bc+1)*qw - 1 + mw.
    """
    qh, qw = query_block
    mh, mw = memory_margin
    n = h * w
    M = _new_mask(n, n)
    for i in range(n):
        r, c = i // w, i % w
        br, bc = r // qh, c // qw
        for j in range(n):
            r2, c2 = j // w, j % w
            M[i, j] = br * qh - mh <= r2 <= (br + 1) * qh - 1 + mh and bc * qw - mw <= c2 <= (bc + 1) * qw - 1 + mw
    return M


def axial_oracle(h: int, w: int) -> Tensor:
    """Axial attention over an h x w row-major grid: same row or same column."""
    n = h * w
    M = _new_mask(n, n)
    for i in range(n):
        for j in range(n):
            M[i, j] = i // w == j // w or i % w == j % w
    return M


def graph_oracle(n: int, edge_index: Tensor, self_loops: bool = True) -> Tensor:
    """(n, n): (i, j) iff some edge e has edge_index[0, e] == i (query) and
    edge_index[1, e] == j (key), or (self_loops and i == j)."""
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must be (2, E); got {tuple(edge_index.shape)}")
    edges = set(zip(_ints(edge_index[0]), _ints(edge_index[1])))
    M = _new_mask(n, n)
    for i in range(n):
        for j in range(n):
            M[i, j] = (i, j) in edges or (self_loops and i == j)
    return M


def per_head_oracle(masks: Sequence[Tensor], heads: int) -> Tensor:
    """(heads, n_q, n_kv): head h uses masks[h // (heads // P)], P = len(masks)
    (contiguous groups of heads // P heads each); heads must be a multiple of P."""
    P = len(masks)
    if P == 0 or heads % P != 0 or heads < P:
        raise ValueError(f"heads ({heads}) must be a positive multiple of len(masks) ({P})")
    n_q, n_kv = masks[0].shape
    if any(tuple(m.shape) != (n_q, n_kv) for m in masks):
        raise ValueError("all masks must have the same (n_q, n_kv) shape")
    per_group = heads // P
    M = torch.zeros(heads, n_q, n_kv, dtype=torch.bool)
    for h in range(heads):
        src = masks[h // per_group]
        for i in range(n_q):
            for j in range(n_kv):
                M[h, i, j] = bool(src[i, j])
    return M


# --------------------------------------------------------------------------
# LAMA pooling (Mehta et al., 2019): low-rank bilinear pooling in the
# Hadamard-product form of Kim et al. (2017)
# --------------------------------------------------------------------------


def oracle_lama_weights(
    x: Tensor, u: Tensor, v: Tensor, p: Tensor, c: Tensor | None = None, key_mask: Tensor | None = None
) -> Tensor:
    """Pooling weights alpha (B, heads, N) of LAMA, written from

        s_hi = sum_r p[r, h] * tanh(sum_d u[d, r] x_i[d]) * tanh(sum_d v[d, r] c[d])
        alpha_h = softmax over the real tokens i of s_h   (padding: weight 0)

    ``x`` (B, N, dim); ``u``, ``v`` (dim, r); ``p`` (r, heads); ``c`` (dim,) a fixed context, or
    None for the mean of the real tokens of each sequence (the zero vector when there is none).
    A sequence with no real token gets all-zero weights.
    """
    x, u, v, p = (t.to(F64) for t in (x, u, v, p))
    B, N, dim = x.shape
    rank, heads = p.shape
    rows = []
    for b in range(B):
        real = [i for i in range(N) if key_mask is None or bool(key_mask[b, i])]
        if c is not None:
            ctx = c.to(F64)
        elif real:
            ctx = sum(x[b, i] for i in real) / len(real)
        else:
            ctx = torch.zeros(dim, dtype=F64)
        ctx_features = [torch.tanh(torch.dot(v[:, r], ctx)) for r in range(rank)]
        heads_rows = []
        for h in range(heads):
            scores = {}
            for i in real:
                scores[i] = sum(
                    p[r, h] * torch.tanh(torch.dot(u[:, r], x[b, i])) * ctx_features[r] for r in range(rank)
                )
            top = max(float(s.detach()) for s in scores.values()) if scores else 0.0
            total = sum(torch.exp(s - top) for s in scores.values())
            heads_rows.append(
                torch.stack(
                    [
                        torch.exp(scores[i] - top) / total if i in scores else torch.zeros((), dtype=F64)
                        for i in range(N)
                    ]
                )
            )
        rows.append(torch.stack(heads_rows))
    return torch.stack(rows)


# --------------------------------------------------------------------------
# Axial attention (Ho et al., 2019): a row pass, then a column pass
# --------------------------------------------------------------------------


def _linear_oracle(W: Tensor, b: Tensor | None, x: Tensor) -> Tensor:
    """y = W x + b for one vector x (the nn.Linear convention)."""
    y = torch.stack([torch.dot(W[o], x) for o in range(W.shape[0])])
    return y if b is None else y + b


def _axial_pass_oracle(
    x: Tensor, h: int, w: int, heads: int, params: Sequence[Tensor | None], along_row: bool, causal: bool
) -> Tensor:
    Wq, bq, Wk, bk, Wv, bv, Wo, bo = (None if t is None else t.to(F64) for t in params)
    B, N, dim = x.shape
    d = Wq.shape[0] // heads
    out_rows = []
    for b in range(B):
        q = [_linear_oracle(Wq, bq, x[b, n]) for n in range(N)]
        k = [_linear_oracle(Wk, bk, x[b, n]) for n in range(N)]
        v = [_linear_oracle(Wv, bv, x[b, n]) for n in range(N)]
        tokens = []
        for n in range(N):
            r, c = n // w, n % w
            if along_row:
                keys = [r * w + c2 for c2 in range(w) if not causal or c2 <= c]
            else:
                keys = [r2 * w + c for r2 in range(h) if not causal or r2 <= r]
            per_head = []
            for head in range(heads):
                s = slice(head * d, (head + 1) * d)
                scores = [torch.dot(q[n][s], k[j][s]) / math.sqrt(d) for j in keys]
                top = max(float(t.detach()) for t in scores)
                e = [torch.exp(t - top) for t in scores]
                total = sum(e)
                per_head.append(sum(e_j / total * v[j][s] for e_j, j in zip(e, keys)))
            tokens.append(_linear_oracle(Wo, bo, torch.cat(per_head)))
        out_rows.append(torch.stack(tokens))
    return torch.stack(out_rows)


def oracle_axial_attention(
    x: Tensor,
    h: int,
    w: int,
    heads: int,
    row: Sequence[Tensor | None],
    column: Sequence[Tensor | None],
    causal: bool = False,
) -> Tensor:
    """Axial attention on an h x w grid, x (B, h*w, dim) in raster order (token n is row n // w,
    column n % w). ``row`` and ``column`` are each pass's (Wq, bq, Wk, bk, Wv, bv, Wo, bo), with
    W (out, in) and y = W x + b; heads split q, k, v into ``heads`` contiguous slices of width d
    and scores are q.k / sqrt(d).

    Row pass: token (r, c) attends (r, c') for every c' (c' <= c when causal).
    Column pass, on the row pass's output: (r, c) attends (r', c) (r' <= r when causal).
    """
    y = _axial_pass_oracle(x.to(F64), h, w, heads, row, along_row=True, causal=causal)
    return _axial_pass_oracle(y, h, w, heads, column, along_row=False, causal=causal)


# --------------------------------------------------------------------------
# GAT additive scores (Velickovic et al., 2018) along a graph's edges
# --------------------------------------------------------------------------


def oracle_gat_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    edges: Sequence[Sequence[int]],
    n: int,
    a: Tensor,
    *,
    self_loops: bool = True,
    causal: bool = False,
    key_mask: Tensor | None = None,
) -> Tensor:
    """GAT attention with q_i, k_j as the projected features W h_i, W h_j, by a loop over edges:

        e_ij    = LeakyReLU(a[h, 0] . q_i + a[h, 1] . k_j), negative slope 0.2
        alpha_i = softmax over the edges (i, j) of node i of e_ij
        out_i   = sum over those edges of alpha_ij v_j

    ``edges`` are (query i, key j) pairs (duplicates count once), plus (i, i) when
    ``self_loops``; ``causal`` drops edges with j > i; padded keys (``key_mask[b, j]``
    False) are dropped. A node left with no edge outputs zeros. ``a`` is (H, 2, D).
    """
    q, k, v, a = (t.to(F64) for t in (q, k, v, a))
    B, H, N, _ = q.shape
    if N != n:
        raise ValueError(f"inputs have N={N}, graph has n={n}")
    edge_set = {(int(i), int(j)) for i, j in edges} | ({(i, i) for i in range(n)} if self_loops else set())
    out = []
    for b in range(B):
        per_head = []
        for h in range(H):
            scores: dict = {i: [] for i in range(n)}
            for i, j in sorted(edge_set):
                if causal and j > i:
                    continue
                if key_mask is not None and not bool(key_mask[b, j]):
                    continue
                e = torch.dot(a[h, 0], q[b, h, i]) + torch.dot(a[h, 1], k[b, h, j])
                scores[i].append((j, torch.where(e > 0, e, 0.2 * e)))
            rows = []
            for i in range(n):
                if not scores[i]:
                    rows.append(torch.zeros(v.shape[-1], dtype=F64))
                    continue
                top = max(float(e.detach()) for _, e in scores[i])
                total = sum(torch.exp(e - top) for _, e in scores[i])
                rows.append(sum(torch.exp(e - top) / total * v[b, h, j] for j, e in scores[i]))
            per_head.append(torch.stack(rows))
        out.append(torch.stack(per_head))
    return torch.stack(out)


# --------------------------------------------------------------------------
# Reformer LSH attention, rounds combined (Kitaev et al. 2020, Appendix A)
# --------------------------------------------------------------------------
# Written from MECHANISMS.md's `lsh` entry and the paper, without reading the
# implementation. Buckets are given (the oracle does not hash). Shared QK: keys
# are the unit-normalised queries; s_ij = q_i . k_j / sqrt(D). Round r shows key j
# to real query i when j is real, in the same bucket, j != i (j < i when causal),
# and j's rank among its bucket's real tokens (position order) lies in the query's
# rank-chunk or the one before. dedupe=True: softmax over the union of the rounds'
# sets; dedupe=False: weights N_ij exp(s_ij). A real query with an empty union
# outputs v_i; a padded query outputs zeros.


def lsh_visible_sets(buckets, chunk, *, causal=False, key_mask=None):
    """Per-round visible key sets.

    Returns ``sets[r][b][h][i]`` = Python set of key indices visible to query i in round r
    (empty set for padded queries).  ``buckets``: LongTensor (R, B, H, N).
    """
    R, B, H, N = buckets.shape
    if key_mask is None:
        real = [[True] * N for _ in range(B)]
    else:
        real = [[bool(key_mask[b, n]) for n in range(N)] for b in range(B)]
    sets = []
    for r in range(R):
        per_b = []
        for b in range(B):
            per_h = []
            for h in range(H):
                bk = [int(buckets[r, b, h, n]) for n in range(N)]
                # rank of each real token within its bucket, in position order
                rank = [None] * N
                counter = {}
                for n in range(N):
                    if not real[b][n]:
                        continue
                    rank[n] = counter.get(bk[n], 0)
                    counter[bk[n]] = rank[n] + 1
                per_i = []
                for i in range(N):
                    vis = set()
                    if real[b][i]:
                        g = rank[i] // chunk
                        lo, hi = (g - 1) * chunk, (g + 1) * chunk
                        for j in range(N):
                            if not real[b][j]:
                                continue
                            if bk[j] != bk[i]:
                                continue
                            if j == i:
                                continue
                            if causal and not (j < i):
                                continue
                            if not (lo <= rank[j] < hi):
                                continue
                            vis.add(j)
                    per_i.append(vis)
                per_h.append(per_i)
            per_b.append(per_h)
        sets.append(per_b)
    return sets


def lsh_union_oracle(q, v, buckets, chunk, *, causal=False, key_mask=None, dedupe=True) -> Tensor:
    """Reference output (B, H, N, Dv) of multi-round LSH attention (see module docstring).

    q: (B, H, N, D) float64; v: (B, H, N, Dv) float64; buckets: LongTensor (R, B, H, N);
    key_mask: (B, N) bool, True = real token, or None (all real).
    """
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    R = buckets.shape[0]
    assert buckets.shape == (R, B, H, N)
    sets = lsh_visible_sets(buckets, chunk, causal=causal, key_mask=key_mask)
    scale = 1.0 / math.sqrt(D)
    out_b = []
    for b in range(B):
        out_h = []
        for h in range(H):
            # shared QK: unit-normalised queries as keys (plain division, as specified)
            keys = [q[b, h, j] / torch.sqrt((q[b, h, j] * q[b, h, j]).sum()) for j in range(N)]
            rows = []
            for i in range(N):
                is_real = key_mask is None or bool(key_mask[b, i])
                if not is_real:
                    rows.append(torch.zeros(Dv, dtype=v.dtype, device=v.device))
                    continue
                counts = {}  # N_ij over rounds
                for r in range(R):
                    for j in sets[r][b][h][i]:
                        counts[j] = counts.get(j, 0) + 1
                if not counts:
                    rows.append(v[b, h, i])  # attends to itself only
                    continue
                idx = sorted(counts)
                logits = []
                for j in idx:
                    s = (q[b, h, i] * keys[j]).sum() * scale
                    if not dedupe:
                        s = s + math.log(counts[j])  # weight N_ij * exp(s_ij)
                    logits.append(s)
                w = torch.softmax(torch.stack(logits), dim=0)
                vals = torch.stack([v[b, h, j] for j in idx])  # (|U_i|, Dv)
                rows.append((w.unsqueeze(-1) * vals).sum(0))
            out_h.append(torch.stack(rows))
        out_b.append(torch.stack(out_h))
    return torch.stack(out_b)
