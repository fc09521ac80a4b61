"""A/B of LSH's shared-round count by two comparisons instead of a subtraction and a shift, in one
process (issue 12).

``lsh_chunks.shared_rounds`` counts, for each (query, key) pair of a round's chunks, the other
rounds where the two meet: their codes differ by 0 or 1. It took the difference of the codes as
a ``(c, 2c)`` int64 tensor per chunk and shifted it; now two comparisons of the small operands
write bools. ``old_shared_rounds`` below is the code before, swapped in per call; each pair is
timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats).
Usage: ``python scripts/ab_lsh_rounds.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ab_timing import swap_main
from torch import Tensor

from attnzoo.mechanisms import lsh_chunks


def old_shared_rounds(others: list, position: Tensor, chunk: int) -> Tensor:
    bh, chunks = position.shape[0], position.shape[1] // chunk
    found = torch.zeros(bh, chunks, chunk, 2 * chunk, dtype=torch.uint8, device=position.device)
    key_pos = lsh_chunks._windows(F.pad(position, (chunk, 0)), chunk).flatten(1)
    for o in others:
        code = o.code.flatten(0, 1)
        code_q = code.gather(1, position).view(bh, chunks, chunk, 1)
        code_k = code.gather(1, key_pos).view(bh, chunks, 1, 2 * chunk)
        found += torch.bitwise_right_shift(code_q - code_k, 1) == 0
    return found


if __name__ == "__main__":
    swap_main(lsh_chunks, "shared_rounds", old_shared_rounds)
