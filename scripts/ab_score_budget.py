"""A/B of the tile plan's chunk size, in one process (issue 12).

``blocked.SCORE_BUDGET`` (the most scores one chunk of a piece holds) is now 1M; before, 4M.
Both are swapped in per call; each pair is timed forward+backward interleaved with dense SDPA's
(B=1, H=8, D=64, median of the repeats). The tile plan runs what has no structured or gathered
path (``bigbird``, ``block2d``, user patterns). Usage: ``python scripts/ab_score_budget.py N
CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab

from attnzoo.backends import blocked


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    rules = {"old": 1 << 22, "new": blocked.SCORE_BUDGET}

    def use(rule: str) -> None:
        blocked.SCORE_BUDGET = rules[rule]

    fwd_bwd_ab(n, causal, names, repeats, use)


if __name__ == "__main__":
    main()
