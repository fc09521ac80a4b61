"""A/B of LSH's shared-round count by two comparisons instead of a subtraction and a shift, in one
process (issue 12).

``lsh_chunks.shared_rounds`` counts, for each (query, key) pair of a round's chunks, the other
rounds where the two meet: their codes differ by 0 or 1. It took the difference of the codes as
a ``(c, 2c)`` int64 tensor per chunk and shifted it; then two comparisons of the small operands
wrote bools (``ab-lsh-rounds-cpu.txt``); since ``ab_lsh_int16.py`` the codes are narrowed to
int16 first, so "new" below is that code now. ``old_shared_rounds`` is the code before, swapped
in per call; each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64,
median of the repeats). Usage: ``python scripts/ab_lsh_rounds.py N CAUSAL(0|1) NAME[,NAME...]
[REPEATS]``.

The rule it swaps in for left the code at ``1d43ac5`` (``missed_rounds`` and ``discounted`` replaced
it): run it from a checkout of ``1d43ac5^``, where it ran when its A/B file was written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from ab_timing import swap_main
from torch import Tensor

from attnzoo.mechanisms import lsh_chunks


def code_pairs(others: list, position: Tensor, chunk: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Per other round, its codes at this round's queries ``(BH, chunks, c, 1)`` and at their
    window keys ``(BH, chunks, 1, 2c)``, in int64 (the A/B scripts' old rules)."""
    bh, chunks = position.shape[0], position.shape[1] // chunk
    key_pos = lsh_chunks._windows(F.pad(position, (chunk, 0)), chunk).flatten(1)
    for o in others:
        code = o.code.flatten(0, 1)
        code_q = code.gather(1, position).view(bh, chunks, chunk, 1)
        yield code_q, code.gather(1, key_pos).view(bh, chunks, 1, 2 * chunk)


def counted(meets: Callable[[Tensor, Tensor], Tensor]) -> Callable[[list, Tensor, int], Tensor]:
    """A ``shared_rounds`` that sums ``meets(code_q, code_k)`` over the other rounds, as uint8."""

    def shared_rounds(others: list, position: Tensor, chunk: int) -> Tensor:
        bh, chunks = position.shape[0], position.shape[1] // chunk
        found = torch.zeros(bh, chunks, chunk, 2 * chunk, dtype=torch.uint8, device=position.device)
        for code_q, code_k in code_pairs(others, position, chunk):
            found += meets(code_q, code_k)
        return found

    return shared_rounds


old_shared_rounds = counted(lambda q, k: torch.bitwise_right_shift(q - k, 1) == 0)


if __name__ == "__main__":
    swap_main(lsh_chunks, "shared_rounds", old_shared_rounds)
