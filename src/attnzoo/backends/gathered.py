"""The blocked backend's ``gathered`` path: patterns that name a few keys per query row
(``patterns.RowKeyed``: ``random(r)``, ``logsparse(levels)``, a ``graph`` whose degrees are even
enough), alone or and-ed with ``causal()``
or other position rules. Tiles cannot serve them: r random keys per row land in nearly every
key block, and logsparse's far keys in a tile each, so a query block's tiles are most of the
matrix under a mask — slower than dense attention (``logsparse`` on tiles: 0.3x SDPA at 1K,
0.7x at 4K, fwd+bwd).

Instead each row's kept keys are a sparse CSR structure, built once per pattern and lengths and
cached (``row_plan``), and the attention runs as sparse products over it
(``sparse_rows.SparseRowsAttention``: the listed pairs' scores by ``sampled_addmm``, a softmax
per row, CSR @ V, and a backward of the same products). Time and memory O(N r D); nothing is
N x N. This replaced a gather of every row's keys (elementwise products over ``(N, r, D)``
copies, memory-bound): ``random(64)`` went from 0.34x dense SDPA (fwd+bwd) at N = 1024 to 2.8x
in one process (``benchmarks/speed-random-csr-cpu.jsonl`` against
``speed-random-gathered-cpu.jsonl`` for the sweep).

An additive bias (``score_mods.plain_bias``: ALiBi) is added at each listed pair
(``sparse_rows.pair_bias``); no other ``score_mod``. ``random`` with ALiBi fwd+bwd at 1K went
from 0.19x SDPA on the tile path to 1.79x (``benchmarks/ab-gathered-bias-cpu.txt``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnzoo.backends.call import Call, PlanCache, compute_dtype, plain_softmax_reasons
from attnzoo.backends.sparse_rows import SparseRows, SparseRowsAttention, pair_bias, sparse_rows
from attnzoo.patterns import Pattern
from attnzoo.patterns.algebra import Intersection
from attnzoo.patterns.atomic import RowKeyed
from attnzoo.score_mods import plain_bias

#: ``(pattern, n_q, n_kv)`` -> ``SparseRows`` or None.
TABLES: PlanCache[tuple, Any] = PlanCache(maxsize=32)


def _row_table(pattern: Pattern, n_q: int, n_kv: int) -> tuple[Tensor, Tensor] | None:
    """The keys of each query row and which of them the whole pattern keeps, or None when the
    pattern does not name its keys row by row. A ``RowKeyed`` pattern (``random(r)``,
    ``logsparse(levels)``, ``graph`` while its table pays) names them; an intersection with one
    such part keeps those of its keys the other parts allow (evaluated on its S keys per row
    only, so a part's cost is O(N S))."""
    if pattern.per_head:
        return None
    if isinstance(pattern, RowKeyed):
        return pattern.row_table(n_q, n_kv)
    if not isinstance(pattern, Intersection):
        return None
    keyed = [p for p in pattern.parts if isinstance(p, RowKeyed)]
    if len(keyed) != 1:
        return None
    table = keyed[0].row_table(n_q, n_kv)
    if table is None:
        return None
    table, valid = table
    rows = (torch.arange(n_q) + (n_kv - n_q))[:, None]  # queries end-aligned to the keys
    zero = torch.zeros((), dtype=torch.long)
    for part in pattern.parts:
        if part is not keyed[0]:
            valid = valid & part.mask_mod_for(n_q, n_kv)(zero, zero, rows, table)
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
    """Why the gathered path cannot run ``call`` (empty: it can). It takes an additive bias
    (``score_mods.plain_bias``: ALiBi), added to each pair's score; no other ``score_mod``."""
    reasons = plain_softmax_reasons(call, "the gathered path takes an additive bias only", bias=True)
    if row_plan(call) is None:
        reasons.append(
            "the pattern does not name its keys row by row (a patterns.RowKeyed, or its intersections; a graph "
            "with a hub: its degrees too uneven for a row table, patterns.atomic.GRAPH_TABLE_SLOTS_PER_EDGE)"
        )
    return reasons


def gathered_attention(call: Call) -> Tensor:
    """Exact attention of ``call`` over each row's listed keys (see the module docstring)."""
    plan = row_plan(call)
    dtype = compute_dtype(call.q)  # the sparse kernels take float32 and float64
    q, k, v = (x.to(dtype) for x in (call.q, call.k, call.v))
    key_mask = call.key_mask

    def visible(r: SparseRows, b: int) -> Tensor | None:  # the pairs whose key is real
        return None if key_mask is None else key_mask[b][r.col]

    bias = plain_bias(call.score_mod, q.device)
    offset = call.k.shape[2] - call.q.shape[2]
    bias_of = None if bias is None else (lambda r, b, h: pair_bias(bias, r, b, h, offset, dtype))
    out = SparseRowsAttention.apply(q, k, v, lambda b, h: plan, visible, call.scale, bias_of)[0]
    return out.to(call.q.dtype)
