"""A/B of routing's nearest centroid as ``max(2).indices`` instead of ``argmax(2)``, in one process
(issue 12).

``routing`` assigns each query and key to its nearest centroid with an argmax over the cluster
dimension of ``(B, H, C, N)`` similarities, not the last one; on CPU ``argmax`` there ran 6-10x
slower than ``max(dim).indices``, which returns the same indices (``_ops.argmax_over``). The old
rule below is swapped into the three modules that call it; each pair is timed forward+backward
interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_argmax.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab
from torch import Tensor

from attnzoo.mechanisms import _ops, routing, routing_band, routing_tiles

MODULES = (routing, routing_band, routing_tiles)


def old_argmax(x: Tensor, dim: int) -> Tensor:
    return x.argmax(dim)


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    rules = {"old": old_argmax, "new": _ops.argmax_over}

    def use(rule: str) -> None:
        for module in MODULES:
            module.argmax_over = rules[rule]

    fwd_bwd_ab(n, causal, names, repeats, use)


if __name__ == "__main__":
    main()
