"""A/B of the gated scan's loops over unbound chunks, in one process (issue 12).

``_ops.scan_states`` / ``scan_grads`` loop over chunks; they indexed three tensors per chunk
(``x[:, :, c]``, a dispatch each), and now ``unbind`` them once and index Python lists. With the
causal kernel path in blocks of heads the loops run once per block: 1 008 steps per ``rfa``
fwd+bwd at 4K. ``old_states`` / ``old_grads`` below are the code before. Both are swapped in per
call (``kernel_chunks`` imports them); each pair is timed forward+backward, causal, interleaved
with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_scan_unbind.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import sys

import torch
from ab_timing import fwd_bwd_ab
from torch import Tensor

from attnzoo.mechanisms import _ops, kernel_chunks


def old_states(chunk_sums: Tensor, gates: Tensor, s0: Tensor) -> tuple[Tensor, Tensor]:
    states = torch.empty_like(chunk_sums)
    states[:, :, 0] = s0
    for c in range(chunk_sums.shape[2] - 1):
        torch.addcmul(chunk_sums[:, :, c], gates[:, :, c], states[:, :, c], out=states[:, :, c + 1])
    return states, torch.addcmul(chunk_sums[:, :, -1], gates[:, :, -1], states[:, :, -1])


def old_grads(grad_states: Tensor, grad_final: Tensor, gates: Tensor, states: Tensor) -> tuple[Tensor, ...]:
    d_sums = torch.empty_like(states)
    d_sums[:, :, -1] = grad_final
    for c in range(states.shape[2] - 1, 0, -1):
        torch.addcmul(grad_states[:, :, c], gates[:, :, c], d_sums[:, :, c], out=d_sums[:, :, c - 1])
    d_s0 = torch.addcmul(grad_states[:, :, 0], gates[:, :, 0], d_sums[:, :, 0])
    if gates.shape[-2] == 1:
        d_gates = d_sums.flatten(-2)[..., None, :] @ states.flatten(-2)[..., None]
    else:
        d_gates = (d_sums * states).sum(-1, keepdim=True)
    return d_sums, d_gates, d_s0


def main() -> None:
    n, names = int(sys.argv[1]), sys.argv[2].split(",")
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    rules = {"old": (old_states, old_grads), "new": (_ops.scan_states, _ops.scan_grads)}

    def use(rule: str) -> None:
        kernel_chunks.scan_states, kernel_chunks.scan_grads = rules[rule]

    fwd_bwd_ab(n, True, names, repeats, use)


if __name__ == "__main__":
    main()
