"""The blocked backend's ``key_sets`` path: patterns whose queries fall into groups that each see
one set of keys (``patterns.GroupKeyed``: ``block2d``, a query block of an image and its block
extended by the margin), alone or and-ed with ``causal()`` or other position rules.

Tiles serve them badly: a 2-D block is a run of ``qw`` pixels in each of ``qh`` raster rows, so
its keys are ``qh + 2 mh`` short runs, and 1-D tiles around them are mostly masked (``block2d``
at its defaults ran at 0.9x dense SDPA at 1K and 4K fwd+bwd, for a bound of 4-5x). Instead each
group's queries ``(G, S_q)`` and keys ``(G, S_k)`` are gathered as rows (``call.rows_at``) and
one ``scaled_dot_product_attention`` call runs every group at once, ``(B H, G, S_q, D)`` against
``(B H, G, S_k, D)``: on the CPU the flash kernel, forward and backward, with an additive mask
only where some slot or pair is not allowed (a group at the image's edge, ``causal()``, padded
keys). The gathers' backward adds the keys' gradients back (``index_add_``). O(N S_k D) time,
O(N S_k) memory at most (the mask of an intersection, or of a bias); nothing is N x N. A row
that sees no key comes out 0 (the kernel's answer to a masked row, checked by the tests).

An additive bias (``score_mods.plain_bias``: ALiBi) joins the mask, ``(B H, G, S_q, S_k)``, its
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


def _bias_values(bias: Bias, plan: KeySetPlan, call: Call, dtype: torch.dtype) -> Tensor:
    """``bias`` at every group's pairs, ``(B, H, G, S_q, S_k)``: queries end-aligned to the keys
    (``q_idx = row + N_kv - N_q``, ``spec``'s convention); empty slots read position 0 (masked)."""
    (groups, rows, keys), device = plan.shape, call.q.device
    (b, h, n_q), n_kv = call.q.shape[:3], call.k.shape[2]
    q_idx = (plan.rows.to(device) + (n_kv - n_q)).view(1, 1, groups, rows, 1)
    kv_idx = plan.keys.to(device).view(1, 1, groups, 1, keys)
    batch = torch.arange(b, device=device).view(-1, 1, 1, 1, 1)
    head = torch.arange(h, device=device).view(1, -1, 1, 1, 1)
    return bias(batch, head, q_idx, kv_idx).to(dtype).expand(b, h, groups, rows, keys)


def key_set_attention(call: Call) -> Tensor:
    """Exact attention of ``call`` over each group's keys (see the module docstring)."""
    plan = key_set_plan(call)
    assert plan is not None, "not_key_set_reasons(call) says why"
    (groups, rows, keys), dtype = plan.shape, compute_dtype(call.q)
    q, k, v = (x.to(dtype) for x in (call.q, call.k, call.v))
    b, h = q.shape[:2]

    def grouped(x: Tensor, index: Tensor, size: int) -> Tensor:  # [B, H, N, e] -> [B H, G, size, e]
        return rows_at(x, index).view(b * h, groups, size, x.shape[-1])

    qx, kx, vx = grouped(q, plan.rows.to(q.device), rows), *(grouped(x, plan.keys.to(q.device), keys) for x in (k, v))
    allowed = None if plan.allowed is None else plan.allowed.to(q.device)[None]  # [1, G, 1 | S_q, S_k]
    bias = plain_bias(call.score_mod, q.device)
    biases = None if bias is None else _bias_values(bias, plan, call, dtype)  # [B, H, G, S_q, S_k]

    def attend(part: slice, allowed: Tensor | None, at: int | slice) -> Tensor:  # batch rows `part` of qx
        mask = additive_mask(allowed, dtype)
        if biases is not None:
            values = biases[at].reshape(-1, *biases.shape[-3:])  # [B H | H, G, S_q, S_k]
            mask = cut_far(values if mask is None else mask + values, qx[part], kx[part], call.scale)
        return F.scaled_dot_product_attention(qx[part], kx[part], vx[part], attn_mask=mask, scale=call.scale)

    if call.key_mask is None:
        out = attend(slice(None), allowed, slice(None))
    else:  # one call per batch row: its real keys in each group, [1, G, 1, S_k], not repeated per head
        outs = []
        for i, real in enumerate(call.key_mask):
            mask = real.index_select(0, plan.keys.to(q.device)).view(1, groups, 1, keys)
            outs.append(attend(slice(i * h, (i + 1) * h), mask if allowed is None else mask & allowed, i))
        out = torch.cat(outs)
    out = rows_at(out.view(b, h, groups * rows, -1), plan.where.to(q.device))  # each query's slot
    return out.to(call.q.dtype)
