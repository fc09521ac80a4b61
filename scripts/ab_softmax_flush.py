"""A/B of ``_ops.masked_softmax`` with its weights below ``eps^4`` set to 0 (new) against kept (old),
in one process: peaky scores (a trained model's large q, k) leave denormal weights, and the
products after them (``P V``, ``dS K``, ``dS^T Q``) slow down many times on a CPU. The fast paths
of ``hierarchical`` and ``sac`` run it; each is fed ``s q``, ``s k`` (``-xS``) and timed
forward+backward interleaved with dense SDPA's on unit-variance inputs (B=1, H=8, D=64, medians).
Usage: ``python scripts/ab_softmax_flush.py N CAUSAL(0|1) [REPEATS]`` (``cd scripts; PYTHONPATH=../src``).
"""

from __future__ import annotations

import sys

from ab_feature_floor import Scaled
from ab_timing import fwd_bwd_ab

import attnzoo
from attnzoo.mechanisms import _ops

RULES = {"old": lambda weights: weights, "new": _ops.flush_small_weights_}


def main() -> None:
    n, causal = int(sys.argv[1]), sys.argv[2] == "1"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    built = {f"{name}-x{s}": Scaled(attnzoo.build(name), s) for name in ("hierarchical", "sac") for s in (1, 10)}

    def use(rule: str) -> None:
        _ops.flush_small_weights_ = RULES[rule]

    fwd_bwd_ab(n, causal, [], repeats, use, built)


if __name__ == "__main__":
    main()
