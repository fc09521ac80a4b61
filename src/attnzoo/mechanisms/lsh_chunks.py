"""LSH attention's hashing and its fast path: the chunk-aligned sorted layout (``lsh`` is
registered in ``attnzoo.mechanisms.lsh``, beside the dense ``reference_lsh``).

Each round lays the tokens out in sorted order with every bucket starting on a chunk boundary
(filler slots pad the buckets), so a query's chunk sees exactly its own chunk of slots and the
one before: one CPU flash-kernel call per round over zero-copy windows of 2c keys, with an
additive mask (same bucket, real key, not self, causal, ``-log N_ij``). The backward runs the
flash kernel's backward per round with the union's output and log-sum-exp. O(N c) memory.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.backends.call import merge_by_lse
from attnzoo.mechanisms.block_attend import flash_backward, flash_forward


def buckets(keys: Tensor, rotation: Tensor, real: Tensor) -> Tensor:
    """``(B, H, N)`` buckets ``argmax([xR; -xR])`` of the unit keys ``(B, H, N, D)`` under the
    heads' rotations ``R (H, D, n_buckets / 2)``; padded
    tokens go to an extra last bucket ``n_buckets`` so they never shift real tokens' ranks."""
    n_buckets = max(2 * rotation.shape[-1], 1)
    if rotation.shape[-1]:
        projected = keys.float() @ rotation.float()[None]  # [B, H, N, n_buckets/2]
        bucket = torch.cat([projected, -projected], dim=-1).argmax(-1)
    else:
        bucket = torch.zeros(keys.shape[:3], dtype=torch.long, device=keys.device)
    return torch.where(real[:, None, :], bucket, n_buckets)


def round_buckets(keys: Tensor, rotations: Tensor, real: Tensor) -> Tensor:
    """``buckets`` of every round at once, ``(R, B, H, N)`` under ``rotations (R, H, D, n_buckets
    / 2)``: one product for all rounds, and the argmax over ``[xR; -xR]`` read from the max and
    the min of ``xR`` (a tie between ``max`` and ``-min`` goes to the first half, as argmax's
    first index does): 0.61 ms for ``lsh``'s two rounds at 1K where a product, ``cat`` and
    ``argmax`` over a last dimension of 8 per round took 0.80 (``benchmarks/ab-lsh-hashing-cpu.txt``)."""
    rounds, half = rotations.shape[0], rotations.shape[-1]
    if not half:
        return torch.stack([buckets(keys, r, real) for r in rotations])
    rotation = rearrange(rotations.float(), "r h d e -> h d (r e)")
    projected = rearrange(keys.float() @ rotation, "b h n (r e) -> r b h n e", r=rounds)
    high, top = projected.max(-1)
    low, bottom = projected.min(-1)
    bucket = torch.where(high >= -low, top, bottom + half)
    return torch.where(real[:, None, :], bucket, 2 * half)


@dataclass(frozen=True)
class Round:
    """One hashing round laid out for the kernel. Real tokens are sorted by (bucket, position)
    into ``length`` slots per (batch, head) row, each bucket starting on a chunk boundary
    (filler slots pad it), so a bucket's rank-chunks are whole chunks of slots and chunk ``i``
    sees chunk ``i - 1`` (if the same bucket) and itself. Indices are flat over the ``B * H``
    rows: ``keys`` the token behind each slot with c leading dummies (the window before the
    first chunk), ``queries`` the same without them, and ``queries_t`` the same again in the
    order ``(BH, c, chunks)`` the kernel wants the output gradient in; ``slot`` each position's
    slot, ``slot_t`` the same in that order (``own_t`` in the key windows' order ``(BH, 2c,
    chunks)``, second half: the kernel's layouts of its lse and gradients), ``code`` a
    number per position whose difference (query - key) is 0 or 1 exactly when this round shows
    the key to the query. ``mask (BH, chunks, c, 2c)`` is the additive mask, ``empty`` the rows
    that see nothing."""

    length: int
    keys: Tensor
    queries: Tensor
    queries_t: Tensor
    slot: Tensor
    slot_t: Tensor
    own_t: Tensor
    code: Tensor
    mask: Tensor | None = None
    empty: Tensor | None = None


def _windows(x: Tensor, chunk: int) -> Tensor:
    """``(BH, c + L, ...)`` -> zero-copy ``(BH, L / c, 2c, ...)``: chunk i's keys are slots
    ``(i - 1) c .. (i + 1) c`` (the leading c entries stand before slot 0)."""
    x = x.contiguous()
    chunks = x.shape[1] // chunk - 1
    return x.as_strided(
        (x.shape[0], chunks, 2 * chunk, *x.shape[2:]), (x.stride(0), chunk * x.stride(1), *x.stride()[1:])
    )


def layout(bucket: Tensor, n_buckets: int, chunk: int) -> tuple[Round, Tensor, Tensor, Tensor]:
    """The round's slots for ``bucket (B, H, N)`` (``n_buckets`` = padding), and per slot
    ``(BH, L)`` its position (0 in filler slots), whether it is filled, and its chunk's bucket."""
    (b, h, n), dev = bucket.shape, bucket.device
    order = torch.sort(bucket, dim=-1, stable=True).indices  # by (bucket, position)
    bucket_s = bucket.gather(-1, order)
    counts = torch.zeros(b, h, n_buckets + 1, dtype=torch.long, device=dev).scatter_add_(
        -1, bucket, torch.ones_like(bucket)
    )
    rank = torch.arange(n, device=dev) - (counts.cumsum(-1) - counts).gather(-1, bucket_s)
    room = torch.div(counts + chunk - 1, chunk, rounding_mode="floor") * chunk
    room[..., -1] = 0  # padding tokens take no slots
    length = max(int(room.sum(-1).max()), chunk)
    slot_s = torch.where(bucket_s < n_buckets, (room.cumsum(-1) - room).gather(-1, bucket_s) + rank, length)
    position = torch.zeros(b, h, length + 1, dtype=torch.long, device=dev).scatter_(-1, slot_s, order)[..., :length]
    filled = torch.zeros(b, h, length + 1, dtype=torch.bool, device=dev).scatter_(-1, slot_s, True)[..., :length]
    slot_bucket = torch.full((b, h, length + 1), -1, dtype=torch.long, device=dev).scatter_(-1, slot_s, bucket_s)
    slot = torch.empty_like(order).scatter_(-1, order, slot_s).clamp_(max=length - 1)  # padding: fixed by the caller
    chunks, c, o = length // chunk, torch.div(slot, chunk, rounding_mode="floor"), slot % chunk
    rows = torch.arange(b * h, device=dev).view(b, h, 1)
    keys = F.pad(position + rows * n, (chunk, 0))  # [B, H, c + L]; dummies read position 0 of row 0
    # The flash kernel's outputs (and the output gradient it reads) are laid out (BH, c, chunks)
    # in memory: index that order directly rather than copying them into (BH, chunks, c).
    queries_t = rearrange(keys[..., chunk:], "b h (j o) -> b h o j", o=chunk)
    r = Round(
        length=length,
        keys=keys.flatten(),
        queries=keys[..., chunk:].flatten(),
        queries_t=queries_t.flatten(),
        slot=(rows * length + slot).flatten(),
        slot_t=((rows * chunk + o) * chunks + c).flatten(),
        own_t=((rows * 2 * chunk + chunk + o) * chunks + c).flatten(),
        code=bucket * (chunks + 2) + c,
    )
    return r, position.flatten(0, 1), filled.flatten(0, 1), slot_bucket[..., :length:chunk].flatten(0, 1)


def round_mask(
    r: Round,
    position: Tensor,
    filled: Tensor,
    chunk_bucket: Tensor,
    others: list[Round],
    *,
    chunk: int,
    causal: bool,
    dedupe: bool,
    dtype: torch.dtype,
) -> Round:
    """``r`` with its additive mask (0, or ``-log N_ij`` with ``dedupe``, where visible; -inf
    elsewhere: other buckets, filler slots, self, the future) and its empty rows (filler slots'
    rows among them). Filler rows are not masked: their output is never read, and the backward
    gives every empty row an lse of +inf, so they weigh nothing there."""
    bh, chunks = position.shape[0], r.length // chunk
    same_prev = F.pad(chunk_bucket[:, 1:] == chunk_bucket[:, :-1], (1, 0), value=False)  # [BH, chunks]
    key_ok = _windows(F.pad(filled, (chunk, 0), value=False), chunk).clone()  # [BH, chunks, 2c]
    key_ok[..., :chunk] &= same_prev[..., None]
    inf = float("-inf")
    own = torch.ones(chunk, chunk, dtype=torch.bool, device=filled.device)
    own = own.tril(-1) if causal else own.fill_diagonal_(False)
    fixed = torch.zeros(chunk, 2 * chunk, dtype=dtype, device=filled.device)
    fixed[:, chunk:].masked_fill_(~own, inf)
    if dedupe and len(others) == 1:
        mask = met_once(others[0], position, key_ok, fixed, chunk)
    else:
        key_term = torch.zeros(bh, chunks, 1, 2 * chunk, dtype=dtype, device=filled.device)
        key_term.masked_fill_(~key_ok[:, :, None], inf)
        if dedupe and others:
            mask = discounted(key_term, fixed, missed_rounds(others, position, chunk), len(others))
        else:
            mask = key_term + fixed
    # A row sees something when it is filled and some key of its window passes: counted on the
    # (BH, chunks, 2c) key pieces instead of a pass over the float mask. Own chunk: the keys
    # before the query (causal) or all but itself.
    ko = key_ok[..., chunk:].to(torch.int32)
    seen = ko.cumsum(-1) if causal else ko.sum(-1, keepdim=True)
    sees = key_ok[..., :chunk].any(-1, keepdim=True) | (seen - ko > 0)
    return dataclasses.replace(r, mask=mask, empty=~(sees & filled.view(bh, chunks, chunk)))


def met_once(other: Round, position: Tensor, key_ok: Tensor, fixed: Tensor, chunk: int) -> Tensor:
    """The additive mask with one other round (``lsh``'s default of two): ``fixed (c, 2c)``, -inf
    where ``key_ok (BH, chunks, 2c)`` is False, less ``ln 2`` where the other round shows the pair
    too (its codes differ by 0 or 1). In four float passes: ``y = |code_q - 1/2 - code_k|`` is
    1/2 exactly there (the codes are integers), clamped to 3/2 elsewhere and to -inf at a bad key
    (a tensor bound), then ``fixed - 3/2 ln 2 + ln 2 y``. The int16 count of ``missed_rounds``
    and ``discounted``'s int16 -> float add took 0.88 ms a round at 1K where this takes 0.53
    (``benchmarks/ab-lsh-hashing-cpu.txt``)."""
    code = other.code.flatten(0, 1)
    # The codes' differences must be exact: float64 where float32's 24 bits would not hold them.
    exact = fixed.dtype if int(code.max()) < 2**24 or fixed.dtype == torch.float64 else torch.float64
    code_q, code_k = _pair_codes(code.to(exact), position, chunk)
    top = torch.full(key_ok.shape, float("-inf"), dtype=exact, device=code.device).masked_fill_(key_ok, 1.5)
    y = (code_q.sub_(0.5) - code_k).abs_().clamp_(max=top[:, :, None])
    mask = torch.add(fixed.to(exact) - 1.5 * math.log(2.0), y, alpha=math.log(2.0), out=y)
    return mask.to(fixed.dtype)


def _pair_codes(code: Tensor, position: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Another round's ``code (BH, N)`` at this round's queries ``(BH, chunks, c, 1)`` and at
    their window keys ``(BH, chunks, 1, 2c)`` (``position (BH, L)``: each slot's token), in
    ``code``'s dtype: their difference is 0 or 1 where that round shows the pair too."""
    bh, chunks = position.shape[0], position.shape[1] // chunk
    key_pos = _windows(F.pad(position, (chunk, 0)), chunk).flatten(1)
    code_q = code.gather(1, position).view(bh, chunks, chunk, 1)
    return code_q, code.gather(1, key_pos).view(bh, chunks, 1, 2 * chunk)


def discounted(key_term: Tensor, fixed: Tensor, missed: Tensor, others: int) -> Tensor:
    """The additive mask ``key_term (BH, chunks, 1, 2c) + fixed (c, 2c) - log N_ij``, with ``N_ij
    = 1 + others - missed`` the rounds that show the pair, from ``missed`` (``missed_rounds``):
    three rounds or more (two: ``met_once``)."""
    return (key_term + fixed).sub_(torch.log1p((others - missed).to(fixed.dtype)))


def missed_rounds(others: list[Round], position: Tensor, chunk: int) -> Tensor:
    """``(BH, chunks, c, 2c)``: in how many of the ``others`` rounds each (query, key) pair of
    this round's chunks does *not* meet (it meets where the bucket is the same and the key's
    chunk is the query's or the one before: codes that differ by 0 or 1). Integer arithmetic
    throughout: on lsh's 1.4M pairs per round at 1K, the comparison to bool it replaced took
    0.48 ms, the subtraction, shift, ``abs`` and clamp 0.26 together."""
    missed = None
    for o in others:
        code = o.code.flatten(0, 1)
        # int16 where the codes fit (an int16 subtraction costs a tenth of a broadcast
        # comparison: ab-lsh-int16-cpu.txt), their width otherwise.
        narrow = torch.int16 if int(code.max()) < 2**15 else code.dtype
        code_q, code_k = _pair_codes(code.to(narrow), position, chunk)
        apart = (code_q - code_k) >> 1  # 0 exactly for a difference of 0 or 1
        apart = apart.abs_().clamp_max_(1)  # 0 where they meet, else 1
        missed = apart if missed is None else missed.add_(apart)
    return missed


def _rows(x: Tensor, index: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Rows ``index`` of ``x`` flattened to ``(-1, x.shape[-1])``, viewed as ``shape + (D,)``."""
    return x.reshape(-1, x.shape[-1]).index_select(0, index).view(*shape, x.shape[-1])


def _native(x: Tensor) -> Tensor:
    """A kernel tensor ``(BH, chunks, W, ...)`` as ``(BH, W, chunks, ...)``: its memory order,
    so this is a view (a copy only if the kernel ever changes its layout)."""
    return x.transpose(1, 2).contiguous()


def _by_position(x: Tensor, r: Round, shape: torch.Size) -> Tensor:
    """A kernel output ``(BH, chunks, c, D)`` by position ``shape + (D,)``, read in whichever of
    the two orders it is laid out in (the kernel's output is, its lse and gradients are not)."""
    if x.is_contiguous():
        return _rows(x, r.slot, shape)
    return _rows(_native(x), r.slot_t, shape)


def _round_forward(q: Tensor, keys: Tensor, v: Tensor, r: Round, chunk: int, scale: float) -> tuple[Tensor, ...]:
    """One round's kernel inputs ``(qx, kx, vx)``, its kernel output and log-sum-exp (+inf
    where a row sees nothing, for the backward) and its output and log-sum-exp by position."""
    bh, chunks, by_position = r.mask.shape[0], r.length // chunk, q.shape[:3]
    qx = _rows(q, r.queries, (bh, chunks, chunk))
    kx, vx = (_windows(_rows(x, r.keys, (bh, chunk + r.length)), chunk) for x in (keys, v))  # [BH, chunks, 2c, D]
    out, lse = flash_forward(qx, kx, vx, 0.0, False, attn_mask=r.mask, scale=scale)[:2]
    # The kernel reports lse 0 for a row with no key: -inf by position, +inf for the backward
    # (p = exp(s - inf) = 0 even where s is -inf everywhere).
    lse = lse.masked_fill(r.empty, float("inf"))
    lse_position = _by_position(lse[..., None], r, by_position)[..., 0]
    lse_position = lse_position.masked_fill(torch.isinf(lse_position), float("-inf"))
    return (qx, kx, vx), (out, lse), _by_position(out, r, by_position), lse_position


def _tensors(r: Round) -> tuple[Tensor | None, ...]:
    """The fields of ``r`` after ``length``, in order: ``Round(r.length, *_tensors(r))`` is ``r``."""
    return tuple(getattr(r, f.name) for f in dataclasses.fields(Round)[1:])


def _scatter(gq: Tensor, gk: Tensor, gv: Tensor, r: Round, chunk: int, shape: torch.Size) -> tuple[Tensor, ...]:
    """A round's kernel gradients ``(BH, chunks, c | 2c, D)`` back by position ``shape``. A key's
    gradient is its own window's second half plus the next window's first half: summed in place
    in window space (memory order ``(BH, 2c, chunks, D)``), then one gather per tensor."""
    grads = [_by_position(gq, r, shape)]
    for g in (gk, gv):
        g = _native(g)  # [BH, 2c, chunks, D]
        g[:, chunk:, :-1] += g[:, :chunk, 1:]
        grads.append(_rows(g, r.own_t, shape))
    return tuple(grads)


class _Rounds(torch.autograd.Function):
    """All rounds, combined into one softmax by log-sum-exp; returns ``(out, lse)``. Backward:
    each round's flash backward with the union's output and log-sum-exp (with one round, the
    kernel's own, kept in its layout), its gradients gathered back by position (``_scatter``)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        keys: Tensor,
        v: Tensor,
        rounds: list[Round],  # type: ignore[override]
        real: Tensor | None,
        chunk: int,
        scale: float,
    ) -> tuple[Tensor, Tensor]:
        kernel, outs, lses = [], [], []
        for r in rounds:
            inputs, native, out, lse = _round_forward(q, keys, v, r, chunk, scale)
            # one round: its kernel output and lse are the union's, in the kernel's layout
            kernel.append((*inputs, *native) if len(rounds) == 1 else inputs)
            outs.append(out)
            lses.append(lse)
        out, total = merge_by_lse(outs, lses)  # the rounds' key sets: one softmax
        if real is not None:  # padding tokens have no slot: they read another's, and see nothing
            real = real[:, None, :]
            out, total = out * real[..., None], total.masked_fill(~real, float("-inf"))
        # Every tensor backward reads goes through save_for_backward: freed once backward has run,
        # there again for a second backward of a retained graph (retain_graph=True, gradcheck).
        union = (out, total) if len(rounds) > 1 else ()
        ctx.save_for_backward(*union, *(x for r, inputs in zip(rounds, kernel) for x in (*inputs, *_tensors(r))))
        ctx.lengths, ctx.chunk, ctx.scale, ctx.real = [r.length for r in rounds], chunk, scale, real
        ctx.mark_non_differentiable(total)
        return out, total

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved, single = ctx.saved_tensors, len(ctx.lengths) == 1
        if not single:
            out, total, *per_round = saved
            # A row that sees nothing has p = 0 everywhere: exp(-inf - (+inf)), not exp(-inf + inf).
            total = torch.where(torch.isinf(total), float("inf"), total)
        else:
            per_round = saved
        grad, grads = grad.contiguous(), None
        size = len(per_round) // len(ctx.lengths)
        for length, start in zip(ctx.lengths, range(0, len(per_round), size)):
            qx, kx, vx, *fields = per_round[start : start + size]
            if single:  # the kernel's own output and lse (+inf where a row sees nothing)
                o, lse, *fields = fields
            r = Round(length, *fields)
            if not single:
                o = _rows(out, r.queries, qx.shape[:3])
                lse = total.flatten().index_select(0, r.queries).view(qx.shape[:3]).masked_fill_(r.empty, float("inf"))
            # the output gradient in the kernel's own layout, which it would otherwise copy into
            g = _rows(grad, r.queries_t, (qx.shape[0], qx.shape[2], qx.shape[1])).transpose(1, 2)
            kernel_grads = flash_backward(g, qx, kx, vx, o, lse, 0.0, False, attn_mask=r.mask, scale=ctx.scale)
            scattered = _scatter(*kernel_grads, r, ctx.chunk, grad.shape[:3])
            grads = scattered if grads is None else tuple(a.add_(b) for a, b in zip(grads, scattered))
        if ctx.real is not None:
            grads = tuple(x * ctx.real[..., None] for x in grads)
        return *grads, None, None, None, None


def chunked_lsh(
    q: Tensor,
    keys: Tensor,
    v: Tensor,
    table: list[Tensor],
    key_mask: Tensor | None,
    *,
    n_buckets: int,
    chunk: int,
    causal: bool,
    dedupe: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """All rounds of ``table`` (per round the ``(B, H, N)`` buckets from ``buckets``) combined
    into one softmax: ``(out (B, H, N, D_v), log-sum-exp (B, H, N))``, the log-sum-exp -inf (and
    the row 0) where a query sees nothing. ``q``, ``keys``, ``v`` in the compute dtype."""
    with torch.no_grad():
        laid = [layout(bucket, n_buckets, chunk) for bucket in table]
        plain = [r for r, *_ in laid]
        rounds = [
            round_mask(
                r, *slots, [o for o in plain if o is not r], chunk=chunk, causal=causal, dedupe=dedupe, dtype=q.dtype
            )
            for r, *slots in laid
        ]
    # The flash kernel needs one head size for q, k and v: zero columns change no score.
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda x: x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))  # noqa: E731
    out, total = _Rounds.apply(pad(q), pad(keys), pad(v), rounds, key_mask, chunk, scale)
    return out[..., : v.shape[-1]], total
