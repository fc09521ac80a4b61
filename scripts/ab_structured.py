"""Before/after of the blocked backend's structured path: dense SDPA, the structured path and the
generic tile plan, timed interleaved in one run (rounds of SDPA, structured, tiles after one
warm-up each), forward and forward+backward, for ``sliding_window(left, right)``.

    python scripts/ab_structured.py 64,64:1024,4096 64,0:1024,4096 256,256:16384

Prints one line per (window, causal, N, pass): SDPA's median time and the median of the pairwise
ratios SDPA / path for both paths, beside the density bound.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from attnzoo import patterns as P
from attnzoo.backends import blocked, plan, windowed
from attnzoo.backends.call import Call
from attnzoo.bench.speed import machine
from attnzoo.bench.train import git_revision


def _paths(pattern: P.Pattern, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> dict:
    full = pattern & P.causal() if causal else pattern
    call = Call(q, k, v, full, None, None, q.shape[-1] ** -0.5, 128)
    structure, tile_plan = plan.structure_for(call), plan.plan_for(call)
    assert structure is not None
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "structured": lambda: windowed.structured_attention(call, structure),
        "tiles": lambda: blocked.blocked_attention(call, tile_plan),
    }


def _clock(fn, backward: bool, inputs: tuple) -> float:
    for x in inputs:
        x.grad = None
    start = time.perf_counter()
    if backward:
        fn().sum().backward()
    else:
        with torch.no_grad():
            fn()
    return time.perf_counter() - start


def main(specs: list[str]) -> None:
    meta = machine()
    print(f"python scripts/ab_structured.py {' '.join(specs)}")
    print(
        f"git {git_revision()}, {meta['processor']} ({meta['cpus']} cores), torch {meta['torch']}, {meta['date']}; "
        "B=1, H=8, D=64, fp32"
    )
    for spec in specs:
        window, sizes = spec.split(":")
        left, right = map(int, window.split(","))
        for n in map(int, sizes.split(",")):
            rounds = 3 if n > 8192 else 5
            for causal in (True,) if right == 0 else (False,):
                pattern = P.sliding_window(left, right)
                bound = 1 / (pattern & P.causal() if causal else pattern).density(n) * (0.5 + 0.5 / n if causal else 1)
                inputs = tuple(torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
                paths = _paths(pattern, *inputs, causal)
                for backward in (False, True):
                    times = {name: [] for name in paths}
                    for fn in paths.values():
                        _clock(fn, backward, inputs)  # warm-up
                    for _ in range(rounds):
                        for name, fn in paths.items():
                            times[name].append(_clock(fn, backward, inputs))
                    ratio = {
                        name: statistics.median(a / b for a, b in zip(times["sdpa"], times[name]))
                        for name in ("structured", "tiles")
                    }
                    print(
                        f"sliding_window({left},{right}) causal={causal} N={n} {'fwd+bwd' if backward else 'fwd'}: "
                        f"SDPA {1e3 * statistics.median(times['sdpa']):.0f} ms; structured {ratio['structured']:.2f}x, "
                        f"tiles {ratio['tiles']:.2f}x (density bound {bound:.1f}x)",
                        flush=True,
                    )


if __name__ == "__main__":
    main(sys.argv[1:])
