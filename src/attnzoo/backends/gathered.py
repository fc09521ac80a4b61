"""The blocked backend's ``gathered`` path: patterns that name a few keys per query row with no
locality between rows (``random(r)``, alone or and-ed with ``causal()`` or other position
rules). Tiles cannot serve them: r random keys per row land in nearly every key block, so a
query block's tiles are the whole matrix under a mask — slower than dense attention.

Instead each row's kept keys are a sparse CSR structure, built once per pattern and lengths and
cached (``row_plan``), and the attention runs as sparse products over it
(``sparse_rows.SparseRowsAttention``: the listed pairs' scores by ``sampled_addmm``, a softmax
per row, CSR @ V, and a backward of the same products). Time and memory O(N r D); nothing is
N x N. This replaced a gather of every row's keys (elementwise products over ``(N, r, D)``
copies, memory-bound): ``random(64)`` went from 0.34x dense SDPA (fwd+bwd) at N = 1024 to 2.8x
in one process (``benchmarks/speed-random-csr-cpu.jsonl`` against
``speed-random-gathered-cpu.jsonl`` for the sweep).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnzoo.backends.call import Call, PlanCache, compute_dtype
from attnzoo.backends.sparse_rows import SparseRows, SparseRowsAttention, sparse_rows
from attnzoo.patterns import Pattern
from attnzoo.patterns.algebra import Intersection
from attnzoo.patterns.atomic import Random

#: ``(pattern, n_q, n_kv)`` -> ``SparseRows`` or None.
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
    # Each row's kept keys first.
    order = (~valid).to(torch.int8).argsort(dim=1, stable=True)
    return table.gather(1, order), valid.gather(1, order)


def row_plan(call: Call) -> SparseRows | None:
    """The kept pairs of the call's pattern as ``SparseRows`` (None if the pattern does not name
    its keys row by row), cached by the pattern's value and the lengths."""
    n_q, n_kv, _ = call.sizes()

    def build() -> SparseRows | None:
        table = _row_table(call.pattern, n_q, n_kv)
        return None if table is None else sparse_rows(*table, n_kv)

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


def gathered_attention(call: Call) -> Tensor:
    """Exact attention of ``call`` over each row's listed keys (see the module docstring)."""
    plan = row_plan(call)
    dtype = compute_dtype(call.q)  # the sparse kernels take float32 and float64
    q, k, v = (x.to(dtype) for x in (call.q, call.k, call.v))
    key_mask = call.key_mask

    def visible(r: SparseRows, b: int) -> Tensor | None:  # the pairs whose key is real
        return None if key_mask is None else key_mask[b][r.col]

    out = SparseRowsAttention.apply(q, k, v, lambda b, h: plan, visible, call.scale)[0]
    return out.to(call.q.dtype)
