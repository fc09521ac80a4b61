"""A/B of Performer's and ``efficient``'s features through ``_ops.floored_exp_`` instead of ``exp``,
in one process (issue 12).

torch's elementwise ``exp`` on CPU leaves its vector path for exponents below about -87 in float32
and returns denormals there, which slow every matrix product they enter. Performer's features
``exp(w^T x - |x|^2 / 2 - shift)`` reach such exponents when queries or keys are large (a trained
model's, or here unit-variance queries and keys times 10), as do ``efficient``'s key features
``exp(k - max)``: ``floored_exp_`` flushes them to 0 after one reduction has found them, and is
plain ``exp_`` otherwise. The old rule (``exp_``) is swapped in per call; each pair is timed
forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats), for
``performer`` and ``efficient`` and for both fed ``10 q``, ``10 k`` (``-x10``). Usage: ``python
scripts/ab_floored_exp.py N CAUSAL(0|1) [REPEATS]`` (``efficient`` only where not causal).
"""

from __future__ import annotations

import sys

import torch
from ab_timing import fwd_bwd_ab

import attnzoo
from attnzoo.mechanisms import kernel_linear, kernel_performer

MODULES = (kernel_performer, kernel_linear)


RULES = {"old": lambda x: x.exp_(), "new": kernel_performer.floored_exp_}


class LargeInputs(torch.nn.Module):
    """``attn`` fed ``10 q``, ``10 k``: exponents spread past float32's smallest normal."""

    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        return self.attn(q * 10, k * 10, v, **kw)


def main() -> None:
    n, causal = int(sys.argv[1]), sys.argv[2] == "1"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    names = ["performer"] if causal else ["performer", "efficient"]
    built = {f"{name}-x10": LargeInputs(attnzoo.build(name)) for name in names}

    def use(rule: str) -> None:
        for module in MODULES:
            module.floored_exp_ = RULES[rule]

    fwd_bwd_ab(n, causal, names, repeats, use, built)


if __name__ == "__main__":
    main()
