"""A/B of the chunk gates' gradient as an einsum instead of a degenerate bmm, in one process
(issue 12).

``_ops.scan_grads`` takes the gradient of one gate per chunk as the dot product of two
``(m, E)`` states. It was a ``(1, m E) @ (m E, 1)`` ``bmm`` per chunk, which the CPU profile of
causal ``rfa`` at 4K showed at 11.7 ms per fwd+bwd for 17 MFLOP; now ``einsum``. ``old_gate_grads``
below is the code before, swapped in per call (``_ops.gate_grads``); each pair is timed
forward+backward, causal, interleaved with dense SDPA's (B=1, H=8, D=64, median of the
repeats). Usage: ``python scripts/ab_gate_dot.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab
from torch import Tensor

from attnzoo.mechanisms import _ops


def old_gate_grads(d_sums: Tensor, states: Tensor, per_chunk: bool) -> Tensor:
    if per_chunk:
        return d_sums.flatten(-2)[..., None, :] @ states.flatten(-2)[..., None]
    return (d_sums * states).sum(-1, keepdim=True)


def main() -> None:
    n, names = int(sys.argv[1]), sys.argv[2].split(",")
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    rules = {"old": old_gate_grads, "new": _ops.gate_grads}

    def use(rule: str) -> None:
        _ops.gate_grads = rules[rule]

    fwd_bwd_ab(n, True, names, repeats, use)


if __name__ == "__main__":
    main()
