"""A/B of the non-causal kernel blocks off the CPU: the CPU's 8K rows a block against the default
``kernel.DEVICE_BLOCK_BYTES`` (one block for these three at these sizes), fwd+bwd, the two
alternated three times with dense SDPA timed after each pair; medians in ms. Ran on an H100
(``benchmarks/gpu/ab-device-block-rows-h100.txt``; then the cap was 2**20 rows, which gave the
same single block).

    PYTHONPATH=src python scripts/ab_device_block_rows.py cuda
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.mechanisms import kernel

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
SIZES = (256,) if DEVICE == "cpu" else (4096, 16384)  # the CPU: a smoke run only
DEFAULT_BYTES = kernel.DEVICE_BLOCK_BYTES


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compare(n: int) -> None:
    """Every mechanism at length ``n``, each rule and SDPA alternated three times."""
    q, k, v = (torch.randn(1, 8, n, 64, device=DEVICE, requires_grad=True) for _ in range(3))

    def sdpa():
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    for name in ("performer", "efficient", "linear"):
        attn = attnzoo.build(name).to(DEVICE)

        def mechanism(attn=attn):
            attn(q, k, v).sum().backward()

        # 8K rows (batch x head x position) a block, as on the CPU, in bytes of this map's features
        rules = {8192: 8192 * attn.num_features(64) * 4, "default": DEFAULT_BYTES}
        times = {rule: [] for rule in (*rules, "sdpa")}
        for _ in range(3):
            for rule, cap in rules.items():
                kernel.DEVICE_BLOCK_BYTES = cap
                mechanism()  # warm-up at this rule
                times[rule].append(median_ms(mechanism))
            sdpa()
            times["sdpa"].append(median_ms(sdpa))
        print(n, name, {key: round(statistics.median(ms), 2) for key, ms in times.items()}, flush=True)


if __name__ == "__main__":
    for size in SIZES:
        compare(size)
