"""A/B of the top-k selections through ``topk.largest`` (two stages: the k groups with the
largest maxima, then the k largest of their members) instead of one ``torch.topk`` over each
whole row, in one process (issue 12).

``largest`` serves ``select_topk`` (``topk``, ``dsa``, ``nsa``, ``moba``) and the k-th score of
``topk_keep`` (``sac``); ``topk_mask`` (the references' rule) used it too when
``benchmarks/ab-topk-largest-cpu.txt`` was made, and keeps ``torch.topk`` since. The old rule
is swapped in per call; each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_topk_largest.py N CAUSAL(0|1) topk[,sac,...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import swap_main
from torch import Tensor

from attnzoo.mechanisms import topk


def whole_rows(s: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The old rule: ``torch.topk`` over every row."""
    return s.topk(k, dim=-1)


if __name__ == "__main__":
    swap_main(topk, "largest", whole_rows)
