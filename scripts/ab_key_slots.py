"""A/B of the key-sets plan dropping the key slots that no row of any group may see (causal
``block2d``: its blocks' lower margins) against the plan as the revision OLD_REV built it, in one
process.

The old ``_build`` is loaded from ``git show OLD_REV:src/attnzoo/backends/key_sets.py`` and
swapped in per call, with the plan cache cleared (both arms rebuild their plans every call);
each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the
repeats). Usage: ``python scripts/ab_key_slots.py OLD_REV N CAUSAL(0|1) NAMES [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import ab_main, module_at

from attnzoo.backends import key_sets

if __name__ == "__main__":
    rev, *args = sys.argv[1:]
    rules = {"old": module_at(rev, "src/attnzoo/backends/key_sets.py")._build, "new": key_sets._build}

    def use(rule: str) -> None:
        key_sets._build = rules[rule]
        key_sets.PLANS.clear()

    ab_main(use, args)
