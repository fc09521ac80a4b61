"""A/B of ``sac``'s and ``hierarchical``'s gathers of each block's keys and values through
``_ops.rows_at`` (one ``index_select`` over the flattened ``(B H M, D)`` rows) instead of
``index_select`` along dim 2 of the ``(B, H, M, D)`` tensor, in one process (issue 12).

The old gather is swapped into both modules per call; each pair is timed forward+backward
interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage:
``python scripts/ab_rows_at.py N CAUSAL(0|1) sac[,hierarchical] [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab, split_names
from torch import Tensor

from attnzoo.mechanisms import hierarchical, sac


def along_dim2(x: Tensor, positions: Tensor) -> Tensor:
    """The old gather: ``index_select`` along dim 2."""
    return x.index_select(2, positions)


if __name__ == "__main__":
    rules = {"old": along_dim2, "new": sac.rows_at}

    def use(rule: str) -> None:
        sac.rows_at = hierarchical.rows_at = rules[rule]

    args = sys.argv[1:]
    fwd_bwd_ab(int(args[0]), args[1] == "1", split_names(args[2]), int(args[3]) if len(args) > 3 else 7, use)
