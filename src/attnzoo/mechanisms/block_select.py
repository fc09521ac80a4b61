"""Trainable sparse attention over content-selected key blocks: MoBA here, NSA in ``nsa.py``.

MoBA (Mixture of Block Attention, Lu et al. 2025, https://arxiv.org/abs/2502.13189) cuts the
keys into blocks, gates each (query, block) pair by ``q_i . mean(k in block)`` and lets every
query attend to the keys of its ``topk`` best blocks (causal: its own block always, the rest
among earlier blocks). NSA (``nsa.py``) selects blocks by the attention of a compressed branch.

Both run on ``attend_blocks``: each query attends to the keys of its own few selected blocks.
The (query, block) pairs are sorted by block and packed into tiles of up to ``TILE`` queries
that share one key block, so a tile is two small dense products (scores, then weights times
values); the scores are moved to a (query, slot, key) layout for one softmax per query over the
union of its blocks. Memory and time are O(N * slots * block): no N x N tensor, and every key
block is read once per tile, not once per query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo._compat import flash_attention_cpu, flash_attention_cpu_backward
from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, default_scale
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.topk import select_topk, topk_mask
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


def block_means(k: Tensor, real: Tensor | None, block: int) -> tuple[Tensor, Tensor]:
    """The mean key of each block, over its real keys only: ``k (B, H, N, D)``, ``real (B, N)``
    (None: all real) -> ``means (B, H, C, D)``, ``has_real (B, C)`` bool, ``C = ceil(N / block)``
    (the last block may be short). A block with no real key has mean 0 and ``has_real`` False."""
    n = k.shape[2]
    c = -(-n // block)
    real = torch.ones(k.shape[0], n, dtype=torch.bool, device=k.device) if real is None else real
    weight = F.pad(real.to(k.dtype), (0, c * block - n))  # (B, C * block)
    sums = torch.einsum("bhcjd,bcj->bhcd", _blocks(k, block), rearrange(weight, "b (c j) -> b c j", j=block))
    count = rearrange(weight, "b (c j) -> b c j", j=block).sum(-1)
    return sums / count.clamp(min=1)[:, None, :, None], count > 0


def _blocks(x: Tensor, block: int) -> Tensor:
    """``(B, H, N, D)`` -> ``(B, H, C, block, D)``, zero-padded to whole blocks."""
    c = -(-x.shape[2] // block)
    return rearrange(F.pad(x, (0, 0, 0, c * block - x.shape[2])), "b h (c j) d -> b h c j d", j=block)


def moba_selection(gates: Tensor, positions: Tensor, has_real: Tensor, block: int, topk: int, causal: bool) -> Tensor:
    """MoBA's blocks of each query: ``gates (B, H, R, C)`` of the query rows at ``positions (R,)``,
    ``has_real (B, C)`` -> bool ``(B, H, R, C)``, True for the blocks the row attends to.

    Not causal: the ``topk`` highest-gated blocks. Causal: the own block (``position // block``)
    and the ``topk - 1`` highest-gated earlier blocks (all of them when fewer exist). Ties go to
    the lower block index (``select_topk``); a block with no real key is never chosen."""
    blocks = torch.arange(gates.shape[-1], device=gates.device)
    eligible = has_real[:, None, None, :]  # (B, 1, 1, C)
    own = blocks == torch.div(positions, block, rounding_mode="floor")[:, None]  # (R, C)
    if causal:
        eligible, topk = eligible & (blocks < torch.div(positions, block, rounding_mode="floor")[:, None]), topk - 1
    keep = own.expand(gates.shape) if causal else torch.zeros_like(gates, dtype=torch.bool)
    if topk > 0:
        idx, valid = select_topk(gates, eligible, min(topk, gates.shape[-1]))
        # Unused slots may repeat a kept index: count the used ones instead of writing booleans.
        keep = keep | (
            torch.zeros(gates.shape, dtype=torch.long, device=gates.device).scatter_add_(-1, idx, valid.long()) > 0
        )
    return keep


#: A bucket's groups are at least this fraction of its longest: padding costs at most 1 - FILL.
BUCKET_FILL = 0.8


class _Bucket(NamedTuple):
    """Groups ``first .. first + count`` of ``_Layout.order``, each padded to ``length`` rows;
    their pairs are ``span``, laid out ``(count, length)``: one kernel call."""

    span: slice
    first: int
    count: int
    length: int


@dataclass(frozen=True)
class _Layout:
    """Where the (query row, key block) pairs of ``attend_blocks`` go (integers only, no gradient).

    A group is the rows of one (b, h) that attend one key block, in ascending order. The groups
    that hold a row are ordered longest first (``order (G,)``, their flat index ``(b h c)``) and
    cut into buckets of similar length (``BUCKET_FILL``); a bucket pads its groups with the spare
    row ``B H R`` (a zero row) to its longest and runs as one flash-kernel call, its groups the
    batch. ``row (P,)``: the flat query row ``(b h r)`` of each pair, bucket after bucket.
    ``own_first``: causal self-attention in which every row attends its own block and no later
    one, so each group starts with its own block's rows in order and the kernel's top-left
    causal mask (row i sees keys 0..i) is exactly the causal rule."""

    row: Tensor
    order: Tensor
    buckets: list[_Bucket]
    own_first: bool
    heads: int
    n_blocks: int

    @staticmethod
    def kernel(pairs: Tensor, u: _Bucket) -> Tensor:
        """Pair rows ``(P, E)`` -> bucket ``u``'s kernel input ``(count, 1, length, E)`` (a view)."""
        return pairs[u.span].view(u.count, 1, u.length, pairs.shape[-1])


def _buckets(lengths: Tensor) -> list[_Bucket]:
    """Cut group ``lengths (G,)`` (longest first) where ``log(length)`` crosses a multiple of
    ``-log(BUCKET_FILL)``: each bucket's groups are at least ``BUCKET_FILL`` of its first."""
    step = -math.log(BUCKET_FILL)
    _, counts = torch.unique_consecutive(torch.floor(lengths.double().log() / step), return_counts=True)
    buckets, first, start = [], 0, 0
    for count in counts.tolist():
        length = int(lengths[first])
        buckets.append(_Bucket(slice(start, start + count * length), first, count, length))
        first, start = first + count, start + count * length
    return buckets


def _layout(keep: Tensor, block: int, causal: bool, self_attention: bool) -> _Layout:
    """Lay out the pairs of ``keep (B, H, R, C)`` (see ``_Layout``)."""
    batch, heads, rows, n_blocks = keep.shape
    device = keep.device
    counts = rearrange(keep.sum(2), "b h c -> (b h c)")  # rows per group
    order = counts.argsort(descending=True, stable=True)[: int((counts > 0).sum())]
    buckets = _buckets(counts[order])
    padded = torch.cat([torch.full((u.count,), u.length, device=device) for u in buckets])  # (G,)
    start = torch.zeros_like(counts).index_put_((order,), padded.cumsum(0) - padded)  # each group's first pair
    b, h, c, r = keep.transpose(2, 3).nonzero(as_tuple=True)  # ordered by group, then row
    group = (b * heads + h) * n_blocks + c
    pair = start[group] + torch.arange(b.shape[0], device=device) - (counts.cumsum(0) - counts)[group]
    total = buckets[-1].span.stop if buckets else 0
    row = torch.full((total,), batch * heads * rows, device=device).index_put_((pair,), (b * heads + h) * rows + r)
    own_first = False
    if causal and self_attention:
        own = torch.div(r, block, rounding_mode="floor")
        own_first = bool((c <= own).all()) and int((c == own).sum()) == batch * heads * rows
    return _Layout(row, order, buckets, own_first, heads, n_blocks)


@dataclass(frozen=True)
class _Options:
    """What every kernel call runs with: ``rows`` queries end-aligned to ``n`` keys in blocks of
    ``block``, the real keys ``real (B, N)`` (None: all), causality and the scale."""

    block: int
    n: int
    rows: int
    causal: bool
    real: Tensor | None
    scale: float


def _mask(t: _Layout, u: _Bucket, o: _Options, dtype: torch.dtype) -> tuple[Tensor | None, bool, Tensor | None]:
    """Bucket ``u``'s kernel mask: ``(additive mask or None, is_causal, rows that see a key or
    None)``; the mask is ``(count, 1, length | 1, block)``: no larger than its scores."""
    groups = t.order[u.first : u.first + u.count]
    key = (groups % t.n_blocks)[:, None] * o.block + torch.arange(o.block, device=groups.device)  # (count, block)
    visible = None
    if o.real is not None or (not o.causal and o.n % o.block):  # with causality a short last block needs none
        batch = torch.div(groups, t.heads * t.n_blocks, rounding_mode="floor")[:, None]
        real = torch.ones_like(key, dtype=torch.bool) if o.real is None else F.pad(o.real, (0, o.block))[batch, key]
        visible = (real & (key < o.n))[:, None, None, :]
    if o.causal and t.own_first:
        if visible is None:
            return None, True, None
        visible = visible & torch.ones(u.length, o.block, dtype=torch.bool, device=key.device).tril()
    elif o.causal:  # rows at their own positions (decoding): the causal rule row by row
        position = t.kernel(t.row[:, None], u)[:, 0, :, 0] % o.rows + (o.n - o.rows)  # (count, length)
        causal = key[:, None, None, :] <= position[:, None, :, None]
        visible = causal if visible is None else causal & visible
    if visible is None:
        return None, False, None
    additive = torch.zeros(visible.shape, dtype=dtype, device=key.device).masked_fill_(~visible, -math.inf)
    return additive, False, visible.any(-1)


def _rows(x: Tensor) -> Tensor:
    """``(B, H, R, E)`` -> ``(B H R + 1, E)``: one row per query and a zero row for padding pairs."""
    return F.pad(x.reshape(-1, x.shape[-1]), (0, 0, 0, 1))


def _key_blocks(x: Tensor, t: _Layout, block: int) -> Tensor:
    """``(B, H, N, E)`` -> the key blocks of the groups, in ``t.order``: ``(G, block, E)`` (zero-padded)."""
    x = F.pad(x, (0, 0, 0, t.n_blocks * block - x.shape[2]))
    return rearrange(x, "b h (c j) e -> (b h c) j e", j=block).index_select(0, t.order)


def _unblock(x: Tensor, t: _Layout, shape: torch.Size) -> Tensor:
    """Inverse of ``_key_blocks``: ``(G, block, E)`` -> ``shape`` ``(B, H, N, E)``, zero for the
    blocks no row attends."""
    x = x.new_zeros(shape[0] * shape[1] * t.n_blocks, *x.shape[1:]).index_copy_(0, t.order, x)
    return rearrange(x, "(b h c) j e -> b h (c j) e", b=shape[0], h=shape[1])[:, :, : shape[2]]


def _row_lse(lse: Tensor, row: Tensor, rows: int) -> Tensor:
    """Pair log-sum-exps ``(P,)`` -> each row's over all its pairs, ``(rows + 1,)``: ``-inf`` for
    a row that sees no key and for the spare row (its pairs are padding)."""
    peak = lse.new_full((rows + 1,), -math.inf).scatter_reduce_(0, row, lse, "amax")
    peak = torch.where(peak == -math.inf, 0.0, peak)
    total = peak + lse.new_zeros(rows + 1).index_put_((row,), torch.exp(lse - peak[row]), accumulate=True).log()
    total[-1] = -math.inf
    return total


class _BlockAttention(torch.autograd.Function):
    """``attend_blocks``: one flash-kernel call per bucket of groups (see ``_Layout``), the pairs
    merged per row by log-sum-exp; backward the kernel's backward per bucket, given each row's
    merged output and log-sum-exp (so that its softmax is over the union of its blocks)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, t: _Layout, o: _Options) -> Tensor:  # type: ignore[override]
        (batch, heads, rows, _), d_v = q.shape, v.shape[-1]
        q_pairs = _rows(q).index_select(0, t.row)  # (P, D)
        k_blocks, v_blocks = _key_blocks(k, t, o.block), _key_blocks(v, t, o.block)
        outs, lses = [], []
        for u in t.buckets:
            mask, is_causal, seen = _mask(t, u, o, q.dtype)
            k_u, v_u = (x[u.first : u.first + u.count, None] for x in (k_blocks, v_blocks))
            out, lse = flash_attention_cpu(
                t.kernel(q_pairs, u), k_u, v_u, 0.0, is_causal, attn_mask=mask, scale=o.scale
            )[:2]
            if seen is not None:  # the kernel gives a row that sees nothing lse = 0
                lse = lse.masked_fill(~seen.expand_as(lse), -math.inf)
            outs.append(out.reshape(-1, d_v))
            lses.append(lse.flatten().to(q.dtype))
        lse = torch.cat(lses)  # (P,)
        row_lse = _row_lse(lse, t.row, batch * heads * rows)
        weight = torch.exp(lse - torch.where(row_lse == -math.inf, 0.0, row_lse)[t.row])[:, None]
        merged = q.new_zeros(batch * heads * rows + 1, d_v)
        for u, out in zip(t.buckets, outs):
            merged.index_put_((t.row[u.span],), out.mul_(weight[u.span]), accumulate=True)
        merged[-1] = 0.0
        ctx.save_for_backward(q_pairs, k_blocks, v_blocks, merged, row_lse)
        ctx.layout, ctx.options, ctx.shapes = t, o, (k.shape, v.shape)
        return merged[:-1].view(batch, heads, rows, d_v)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q_pairs, k_blocks, v_blocks, out, row_lse = ctx.saved_tensors
        t, o, (k_shape, v_shape) = ctx.layout, ctx.options, ctx.shapes
        # A row that sees no key (and the spare row): lse = inf makes every weight exp(s - lse) 0.
        lse = torch.where(row_lse == -math.inf, math.inf, row_lse)[t.row, None]
        grad_pairs, out_pairs = _rows(grad).index_select(0, t.row), out.index_select(0, t.row)
        d_q, d_k, d_v = q_pairs.new_zeros(out.shape[0], q_pairs.shape[-1]), [], []
        for u in t.buckets:
            mask, is_causal, _ = _mask(t, u, o, q_pairs.dtype)
            k_u, v_u = (x[u.first : u.first + u.count, None] for x in (k_blocks, v_blocks))
            d_out, q_u, out_u, lse_u = (t.kernel(x, u) for x in (grad_pairs, q_pairs, out_pairs, lse))
            dq, dk, dv = flash_attention_cpu_backward(
                d_out, q_u, k_u, v_u, out_u, lse_u[..., 0].contiguous(), 0.0, is_causal, attn_mask=mask, scale=o.scale
            )
            d_q.index_put_((t.row[u.span],), dq.reshape(-1, dq.shape[-1]), accumulate=True)
            d_k.append(dk[:, 0])
            d_v.append(dv[:, 0])
        d_k, d_v = _unblock(torch.cat(d_k), t, k_shape), _unblock(torch.cat(d_v), t, v_shape)
        return d_q[:-1].view(*grad.shape[:3], -1), d_k, d_v, None, None


def attend_blocks(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor, *, block: int, scale: float, causal: bool, real: Tensor | None
) -> Tensor:
    """Each query row attends (one softmax) to the keys of its selected blocks.

    Args:
        q: ``(B, H, R, D)``: rows at the last R key positions (R = N: self-attention).
        k, v: ``(B, H, N, D)``, ``(B, H, N, D_v)``, cut into blocks of ``block`` (the last may be short).
        keep: ``(B, H, R, C)`` bool: the blocks each row attends to.
        scale: score scale. causal: keys after a row's position are never attended.
        real: ``(B, N)`` bool or None: padded keys are never attended.

    Returns:
        ``(B, H, R, D_v)``; a row with no visible key gets zeros (and passes zero gradient).

    Notes:
        The rows that attend key block c (its group) are gathered and run through PyTorch's CPU
        flash kernel against that block's keys, a zero-copy view: C calls of ``(B, H, rows in
        the group, D)`` by ``(B, H, block, D)``. Memory O(R S D) for S blocks per row; no scores
        are kept (backward recomputes them from the merged log-sum-exp).
    """
    (batch, heads, rows, dim), n, d_v = q.shape, k.shape[2], v.shape[-1]
    with torch.no_grad():
        t = _layout(keep, block, causal, rows == n)
    if not t.buckets:
        return v.new_zeros(batch, heads, rows, d_v)
    if dim != d_v:  # the kernel takes one head size: zero columns change no score and no output
        width = max(dim, d_v)
        q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    options = _Options(block, n, rows, causal, real, scale)
    return _BlockAttention.apply(q, k, v, t, options)[..., :d_v]


def _check_blocks(block: int, topk: int, what: str) -> None:
    for name, value in (("block", block), (what, topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _moba_gates(q: Tensor, k: Tensor, real: Tensor | None, block: int) -> tuple[Tensor, Tensor]:
    """``q_i . mean(k in b)`` for every query and block, ``(B, H, N_q, C)``, and ``has_real
    (B, C)``; no gradient (the selection is discrete)."""
    with torch.no_grad():
        means, has_real = block_means(k, real, block)
        return torch.einsum("bhnd,bhcd->bhnc", q, means), has_real


def moba(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block: int,
    topk: int,
    causal: bool,
    scale: float,
    key_mask: Tensor | None = None,
) -> Tensor:
    """MoBA (Lu et al. 2025, https://arxiv.org/abs/2502.13189), the fast path.

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)`` (self-attention).
        block: keys per block (the last block may be short). topk: blocks per query.
        causal: blocks starting after the query are excluded; the own block (keys ``j <= i``
            only) is always selected and counts toward ``topk``.
        scale: score scale (of the softmax; the gates are ``q_i . mean(k in b)`` unscaled).
        key_mask: ``(B, N)`` bool, True = real, or None: padded keys are never attended and
            never averaged into a block mean; a block with no real key is never selected.

    Returns:
        ``(B, H, N, D_v)`` in the dtype of q. Ties between gates go to the lower block index.
    """
    _check_blocks(block, topk, "topk")
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    gates, has_real = _moba_gates(qc, kc, key_mask, block)
    positions = torch.arange(q.shape[2], device=q.device) + (k.shape[2] - q.shape[2])
    keep = moba_selection(gates, positions, has_real, block, topk, causal)
    out = attend_blocks(qc, kc, vc, keep, block=block, scale=scale, causal=causal, real=key_mask)
    return out.to(q.dtype)


def reference_moba(
    q: Tensor, k: Tensor, v: Tensor, *, block: int, topk: int, causal: bool, scale: float, key_mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Dense MoBA (Lu et al. 2025, https://arxiv.org/abs/2502.13189) as the paper writes it: gate
    ``s_ib = q_i . mean(K_b)``; causal: ``s_ib = -inf`` for blocks after i's own, ``+inf`` for
    i's own block; the query keeps its ``topk`` highest-gated blocks (``topk_mask``: ties to the
    lower index); softmax over the kept blocks' keys (causal: ``j <= i``; padded keys never).

    Returns:
        ``(out (B, H, N, D_v), weights (B, H, N, N))``. Allocates N x N by design.
    """
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    n = k.shape[2]
    gates, has_real = _moba_gates(qc, kc, key_mask, block)
    blocks = torch.arange(gates.shape[-1], device=q.device)
    key_block, pos = torch.arange(n, device=q.device) // block, torch.arange(n, device=q.device)
    eligible = has_real[:, None, None, :]
    if causal:
        own = blocks == (pos // block)[:, None]  # (N, C)
        others = topk_mask(gates, eligible & (blocks < (pos // block)[:, None]), topk - 1) if topk > 1 else own & False
        keep_block = own | others
    else:
        keep_block = topk_mask(gates, eligible, topk)
    visible = keep_block[..., key_block]  # (B, H, N, N): key j is kept with its block
    if causal:
        visible = visible & (pos[None, :] <= pos[:, None])
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    weights = normalize_scores(torch.einsum("bhid,bhjd->bhij", qc, kc) * scale, visible, "softmax")
    return torch.einsum("bhij,bhjd->bhid", weights, vc).to(q.dtype), weights


@dataclass(frozen=True, kw_only=True)
class MoBAConfig(Config):
    """Config of ``moba``.

    Args:
        block: keys per block (the last may be short). Default 64.
        topk: blocks per query, the own block included when causal. Default 8.
        scale: score scale; default None means ``1 / sqrt(D)``.
    """

    block: int = bounded(64, ge=1)
    topk: int = bounded(8, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Blocks of about n / 64 keys (at least 2), about an eighth of the keys selected (at least 2 blocks)."""
        block = max(2, n // 64)
        return dict(block=block, topk=max(2, n // (8 * block)))


@dataclass(frozen=True)
class MoBAState:
    """``moba``'s decode state: every key and value (``cache``), and the mean of the real keys of
    each block so far, ``means (B, H, C, D)``, with ``has_real (B, C)``."""

    cache: KVCache
    means: Tensor
    has_real: Tensor


@register(
    "moba",
    config=MoBAConfig,
    family="content",
    summary="Mixture of Block Attention: each query attends to the key blocks whose mean key it gates highest.",
    paper="Lu et al. 2025, MoBA: Mixture of Block Attention for Long-Context LLMs, https://arxiv.org/abs/2502.13189",
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True),
    complexity=Complexity(
        time="O(N^2 D / block) gates + O(N topk block D) attention",
        memory="O(N^2 / block) gates, O(N topk (block + D)) attention",
        subquadratic_memory=True,
    ),
    notes=(
        "gate of query i and block b: q_i . mean(k in b), unscaled; the topk highest-gated blocks are kept, "
        "ties to the lower block index; gates pass no gradient (the selection is discrete)",
        "causal: blocks after the query's own are excluded; the own block (keys j <= i) is always kept and "
        "counts toward topk",
        "key_mask: padded keys are never attended and never averaged into a block mean; a block with no real "
        "key is never selected",
        "fast path: (query, block) pairs sorted by block into tiles of 64 queries that share one key block; "
        "scores, softmax (per query, across its tiles) and backward in those tiles: never N x N",
        "decode step: a KV cache and the running mean of each block's real keys; O(t D / block) gates and "
        "O(topk block D) attention per token",
    ),
)
class MoBAAttention(Attention):
    """MoBA; ``_attend`` runs ``moba``, ``_reference`` the dense ``reference_moba``."""

    config: MoBAConfig

    def _options(self, q: Tensor, args: AttendArgs) -> dict[str, Any]:
        cfg = self.config
        scale = default_scale(cfg.scale, q.shape[-1])
        return dict(block=cfg.block, topk=cfg.topk, causal=args.causal, scale=scale, key_mask=args.key_mask)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return moba(q, k, v, **self._options(q, args))

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        out, weights = reference_moba(q, k, v, **self._options(q, args))
        return (out, weights) if return_weights else out

    def _init_state(self, spec: StateSpec) -> MoBAState:
        """An empty cache and no blocks."""
        dtype = compute_dtype(torch.empty((), dtype=spec.dtype))
        means = torch.zeros(spec.batch, spec.kv_heads, 0, spec.head_dim, device=spec.device, dtype=dtype)
        return MoBAState(KVCache.for_state(spec), means, torch.zeros(spec.batch, 0, dtype=torch.bool))

    def _step(self, state: MoBAState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, MoBAState]:
        """The new rows of the causal forward: the means of the blocks the new tokens touch are
        recomputed from the cache (at most ``T + block`` keys), the rest are kept."""
        cfg, start = self.config, state.cache.length
        cache = state.cache.append(k, v, args.key_mask)
        first = start // cfg.block
        real = cache.key_mask
        with torch.no_grad():
            tail = cache.k[:, :, first * cfg.block :].to(state.means.dtype)
            means, has_real = block_means(tail, None if real is None else real[:, first * cfg.block :], cfg.block)
        means = torch.cat([state.means[:, :, :first], means], 2)
        has_real = torch.cat([state.has_real[:, :first].to(has_real.device), has_real], 1)
        qc, kc, vc = (x.to(compute_dtype(q)) for x in (q, cache.k, cache.v))
        positions = torch.arange(start, cache.length, device=q.device)
        gates = torch.einsum("bhnd,bhcd->bhnc", qc.detach(), means)
        keep = moba_selection(gates, positions, has_real, cfg.block, cfg.topk, True)
        scale = default_scale(cfg.scale, q.shape[-1])
        out = attend_blocks(qc, kc, vc, keep, block=cfg.block, scale=scale, causal=True, real=real).to(q.dtype)
        return nan_rows_of_non_finite_queries(out, q), MoBAState(cache, means, has_real)
