"""A/B of LSH's hashing, layout and two-round mask, in one process (issue 12).

Three changes to ``lsh``'s work outside the kernel: ``round_buckets`` hashes every round with
one product and reads ``argmax([xR; -xR])`` from the max and the min of ``xR`` (it was a product,
a ``cat`` and an ``argmax`` over a last dimension of 8 per round); ``layout`` sorts the buckets
with a stable sort (an ``argsort`` of ``bucket * N + position`` before); with two rounds,
``round_mask`` writes the mask in four float passes from the codes (``met_once``) where an int16
count and an int16 -> float add took more. The old rules are loaded from git ``cf13aed`` and
swapped in per call; each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_lsh_hashing.py N CAUSAL(0|1)
NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import ab_main, module_at
from torch import Tensor

from attnzoo.mechanisms import lsh, lsh_chunks

OLD = module_at("cf13aed", "src/attnzoo/mechanisms/lsh_chunks.py")
NEW = {name: getattr(lsh_chunks, name) for name in ("layout", "round_mask")}


def old_round_buckets(keys: Tensor, rotations: Tensor, real: Tensor) -> list[Tensor]:
    return [OLD.buckets(keys, rotation, real) for rotation in rotations]


def use(rule: str) -> None:
    lsh.round_buckets = old_round_buckets if rule == "old" else lsh_chunks.round_buckets
    for name, new in NEW.items():
        setattr(lsh_chunks, name, getattr(OLD, name) if rule == "old" else new)


if __name__ == "__main__":
    ab_main(use)
