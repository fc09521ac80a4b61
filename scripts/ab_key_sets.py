"""A/B of ``block2d`` on the blocked backend's key-sets path (each query block's rows and its
extended block's keys gathered, one SDPA call over every block) against the tile plan it ran
on before, in one process.

The old rule is a ``not_key_set_reasons`` that always finds a reason, swapped in per call; each
pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the
repeats). Usage: ``python scripts/ab_key_sets.py N CAUSAL(0|1) NAMES [REPEATS]``, e.g.
``block2d`` at 1K (its default 32 x 32 grid) and
``block2d:h=64,w=64,query_block=(32,32),memory_margin=(1,1)`` at 4K (``bench speed``'s config
sized for 4K).
"""

from __future__ import annotations

from ab_timing import swap_main

from attnzoo.backends import blocked
from attnzoo.backends.call import Call


def never(call: Call) -> list[str]:
    """The old rule: the key-sets path never runs."""
    return ["the tile plan (old rule)"]


if __name__ == "__main__":
    swap_main(blocked, "not_key_set_reasons", never)
