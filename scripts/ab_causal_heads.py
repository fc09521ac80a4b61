"""A/B of the causal kernel path in blocks of heads, in one process (issue 12).

``kernel.kernel_attention`` now runs its causal path on blocks of K/V heads whose key features
take at most ``CAUSAL_BLOCK_BYTES`` (4 MiB); before, all heads at once (``rfa``'s features are
32 MiB at N = 4096, H = 8: fresh mappings, page-faulted on every call). Both settings are
swapped in per call; each pair is timed forward+backward, causal, interleaved with dense SDPA's
causal forward+backward (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_causal_heads.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab

from attnzoo.mechanisms import kernel


def main() -> None:
    n, names = int(sys.argv[1]), sys.argv[2].split(",")
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    rules = {"old": 2**62, "new": kernel.CAUSAL_BLOCK_BYTES}

    def use(rule: str) -> None:
        kernel.CAUSAL_BLOCK_BYTES = rules[rule]

    fwd_bwd_ab(n, True, names, repeats, use)


if __name__ == "__main__":
    main()
