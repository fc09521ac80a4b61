"""Decode steps of the pattern mechanisms (``pattern_attention.PatternAttention``): which cache a pattern
needs, and one step over it.

A step computes the new tokens' rows of the *causal* forward, so it needs row t of the pattern
to be the same whatever the final length (the mechanisms that cannot promise it refuse). Two
caches:

- ``KeptKeys``: for a band with a left end, alone or with key columns or global tokens
  (``local``, ``dilated``, ``sinks``, ``longformer``, ``etc``, ``star``), only the keys a later
  row can still see are kept — the band's reach behind the newest token, the columns
  (StreamingLLM's attention sinks) and everything up to the last global token — each with its
  absolute position. O(window + columns) memory and work per token, at any position.
- ``KVCache`` (``mechanisms.cache``): every other pattern keeps every key; the new rows are
  masked over the cache, O(t) per token like exact attention.

Either way a step of up to ``DIRECT_STEP_TOKENS`` tokens without a ``score_mod`` is one masked
SDPA call; longer steps and steps with a ``score_mod`` go through the mechanism's own forward
(a contiguous span) or the dense reference, with the ``score_mod`` seeing absolute positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo import patterns as P
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms.base import AttendArgs, StateSpec, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.cache import KVCache
from attnzoo.spec import ScoreMod

if TYPE_CHECKING:
    from attnzoo.mechanisms.pattern_attention import PatternAttention

#: Decode steps of up to this many new tokens run as one masked SDPA over the cache; longer
#: ones (a prefill) take the mechanism's own fast path where the keys form a contiguous span.
DIRECT_STEP_TOKENS = 64


@dataclass(frozen=True)
class KeptKeys:
    """The keys a later row can still see: ``k (B, H_kv, L, D)``, ``v (B, H_kv, L, D_v)`` at absolute
    ``positions (L,)`` (ascending), which of them are real tokens (``real (B, L)``, None while
    all are), ``seen`` tokens so far; a row reaches ``reach`` keys back and always sees the key
    ``columns``."""

    k: Tensor
    v: Tensor
    positions: Tensor
    seen: int
    reach: int
    columns: Tensor
    real: Tensor | None = None

    def after(self, span: _Span) -> KeptKeys:
        """The state once the span (kept keys + new tokens) is seen: what a row at or after the
        next position can still see, copied so the span can be freed."""
        positions = span.positions
        seen = int(positions[-1]) + 1
        if not self.columns.numel():  # a band alone: the kept keys are the span's last `reach`
            index = slice(max(0, positions.shape[0] - self.reach), None)
            k, v = span.k[:, :, index].clone(), span.v[:, :, index].clone()
        else:
            index = ((positions >= seen - self.reach) | torch.isin(positions, self.columns)).nonzero().flatten()
            k, v = span.k.index_select(2, index), span.v.index_select(2, index)
        real = None if span.real is None else span.real[:, index].clone()
        return KeptKeys(k, v, positions[index], seen, self.reach, self.columns, real)


@dataclass(frozen=True)
class _Span:
    """The keys a step attends over: ``k, v`` at absolute ``positions``, ``real (B, L)`` or None."""

    k: Tensor
    v: Tensor
    positions: Tensor
    real: Tensor | None


def _kept_keys_shape(pattern: P.Pattern) -> tuple[int, Tensor] | None:
    """``(reach, kept columns)`` when ``pattern`` is a band with a left end, alone or united
    with key columns (``sinks``) or global tokens (``longformer``, ``etc``, ``star``); None
    otherwise. A global token's causal row sees every key up to it, so every position up to the
    last global token is kept (a constant: the global tokens sit at fixed positions), and its
    column is then kept with them."""
    parts = pattern.parts if isinstance(pattern, P.Union) else (pattern,)
    bands = [p for p in parts if isinstance(p, P.Band)]
    columns = [p.indices for p in parts if isinstance(p, P.KeyColumns)]
    columns += [torch.arange(int(p.indices.max()) + 1) for p in parts if isinstance(p, P.GlobalTokens)]
    if len(bands) != 1 or bands[0].lo is None or len(bands) + len(columns) != len(parts):
        return None
    return max(0, -bands[0].lo), torch.cat(columns or [torch.zeros(0, dtype=torch.long)]).unique()


def init_state(attn: PatternAttention, spec: StateSpec) -> KeptKeys | KVCache:
    """``KeptKeys`` where the pattern allows it, else a ``KVCache`` (preallocated to
    ``spec.capacity`` when given)."""
    shape = _kept_keys_shape(attn.pattern)
    if shape is None:
        return KVCache.for_state(spec)
    # K/V heads as step gets them: H_kv for grouped-query K/V (the mechanisms declare gqa)
    k = torch.empty(spec.batch, spec.kv_heads, 0, spec.head_dim, device=spec.device, dtype=spec.dtype)
    v = torch.empty(spec.batch, spec.kv_heads, 0, spec.value_dim, device=spec.device, dtype=spec.dtype)
    empty = torch.zeros(0, dtype=torch.long, device=spec.device)
    return KeptKeys(k, v, empty, 0, shape[0], shape[1].to(spec.device))


def step(
    attn: PatternAttention, state: KeptKeys | KVCache, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs
) -> tuple[Tensor, KeptKeys | KVCache]:
    """The new tokens' rows of ``attn``'s causal forward over the keys in ``state``."""
    mask = args.key_mask
    if isinstance(state, KVCache):
        new_state = state.append(k, v, mask)
        positions = torch.arange(new_state.length, device=k.device)
        span = _Span(new_state.k, new_state.v, positions, new_state.key_mask)
    else:
        new = torch.arange(state.seen, state.seen + k.shape[2], device=k.device)
        real = None
        if mask is not None or state.real is not None:
            old = (
                state.real
                if state.real is not None
                else k.new_ones(k.shape[0], state.positions.shape[0], dtype=torch.bool)
            )
            real = torch.cat([old, mask if mask is not None else k.new_ones(mask_shape(k), dtype=torch.bool)], dim=1)
        span = _Span(
            torch.cat([state.k, k], dim=2), torch.cat([state.v, v], dim=2), torch.cat([state.positions, new]), real
        )
        new_state = state.after(span)
    return _attend_span(attn, q, span, args.score_mod), new_state


def mask_shape(k: Tensor) -> tuple[int, int]:
    """``(B, T)``: the shape of a key padding mask for ``k (B, H, T, D)``."""
    return k.shape[0], k.shape[2]


def _attend_span(attn: PatternAttention, q: Tensor, span: _Span, score_mod: ScoreMod | None) -> Tensor:
    """The last ``T`` positions' rows over the span's keys."""
    k, v, positions = span.k, span.v, span.positions
    n_q, n_kv, start = q.shape[2], k.shape[2], int(positions[0])
    contiguous = int(positions[-1]) - start + 1 == n_kv
    if score_mod is None and n_q <= DIRECT_STEP_TOKENS:
        rows = positions[n_kv - n_q :, None]
        visible = _visible(attn, q.shape[1], rows, positions[None, :])  # [H | 1, T, L]
        if span.real is not None:
            visible = visible & span.real[:, None, None, :]  # (B, H | 1, T, L)
        k, v, visible = _seen_keys_only(k, v, visible)
        gqa = k.shape[1] != q.shape[1]  # grouped K/V kept at H_kv heads: SDPA indexes them
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=attn.config.scale, enable_gqa=gqa)
        out = torch.where(visible.any(-1, keepdim=True), out, 0.0)  # rows that see no key: zeros, not NaN
        return nan_rows_of_non_finite_queries(out, q)
    if score_mod is not None and not (contiguous and start == 0):  # span index != position
        inner = score_mod

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            # A contiguous span is a shift (backends may pass indices past the end for padded
            # tiles); otherwise the positions are looked up (clamped alike).
            if contiguous:
                return inner(score, b, h, q_idx + start, kv_idx + start)
            last = positions.shape[0] - 1
            return inner(score, b, h, positions[q_idx.clamp(max=last)], positions[kv_idx.clamp(max=last)])

    if contiguous:  # the forward's own (end-aligned) pattern is the same over a shifted span
        return attn(q, k, v, causal=True, key_mask=span.real, score_mod=score_mod)
    rows = positions[n_kv - n_q :, None]
    visible = _visible(attn, q.shape[1], rows, positions[None, :])

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return visible[h if visible.shape[0] > 1 else 0, q_idx - (n_kv - n_q), kv_idx]

    k, v = attn._kv_heads(q, k, v, native=False)  # the dense fallback takes one K/V per query head
    out = reference_attention(
        q, k, v, key_mask=span.real, score_mod=score_mod, scale=attn.config.scale, mask_mod=mask_mod
    )
    return nan_rows_of_non_finite_queries(out, q)


def _seen_keys_only(k: Tensor, v: Tensor, visible: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The span's keys that some new row sees, gathered (with ``visible`` cut to them) when they
    are at most half the span: a strided or block pattern's row sees t / stride or one block of
    the t cached keys, and a masked SDPA over all t (CPU: no flash path with a mask) cost 5x an
    unmasked softmax step at t = 16384. The row's output is the same: unseen keys weigh 0."""
    seen = visible.reshape(-1, visible.shape[-1]).any(0)  # (L,): the union over batch, heads, rows
    index = seen.nonzero().flatten()
    if 2 * index.numel() > seen.numel() or not index.numel():
        return k, v, visible
    return k.index_select(2, index), v.index_select(2, index), visible.index_select(-1, index)


def _visible(attn: PatternAttention, heads: int, rows: Tensor, keys: Tensor) -> Tensor:
    """Bool ``(H or 1, T, L)``: the causal pattern at absolute positions ``rows (T, 1)`` and
    ``keys (1, L)``."""
    pattern = attn.pattern.resolve_heads(heads)
    zero = torch.zeros((), dtype=torch.long, device=rows.device)
    h = torch.arange(heads, device=rows.device)[:, None, None] if pattern.per_head else zero
    n = int(rows.max()) + 1
    mask = (keys <= rows) & pattern.mask_mod_for(n, n, rows.device)(zero, h, rows, keys)
    return torch.broadcast_to(mask, (heads if pattern.per_head else 1, rows.shape[0], keys.shape[1]))
