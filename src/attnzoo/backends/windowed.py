"""Runs a ``structured.Structure`` (see ``attnzoo.backends.structured`` for what the plans
are): zero-copy K/V windows and de-interleaved sub-sequences through PyTorch's CPU flash
kernel, window parts united with global columns by log-sum-exp, and their backward (the flash
kernel's backward on the union's output and log-sum-exp; overlapping windows' key gradients
added back block by block). Grouped-query K/V (``H_kv`` heads dividing ``H``) are taken as they
are where ``grouped.grouped_windows`` says so: the layouts are in ``attnzoo.backends.grouped``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo._compat import flash_attention_cpu, flash_attention_cpu_backward
from attnzoo.backends.call import Call, compute_dtype
from attnzoo.backends.grouped import (
    blocks_to_rows,
    fold_rows,
    grouped_matmul,
    grouped_outer,
    part_kv_heads,
    rows_to_blocks,
    unfold_rows,
)
from attnzoo.backends.structured import Merged, Structure, Windows, WithGlobals


class _Options(NamedTuple):
    """What every part of one call runs with besides q, k, v: the real keys ``key_valid (B, N)``
    (None = all real) and the score scale."""

    key_valid: Tensor | None
    scale: float


# --- layout: heads, de-interleaving, windows ------------------------------------------------


def _split(x: Tensor, stride: int, sub: int) -> Tensor:
    """``(B, H, N, D)`` -> ``(B * stride, H, sub, D)``: residue class ``r`` of the positions is
    batch row ``b * stride + r`` (N padded to ``sub * stride`` with zeros)."""
    if stride == 1:
        return x
    x = F.pad(x, (0, 0, 0, sub * stride - x.shape[2]))
    return rearrange(x, "b h (n m) d -> (b m) h n d", m=stride).contiguous()


def _merge(x: Tensor, stride: int, n: int) -> Tensor:
    """Inverse of ``_split`` (drops the padding)."""
    if stride == 1:
        return x
    return rearrange(x, "(b m) h n d -> b h (n m) d", m=stride)[:, :, :n]


def _split_keys(key_valid: Tensor | None, batch: int, n: int, stride: int, sub: int) -> Tensor | None:
    """Real keys ``(B, N)`` -> ``(B * stride, sub)``; None when every key is real."""
    if key_valid is None and sub * stride == n:
        return None
    if key_valid is None:
        key_valid = torch.ones(batch, n, dtype=torch.bool)
    key_valid = F.pad(key_valid, (0, sub * stride - n), value=False)
    return rearrange(key_valid, "b (n m) -> (b m) n", m=stride)


def _key_windows(x: Tensor, w: Windows, blocks: int) -> Tensor:
    """``(BH, n, D)`` -> zero-copy ``(BH, blocks, width, D)`` windows (x padded with zeros)."""
    front = max(0, -w.start)
    total = max(front + w.start + (blocks - 1) * w.block + w.width, front + x.shape[1])
    x = F.pad(x, (0, 0, front, total - front - x.shape[1])).contiguous()
    first = front + w.start
    return x[:, first:].as_strided(
        (x.shape[0], blocks, w.width, x.shape[2]), (x.stride(0), w.block * x.stride(1), x.stride(1), 1)
    )


def _window_mask(w: Windows, key_valid: Tensor | None, heads: int, blocks: int, dtype: torch.dtype) -> Tensor | None:
    """The pattern mask, with padded keys removed per batch row: ``(1 | B*H, blocks, block, width)``."""
    mask = None if w.allowed is None else w.allowed.to(dtype)
    if key_valid is None:
        return mask
    valid = _key_windows(key_valid[:, :, None].to(dtype), w, blocks)[..., 0]  # [B, blocks, width]
    padding = torch.zeros(valid.shape, dtype=dtype).masked_fill_(valid == 0, float("-inf"))[:, :, None, :]
    mask = padding if mask is None else mask + padding
    mask = mask.expand(key_valid.shape[0], blocks, w.block, w.width)
    return mask[:, None].expand(-1, heads, -1, -1, -1).flatten(0, 1)


def _dense_mask(w: Windows, key_valid: Tensor | None, n: int, dtype: torch.dtype) -> Tensor | None:
    # The pattern inside a sub-sequence, when it has one, already holds the causal rule.
    mask = None if w.allowed is None else w.allowed.to(dtype)[None, None]
    if key_valid is None:
        return mask
    padding = torch.zeros(key_valid.shape, dtype=dtype).masked_fill_(~key_valid, float("-inf"))[:, None, None, :]
    mask = padding if mask is None else mask + padding
    if w.causal and w.allowed is None:
        # The kernel takes is_causal or a mask, not both: with padding the mask is (B * stride,
        # 1, n, n) for sub-sequences of n = N / stride, i.e. N^2 / stride in all — the pair count
        # of the pattern itself (quadratic only for ``causal()`` alone, which is dense anyway).
        mask = mask + torch.full((n, n), float("-inf"), dtype=dtype).triu_(1)
    return mask


# --- forward and backward of one part ------------------------------------------------------


@dataclass
class _Saved:
    """A part's kernel-layout tensors, kept from forward for backward."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    mask: Tensor | None
    is_causal: bool

    def stash(self, ctx: Any, *extra: Tensor) -> None:
        """Save the tensors (after ``extra``) with ``ctx.save_for_backward``: freed as soon as
        backward has run, yet there again for a second backward of a retained graph
        (``retain_graph=True``, gradcheck), which a ``del`` after the first one would break."""
        ctx.save_for_backward(*extra, self.q, self.k, self.v, self.out, self.lse, self.mask)
        ctx.is_causal = self.is_causal

    @staticmethod
    def unstash(ctx: Any, n_extra: int = 0) -> tuple[tuple[Tensor, ...], _Saved]:
        """``(extra, saved)`` as ``stash`` left them."""
        tensors = ctx.saved_tensors
        return tensors[:n_extra], _Saved(*tensors[n_extra:], ctx.is_causal)


def _part_forward(w: Windows, q: Tensor, k: Tensor, v: Tensor, opts: _Options) -> tuple[Tensor, _Saved]:
    """One part's rows ``(B, H, N, D_v)``; K/V may have ``H_kv`` heads dividing ``H`` (a group's
    query heads stacked as rows: ``grouped.rows_to_blocks``, ``grouped.fold_rows``), except
    for a dense part run with ``is_causal`` (``grouped.grouped_windows`` refuses those)."""
    n, sub = q.shape[2], -(-q.shape[2] // w.stride)
    qs, ks, vs = (_split(x, w.stride, sub) for x in (q, k, v))
    valid = _split_keys(opts.key_valid, q.shape[0], n, w.stride, sub)
    if w.width == 0:  # dense
        mask = _dense_mask(w, valid, sub, q.dtype)
        is_causal = w.causal and mask is None and w.allowed is None
        groups = qs.shape[1] // ks.shape[1]  # > 1 only without is_causal (grouped.grouped_windows)
        qs = fold_rows(qs, groups)  # [B', H_kv, G sub, D]
        if mask is not None and groups > 1 and mask.shape[-2] > 1:
            mask = mask.repeat(1, 1, groups, 1)  # the pattern once per group member's rows
        out, lse = flash_attention_cpu(qs, ks, vs, 0.0, is_causal, attn_mask=mask, scale=opts.scale)[:2]
        return _merge(unfold_rows(out, groups), w.stride, n), _Saved(qs, ks, vs, out, lse, mask, is_causal)
    h, groups, blocks = qs.shape[1], qs.shape[1] // ks.shape[1], -(-sub // w.block)
    qx = rows_to_blocks(qs, blocks, w.block, groups)  # [B' H_kv, blocks, G block, D]
    kx, vx = _key_windows(ks.flatten(0, 1), w, blocks), _key_windows(vs.flatten(0, 1), w, blocks)
    mask = _window_mask(w, valid, ks.shape[1], blocks, q.dtype)
    if mask is not None and groups > 1:
        mask = mask.repeat(1, 1, groups, 1)  # the band (and padding) once per group member's rows
    out, lse = flash_attention_cpu(qx, kx, vx, 0.0, False, attn_mask=mask, scale=opts.scale)[:2]
    rows = blocks_to_rows(out, h, groups, sub)
    return _merge(rows, w.stride, n), _Saved(qx, kx, vx, out, lse, mask, False)


def _to_kernel(x: Tensor, w: Windows, saved: _Saved) -> Tensor:
    """``(B, H, N, D)`` rows -> the kernel layout of ``saved.out`` (zero rows where padded)."""
    sub = -(-x.shape[2] // w.stride)
    x = _split(x, w.stride, sub)
    if w.width == 0:  # dense
        return fold_rows(x, saved.q.shape[2] // saved.k.shape[2])
    return rows_to_blocks(x, saved.q.shape[1], w.block, saved.q.shape[2] // w.block)


def _part_backward(
    w: Windows, saved: _Saved, grad: Tensor, scale: float, out: Tensor | None = None, lse: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v gradients of one part. ``out``/``lse`` (``(B, H, N, Dv)``, ``(B, H, N)``) replace
    the part's own when it is one term of a union: the kernel's backward then uses the union's
    softmax (``delta = rowsum(dO * O)`` over the whole union)."""
    n, sub = grad.shape[2], -(-grad.shape[2] // w.stride)
    heads = grad.shape[1]
    g = _to_kernel(grad, w, saved).contiguous()
    kernel_out = saved.out if out is None else _to_kernel(out, w, saved).contiguous()
    kernel_lse = saved.lse if lse is None else _to_kernel(lse[..., None], w, saved)[..., 0].contiguous()
    dq, dk, dv = flash_attention_cpu_backward(
        g, saved.q, saved.k, saved.v, kernel_out, kernel_lse, 0.0, saved.is_causal, attn_mask=saved.mask, scale=scale
    )
    if w.width == 0:  # dense
        dq = unfold_rows(dq, saved.q.shape[2] // saved.k.shape[2])
        return tuple(_merge(x, w.stride, n) for x in (dq, dk, dv))  # type: ignore[return-value]
    groups = saved.q.shape[2] // w.block
    bb = dq.shape[0] * groups // heads
    dq = blocks_to_rows(dq, heads, groups, sub)
    dk, dv = (_overlap_add(x, w, sub).view(bb, heads // groups, sub, -1) for x in (dk, dv))
    return _merge(dq, w.stride, n), _merge(dk, w.stride, n), _merge(dv, w.stride, n)


def _part_lse(w: Windows, saved: _Saved, n: int, heads: int) -> Tensor:
    """The part's log-sum-exp ``(B, H, N)``, ``-inf`` where a row sees no key of the part (the
    kernel reports 0 there)."""
    lse = saved.lse
    if saved.mask is not None:
        lse = lse.masked_fill((saved.mask == float("-inf")).all(-1).expand_as(lse), float("-inf"))
    if w.width == 0:  # dense
        return _merge(unfold_rows(lse[..., None], saved.q.shape[2] // saved.k.shape[2]), w.stride, n)[..., 0]
    sub = -(-n // w.stride)
    return _merge(blocks_to_rows(lse[..., None], heads, saved.q.shape[2] // w.block, sub), w.stride, n)[..., 0]


def _overlap_add(windows: Tensor, w: Windows, n: int) -> Tensor:
    """Key gradients ``(BH, blocks, width, D)`` of overlapping windows -> ``(BH, n, D)``."""
    bh, blocks, width, dim = windows.shape
    front, per = max(0, -w.start), width // w.block
    first = (front + w.start) // w.block
    total = max(first + blocks - 1 + per, -(-(front + n) // w.block))
    out = windows.new_zeros(bh, total, w.block, dim)
    parts = windows.view(bh, blocks, per, w.block, dim)
    for s in range(per):
        out[:, first + s : first + s + blocks] += parts[:, :, s]
    return out.view(bh, total * w.block, dim)[:, front : front + n]


class _PartAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Windows, opts: _Options) -> Tensor:  # type: ignore[override]
        out, saved = _part_forward(w, q, k, v, opts)
        saved.stash(ctx)
        ctx.w, ctx.scale = w, opts.scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        dq, dk, dv = _part_backward(ctx.w, _Saved.unstash(ctx)[1], grad, ctx.scale)
        return dq, dk, dv, None, None


#: From this many global keys on, a union's columns run through the flash kernel on the gathered
#: keys (``_KernelUnionAttention``) instead of as explicit ``(N, g)`` scores (Sparse Transformer's
#: fixed columns are N / 16 keys: 256 at N = 4096, where the explicit scores took 80% of the time).
KERNEL_COLUMNS = 32


def _column_allowed(part: WithGlobals, opts: _Options, device: torch.device) -> Tensor:
    """Which (row, global key) pairs the union's columns hold: bool ``(1 | B, 1, N, g)``."""
    allowed = part.columns.to(device)[None, None]
    if opts.key_valid is not None:
        allowed = allowed & opts.key_valid[:, None, None, part.tokens.to(device)]
    return allowed


def _column_scores(part: WithGlobals, q: Tensor, k: Tensor, opts: _Options) -> Tensor:
    """Scores of every row against the global keys ``(B, H, N, g)``, ``-inf`` where not allowed."""
    allowed = _column_allowed(part, opts, q.device)
    cd = compute_dtype(q)
    scores = grouped_matmul(q.to(cd), k[:, :, part.tokens.to(q.device)].to(cd).transpose(-1, -2)) * opts.scale
    return scores.masked_fill(~allowed, float("-inf"))


def _finite(lse: Tensor, fill: float) -> Tensor:
    return torch.where(torch.isinf(lse), fill, lse)


class _UnionAttention(torch.autograd.Function):
    """Window part + global columns, merged by log-sum-exp; backward gives both parts the
    union's output and log-sum-exp (see ``_part_backward``)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, part: WithGlobals, opts: _Options) -> Tensor:  # type: ignore[override]
        scores = _column_scores(part, q, k, opts)
        lse = torch.logsumexp(scores, dim=-1)
        saved, out_w = None, None
        if part.windows is not None:
            out_w, saved = _part_forward(part.windows, q, k, v, opts)
            lse_w = _part_lse(part.windows, saved, q.shape[2], q.shape[1]).to(lse.dtype)
            lse = torch.logaddexp(lse, lse_w)
        probs = torch.exp(scores - _finite(lse, 0.0)[..., None])
        out = grouped_matmul(probs, v[:, :, part.tokens.to(q.device)].to(probs.dtype))
        if out_w is not None:
            out = out + out_w.to(out.dtype) * torch.exp(lse_w - _finite(lse, 0.0))[..., None]
        out = out.to(q.dtype)
        if saved is None:
            ctx.save_for_backward(q, k, v, out, lse, probs)
        else:
            saved.stash(ctx, q, k, v, out, lse, probs)
        ctx.part, ctx.scale = part, opts.scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        part, scale = ctx.part, ctx.scale
        if part.windows is not None:
            (q, k, v, out, lse, probs), saved = _Saved.unstash(ctx, 6)
            lse_k = _finite(lse, float("inf")).to(saved.lse.dtype)  # rows that see nothing: p = 0
            dq, dk, dv = (x.to(probs.dtype) for x in _part_backward(part.windows, saved, grad, scale, out, lse_k))
        else:
            q, k, v, out, lse, probs = ctx.saved_tensors
            dq, dk, dv = (torch.zeros(x.shape, dtype=probs.dtype, device=x.device) for x in (q, k, v))
        index = part.tokens.to(q.device)
        g = grad.to(probs.dtype)
        delta = (g * out.to(probs.dtype)).sum(-1, keepdim=True)
        d_scores = probs * (grouped_matmul(g, v[:, :, index].to(probs.dtype).transpose(-1, -2)) - delta) * scale
        dq = dq + grouped_matmul(d_scores, k[:, :, index].to(probs.dtype))
        dk = dk.index_add(2, index, grouped_outer(d_scores, q.to(probs.dtype), k.shape[1]))
        dv = dv.index_add(2, index, grouped_outer(probs, g, k.shape[1]))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class _KernelUnionAttention(torch.autograd.Function):
    """``_UnionAttention`` for many global keys (``KERNEL_COLUMNS``), K/V heads equal to the query
    heads: the columns are one flash-kernel call on the gathered keys and values under their
    ``(N, g)`` mask, merged with the window part by log-sum-exp; backward runs the kernel's
    backward for both with the union's output and log-sum-exp, and adds the gathered keys' and
    values' gradients back at their positions."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, part: WithGlobals, opts: _Options) -> Tensor:  # type: ignore[override]
        index = part.tokens.to(q.device)
        kg, vg = k[:, :, index].contiguous(), v[:, :, index].contiguous()  # [B, H, g, D]
        allowed = _column_allowed(part, opts, q.device)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        out, lse = flash_attention_cpu(q, kg, vg, 0.0, False, attn_mask=mask, scale=opts.scale)[:2]
        lse = lse.masked_fill(~allowed.any(-1), float("-inf"))  # the kernel reports 0 for a row with no key
        saved = None
        if part.windows is not None:
            out_w, saved = _part_forward(part.windows, q, k, v, opts)
            lse_w = _part_lse(part.windows, saved, q.shape[2], q.shape[1]).to(lse.dtype)
            union = torch.logaddexp(lse, lse_w)
            top = _finite(union, 0.0)
            out = out * torch.exp(lse - top)[..., None].to(out.dtype) + out_w * torch.exp(lse_w - top)[..., None].to(
                out.dtype
            )
            lse = union
        if saved is None:
            ctx.save_for_backward(q, kg, vg, mask, out, lse)
        else:
            saved.stash(ctx, q, kg, vg, mask, out, lse)
        ctx.part, ctx.scale, ctx.kv_shape = part, opts.scale, k.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        part, scale = ctx.part, ctx.scale
        if part.windows is not None:
            (q, kg, vg, mask, out, lse), saved = _Saved.unstash(ctx, 6)
        else:
            q, kg, vg, mask, out, lse = ctx.saved_tensors
        lse = _finite(lse, float("inf"))  # rows that see nothing: p = 0
        grad = grad.contiguous()
        dq, dkg, dvg = flash_attention_cpu_backward(grad, q, kg, vg, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        if part.windows is not None:
            dq_w, dk, dv = _part_backward(part.windows, saved, grad, scale, out, lse.to(saved.lse.dtype))
            dq = dq + dq_w
        else:
            dk, dv = (torch.zeros(ctx.kv_shape[:3] + x.shape[3:], dtype=x.dtype, device=x.device) for x in (kg, vg))
        index = part.tokens.to(q.device)
        return dq, dk.index_add(2, index, dkg), dv.index_add(2, index, dvg), None, None


def _global_rows(part: WithGlobals, q: Tensor, k: Tensor, v: Tensor, opts: _Options) -> Tensor:
    """The global tokens' rows: each attends every (real, and with ``causal`` earlier) key.
    ``(B, H, g, Dv)``; O(g N) memory; differentiable by autograd."""
    index = part.tokens.to(q.device)
    cd = compute_dtype(q)
    scores = grouped_matmul(q[:, :, index].to(cd), k.to(cd).transpose(-1, -2)) * opts.scale
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if part.causal:
        allowed = torch.arange(k.shape[2], device=q.device)[None, :] <= index[:, None]
    key_valid = opts.key_valid
    allowed = allowed[None, None] if key_valid is None else allowed[None, None] & key_valid[:, None, None, :]
    # A row with no key gets zeros (finite scores times 0); a NaN query's row stays NaN.
    has_key = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    weights = torch.softmax(scores, dim=-1) * has_key
    return grouped_matmul(weights, v.to(cd)).to(q.dtype)


class _MergedAttention(torch.autograd.Function):
    """Disjoint window parts merged by log-sum-exp; backward gives every part the union's
    output and log-sum-exp (see ``_part_backward``)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, merged: Merged, opts: _Options) -> Tensor:  # type: ignore[override]
        outs, lses, saved = [], [], []
        for w in merged.parts:
            out, part = _part_forward(w, q, k, v, opts)
            outs.append(out)
            lses.append(_part_lse(w, part, q.shape[2], q.shape[1]))
            saved.append(part)
        lse = torch.logsumexp(torch.stack(lses), 0)  # [B, H, N]
        out = sum(o * torch.exp(p - _finite(lse, 0.0))[..., None].to(o.dtype) for o, p in zip(outs, lses))
        ctx.merged, ctx.scale, ctx.causal = merged, opts.scale, [part.is_causal for part in saved]
        # save_for_backward (see ``_Saved.stash``): a retained graph can run backward twice.
        ctx.save_for_backward(
            out, lse, *(t for part in saved for t in (part.q, part.k, part.v, part.out, part.lse, part.mask))
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out, lse, *tensors = ctx.saved_tensors
        saved = [_Saved(*tensors[6 * i : 6 * i + 6], causal) for i, causal in enumerate(ctx.causal)]
        lse = _finite(lse, float("inf"))  # rows that see nothing: p = 0
        grads = [
            _part_backward(w, part, grad, ctx.scale, out, lse.to(part.lse.dtype))
            for w, part in zip(ctx.merged.parts, saved)
        ]
        return (*(sum(g[i] for g in grads) for i in range(3)), None, None)


def _run_part(part: Windows | WithGlobals | Merged, q: Tensor, k: Tensor, v: Tensor, opts: _Options) -> Tensor:
    if isinstance(part, Windows):
        return _PartAttention.apply(q, k, v, part, opts)
    if isinstance(part, Merged):
        return _MergedAttention.apply(q, k, v, part, opts)
    if part.tokens.numel() >= KERNEL_COLUMNS and q.shape[1] == k.shape[1]:
        out = _KernelUnionAttention.apply(q, k, v, part, opts)
    else:
        out = _UnionAttention.apply(q, k, v, part, opts)
    if not part.rows:
        return out
    return out.index_copy(2, part.tokens.to(q.device), _global_rows(part, q, k, v, opts))


def structured_attention(call: Call, plan: Structure) -> Tensor:
    """Exact attention of ``call`` over ``plan`` (see the module docstring). ``(B, H, N, D)`` in
    and out; rows with no visible key give zeros and zero gradient. K/V may have ``H_kv``
    heads dividing ``H`` where ``grouped.grouped_windows(plan, H / H_kv)`` (else ``H``)."""
    q, k, v, opts = call.q, call.k, call.v, _Options(call.key_mask, call.scale)
    if len(plan.parts) == 1 and plan.parts[0][0] is None:
        return _run_part(plan.parts[0][1], q, k, v, opts)
    pieces, groups = [], q.shape[1] // k.shape[1]
    sizes = _head_runs(plan)
    if sizes is not None and groups == 1:
        # Head groups that are consecutive runs in head order (``per_head`` makes them so): split
        # and concatenated, each a view forward and one copy backward, where indexing the heads
        # out and back costs a gather, and in backward a zero-filled scatter and an add, per tensor.
        parts = zip(plan.parts, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1))
        return torch.cat([_run_part(part, *qkv, opts) for (_, part), *qkv in parts], dim=1)
    for heads, part in plan.parts:
        kv = heads if groups == 1 else part_kv_heads(heads, groups)  # not None: see grouped_windows
        pieces.append((heads, _run_part(part, q[:, heads], k[:, kv], v[:, kv], opts)))
    # Head groups are disjoint: put each group's rows back at its heads (differentiably).
    order = torch.cat([heads for heads, _ in pieces]).argsort()
    return torch.cat([piece for _, piece in pieces], dim=1)[:, order.to(q.device)]


def _head_runs(plan: Structure) -> list[int] | None:
    """The sizes of the plan's head groups when they are consecutive runs ``0..a-1, a..b-1, ...``
    in order, else None."""
    sizes, first = [], 0
    for heads, _ in plan.parts:
        if heads is None or heads.numel() == 0:
            return None
        if not torch.equal(heads.cpu(), torch.arange(first, first + heads.numel())):
            return None
        sizes.append(heads.numel())
        first += heads.numel()
    return sizes
