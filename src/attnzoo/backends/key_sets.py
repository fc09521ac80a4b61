"""The blocked backend's ``key_sets`` path: patterns whose queries fall into groups that each see
one set of keys (``patterns.GroupKeyed``: ``block2d``, a query block of an image and its block
extended by the margin), alone or and-ed with ``causal()`` or other position rules.

Tiles serve them badly: a 2-D block is a run of ``qw`` pixels in each of ``qh`` raster rows, so
its keys are ``qh + 2 mh`` short runs, and 1-D tiles around them are mostly masked (``block2d``
at its defaults ran at 0.9x dense SDPA at 1K and 4K fwd+bwd, for a bound of 4-5x). Instead each
group's queries ``(G, S_q)`` and keys ``(G, S_k)`` are gathered as rows (``call.rows_at``) and
one ``scaled_dot_product_attention`` call runs every group at once, ``(B H, G, S_q, D)`` against
``(B H, G, S_k, D)`` (in slabs of (batch, head) rows under ``SLAB_BYTES`` of gathered keys,
each one call): on the CPU the flash kernel, forward and backward, with an additive mask
only where some slot or pair is not allowed (a group at the image's edge, ``causal()``, padded
keys). The gathers' backward adds the keys' gradients back (``index_add_``). O(N S_k D) time,
O(N S_k) memory at most (the mask of an intersection, or of a bias); nothing is N x N. A row
that sees no key comes out 0 (the kernel's answer to a masked row, checked by the tests).

An additive bias (``score_mods.plain_bias``: ALiBi) joins the mask, ``(slab, G, S_q, S_k)``, its
far pairs cut (``call.cut_far``); no other ``score_mod``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.backends.call import (
    Call,
    PlanCache,
    additive_mask,
    compute_dtype,
    cut_far,
    plain_softmax_reasons,
    rows_at,
)
from attnzoo.patterns import Pattern
from attnzoo.patterns.algebra import Intersection
from attnzoo.patterns.atomic import GroupKeyed, KeySets
from attnzoo.score_mods import Bias, plain_bias


class KeySetPlan(NamedTuple):
    """A call's groups, ready to gather: ``rows (G S_q)``, ``keys (G S_k)`` (flat positions,
    empty slots at 0), ``where (N_q)`` each query's slot in ``rows``, ``allowed`` the bool
    ``(G, 1 | S_q, S_k)`` pairs the pattern allows (None: every one), ``shape (G, S_q, S_k)``."""

    rows: Tensor
    keys: Tensor
    where: Tensor
    allowed: Tensor | None
    shape: tuple[int, int, int]


#: ``(pattern, n_q, n_kv)`` -> ``KeySetPlan`` or None.
PLANS: PlanCache[tuple, KeySetPlan | None] = PlanCache(maxsize=32)


def _key_sets(pattern: Pattern, n_q: int, n_kv: int) -> tuple[KeySets, list[Pattern]] | None:
    """The groups of the pattern's ``GroupKeyed`` part and the other parts of an intersection
    with it (None when the pattern has no such part, or is per head)."""
    if pattern.per_head:
        return None
    if isinstance(pattern, GroupKeyed):
        return pattern.key_sets(n_q, n_kv), []
    if not isinstance(pattern, Intersection):
        return None
    keyed = [p for p in pattern.parts if isinstance(p, GroupKeyed)]
    if len(keyed) != 1:
        return None
    return keyed[0].key_sets(n_q, n_kv), [p for p in pattern.parts if p is not keyed[0]]


def _build(pattern: Pattern, n_q: int, n_kv: int) -> KeySetPlan | None:
    found = _key_sets(pattern, n_q, n_kv)
    if found is None:
        return None
    sets, others = found
    groups, rows = sets.rows.shape
    allowed = sets.keys_valid[:, None, :]  # [G, 1, S_k]
    zero = torch.zeros((), dtype=torch.long)
    for part in others:  # evaluated on the groups' own pairs only: O(N S_k)
        query = (sets.rows + (n_kv - n_q))[:, :, None]  # queries end-aligned to the keys
        allowed = allowed & part.mask_mod_for(n_q, n_kv)(zero, zero, query, sets.keys[:, None, :])
    where = torch.full((n_q,), -1, dtype=torch.long)
    where[sets.rows[sets.rows_valid]] = torch.arange(groups * rows).view(groups, rows)[sets.rows_valid]
    if bool((where < 0).any()):
        raise ValueError(f"{pattern.name}: key_sets leaves queries without a group")
    # Key slots no row of any group may see are dropped (causal: the rows of an image block's
    # margin below it), so the kernel never computes them.
    slots = allowed.flatten(0, 1).any(0).nonzero().flatten()
    key_table, allowed = sets.keys[:, slots], allowed[..., slots]
    keep = None if bool(allowed.all()) else allowed
    return KeySetPlan(sets.rows.flatten(), key_table.flatten(), where, keep, (groups, rows, slots.numel()))


def key_set_plan(call: Call) -> KeySetPlan | None:
    """The call's ``KeySetPlan`` (None if its pattern has no query groups with shared keys),
    cached by the pattern's value and the lengths."""
    n_q, n_kv, _ = call.sizes()
    return PLANS.get((call.pattern, n_q, n_kv), lambda: _build(call.pattern, n_q, n_kv))


def not_key_set_reasons(call: Call) -> list[str]:
    """Why the key-sets path cannot run ``call`` (empty: it can)."""
    reasons = plain_softmax_reasons(call, "the key-sets path takes an additive bias only", bias=True)
    if key_set_plan(call) is None:
        reasons.append("the pattern has no query groups that share their keys (a patterns.GroupKeyed)")
    return reasons


#: The most bytes of gathered keys (``(slab, G, S_k, D)``) one slab of (batch, head) rows holds:
#: a larger temporary than glibc's largest mmap threshold (32 MiB) is mapped afresh and
#: page-faulted on every call. ``block2d`` at 4K (64 x 64), fwd+bwd: 125 ms in one slab (34 MB of
#: gathered keys), 89 in slabs of 8 MiB (``benchmarks/ab-key-set-slabs-cpu.txt``). Not
#: ``_ops.SLAB_BYTES`` (16 MiB, for ``hierarchical`` and ``sac``): at 16 MiB ``block2d`` at 8K
#: read 9.17x SDPA against 11.80x (each slab's mask and gradients beside its keys).
SLAB_BYTES = 8 << 20


def _bias_values(bias: Bias, plan: KeySetPlan, call: Call, slab: Tensor, dtype: torch.dtype) -> Tensor:
    """``bias`` at every group's pairs of the flat (batch, head) rows ``slab``, ``(slab, G, S_q,
    S_k)``: queries end-aligned to the keys (``q_idx = row + N_kv - N_q``, ``spec``'s
    convention); empty slots read position 0 (masked)."""
    (groups, rows, keys), device = plan.shape, call.q.device
    (h, n_q), n_kv = call.q.shape[1:3], call.k.shape[2]
    q_idx = (plan.rows.to(device) + (n_kv - n_q)).view(1, groups, rows, 1)
    kv_idx = plan.keys.to(device).view(1, groups, 1, keys)
    batch, head = (x.view(-1, 1, 1, 1) for x in (torch.div(slab, h, rounding_mode="floor"), slab % h))
    return bias(batch, head, q_idx, kv_idx).to(dtype).expand(slab.numel(), groups, rows, keys)


def key_set_attention(call: Call) -> Tensor:
    """Exact attention of ``call`` over each group's keys (see the module docstring), in slabs of
    (batch, head) rows whose gathered keys stay under ``SLAB_BYTES``."""
    plan = key_set_plan(call)
    assert plan is not None, "not_key_set_reasons(call) says why"
    (groups, rows, keys), dtype, device = plan.shape, compute_dtype(call.q), call.q.device
    b, h, n_q, d = call.q.shape
    # [B H, N, e]; split, not sliced: the split's backward is one concatenation
    q, k, v = (x.to(dtype).flatten(0, 1) for x in (call.q, call.k, call.v))
    size = max(1, SLAB_BYTES // (groups * keys * max(d, v.shape[-1]) * q.element_size()))
    where = plan.where.to(device)
    outs = []
    for start, parts in zip(range(0, b * h, size), zip(*(x.split(size) for x in (q, k, v)))):
        slab = torch.arange(start, start + parts[0].shape[0], device=device)
        out = _slab_attention(call, plan, slab, *parts)  # [slab, G, S_q, D_v]
        outs.append(rows_at(out.view(1, -1, groups * rows, out.shape[-1]), where)[0])  # each query's slot
    return torch.cat(outs).view(b, h, n_q, -1).to(call.q.dtype)


def _slab_attention(call: Call, plan: KeySetPlan, slab: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One slab's groups: ``q, k, v`` ``(slab, N, e)`` (the flat (batch, head) rows ``slab``)
    gathered by group and run in one SDPA call, ``(slab, G, S_q, D_v)``."""
    (groups, rows, keys), device, dtype = plan.shape, q.device, q.dtype

    def grouped(x: Tensor, index: Tensor, size: int) -> Tensor:  # [slab, N, e] -> [slab, G, size, e]
        return rows_at(x[None], index)[0].view(x.shape[0], groups, size, x.shape[-1])

    qx, kx, vx = grouped(q, plan.rows.to(device), rows), *(grouped(x, plan.keys.to(device), keys) for x in (k, v))
    allowed = None if plan.allowed is None else plan.allowed.to(device)[None]  # [1, G, 1 | S_q, S_k]
    if call.key_mask is not None:  # each row's batch row: its real keys in each group, [slab, G, 1, S_k]
        real = call.key_mask[torch.div(slab, call.q.shape[1], rounding_mode="floor")]
        real = real.index_select(1, plan.keys.to(device)).view(-1, groups, 1, keys)
        allowed = real if allowed is None else real & allowed
    mask = additive_mask(allowed, dtype)
    bias = plain_bias(call.score_mod, device)
    if bias is not None:
        values = _bias_values(bias, plan, call, slab, dtype)  # [slab, G, S_q, S_k]
        mask = cut_far(values if mask is None else mask + values, qx, kx, call.scale)
    return F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, scale=call.scale)
