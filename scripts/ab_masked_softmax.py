"""A/B of ``_ops.masked_softmax`` against the reference's ``normalize_scores`` in the fast paths of
``hierarchical`` and ``sac``, in one process (issue 12).

``normalize_scores`` makes two masked copies of the score tile and multiplies it by the rows'
has-a-key flag, and autograd runs each of those passes again backward; ``masked_softmax`` is one
autograd function with one masked copy forward and one masked softmax backward. The old rule
below is swapped into both modules; each pair is timed forward+backward interleaved with dense
SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python scripts/ab_masked_softmax.py N
CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab
from torch import Tensor

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms import _ops, hierarchical, sac


def old_masked_softmax(scores: Tensor, visible: Tensor) -> Tensor:
    return normalize_scores(scores, visible, "softmax")


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    rules = {"old": old_masked_softmax, "new": _ops.masked_softmax}

    def use(rule: str) -> None:
        hierarchical.masked_softmax = sac.masked_softmax = rules[rule]

    fwd_bwd_ab(n, causal, names, repeats, use)


if __name__ == "__main__":
    main()
