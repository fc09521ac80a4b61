"""A/B of ``sac``'s block of nodes (``sac.BLOCK``: 16 now, 32 before), in one process (issue 12).

The forward's fast path runs blocks of nodes over the union of their candidate keys: a block of
b nodes shares its window keys (about ``candidates + b``) but not its random ones (``b
n_random``), which every node of the block scores. Fewer nodes per block score fewer keys per
node in smaller GEMMs. ``BLOCK`` is set per call (each block size has its own cached blocks, built
in the warm-up round); each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_sac_block.py N CAUSAL(0|1) sac
[REPEATS] [OLD]`` (OLD: the block to compare with, default 32).
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab

from attnzoo.mechanisms import sac

if __name__ == "__main__":
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    rules = {"old": int(sys.argv[5]) if len(sys.argv) > 5 else 32, "new": sac.BLOCK}
    fwd_bwd_ab(n, causal, names, repeats, lambda rule: setattr(sac, "BLOCK", rules[rule]))
