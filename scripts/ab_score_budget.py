"""A/B of the tile plan's chunk size, in one process (issue 12).

``blocked.SCORE_BUDGET`` (the most scores one chunk of a piece holds) is now 1M; before, 4M.
Both are swapped in per call; each pair is timed forward+backward interleaved with dense SDPA's
(B=1, H=8, D=64, median of the repeats). The tile plan runs what has no structured or gathered
path (``bigbird``, ``block2d``, user patterns). Usage: ``python scripts/ab_score_budget.py N
CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import swap_main

from attnzoo.backends import blocked


def main() -> None:
    swap_main(blocked, "SCORE_BUDGET", 1 << 22)


if __name__ == "__main__":
    main()
