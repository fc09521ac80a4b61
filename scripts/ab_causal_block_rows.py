"""The causal kernel path's blocks of heads on the CPU, in one process (issue 12).

``kernel.causal_block_heads`` sizes the blocks of K/V heads the causal path runs one after
another: as many heads as ``CAUSAL_BLOCK_BYTES`` (4 MiB) of key features hold, and now at least
``CAUSAL_BLOCK_ROWS`` (8192) batch x head x position rows. Two modes, each timed
forward+backward interleaved with dense causal SDPA's (B=1, H=8, D=64, medians):

- ``python scripts/ab_causal_block_rows.py sweep N NAME[,NAME...] [REPEATS]``: blocks of 1, 2, 4
  and 8 heads side by side (the bytes limit set to that many heads' features);
- ``python scripts/ab_causal_block_rows.py N NAME[,NAME...] [REPEATS]``: the rule before (bytes
  only: ``CAUSAL_BLOCK_ROWS = 0``) against the rule now.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from ab_timing import swap_main

import attnzoo
from attnzoo.bench.monitor import release_mmap_threshold
from attnzoo.mechanisms import kernel

HEADS = (1, 2, 4, 8)


def sweep(n: int, names: list[str], repeats: int) -> None:
    release_mmap_threshold()
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, n, 64)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn().backward(grad)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    kernel.CAUSAL_BLOCK_ROWS = 0
    for name in names:
        attn = attnzoo.build(name)
        head = n * attn.num_features(64) * 4  # one head's key features, float32
        times: dict[int, list[float]] = {h: [] for h in HEADS}
        dense = []
        for i in range(repeats + 1):
            dense.append(timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
            for h in HEADS if i % 2 else HEADS[::-1]:
                kernel.CAUSAL_BLOCK_BYTES = h * head
                times[h].append(timed(lambda attn=attn: attn(q, k, v, causal=True)))
        sdpa = statistics.median(dense[1:])
        cells = [f"{h} heads {statistics.median(t[1:]) * 1e3:.1f} ms" for h, t in times.items()]
        print(f"N={n} causal {name}: SDPA {sdpa * 1e3:.1f} ms; " + ", ".join(cells))


if __name__ == "__main__":
    if sys.argv[1] == "sweep":
        names = sys.argv[3].split(",")
        sweep(int(sys.argv[2]), names, int(sys.argv[4]) if len(sys.argv) > 4 else 7)
    else:
        swap_main(kernel, "CAUSAL_BLOCK_ROWS", 0, causal=True)
