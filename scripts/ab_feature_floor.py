"""A/B of Performer's feature floor (issue 12's "large inputs"), in one process. New: features below
``eps^2`` of their stabiliser's maximum are 0 (``_ops.feature_floor``), so are the ratios below
``eps^2`` that merge non-causal blocks' sums (``kernel._merge``), and the sums' entries below
``tiny / eps^3`` after merging or, causal, in the states where a feature was flushed
(``_ops.flush_tiny_``). Old: the floor at float32's smallest normal (``_ops.exp_floor``) and the
sums kept as they are.

Queries and keys of a trained model can be several times larger than unit variance; Performer's
features ``exp(w^T x - |x|^2 / 2 - shift)`` then spread over exponents far below 0, and the
products after them (``phi(q) S``, the states, the gradients through them) land in the denormal
range, where a CPU product runs many times slower. Each mechanism is ``performer`` fed ``s q``,
``s k`` (``-xS``), timed forward+backward interleaved with dense SDPA's on unit-variance inputs
(B=1, H=8, D=64, medians). Usage: ``python scripts/ab_feature_floor.py N CAUSAL(0|1) [REPEATS]``
(``cd scripts; PYTHONPATH=../src``).
"""

from __future__ import annotations

import sys

import torch
from ab_timing import fwd_bwd_ab

import attnzoo
from attnzoo.mechanisms import _ops, kernel, kernel_chunks, kernel_performer

#: rule -> (the feature and merge floor, the sums' flush)
RULES = {"old": (_ops.exp_floor, lambda sums: sums), "new": (_ops.feature_floor, _ops.flush_tiny_)}
SCALES = (1, 3, 5, 10, 20)


class Scaled(torch.nn.Module):
    """``attn`` fed ``scale q``, ``scale k``."""

    def __init__(self, attn: torch.nn.Module, scale: float) -> None:
        super().__init__()
        self.attn, self.scale = attn, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        return self.attn(q * self.scale, k * self.scale, v, **kw)


def main() -> None:
    n, causal = int(sys.argv[1]), sys.argv[2] == "1"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    built = {f"performer-x{s}": Scaled(attnzoo.build("performer", seed=0), s) for s in SCALES}

    def use(rule: str) -> None:
        floor, flush = RULES[rule]
        kernel_performer.feature_floor = kernel.feature_floor = floor
        kernel_chunks.flush_tiny_ = kernel.flush_tiny_ = flush

    fwd_bwd_ab(n, causal, [], repeats, use, built)


if __name__ == "__main__":
    main()
