"""A/B of the key-sets path in slabs of (batch, head) rows whose gathered keys stay under
``key_sets.SLAB_BYTES`` (8 MiB; new) against one slab for every row (old), in one process: a
temporary past glibc's largest mmap threshold (32 MiB) is mapped afresh and page-faulted on every
call. ``block2d`` (64 x 64 at 4K) timed forward+backward interleaved with dense SDPA's (B=1, H=8,
D=64, medians). Usage: ``python scripts/ab_key_set_slabs.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``
(``cd scripts; PYTHONPATH=../src``).
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab, split_names

from attnzoo.backends import key_sets

RULES = {"old": 1 << 62, "new": key_sets.SLAB_BYTES}


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", split_names(sys.argv[3])
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5

    def use(rule: str) -> None:
        key_sets.SLAB_BYTES = RULES[rule]

    fwd_bwd_ab(n, causal, names, repeats, use)


if __name__ == "__main__":
    main()
