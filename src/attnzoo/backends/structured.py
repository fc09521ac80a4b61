"""The blocked backend's structured path: patterns whose rows see one *contiguous run* of keys
run as one call of PyTorch's CPU flash kernel over zero-copy windows of K and V, with no tile
pieces, no gathers and no per-piece merging.

What it recognises (``structure(pattern, ...)``; anything else returns None and the call runs
on the generic tile plan in ``blocked.py``):

- ``Band(lo, hi, 1)`` with finite ends (``local``, ``sliding_window``, causal windows): query
  block ``t`` of ``b`` rows sees the keys ``[t*b + start, t*b + start + width)``, a window of K/V
  taken with ``as_strided`` (no copy). One additive mask ``(1, blocks, b, width)``, computed
  once per plan from the pattern's own ``mask_mod``, removes the pairs outside the band.
- ``block_local(s)`` (and ``block_local(s) & causal()``): the same with non-overlapping windows.
- ``Band(lo, hi, m)`` with ``m > 1`` (``dilated``, ``strided``): positions ``p`` and keys ``j``
  with ``m | j - p`` lie in the same residue class, so the sequence is *de-interleaved* into
  ``m`` sub-sequences (a reshape) and the band ``[ceil(lo/m), floor(hi/m)]`` runs on each;
  unbounded bands become dense (or causal) attention over the sub-sequences, unmasked.
- ``window | global tokens`` (Longformer, ETC, Star, ``global``), ``& causal()`` too: the window
  call plus every row against the g global keys (pairs the window holds excluded), merged by
  log-sum-exp; the global tokens' own rows are computed densely and replace theirs. Sparse
  Transformer's summary columns run the same way (columns, no rows).
- ``per_head([...])`` of the above: one part per head group.

Backward recomputes from q, k, v, the output and the log-sum-exp through the flash kernel's
backward; key gradients of overlapping windows are added back block by block. Nothing
``N x N`` is allocated: windows hold ``N * width`` scores per head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo._compat import flash_attention_cpu, flash_attention_cpu_backward
from attnzoo.patterns.algebra import Intersection, Pattern, PerHead
from attnzoo.patterns.algebra import Union as PatternUnion
from attnzoo.patterns.atomic import Band, BlockLocal, GlobalTokens, PeriodicColumns
from attnzoo.patterns.compound import GlobalBlocks


@dataclass(frozen=True)
class Windows:
    """Query blocks of ``block`` rows, each attending ``width`` keys from ``start`` (both
    multiples of ``block``) relative to the block's first row, on sub-sequences of stride
    ``stride``. ``allowed (1, blocks, block, width)`` is the additive pattern mask (0 / -inf),
    None when every pair in every window is allowed; ``dense`` parts (``width == 0``) attend
    the whole sub-sequence, causally when ``causal``."""

    stride: int
    block: int = 0
    start: int = 0
    width: int = 0
    allowed: Tensor | None = None
    causal: bool = False

    @property
    def dense(self) -> bool:
        return self.width == 0


@dataclass(frozen=True)
class WithGlobals:
    """A window part (or none) united with global tokens (Longformer, ETC, Star): every row
    also attends the global keys ``tokens`` where ``columns (N, g)`` allows it (pairs the
    window already holds are excluded, so each pair counts once), merged by log-sum-exp; the
    global tokens' own rows attend every key (causally when ``causal``) and replace theirs."""

    windows: Windows | None
    tokens: Tensor
    columns: Tensor
    causal: bool
    #: False for key-only columns (Sparse Transformer's summary columns): no global rows.
    rows: bool = True


@dataclass(frozen=True)
class Structure:
    """One part per head group: ``heads`` (None = all heads) and how they run."""

    n: int
    parts: tuple[tuple[Tensor | None, Windows | WithGlobals], ...]


def structure(pattern: Pattern, n_q: int, n_kv: int, heads: int) -> Structure | None:
    """The structured plan of ``pattern`` for self-attention of length ``n_q == n_kv``, or None
    when the pattern has no contiguous-run structure this path knows."""
    if n_q != n_kv:
        return None
    if isinstance(pattern, PerHead):
        groups = pattern.resolve_heads(heads).head_groups()
        parts = []
        for index, part in enumerate(pattern.patterns):
            plan = _part(part, n_q)
            if plan is None:
                return None
            parts.append(((groups == index).nonzero().flatten(), plan))
        return Structure(n_q, tuple(parts))
    plan = _part(pattern, n_q)
    return None if plan is None else Structure(n_q, ((None, plan),))


def _part(pattern: Pattern, n: int) -> Windows | WithGlobals | None:
    return _windows(pattern, n) or _with_globals(pattern, n)


def _with_globals(pattern: Pattern, n: int) -> WithGlobals | None:
    """``window | global tokens`` (optionally ``& causal()``), with at most one window part."""
    causal = False
    if isinstance(pattern, Intersection) and len(pattern.parts) == 2:
        inner, other = pattern.parts
        inner, other = (inner, other) if isinstance(other, Band) else (other, inner)
        if not (isinstance(other, Band) and (other.lo, other.hi, other.modulus) == (None, 0, 1)):
            return None
        pattern, causal = inner, True
    parts = pattern.parts if isinstance(pattern, PatternUnion) else (pattern,)
    tokens = [p for p in parts if isinstance(p, (GlobalTokens, GlobalBlocks, PeriodicColumns))]
    others = [p for p in parts if not isinstance(p, (GlobalTokens, GlobalBlocks, PeriodicColumns))]
    if not tokens or len(others) > 1:
        return None
    window = None
    if others:
        window = _windows(others[0] & Band(None, 0, 1) if causal else others[0], n)
        if window is None:
            return None
    indices = [_column_keys(p, n) for p in tokens]
    index = torch.cat(indices).unique()
    index = index[index < n]
    rows, cols = torch.arange(n)[:, None], index[None, :]
    columns = torch.ones(n, index.numel(), dtype=torch.bool) if not causal else cols <= rows
    if others:
        zero = torch.zeros((), dtype=torch.long)
        columns = columns & ~others[0].mask_mod_for(n, n)(zero, zero, rows, cols)
    rows = any(not isinstance(p, PeriodicColumns) for p in tokens)
    if rows and any(isinstance(p, PeriodicColumns) for p in tokens):
        return None  # rows for some columns only: not this shape
    return WithGlobals(window, index, columns, causal, rows)


def _column_keys(pattern: Pattern, n: int) -> Tensor:
    if isinstance(pattern, GlobalBlocks):
        return pattern._tokens(n).indices
    if isinstance(pattern, PeriodicColumns):
        j = torch.arange(n)
        return j[(j % pattern.period >= pattern.first) & (j % pattern.period <= pattern.last)]
    return pattern.indices


def _windows(pattern: Pattern, n: int) -> Windows | None:
    if isinstance(pattern, Band):
        return _band(pattern, n)
    block_local = _block_local(pattern)
    if block_local is not None:
        size, causal = block_local
        mask = BlockLocal(size).mask_mod_for(n, n) if not causal else pattern.mask_mod_for(n, n)
        return _window_plan(mask, n, 1, size, 0, size)
    return None


def _block_local(pattern: Pattern) -> tuple[int, bool] | None:
    """``block_local(s)`` -> (s, False); ``block_local(s) & causal()`` -> (s, True)."""
    if isinstance(pattern, BlockLocal):
        return pattern.size, False
    if isinstance(pattern, Intersection) and len(pattern.parts) == 2:
        a, b = pattern.parts
        a, b = (a, b) if isinstance(a, BlockLocal) else (b, a)
        if isinstance(a, BlockLocal) and isinstance(b, Band) and (b.lo, b.hi, b.modulus) == (None, 0, 1):
            return a.size, True
    return None


def _band(band: Band, n: int) -> Windows | None:
    m = band.modulus
    if m > n:
        return None
    lo = None if band.lo is None else -((-band.lo) // m)  # ceil(lo / m): sub-sequence offsets
    hi = None if band.hi is None else band.hi // m
    sub = -(-n // m)  # sub-sequence length
    if lo is None or hi is None:
        if hi is None and lo is None:
            return Windows(m)
        if lo is None and hi == 0:
            return Windows(m, causal=True)
        return None
    if lo > hi or hi - lo + 1 >= sub:
        return None
    block = choose_block(hi - lo + 1)
    start = (lo // block) * block
    width = -(-(block + hi - start) // block) * block
    return _window_plan(Band(lo, hi, 1).mask_mod_for(sub, sub), sub, m, block, start, width)


def choose_block(keys: int) -> int:
    """Query rows per window for a band of ``keys`` keys per row: small blocks waste fewer keys
    at the window's ends, large ones run the kernel at a better rate (measured on a 2-core
    EPYC: 32 up to 48 keys, 64 up to 384, else 128)."""
    return 32 if keys <= 48 else 64 if keys <= 384 else 128


def _window_plan(mask_mod: Any, n: int, stride: int, block: int, start: int, width: int) -> Windows:
    """Evaluate the pattern on every window once: ``(1, blocks, block, width)`` additive."""
    blocks = -(-n // block)
    rows = torch.arange(blocks)[:, None, None] * block + torch.arange(block)[None, :, None]
    keys = torch.arange(blocks)[:, None, None] * block + start + torch.arange(width)[None, None, :]
    zero = torch.zeros((), dtype=torch.long)
    ok = mask_mod(zero, zero, rows, keys) & (keys >= 0) & (keys < n) & (rows < n)
    additive = None if bool(ok.all()) else torch.zeros(ok.shape).masked_fill_(~ok, float("-inf"))[None]
    return Windows(stride, block, start, width, additive)


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
    return x[:, first:].as_strided((x.shape[0], blocks, w.width, x.shape[2]),
                                   (x.stride(0), w.block * x.stride(1), x.stride(1), 1))


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
    if key_valid is None:
        return None
    mask = torch.zeros(key_valid.shape, dtype=dtype).masked_fill_(~key_valid, float("-inf"))[:, None, None, :]
    if w.causal:  # the kernel takes is_causal or a mask, not both: O(n^2) on one sub-sequence
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


def _part_forward(w: Windows, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None,
                  scale: float) -> tuple[Tensor, _Saved]:
    n, sub = q.shape[2], -(-q.shape[2] // w.stride)
    qs, ks, vs = (_split(x, w.stride, sub) for x in (q, k, v))
    valid = _split_keys(key_valid, q.shape[0], n, w.stride, sub)
    if w.dense:
        mask = _dense_mask(w, valid, sub, q.dtype)
        is_causal = w.causal and mask is None
        out, lse = flash_attention_cpu(qs, ks, vs, 0.0, is_causal, attn_mask=mask, scale=scale)[:2]
        return _merge(out, w.stride, n), _Saved(qs, ks, vs, out, lse, mask, is_causal)
    bb, h, blocks = qs.shape[0], qs.shape[1], -(-sub // w.block)
    qx = F.pad(qs, (0, 0, 0, blocks * w.block - sub)).reshape(bb * h, blocks, w.block, q.shape[-1])
    kx, vx = _key_windows(ks.flatten(0, 1), w, blocks), _key_windows(vs.flatten(0, 1), w, blocks)
    mask = _window_mask(w, valid, h, blocks, q.dtype)
    out, lse = flash_attention_cpu(qx, kx, vx, 0.0, False, attn_mask=mask, scale=scale)[:2]
    rows = out.reshape(bb, h, blocks * w.block, -1)[:, :, :sub]
    return _merge(rows, w.stride, n), _Saved(qx, kx, vx, out, lse, mask, False)


def _to_kernel(x: Tensor, w: Windows, saved: _Saved) -> Tensor:
    """``(B, H, N, D)`` rows -> the kernel layout of ``saved.out`` (zero rows where padded)."""
    sub = -(-x.shape[2] // w.stride)
    x = _split(x, w.stride, sub)
    if w.dense:
        return x
    return F.pad(x, (0, 0, 0, saved.q.shape[1] * w.block - sub)).reshape(saved.out.shape[:-1] + (x.shape[-1],))


def _part_backward(w: Windows, saved: _Saved, grad: Tensor, scale: float, out: Tensor | None = None,
                   lse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v gradients of one part. ``out``/``lse`` (``(B, H, N, Dv)``, ``(B, H, N)``) replace
    the part's own when it is one term of a union: the kernel's backward then uses the union's
    softmax (``delta = rowsum(dO * O)`` over the whole union)."""
    n, sub = grad.shape[2], -(-grad.shape[2] // w.stride)
    heads = grad.shape[1]
    g = _to_kernel(grad, w, saved).contiguous()
    kernel_out = saved.out if out is None else _to_kernel(out, w, saved).contiguous()
    kernel_lse = saved.lse if lse is None else _to_kernel(lse[..., None], w, saved)[..., 0].contiguous()
    dq, dk, dv = flash_attention_cpu_backward(g, saved.q, saved.k, saved.v, kernel_out, kernel_lse, 0.0,
                                              saved.is_causal, attn_mask=saved.mask, scale=scale)
    if w.dense:
        return tuple(_merge(x, w.stride, n) for x in (dq, dk, dv))  # type: ignore[return-value]
    bb = dq.shape[0] // heads
    dq = dq.reshape(bb, heads, -1, dq.shape[-1])[:, :, :sub]
    dk, dv = (_overlap_add(x, w, sub).view(bb, heads, sub, -1) for x in (dk, dv))
    return _merge(dq, w.stride, n), _merge(dk, w.stride, n), _merge(dv, w.stride, n)


def _part_lse(w: Windows, saved: _Saved, n: int, heads: int) -> Tensor:
    """The part's log-sum-exp ``(B, H, N)``, ``-inf`` where a row sees no key of the part (the
    kernel reports 0 there)."""
    lse = saved.lse
    if saved.mask is not None:
        lse = lse.masked_fill((saved.mask == float("-inf")).all(-1).expand_as(lse), float("-inf"))
    if w.dense:
        return _merge(lse[..., None], w.stride, n)[..., 0]
    sub = -(-n // w.stride)
    bb = lse.shape[0] // heads
    return _merge(lse.reshape(bb, heads, -1)[:, :, :sub, None], w.stride, n)[..., 0]


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
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Windows, key_valid: Tensor | None,  # type: ignore[override]
                scale: float) -> Tensor:
        out, saved = _part_forward(w, q, k, v, key_valid, scale)
        ctx.saved, ctx.w, ctx.scale = saved, w, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        dq, dk, dv = _part_backward(ctx.w, ctx.saved, grad, ctx.scale)
        del ctx.saved
        return dq, dk, dv, None, None, None


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _column_scores(part: WithGlobals, q: Tensor, k: Tensor, key_valid: Tensor | None, scale: float) -> Tensor:
    """Scores of every row against the global keys ``(B, H, N, g)``, ``-inf`` where not allowed."""
    allowed = part.columns.to(q.device)[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, part.tokens.to(q.device)]
    cd = _compute_dtype(q)
    scores = torch.matmul(q.to(cd), k[:, :, part.tokens.to(q.device)].to(cd).transpose(-1, -2)) * scale
    return scores.masked_fill(~allowed, float("-inf"))


def _finite(lse: Tensor, fill: float) -> Tensor:
    return torch.where(torch.isinf(lse), fill, lse)


class _UnionAttention(torch.autograd.Function):
    """Window part + global columns, merged by log-sum-exp; backward gives both parts the
    union's output and log-sum-exp (see ``_part_backward``)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, part: WithGlobals,  # type: ignore[override]
                key_valid: Tensor | None, scale: float) -> Tensor:
        scores = _column_scores(part, q, k, key_valid, scale)
        lse = torch.logsumexp(scores, dim=-1)
        saved, out_w = None, None
        if part.windows is not None:
            out_w, saved = _part_forward(part.windows, q, k, v, key_valid, scale)
            lse_w = _part_lse(part.windows, saved, q.shape[2], q.shape[1]).to(lse.dtype)
            lse = torch.logaddexp(lse, lse_w)
        probs = torch.exp(scores - _finite(lse, 0.0)[..., None])
        out = torch.matmul(probs, v[:, :, part.tokens.to(q.device)].to(probs.dtype))
        if out_w is not None:
            out = out + out_w.to(out.dtype) * torch.exp(lse_w - _finite(lse, 0.0))[..., None]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, probs)
        ctx.part, ctx.saved, ctx.scale = part, saved, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, probs = ctx.saved_tensors
        part, scale = ctx.part, ctx.scale
        if part.windows is not None:
            lse_k = _finite(lse, float("inf")).to(ctx.saved.lse.dtype)  # rows that see nothing: p = 0
            dq, dk, dv = (x.to(probs.dtype) for x in _part_backward(part.windows, ctx.saved, grad, scale, out, lse_k))
        else:
            dq, dk, dv = (torch.zeros(x.shape, dtype=probs.dtype, device=x.device) for x in (q, k, v))
        del ctx.saved
        index = part.tokens.to(q.device)
        g = grad.to(probs.dtype)
        delta = (g * out.to(probs.dtype)).sum(-1, keepdim=True)
        d_scores = probs * (torch.matmul(g, v[:, :, index].to(probs.dtype).transpose(-1, -2)) - delta) * scale
        dq = dq + torch.matmul(d_scores, k[:, :, index].to(probs.dtype))
        dk = dk.index_add(2, index, torch.matmul(d_scores.transpose(-1, -2), q.to(probs.dtype)))
        dv = dv.index_add(2, index, torch.matmul(probs.transpose(-1, -2), g))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _global_rows(part: WithGlobals, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float) -> Tensor:
    """The global tokens' rows: each attends every (real, and with ``causal`` earlier) key.
    ``(B, H, g, Dv)``; O(g N) memory; differentiable by autograd."""
    index = part.tokens.to(q.device)
    cd = _compute_dtype(q)
    scores = torch.matmul(q[:, :, index].to(cd), k.to(cd).transpose(-1, -2)) * scale
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if part.causal:
        allowed = torch.arange(k.shape[2], device=q.device)[None, :] <= index[:, None]
    allowed = allowed[None, None] if key_valid is None else allowed[None, None] & key_valid[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
    return torch.matmul(weights, v.to(cd)).to(q.dtype)


def _run_part(part: Windows | WithGlobals, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None,
              scale: float) -> Tensor:
    if isinstance(part, Windows):
        return _PartAttention.apply(q, k, v, part, key_valid, scale)
    out = _UnionAttention.apply(q, k, v, part, key_valid, scale)
    if not part.rows:
        return out
    return out.index_copy(2, part.tokens.to(q.device), _global_rows(part, q, k, v, key_valid, scale))


def structured_attention(q: Tensor, k: Tensor, v: Tensor, plan: Structure, *, scale: float,
                         key_padding_mask: Tensor | None = None) -> Tensor:
    """Exact attention over ``plan`` (see the module docstring). ``(B, H, N, D)`` in and out;
    rows with no visible key give zeros and zero gradient."""
    if len(plan.parts) == 1 and plan.parts[0][0] is None:
        return _run_part(plan.parts[0][1], q, k, v, key_padding_mask, scale)
    pieces = []
    for heads, part in plan.parts:
        pieces.append((heads, _run_part(part, q[:, heads], k[:, heads], v[:, heads], key_padding_mask, scale)))
    # Head groups are disjoint: put each group's rows back at its heads (differentiably).
    order = torch.cat([heads for heads, _ in pieces]).argsort()
    return torch.cat([piece for _, piece in pieces], dim=1)[:, order.to(q.device)]
