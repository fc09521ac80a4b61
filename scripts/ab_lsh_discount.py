"""A/B of LSH's ``log N_ij`` discount with two rounds as ``ln 2`` times the shared count, in one
process (issue 12).

``lsh_chunks.discount`` subtracts ``log N_ij`` from the additive mask of each round's chunks
(``N_ij``: the rounds in which a key meets a query). With the default two rounds ``N_ij - 1`` is
0 or 1, so the discount is ``ln 2`` times it, subtracted in one pass; ``old_discount`` below (a
float copy, then ``log1p``) is the code before, swapped in per call; each pair is timed
forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage:
``python scripts/ab_lsh_discount.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.

The rule it swaps in for left the code at ``1d43ac5`` (``missed_rounds`` and ``discounted`` replaced
it): run it from a checkout of ``1d43ac5^``, where it ran when its A/B file was written.
"""

from __future__ import annotations

import torch
from ab_timing import swap_main
from torch import Tensor

from attnzoo.mechanisms import lsh_chunks


def old_discount(mask: Tensor, shared: Tensor, others: int) -> None:
    mask -= torch.log1p(shared.to(mask.dtype))


if __name__ == "__main__":
    swap_main(lsh_chunks, "discount", old_discount)
