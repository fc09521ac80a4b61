"""A/B of ``sac``'s top-k selection by ``topk.topk_keep`` instead of ``topk.topk_mask``, in one
process (issue 12).

``topk_mask`` is the selection rule (a row's k largest visible scores, ties to the lower
position) as the reference reads it: eleven passes over the score tile. ``topk_keep`` keeps what
is at or above each row's k-th score and sends only the rows where that is not exactly k
entries through the rule. The old selection is swapped into ``sac`` per call; each pair is timed
forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage:
``python scripts/ab_topk_keep.py N CAUSAL(0|1) sac [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import swap_main

from attnzoo.mechanisms import sac
from attnzoo.mechanisms.topk import topk_mask

if __name__ == "__main__":
    swap_main(sac, "topk_keep", topk_mask)
