"""The blocked backend's ``gathered`` path: patterns that name a few keys per query row with no
locality between rows (``random(r)``, alone or and-ed with ``causal()`` or other position
rules). Tiles cannot serve them: r random keys per row land in nearly every key block, so a
query block's tiles are the whole matrix under a mask — slower than dense attention.

Instead each row's ``r`` keys are gathered (K and V laid out position-major, ``(N, B, H, D)``,
so one key of every (b, h) is one contiguous run; a chunk of query rows at a time so that the
gathered copies stay a few MB and are reused by the allocator), the ``r`` scores are dot
products over D, and the output is the softmax-weighted sum of the gathered values. Backward
recomputes the scores from the saved log-sum-exp and adds the key and value gradients back with
``index_add_``. Time and memory O(N r D); nothing is N x N. The work is memory-bound (each pair
reads its key and value row: no reuse across rows, unlike the flash kernel's tiles), so the gain
over dense attention is far below 1/density: see the README.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from attnzoo.backends.call import Call, PlanCache, compute_dtype
from attnzoo.patterns import Pattern
from attnzoo.patterns.algebra import Intersection
from attnzoo.patterns.atomic import Random

#: Bytes of one gathered K (or V) chunk: rows per chunk = this / (B H r D * 4).
CHUNK_BYTES = 4 << 20

#: ``(pattern, n_q, n_kv)`` -> ``(table (N_q, r) long, valid (N_q, r) bool)`` or None.
TABLES: PlanCache[tuple, Any] = PlanCache(maxsize=32)


def _row_table(pattern: Pattern, n_q: int, n_kv: int) -> tuple[Tensor, Tensor] | None:
    """The keys of each query row and which of them the whole pattern keeps, or None when the
    pattern does not name its keys row by row. ``random(r)`` names them; an intersection with
    one ``random`` part keeps those of its keys the other parts allow (evaluated on the ``r``
    candidates only, so a part's cost is O(N r))."""
    if pattern.per_head:
        return None
    if isinstance(pattern, Random):
        table = pattern.table(n_q, n_kv)
        return table, torch.ones(table.shape, dtype=torch.bool)
    if not isinstance(pattern, Intersection):
        return None
    randoms = [p for p in pattern.parts if isinstance(p, Random)]
    if len(randoms) != 1:
        return None
    table = randoms[0].table(n_q, n_kv)
    rows = (torch.arange(n_q) + (n_kv - n_q))[:, None]  # queries end-aligned to the keys
    zero = torch.zeros((), dtype=torch.long)
    valid = torch.ones(table.shape, dtype=torch.bool)
    for part in pattern.parts:
        if part is not randoms[0]:
            valid &= part.mask_mod_for(n_q, n_kv)(zero, zero, rows, table)
    # Each row's kept keys first: a chunk of rows then gathers only up to its widest row's count
    # (with causal() about half of the r keys, fewer for early rows).
    order = (~valid).to(torch.int8).argsort(dim=1, stable=True)
    return table.gather(1, order), valid.gather(1, order)


def row_table(call: Call) -> tuple[Tensor, Tensor] | None:
    """``_row_table`` of the call's pattern, cached by the pattern's value and the lengths."""
    n_q, n_kv, _ = call.sizes()
    return TABLES.get((call.pattern, n_q, n_kv), lambda: _row_table(call.pattern, n_q, n_kv))


def not_gathered_reasons(call: Call) -> list[str]:
    """Why the gathered path cannot run ``call`` (empty: it can)."""
    reasons = []
    if call.score_mod is not None:
        reasons.append("a score_mod (the gathered path has no recomputing backward for it)")
    if call.dropout is not None:
        reasons.append("attention dropout")
    if row_table(call) is None:
        reasons.append("the pattern does not name its keys row by row (only random(r) and its intersections do)")
    return reasons


def _position_major(x: Tensor) -> Tensor:
    """``(B, H, N, E)`` -> ``(N, B, H, E)`` contiguous: a key's rows of every (b, h) side by side,
    so gathering a key (or adding its gradient back) moves one contiguous ``B H E`` run."""
    return x.permute(2, 0, 1, 3).contiguous()


def _rows(x: Tensor, keys: Tensor) -> Tensor:
    """``x (N, B, H, E)`` at ``keys (c, w)`` -> ``(c, w, B, H, E)``: ``index_select`` copies whole
    contiguous rows (advanced indexing ``x[keys]`` takes a slower general path)."""
    return x.index_select(0, keys.flatten()).view(*keys.shape, *x.shape[1:])


def _chunks(table: Tensor, valid: Tensor, rows: int, key_mask: Tensor | None) -> Iterator[tuple[slice, Tensor, Tensor]]:
    """Chunks of ``rows`` query rows: ``(rows, keys (c, w), visible (c, w, B | 1, 1))``, cut to
    ``w`` = the most keys a row of the chunk keeps (``_row_table`` puts them first); ``visible``
    is the pattern's and the padding's verdict on each gathered key."""
    for start in range(0, table.shape[0], rows):
        part = slice(start, min(start + rows, table.shape[0]))
        width = int(valid[part].sum(1).max())
        keys, visible = table[part, :width], valid[part, :width, None, None]
        yield part, keys, visible if key_mask is None else visible & key_mask.t()[keys][..., None]


def _weights(qs: Tensor, k_rows: Tensor, visible: Tensor, lse: Tensor | None) -> tuple[Tensor, Tensor]:
    """The chunk's softmax weights ``(c, r, B, H)`` over its gathered keys ``k_rows (c, r, B, H,
    D)`` for scaled queries ``qs (c, B, H, D)``, and their log-sum-exp ``(c, 1, B, H)`` (given in
    backward; ``+inf`` for a row with no visible key, so that its weights are 0)."""
    scores = (k_rows * qs[:, None]).sum(-1).masked_fill_(~visible, -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, 1, keepdim=True)
        lse = torch.where(lse == -math.inf, math.inf, lse)
    return scores.sub_(lse).exp_(), lse


class _GatheredAttention(torch.autograd.Function):
    """Inputs and outputs position-major (``_position_major``): q ``(N_q, B, H, D)``, k, v
    ``(N_kv, B, H, D | D_v)``, out ``(N_q, B, H, D_v)``."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, table: Tensor, valid: Tensor, call: Call) -> Tensor:  # type: ignore[override]
        n_q, row_bytes = q.shape[0], table.shape[1] * k[0].numel() * k.element_size()
        rows = max(1, CHUNK_BYTES // max(1, row_bytes))
        qs = q * call.scale
        out, lse = v.new_empty(n_q, *v.shape[1:]), q.new_empty(n_q, 1, *q.shape[1:3])
        for part, keys, visible in _chunks(table, valid, rows, call.key_mask):
            if keys.shape[1] == 0:  # no row of the chunk keeps a key
                out[part], lse[part] = 0.0, math.inf
                continue
            weights, lse[part] = _weights(qs[part], _rows(k, keys), visible, None)
            out[part] = (weights[..., None] * _rows(v, keys)).sum(1)
        ctx.save_for_backward(qs, k, v, out, lse, table, valid)
        ctx.call, ctx.rows = call, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qs, k, v, out, lse, table, valid = ctx.saved_tensors
        call, rows = ctx.call, ctx.rows
        grad = grad.contiguous()  # position-major, as out
        delta = (grad * out).sum(-1)[:, None]  # (N_q, 1, B, H): rowsum(dO * O)
        d_q, d_k, d_v = torch.empty_like(qs), torch.zeros_like(k), torch.zeros_like(v)
        for part, keys, visible in _chunks(table, valid, rows, call.key_mask):
            k_rows, v_rows, g = _rows(k, keys), _rows(v, keys), grad[part, None]  # (c, r, B, H, E); g (c, 1, B, H, D_v)
            weights, _ = _weights(qs[part], k_rows, visible, lse[part])
            d_scores = (v_rows * g).sum(-1).sub_(delta[part]).mul_(weights)  # (c, r, B, H)
            d_q[part] = (d_scores[..., None] * k_rows).sum(1)
            flat = keys.flatten()
            d_k.index_add_(0, flat, (d_scores[..., None] * qs[part, None]).flatten(0, 1))
            d_v.index_add_(0, flat, (weights[..., None] * g).flatten(0, 1))
        return d_q * call.scale, d_k, d_v, None, None, None


def gathered_attention(call: Call) -> Tensor:
    """Exact attention of ``call`` over each row's listed keys (see the module docstring)."""
    table, valid = row_table(call)  # type: ignore[misc]
    dtype = compute_dtype(call.q)
    q, k, v = (_position_major(x.to(dtype)) for x in (call.q, call.k, call.v))
    out = _GatheredAttention.apply(q, k, v, table.to(q.device), valid.to(q.device), call)
    return out.permute(1, 2, 0, 3).to(call.q.dtype)  # (B, H, N_q, D_v)
