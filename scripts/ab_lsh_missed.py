"""A/B of LSH's per-round mask built from missed rounds in integer arithmetic, in one process
(issue 12).

``lsh_chunks.round_mask`` subtracts ``log N_ij`` (the rounds that show each pair) from each
round's additive mask. It marked the pairs another round shows with a bool comparison of their
codes, counted them as uint8 and subtracted ``ln 2`` times the count in a pass of its own; now
``missed_rounds`` counts the rounds that do *not* show a pair in int16 (subtract, shift,
``abs``, clamp) and ``discounted`` adds ``ln 2`` times it while it writes the sum, the ``-ln 2``
folded into the ``(c, 2c)`` table. The old ``round_mask`` is loaded from git ``aa5a487`` and
swapped in per call; each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_lsh_missed.py N CAUSAL(0|1)
NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import module_at, swap_main

from attnzoo.mechanisms import lsh_chunks

if __name__ == "__main__":
    swap_main(lsh_chunks, "round_mask", module_at("aa5a487", "src/attnzoo/mechanisms/lsh_chunks.py").round_mask)
