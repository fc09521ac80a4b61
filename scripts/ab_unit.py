"""A/B of unit normalisation with a written-out backward, in one process (issue 12).

``_ops.unit`` is ``F.normalize(x, dim=-1)`` with its backward as one function (``dx = r (g - y
<g, y>)``) where autograd ran a division's, a norm's, a clamp's and an expand's. The old rule
puts ``F.normalize`` back where ``rfa``'s Fourier features, ``lsh``'s keys and the delta rules'
q and k call ``unit``; each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_unit.py N CAUSAL(0|1)
NAME[,NAME...] [REPEATS]``; ``python scripts/ab_unit.py alone`` times the function by itself.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from ab_timing import ab_main

from attnzoo.mechanisms import delta, kernel_features, lsh
from attnzoo.mechanisms._ops import unit

MODULES = (kernel_features, lsh, delta)


def normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    return F.normalize(x, dim=-1, eps=eps)


def use(rule: str) -> None:
    for module in MODULES:
        module.unit = unit if rule == "new" else normalize


def alone() -> None:
    for shape in [(1, 1, 4096, 64), (1, 8, 1024, 64), (1, 8, 4096, 64)]:
        x, g = torch.randn(shape, requires_grad=True), torch.randn(shape)
        times: dict[str, list[float]] = {"F.normalize": [], "unit": []}
        for _ in range(40):
            for name, fn in (("F.normalize", normalize), ("unit", unit)):
                start = time.perf_counter()
                fn(x).backward(g)
                x.grad = None
                times[name].append(time.perf_counter() - start)
        medians = ", ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in times.items())
        print(f"{tuple(shape)} fwd+bwd, median of 40: {medians}")


if __name__ == "__main__":
    alone() if sys.argv[1:] == ["alone"] else ab_main(use)
