"""A/B of ``sac``'s and ``hierarchical``'s gathers of each block's keys and values, and
``graph_attention``'s of each node's neighbours, through ``backends.call.rows_at`` (one ``index_select``
over the flattened ``(B H M, D)`` rows) instead of ``index_select`` along dim 2 of the ``(B, H,
M, D)`` tensor (``sac``, ``hierarchical``) or advanced indexing ``x[:, :, keys]``
(``graph_attention``), in one process (issue 12).

The old gathers are swapped into the modules per call; each pair is timed forward+backward
interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage:
``python scripts/ab_rows_at.py N CAUSAL(0|1) sac[,hierarchical,graph_attention] [REPEATS]``
(``graph_attention`` on a graph of N nodes with 32 random neighbours each).
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab, parse_ab_args, random_edges
from torch import Tensor

import attnzoo
from attnzoo.mechanisms import graph, hierarchical, sac


def along_dim2(x: Tensor, positions: Tensor) -> Tensor:
    """The old gather: ``index_select`` along dim 2."""
    return x.index_select(2, positions)


def indexed(x: Tensor, positions: Tensor) -> Tensor:
    """``graph_attention``'s old gather: advanced indexing."""
    return x[:, :, positions]


if __name__ == "__main__":
    new = sac.rows_at

    def use(rule: str) -> None:
        sac.rows_at = hierarchical.rows_at = along_dim2 if rule == "old" else new
        graph.rows_at = indexed if rule == "old" else new

    n, causal, names, repeats = parse_ab_args(sys.argv[1:])
    built = {}
    if "graph_attention" in names:  # on a graph of n nodes with 32 random neighbours each
        names.remove("graph_attention")
        built["graph_attention (degree 32)"] = attnzoo.build("graph_attention", n=n, edges=random_edges(n, 32))
    fwd_bwd_ab(n, causal, names, repeats, use, built)
