"""Where ``topk.largest``'s two stages beat one ``torch.topk`` over each row: both timed on about
1M scores (rows of N, k kept) for each ``(N, k)``, the two stages forced by a threshold of 2
(``topk.TWO_STAGES_FROM`` is where they start). Under ``bench speed``'s malloc thresholds.
Usage: ``python scripts/largest_crossover.py``; prints ``N k N/k direct two``, times in ms.
"""

from __future__ import annotations

import time

import torch

from attnzoo.bench.monitor import release_mmap_threshold
from attnzoo.mechanisms import topk

PAIRS = [(96, 8), (110, 8), (128, 8), (160, 8), (200, 17), (256, 17), (300, 25), (320, 33), (352, 33)]
PAIRS += [(384, 33), (440, 33), (480, 33), (512, 33), (1024, 33), (1024, 65), (4096, 33), (4096, 257)]


def timed(fn, repeats: int = 20) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


if __name__ == "__main__":
    release_mmap_threshold()
    threshold = topk.TWO_STAGES_FROM
    print(f"# TWO_STAGES_FROM = {threshold} in the code; N k N/k direct_ms two_stage_ms")
    for n, k in PAIRS:
        x = torch.randn(max(1, 2**20 // n), n)
        direct = timed(lambda x=x, k=k: x.topk(k, dim=-1))
        topk.TWO_STAGES_FROM = 2
        two = timed(lambda x=x, k=k: topk.largest(x, k))
        topk.TWO_STAGES_FROM = threshold
        print(f"{n} {k} {n / k:.1f} {direct:.2f} {two:.2f} {'two' if two < direct else 'direct'}")
