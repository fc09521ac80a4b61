"""A/B of a graph of even degrees as a row-keyed pattern (``patterns.Graph.row_table``: the
gathered CSR path) against the old rule (never a row table: ``graph`` on tiles,
``graph_attention`` in degree buckets), in one process.

The old rule is ``GRAPH_TABLE_SLOTS_PER_EDGE = 0``, swapped in per call with the plan caches
cleared; each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64,
median of the repeats), on a graph of N nodes with DEGREE random neighbours each. Usage:
``python scripts/ab_graph_rows.py N CAUSAL(0|1) DEGREE [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab, random_edges

import attnzoo
from attnzoo.backends import gathered, plan
from attnzoo.patterns import atomic

if __name__ == "__main__":
    n, causal, degree = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
    slots = {"old": 0, "new": atomic.GRAPH_TABLE_SLOTS_PER_EDGE}

    def use(rule: str) -> None:
        atomic.GRAPH_TABLE_SLOTS_PER_EDGE = slots[rule]
        for cache in (gathered.TABLES, plan.PLANS, plan.STRUCTURES):
            cache.clear()

    edges = random_edges(n, degree)
    names = ("graph", "graph_attention")
    built = {f"{name} (degree {degree})": attnzoo.build(name, n=n, edges=edges) for name in names}
    fwd_bwd_ab(n, causal, [], int(sys.argv[4]) if len(sys.argv) > 4 else 7, use, built)
