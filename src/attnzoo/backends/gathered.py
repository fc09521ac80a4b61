"""The blocked backend's ``gathered`` path: patterns that name a few keys per query row with no
locality between rows (``random(r)``, alone or and-ed with ``causal()`` or other position
rules). Tiles cannot serve them: r random keys per row land in nearly every key block, so a
query block's tiles are the whole matrix under a mask — slower than dense attention.

Instead the rows' keys are the structure of a sparse CSR matrix (``RowPlan``, built once per
pattern and lengths): the scores are a sampled dense-dense product on it
(``torch.sparse.sampled_addmm``: only the listed pairs), the softmax runs over each row's
entries laid out as an ``(N_q, w)`` block (``w`` = the most keys a row keeps), and the output is
a sparse-times-dense product with V. Backward is the same three products: ``dP`` sampled on the
structure from ``dO V^T``, ``dQ = dS K``, and ``dK = dS^T Q``, ``dV = P^T dO`` through the
transposed structure (its order precomputed as a permutation of the entries). Time and memory
O(N r D); nothing is N x N. One (b, h) at a time: the 2-D sparse kernels ran twice as fast as
their batched forms here. This replaced a gather of every row's keys (elementwise products over
``(N, r, D)`` copies, memory-bound): ``random(64)`` went from 0.34x dense SDPA (fwd+bwd) at
N = 1024 to 2.8x in one process (``benchmarks/speed-random-csr-cpu.jsonl`` against
``speed-random-gathered-cpu.jsonl`` for the sweep).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.backends.call import Call, PlanCache, compute_dtype
from attnzoo.patterns import Pattern
from attnzoo.patterns.algebra import Intersection
from attnzoo.patterns.atomic import Random

#: ``(pattern, n_q, n_kv)`` -> ``RowPlan`` or None.
TABLES: PlanCache[tuple, Any] = PlanCache(maxsize=32)


class RowPlan(NamedTuple):
    """The kept (row, key) pairs as a CSR structure, its transpose, and the softmax layout.

    ``crow (N_q + 1)``, ``col (nnz)``: the pairs row by row, keys ascending. ``crow_t (N_kv + 1)``,
    ``col_t (nnz)``: the same pairs key by key; ``perm (nnz)`` puts row-order values in that
    order. ``rows (nnz)``: each pair's row. ``slots (nnz)`` or None: each pair's place in the
    ``(N_q, width)`` softmax block (None when every row keeps ``width`` keys: the values are
    that block as they are)."""

    crow: Tensor
    col: Tensor
    crow_t: Tensor
    col_t: Tensor
    perm: Tensor
    rows: Tensor
    slots: Tensor | None
    width: int
    n_q: int
    n_kv: int


def _row_plan(table: Tensor, valid: Tensor, n_kv: int) -> RowPlan:
    """``RowPlan`` of the kept entries of a row table (``_row_table``)."""
    n_q = table.shape[0]
    counts = valid.sum(1)
    width = int(counts.max()) if n_q else 0
    keys = table.masked_fill(~valid, n_kv).sort(dim=1).values[:, :width]  # kept keys ascending, n_kv after
    kept = keys < n_kv
    rows = torch.arange(n_q)[:, None].expand(n_q, width)[kept]
    col = keys[kept]
    crow = F.pad(counts.cumsum(0), (1, 0))
    perm = torch.argsort(col * max(n_q, 1) + rows)  # key-major order, rows ascending within a key
    crow_t = F.pad(torch.bincount(col, minlength=n_kv).cumsum(0), (1, 0))
    full = bool(kept.all())
    slots = None if full else (rows * width + kept.long().cumsum(1)[kept] - 1)
    return RowPlan(crow, col, crow_t, rows[perm], perm, rows, slots, width, n_q, n_kv)


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
    # Each row's kept keys first (``RowPlan`` keeps only those).
    order = (~valid).to(torch.int8).argsort(dim=1, stable=True)
    return table.gather(1, order), valid.gather(1, order)


def row_plan(call: Call) -> RowPlan | None:
    """``RowPlan`` of the call's pattern (None if it does not name its keys row by row), cached
    by the pattern's value and the lengths."""
    n_q, n_kv, _ = call.sizes()

    def build() -> RowPlan | None:
        table = _row_table(call.pattern, n_q, n_kv)
        return None if table is None else _row_plan(*table, n_kv)

    return TABLES.get((call.pattern, n_q, n_kv), build)


def not_gathered_reasons(call: Call) -> list[str]:
    """Why the gathered path cannot run ``call`` (empty: it can)."""
    reasons = []
    if call.score_mod is not None:
        reasons.append("a score_mod (the gathered path has no recomputing backward for it)")
    if call.dropout is not None:
        reasons.append("attention dropout")
    if row_plan(call) is None:
        reasons.append("the pattern does not name its keys row by row (only random(r) and its intersections do)")
    return reasons


def _csr(plan: RowPlan, values: Tensor, transposed: bool = False) -> Tensor:
    """The pairs with ``values`` (in row order, or key order when ``transposed``) as a CSR matrix
    ``(N_q, N_kv)`` (or ``(N_kv, N_q)``)."""
    if transposed:
        return torch.sparse_csr_tensor(plan.crow_t, plan.col_t, values, (plan.n_kv, plan.n_q), check_invariants=False)
    return torch.sparse_csr_tensor(plan.crow, plan.col, values, (plan.n_q, plan.n_kv), check_invariants=False)


def _sampled(plan: RowPlan, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``alpha * (a @ b^T)`` at the plan's pairs only: values ``(nnz,)`` in row order."""
    pattern = _csr(plan, a.new_zeros(plan.col.numel()))
    return torch.sparse.sampled_addmm(pattern, a, b.t(), beta=0.0, alpha=alpha).values()


def _row_softmax(plan: RowPlan, scores: Tensor, visible: Tensor | None) -> Tensor:
    """Softmax of each row's pair scores ``(nnz,)`` over its visible pairs; 0 for the rest, and
    for every pair of a row with none visible."""
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    if plan.slots is None:
        block = scores.view(plan.n_q, plan.width)
    else:
        block = scores.new_full((plan.n_q * plan.width,), -math.inf).index_copy_(0, plan.slots, scores)
        block = block.view(plan.n_q, plan.width)
    lse = torch.logsumexp(block, 1, keepdim=True)
    weights = torch.exp(block - torch.where(lse == -math.inf, math.inf, lse)).flatten()
    return weights if plan.slots is None else weights[plan.slots]


class _SparseRowsAttention(torch.autograd.Function):
    """q ``(B, H, N_q, D)``, k, v ``(B, H_kv, N_kv, D | D_v)`` (``H_kv`` dividing ``H``) ->
    ``(B, H, N_q, D_v)``; saves the weights ``(B, H, nnz)``."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: RowPlan, call: Call) -> Tensor:  # type: ignore[override]
        batch, heads, groups = q.shape[0], q.shape[1], q.shape[1] // k.shape[1]
        out = v.new_empty(batch, heads, plan.n_q, v.shape[-1])
        weights = q.new_empty(batch, heads, plan.col.numel())
        for b in range(batch):
            visible = None if call.key_mask is None else call.key_mask[b][plan.col]
            for h in range(heads):
                scores = _sampled(plan, q[b, h], k[b, h // groups], call.scale)
                weights[b, h] = _row_softmax(plan, scores, visible)
                out[b, h] = _csr(plan, weights[b, h]) @ v[b, h // groups]
        ctx.save_for_backward(q, k, v, out, weights)
        ctx.plan, ctx.scale = plan, call.scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, weights = ctx.saved_tensors
        plan, scale, groups = ctx.plan, ctx.scale, q.shape[1] // k.shape[1]
        delta = (grad * out).sum(-1)  # (B, H, N_q): rowsum(dO * O)
        d_q, d_k, d_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b in range(q.shape[0]):
            for h in range(q.shape[1]):
                g, p = grad[b, h].contiguous(), weights[b, h]
                d_scores = p * (_sampled(plan, g, v[b, h // groups]) - delta[b, h][plan.rows])
                d_q[b, h] = (_csr(plan, d_scores) @ k[b, h // groups]) * scale
                d_k[b, h // groups] += (_csr(plan, d_scores[plan.perm], transposed=True) @ q[b, h]) * scale
                d_v[b, h // groups] += _csr(plan, p[plan.perm], transposed=True) @ g
        return d_q, d_k, d_v, None, None


def gathered_attention(call: Call) -> Tensor:
    """Exact attention of ``call`` over each row's listed keys (see the module docstring)."""
    plan = row_plan(call)
    dtype = compute_dtype(call.q)  # the sparse kernels take float32 and float64
    q, k, v = (x.to(dtype) for x in (call.q, call.k, call.v))
    with warnings.catch_warnings():  # torch's one-time notice that its CSR support is beta
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        out = _SparseRowsAttention.apply(q, k, v, plan, call)
    return out.to(call.q.dtype)
