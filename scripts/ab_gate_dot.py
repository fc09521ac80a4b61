"""A/B of the chunk gates' gradient as an einsum instead of a degenerate bmm, in one process
(issue 12).

``_ops.scan_grads`` takes the gradient of one gate per chunk as the dot product of two
``(m, E)`` states. It was a ``(1, m E) @ (m E, 1)`` ``bmm`` per chunk, which the CPU profile of
causal ``rfa`` at 4K showed at 11.7 ms per fwd+bwd for 17 MFLOP; now ``einsum``. ``old_grads``
below is the code before, swapped in per call (``kernel_chunks`` imports it); each pair is timed
forward+backward, causal, interleaved with dense SDPA's (B=1, H=8, D=64, median of the
repeats). Usage: ``python scripts/ab_gate_dot.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import sys

import torch
from ab_timing import fwd_bwd_ab
from torch import Tensor

from attnzoo.mechanisms import _ops, kernel_chunks


def old_grads(grad_states: Tensor, grad_final: Tensor, gates: Tensor, states: Tensor) -> tuple[Tensor, ...]:
    d_sums = torch.empty_like(states)
    d_sums[:, :, -1] = grad_final
    grads, gate, d = grad_states.unbind(2), gates.unbind(2), d_sums.unbind(2)
    for c in range(len(d) - 1, 0, -1):
        torch.addcmul(grads[c], gate[c], d[c], out=d[c - 1])
    d_s0 = torch.addcmul(grads[0], gate[0], d[0])
    if gates.shape[-2] == 1:
        d_gates = d_sums.flatten(-2)[..., None, :] @ states.flatten(-2)[..., None]
    else:
        d_gates = (d_sums * states).sum(-1, keepdim=True)
    return d_sums, d_gates, d_s0


def main() -> None:
    n, names = int(sys.argv[1]), sys.argv[2].split(",")
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    rules = {"old": old_grads, "new": _ops.scan_grads}

    def use(rule: str) -> None:
        kernel_chunks.scan_grads = rules[rule]

    fwd_bwd_ab(n, True, names, repeats, use)


if __name__ == "__main__":
    main()
