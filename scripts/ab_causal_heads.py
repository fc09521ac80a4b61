"""A/B of the causal kernel path in blocks of heads, in one process (issue 12).

``kernel.kernel_attention`` now runs its causal path on blocks of K/V heads whose key features
take at most ``CAUSAL_BLOCK_BYTES`` (4 MiB); before, all heads at once (``rfa``'s features are
32 MiB at N = 4096, H = 8: fresh mappings, page-faulted on every call). Both settings are
swapped in per call; each pair is timed forward+backward, causal, interleaved with dense SDPA's
causal forward+backward (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_causal_heads.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import swap_main

from attnzoo.mechanisms import kernel


def main() -> None:
    swap_main(kernel, "CAUSAL_BLOCK_BYTES", 2**62, causal=True)


if __name__ == "__main__":
    main()
