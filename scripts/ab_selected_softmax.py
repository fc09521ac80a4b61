"""A/B of ``selected.selected_softmax`` (topk's and dsa's attention over selected keys) in one process.

The old implementation (dense score tiles per query chunk, the selected weights scattered back for
GEMMs) is loaded from a file written with ``git show 2c4157e:src/attnzoo/mechanisms/selected.py``;
both run on the same random selections, fwd+bwd, interleaved with dense SDPA (B=1, H=8, D=64).
Usage: ``python scripts/ab_selected_softmax.py OLD_SELECTED_PY``.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from attnzoo.mechanisms import selected


def _load(path: str):
    spec = importlib.util.spec_from_file_location("old_selected", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench(old, n: int, kk: int, causal: bool, shared: bool, heads: int = 8) -> str:
    q, k, v = (torch.randn(1, heads, n, 64, requires_grad=True) for _ in range(3))
    scores = torch.rand(1, 1 if shared else heads, n, n)
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1)
    idx = scores.topk(kk, -1).indices
    valid = scores.gather(-1, idx) >= 0

    def chosen(start, stop, reach, _scores):
        return idx[:, :, start:stop].clamp(max=reach - 1), valid[:, :, start:stop]

    runs = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "old": lambda: old.selected_softmax(q * 0.125, k, v, chosen, 256, causal)[0],
        "new": lambda: selected.selected_softmax(q * 0.125, k, v, idx, valid)[0],
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(5):
        for name, run in runs.items():
            start = time.perf_counter()
            run().sum().backward()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts[1:]) for name, ts in times.items()}  # the first warms up
    cells = " ".join(f"{name} {t * 1e3:.1f}ms {medians['sdpa'] / t:.2f}x" for name, t in medians.items())
    return f"N={n} k={kk}{' causal' if causal else ''}{' shared' if shared else ''}: {cells}"


def main() -> None:
    old = _load(sys.argv[1])
    cases = [(1024, 32), (1024, 64), (1024, 256), (2048, 64), (2048, 128), (2048, 256), (4096, 32), (4096, 256)]
    for n, kk in cases:
        print(bench(old, n, kk, causal=False, shared=kk >= 128))


if __name__ == "__main__":
    main()
