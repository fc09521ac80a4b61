"""A/B of ``hierarchical`` and ``sac`` in slabs of heads whose gathered keys stay under
``_ops.SLAB_BYTES`` (16 MiB; ``_ops.in_slabs``, new) against every head at once (old), in one process:
a temporary past glibc's largest mmap threshold (32 MiB) is mapped afresh and page-faulted on
every call. Timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, medians).
Usage: ``python scripts/ab_slabs.py N CAUSAL(0|1) [REPEATS]`` (``cd scripts; PYTHONPATH=../src``).
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab

from attnzoo.mechanisms import _ops

RULES = {"old": 1 << 62, "new": _ops.SLAB_BYTES}


def main() -> None:
    n, causal = int(sys.argv[1]), sys.argv[2] == "1"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5

    def use(rule: str) -> None:
        _ops.SLAB_BYTES = RULES[rule]

    fwd_bwd_ab(n, causal, ["hierarchical", "sac"], repeats, use)


if __name__ == "__main__":
    main()
