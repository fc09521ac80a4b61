"""A/B of ``topk.TWO_STAGES_FROM`` = 14 against the 16 it was (rows from 14 k keys on take
``topk.largest``'s two stages), in one process: each pair timed forward+backward interleaved
with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_two_stages_from.py N CAUSAL(0|1) topk[,dsa] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import swap_main

from attnzoo.mechanisms import topk

if __name__ == "__main__":
    swap_main(topk, "TWO_STAGES_FROM", 16)
