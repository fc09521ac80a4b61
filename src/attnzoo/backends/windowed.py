"""Runs a ``structured.Structure`` (see ``attnzoo.backends.structured`` for what the plans
are): its window parts (``window_parts.py``: zero-copy K/V windows and de-interleaved
sub-sequences through PyTorch's CPU flash kernel), window parts united with global columns by
log-sum-exp, disjoint parts merged, and head groups run side by side. Backward gives every term
of a union the union's output and log-sum-exp. Grouped-query K/V (``H_kv`` heads dividing
``H``) are taken as they are where ``grouped.grouped_windows`` says so: the layouts are in
``attnzoo.backends.grouped``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnzoo._compat import flash_attention_cpu, flash_attention_cpu_backward
from attnzoo.backends.call import Call, additive_mask, compute_dtype, merge_by_lse
from attnzoo.backends.grouped import (
    grouped_matmul,
    grouped_matmul_add_,
    grouped_outer,
    grouped_outer_add_,
    part_kv_heads,
)
from attnzoo.backends.reference import normalize_scores
from attnzoo.backends.structured import Merged, Structure, Windows, WithGlobals
from attnzoo.backends.window_parts import Options, Saved, finite, part_backward, part_forward, part_lse
from attnzoo.score_mods import plain_bias


class _PartAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Windows, opts: Options) -> Tensor:  # type: ignore[override]
        out, saved = part_forward(w, q, k, v, opts)
        saved.stash(ctx)
        ctx.w, ctx.scale = w, opts.scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        dq, dk, dv = part_backward(ctx.w, Saved.unstash(ctx)[1], grad, ctx.scale)
        return dq, dk, dv, None, None


#: From this many global keys on, a union's columns run through the flash kernel on the gathered
#: keys (``_KernelUnionAttention``) instead of as explicit ``(N, g)`` scores (Sparse Transformer's
#: fixed columns are N / 16 keys: 256 at N = 4096, where the explicit scores took 80% of the time).
KERNEL_COLUMNS = 32


def _column_allowed(part: WithGlobals, opts: Options, device: torch.device) -> Tensor:
    """Which (row, global key) pairs the union's columns hold: bool ``(1 | B, 1, N, g)``."""
    allowed = part.columns.to(device)[None, None]
    if opts.key_valid is not None:
        allowed = allowed & opts.key_valid[:, None, None, part.tokens.to(device)]
    return allowed


def _bias_at(opts: Options, q: Tensor, rows: Tensor, keys: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``opts.bias`` at rows ``rows (n_r,)`` by keys ``keys (n_k,)`` (positions) for every batch
    row and head of ``q``: ``(1 | B, H, n_r, n_k)``, or None without a bias."""
    if opts.bias is None:
        return None
    b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1], device=q.device).view(1, -1, 1, 1)
    return opts.bias(b, h, rows.view(1, 1, -1, 1), keys.view(1, 1, 1, -1)).to(dtype)


def _column_scores(part: WithGlobals, q: Tensor, kg: Tensor, opts: Options) -> Tensor:
    """Scores of every row against the global keys ``kg (B, H_kv, g, D)`` (compute dtype), plus
    the call's bias: ``(B, H, N, g)``, ``-inf`` where not allowed."""
    scores = grouped_matmul(q.to(kg.dtype), kg.transpose(-1, -2)) * opts.scale
    rows = torch.arange(q.shape[2], device=q.device)
    bias = _bias_at(opts, q, rows, part.tokens.to(q.device), scores.dtype)
    scores = scores if bias is None else scores + bias
    return scores.masked_fill(~_column_allowed(part, opts, q.device), float("-inf"))


def _save(ctx: Any, saved: Saved | None, *tensors: Tensor) -> None:
    """A union's own tensors, and its window part's after them where it has one."""
    if saved is None:
        ctx.save_for_backward(*tensors)
    else:
        saved.stash(ctx, *tensors)


def _load(ctx: Any, windows: Windows | None, count: int) -> tuple[tuple[Tensor, ...], Saved | None]:
    """What ``_save`` kept: the union's ``count`` tensors and its window part's (or None)."""
    if windows is None:
        return ctx.saved_tensors, None
    return Saved.unstash(ctx, count)


class _UnionAttention(torch.autograd.Function):
    """Window part + global columns, merged by log-sum-exp, and the global tokens' own rows (where
    ``part.rows``) written over theirs, in one function: the output is one buffer that the
    columns' product accumulates into and the rows are copied into, and backward adds every
    term's gradient into the window part's own (no ``(N, D)`` temporaries per term, which also
    kept the heap growing and page-faulting on every call). Backward gives the window part and
    the columns the union's output and log-sum-exp (see ``part_backward``), and the rows' gradient
    only to the rows."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, part: WithGlobals, opts: Options) -> Tensor:  # type: ignore[override]
        index, cd = part.tokens.to(q.device), compute_dtype(q)
        kg, vg = k[:, :, index].to(cd), v[:, :, index].to(cd)  # [B, H_kv, g, D]
        scores = _column_scores(part, q, kg, opts)
        lse = torch.logsumexp(scores, dim=-1)
        saved = None
        if part.windows is not None:
            out, saved = part_forward(part.windows, q, k, v, opts)
            lse_w = part_lse(part.windows, saved, q.shape[2], q.shape[1]).to(lse.dtype)
            union = torch.logaddexp(lse, lse_w)
            out = out.to(cd) * torch.exp(lse_w - finite(union, 0.0))[..., None]  # [B, H, N, Dv], own
            lse = union
        else:
            out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=cd, device=q.device)
        probs = torch.exp(scores - finite(lse, 0.0)[..., None])
        grouped_matmul_add_(out, probs, vg)
        weights = _row_weights(part, q, k, opts) if part.rows else probs.new_empty(0)
        if part.rows:
            out.index_copy_(2, index, grouped_matmul(weights, v.to(cd)))
        out = out.to(q.dtype)
        _save(ctx, saved, q, k, v, out, lse, probs, weights)
        ctx.part, ctx.scale = part, opts.scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        part, scale = ctx.part, ctx.scale
        (q, k, v, out, lse, probs, weights), saved = _load(ctx, part.windows, 7)
        index, cd = part.tokens.to(q.device), probs.dtype
        g_rows = grad[:, :, index].to(cd) if part.rows else None
        if part.rows:  # the rows' output came from the rows alone: no gradient to the other terms there
            grad = grad.index_fill(2, index, 0.0)
        if saved is not None:
            lse_k = finite(lse, float("inf")).to(saved.lse.dtype)  # rows that see nothing: p = 0
            grads = part_backward(part.windows, saved, grad, scale, out, lse_k)
            dq, dk, dv = (x.to(cd) for x in grads)
        else:
            dq, dk, dv = (torch.zeros(x.shape, dtype=cd, device=x.device) for x in (q, k, v))
        g = grad.to(cd)
        kg, vg = k[:, :, index].to(cd), v[:, :, index].to(cd)
        delta = (g * out.to(cd)).sum(-1, keepdim=True)
        d_scores = probs * (grouped_matmul(g, vg.transpose(-1, -2)) - delta) * scale
        grouped_matmul_add_(dq, d_scores, kg)
        dk.index_add_(2, index, grouped_outer(d_scores, q.to(cd), k.shape[1]))
        dv.index_add_(2, index, grouped_outer(probs, g, k.shape[1]))
        if g_rows is not None:
            _rows_backward(g_rows, weights, q, k, v, index, scale, (dq, dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _rows_backward(
    g_rows: Tensor,
    weights: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    scale: float,
    into: tuple[Tensor, ...],
) -> None:
    """The global tokens' rows' gradients, added into ``into = (dq, dk, dv)``: a softmax over
    every key per row, ``weights (B, H, g, N)`` (0 where a row may not look, and for a row that
    sees nothing)."""
    dq, dk, dv = into
    cd = weights.dtype
    d_weights = grouped_matmul(g_rows, v.to(cd).transpose(-1, -2))  # [B, H, g, N]
    d_scores = weights * (d_weights - (d_weights * weights).sum(-1, keepdim=True)) * scale
    dq.index_add_(2, index, grouped_matmul(d_scores, k.to(cd)))
    grouped_outer_add_(dk, d_scores, q[:, :, index].to(cd))
    grouped_outer_add_(dv, weights, g_rows)


class _KernelUnionAttention(torch.autograd.Function):
    """``_UnionAttention`` for many global keys (``KERNEL_COLUMNS``), K/V heads equal to the query
    heads: the columns are one flash-kernel call on the gathered keys and values under their
    ``(N, g)`` mask, merged with the window part by log-sum-exp; backward runs the kernel's
    backward for both with the union's output and log-sum-exp, and adds the gathered keys' and
    values' gradients back at their positions."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, part: WithGlobals, opts: Options) -> Tensor:  # type: ignore[override]
        index = part.tokens.to(q.device)
        kg, vg = k[:, :, index].contiguous(), v[:, :, index].contiguous()  # [B, H, g, D]
        allowed = _column_allowed(part, opts, q.device)
        mask = additive_mask(allowed, q.dtype)
        bias = _bias_at(opts, q, torch.arange(q.shape[2], device=q.device), index, q.dtype)
        if bias is not None:  # the pattern's -inf stay -inf
            mask = bias.expand(q.shape[0], -1, -1, -1) if mask is None else mask + bias
        out, lse = flash_attention_cpu(q, kg, vg, 0.0, False, attn_mask=mask, scale=opts.scale)[:2]
        lse = lse.masked_fill(~allowed.any(-1), float("-inf"))  # the kernel reports 0 for a row with no key
        saved = None
        if part.windows is not None:
            out_w, saved = part_forward(part.windows, q, k, v, opts)
            lse_w = part_lse(part.windows, saved, q.shape[2], q.shape[1]).to(lse.dtype)
            union = torch.logaddexp(lse, lse_w)
            top = finite(union, 0.0)
            out = out * torch.exp(lse - top)[..., None].to(out.dtype) + out_w * torch.exp(lse_w - top)[..., None].to(
                out.dtype
            )
            lse = union
        _save(ctx, saved, q, kg, vg, mask, out, lse)
        ctx.part, ctx.scale, ctx.kv_shape = part, opts.scale, k.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        part, scale = ctx.part, ctx.scale
        (q, kg, vg, mask, out, lse), saved = _load(ctx, part.windows, 6)
        lse = finite(lse, float("inf"))  # rows that see nothing: p = 0
        grad = grad.contiguous()
        dq, dkg, dvg = flash_attention_cpu_backward(grad, q, kg, vg, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        if saved is not None:
            dq_w, dk, dv = part_backward(part.windows, saved, grad, scale, out, lse.to(saved.lse.dtype))
            dq = dq + dq_w
        else:
            dk, dv = (torch.zeros(ctx.kv_shape[:3] + x.shape[3:], dtype=x.dtype, device=x.device) for x in (kg, vg))
        index = part.tokens.to(q.device)
        return dq, dk.index_add_(2, index, dkg), dv.index_add_(2, index, dvg), None, None


def _row_weights(part: WithGlobals, q: Tensor, k: Tensor, opts: Options) -> Tensor:
    """The global tokens' rows' softmax weights ``(B, H, g, N)``: each row attends every (real,
    and with ``causal`` earlier) key; a row with no key gets zeros (finite scores times 0), a NaN
    query's row stays NaN. O(g N) memory."""
    index = part.tokens.to(q.device)
    cd = compute_dtype(q)
    scores = grouped_matmul(q[:, :, index].to(cd), k.to(cd).transpose(-1, -2)) * opts.scale
    bias = _bias_at(opts, q, index, torch.arange(k.shape[2], device=q.device), cd)
    scores = scores if bias is None else scores + bias
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if part.causal:
        allowed = torch.arange(k.shape[2], device=q.device)[None, :] <= index[:, None]
    key_valid = opts.key_valid
    allowed = allowed[None, None] if key_valid is None else allowed[None, None] & key_valid[:, None, None, :]
    return normalize_scores(scores, allowed, "softmax")


def _global_rows(part: WithGlobals, q: Tensor, k: Tensor, v: Tensor, opts: Options) -> Tensor:
    """The global tokens' rows ``(B, H, g, Dv)`` (``_row_weights``), differentiable by autograd
    (``_KernelUnionAttention``'s; ``_UnionAttention`` runs its rows itself)."""
    weights = _row_weights(part, q, k, opts)
    return grouped_matmul(weights, v.to(weights.dtype)).to(q.dtype)


class _MergedAttention(torch.autograd.Function):
    """Disjoint window parts merged by log-sum-exp; backward gives every part the union's
    output and log-sum-exp (see ``part_backward``)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, merged: Merged, opts: Options) -> Tensor:  # type: ignore[override]
        outs, lses, saved = [], [], []
        for w in merged.parts:
            out, part = part_forward(w, q, k, v, opts)
            outs.append(out)
            lses.append(part_lse(w, part, q.shape[2], q.shape[1]))
            saved.append(part)
        out, lse = merge_by_lse(outs, lses)  # [B, H, N, Dv], [B, H, N]
        ctx.merged, ctx.scale, ctx.flags = merged, opts.scale, [part.flags() for part in saved]
        # save_for_backward (see ``Saved.stash``): a retained graph can run backward twice.
        ctx.save_for_backward(out, lse, *(t for part in saved for t in part.tensors()))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out, lse, *tensors = ctx.saved_tensors
        per = len(tensors) // len(ctx.flags)  # each part's ``Saved.tensors()``
        saved = [Saved(*tensors[per * i : per * (i + 1)], *flags) for i, flags in enumerate(ctx.flags)]
        lse = finite(lse, float("inf"))  # rows that see nothing: p = 0
        grads = [
            part_backward(w, part, grad, ctx.scale, out, lse.to(part.lse.dtype))
            for w, part in zip(ctx.merged.parts, saved)
        ]
        return (*(sum(g[i] for g in grads) for i in range(3)), None, None)


def _run_part(part: Windows | WithGlobals | Merged, q: Tensor, k: Tensor, v: Tensor, opts: Options) -> Tensor:
    if isinstance(part, Windows):
        return _PartAttention.apply(q, k, v, part, opts)
    if isinstance(part, Merged):
        return _MergedAttention.apply(q, k, v, part, opts)
    if part.tokens.numel() < KERNEL_COLUMNS or q.shape[1] != k.shape[1]:
        return _UnionAttention.apply(q, k, v, part, opts)  # with the rows
    out = _KernelUnionAttention.apply(q, k, v, part, opts)
    if not part.rows:
        return out
    return out.index_copy(2, part.tokens.to(q.device), _global_rows(part, q, k, v, opts))


def structured_attention(call: Call, plan: Structure) -> Tensor:
    """Exact attention of ``call`` over ``plan`` (see the module docstring). ``(B, H, N, D)`` in
    and out; rows with no visible key give zeros and zero gradient. K/V may have ``H_kv``
    heads dividing ``H`` where ``grouped.grouped_windows(plan, H / H_kv)`` (else ``H``)."""
    q, k, v = call.q, call.k, call.v
    opts = Options(call.key_mask, call.scale, plain_bias(call.score_mod, q.device))  # a bias: plan.structure_for
    if len(plan.parts) == 1 and plan.parts[0][0] is None:
        return _run_part(plan.parts[0][1], q, k, v, opts)
    pieces, groups = [], q.shape[1] // k.shape[1]
    sizes = _head_runs(plan)
    if sizes is not None and groups == 1:
        # Head groups that are consecutive runs in head order (``per_head`` makes them so): split
        # and concatenated, each a view forward and one copy backward, where indexing the heads
        # out and back costs a gather, and in backward a zero-filled scatter and an add, per tensor.
        parts = zip(plan.parts, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1))
        return torch.cat([_run_part(part, *qkv, _group_opts(opts, heads)) for (heads, part), *qkv in parts], dim=1)
    for heads, part in plan.parts:
        kv = heads if groups == 1 else part_kv_heads(heads, groups)  # not None: see grouped_windows
        pieces.append((heads, _run_part(part, q[:, heads], k[:, kv], v[:, kv], _group_opts(opts, heads))))
    # Head groups are disjoint: put each group's rows back at its heads (differentiably).
    order = torch.cat([heads for heads, _ in pieces]).argsort()
    return torch.cat([piece for _, piece in pieces], dim=1)[:, order.to(q.device)]


def _group_opts(opts: Options, heads: Tensor | None) -> Options:
    """``opts`` for a head group's part: its bias reads the group's heads by their index in the
    call (the part numbers them from 0)."""
    if opts.bias is None or heads is None:
        return opts
    bias, index = opts.bias, heads

    def group_bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return bias(b, index.to(h.device)[h], q_idx, kv_idx)

    return opts._replace(bias=group_bias)


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
