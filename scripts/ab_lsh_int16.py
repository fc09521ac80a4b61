"""A/B of LSH's shared-round count from int16 code differences instead of two broadcast
comparisons, in one process (issue 12).

``lsh_chunks.shared_rounds`` marks each (query, key) pair of a round's chunks that another round
also shows: their codes differ by 0 or 1. Two broadcast comparisons of the int64 codes wrote
bools (0.5-0.9 ms per 1M pairs each here); now the codes are narrowed to int16 where they fit,
subtracted and shifted, and compared once. ``old_shared_rounds`` below is the code before (git
c797ba5), swapped in per call; each pair is timed forward+backward interleaved with dense
SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python scripts/ab_lsh_int16.py N
CAUSAL(0|1) lsh [REPEATS]``.

The rule it swaps in for left the code at ``1d43ac5`` (``missed_rounds`` and ``discounted`` replaced
it): run it from a checkout of ``1d43ac5^``, where it ran when its A/B file was written.
"""

from __future__ import annotations

from ab_lsh_rounds import counted
from ab_timing import swap_main

from attnzoo.mechanisms import lsh_chunks

# the code before: two broadcast comparisons of the int64 codes
old_shared_rounds = counted(lambda q, k: (q == k) | (q == k + 1))


if __name__ == "__main__":
    swap_main(lsh_chunks, "shared_rounds", old_shared_rounds)
