"""``attend_blocks``: each query row attends (one softmax) to the keys of its own few selected
key blocks, the kernel under MoBA (``block_select.py``) and NSA's selected branch (``nsa.py``).

The (row, block) pairs are grouped by key block: group = the rows of one (b, h) that attend one
key block, in ascending order. Groups are sorted by length and cut into buckets of similar
length; each bucket is one call of PyTorch's CPU flash kernel (``attnzoo._compat``) with its
groups as the batch, each group's rows (gathered, padded to the bucket's longest) against its
key block (a copy of K/V rearranged by block, O(N D)). The pairs of a row are merged by
log-sum-exp into one softmax over the union of its blocks; backward runs the kernel's backward
per bucket from the merged output and log-sum-exp. Causal self-attention in which every row
attends its own block and nothing later needs no mask: each group then starts with its own
block's rows in order, and the kernel's top-left causal mask is exactly the causal rule.
Off the CPU the kernel's forward and backward run as plain tensor ops (``_plain_forward``,
``_plain_backward``: the same math, scores per bucket materialised).

Memory: O(R S D) for R rows of S blocks each (per-pair outputs); no scores are kept and nothing
is N x N. Query rows (and in backward the output gradient and merged output) are gathered
bucket by bucket, never all P pairs at once: at 4K one (P, D) copy is ~70 MB, fresh memory
from the OS (page faults) on every call, where a bucket's copy is reused by the allocator.
Sums over pairs use ``index_add_`` (its CPU kernel adds rows in parallel): 8 ms for 262K
pairs of 64 floats at 4K, against 28 ms for ``index_put_(accumulate=True)``, which adds them
one by one (measured with torch 2.13 on the 2-core EPYC, quiet and with two other jobs running).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo._compat import flash_attention_cpu, flash_attention_cpu_backward

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

    def gather(self, rows: Tensor, u: _Bucket) -> Tensor:
        """Query rows ``(B H R + 1, E)`` -> bucket ``u``'s kernel input ``(count, 1, length, E)``.
        Gathered bucket by bucket, not for all P pairs at once: a bucket's copy is small enough
        for the allocator to reuse, where one (P, E) copy is fresh memory (page faults) each call."""
        return rows.index_select(0, self.row[u.span]).view(u.count, 1, u.length, rows.shape[-1])


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
    if not buckets:  # no row attends any block
        return _Layout(counts[:0], order, [], False, heads, n_blocks)
    padded = torch.cat([torch.full((u.count,), u.length, device=device) for u in buckets])  # (G,)
    start = torch.zeros_like(counts).index_put_((order,), padded.cumsum(0) - padded)  # each group's first pair
    b, h, c, r = keep.transpose(2, 3).nonzero(as_tuple=True)  # ordered by group, then row
    group = (b * heads + h) * n_blocks + c
    pair = start[group] + torch.arange(b.shape[0], device=device) - (counts.cumsum(0) - counts)[group]
    total = buckets[-1].span.stop
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


def _scores(q: Tensor, k: Tensor, is_causal: bool, mask: Tensor | None, scale: float) -> Tensor:
    s = q @ k.transpose(-1, -2) * scale
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s if mask is None else s + mask


def _plain_forward(q: Tensor, k: Tensor, v: Tensor, _: float, is_causal: bool, *, attn_mask, scale) -> tuple:  # noqa: ANN001
    """The flash kernel's forward in plain tensor ops (devices other than the CPU): ``(out, lse)``,
    zeros and ``lse = 0`` for a row that sees no key, as the kernel gives."""
    s = _scores(q, k, is_causal, attn_mask, scale)
    lse = torch.logsumexp(s, -1)
    lse = torch.where(lse == -math.inf, 0.0, lse)
    return torch.exp(s - lse[..., None]) @ v, lse


def _plain_backward(
    g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, _: float, is_causal: bool, *, attn_mask, scale
) -> tuple:  # noqa: ANN001, E501
    """The flash kernel's backward in plain tensor ops: ``dS = P (dP - rowsum(dO O))``."""
    p = torch.exp(_scores(q, k, is_causal, attn_mask, scale) - lse[..., None])
    d_s = p * (g @ v.transpose(-1, -2) - (g * out).sum(-1, keepdim=True))
    return d_s @ k * scale, d_s.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ g


def flash_forward(q: Tensor, *args, **kwargs) -> tuple:  # noqa: ANN002, ANN003
    """The CPU flash kernel's forward (``_compat.flash_attention_cpu``'s arguments), or on other
    devices the same in plain tensor ops: ``(out, lse, ...)``."""
    return (flash_attention_cpu if q.is_cpu else _plain_forward)(q, *args, **kwargs)


def flash_backward(grad: Tensor, *args, **kwargs) -> tuple:  # noqa: ANN002, ANN003
    """The CPU flash kernel's backward, or its plain-op twin off the CPU: ``(dq, dk, dv)``."""
    return (flash_attention_cpu_backward if grad.is_cpu else _plain_backward)(grad, *args, **kwargs)


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
        q_rows = _rows(q)  # (B H R + 1, D)
        k_blocks, v_blocks = _key_blocks(k, t, o.block), _key_blocks(v, t, o.block)
        outs, lses = [], []
        for u in t.buckets:
            mask, is_causal, seen = _mask(t, u, o, q.dtype)
            k_u, v_u = (x[u.first : u.first + u.count, None] for x in (k_blocks, v_blocks))
            out, lse = flash_forward(t.gather(q_rows, u), k_u, v_u, 0.0, is_causal, attn_mask=mask, scale=o.scale)[:2]
            if seen is not None:  # the kernel gives a row that sees nothing lse = 0
                lse = lse.masked_fill(~seen.expand_as(lse), -math.inf)
            outs.append(out.reshape(-1, d_v))
            lses.append(lse.flatten().to(q.dtype))
        lse = torch.cat(lses)  # (P,)
        row_lse = _row_lse(lse, t.row, batch * heads * rows)
        weight = torch.exp(lse - torch.where(row_lse == -math.inf, 0.0, row_lse)[t.row])[:, None]
        merged = q.new_zeros(batch * heads * rows + 1, d_v)
        for u, out in zip(t.buckets, outs):
            merged.index_add_(0, t.row[u.span], out.mul_(weight[u.span]))
        merged[-1] = 0.0
        ctx.save_for_backward(q_rows, k_blocks, v_blocks, merged, row_lse)
        ctx.layout, ctx.options, ctx.shapes = t, o, (k.shape, v.shape)
        return merged[:-1].view(batch, heads, rows, d_v)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q_rows, k_blocks, v_blocks, out, row_lse = ctx.saved_tensors
        t, o, (k_shape, v_shape) = ctx.layout, ctx.options, ctx.shapes
        # A row that sees no key (and the spare row): lse = inf makes every weight exp(s - lse) 0.
        lse = torch.where(row_lse == -math.inf, math.inf, row_lse)[:, None]
        grad_rows = _rows(grad)
        d_q, d_k, d_v = q_rows.new_zeros(q_rows.shape), [], []
        for u in t.buckets:
            mask, is_causal, _ = _mask(t, u, o, q_rows.dtype)
            k_u, v_u = (x[u.first : u.first + u.count, None] for x in (k_blocks, v_blocks))
            d_out, q_u, out_u, lse_u = (t.gather(x, u) for x in (grad_rows, q_rows, out, lse))
            dq, dk, dv = flash_backward(
                d_out, q_u, k_u, v_u, out_u, lse_u[..., 0], 0.0, is_causal, attn_mask=mask, scale=o.scale
            )
            d_q.index_add_(0, t.row[u.span], dq.reshape(-1, dq.shape[-1]))
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
        See the module docstring: groups of rows per key block, bucketed into flash-kernel calls.
        Memory O(R S (D + D_v)) for S blocks per row, O(N D) for K/V rearranged by block; no
        scores are kept (backward recomputes them from the merged log-sum-exp). D != D_v runs
        with q, k, v zero-padded to one width (the kernel takes one head size).
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
