"""A/B of ``topk.select_topk`` taking its k + 1 largest unordered (``topk._cut`` finds the one to
drop and the tie at the cut) against the ordered top-(k+1) it took at ``0e5df96`` (written out
below), in one process: each pair timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_unordered_cut.py N CAUSAL(0|1)
topk [REPEATS]``.
"""

from __future__ import annotations

import torch
from ab_timing import swap_main

from attnzoo.mechanisms import topk


def _ordered(scores: torch.Tensor, visible: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = scores if visible is None else scores.masked_fill(~visible, float("-inf"))
    if k < s.shape[-1]:
        top, idx = topk.largest(s, k + 1)
        values, idx, ambiguous = top[..., :k], idx[..., :k], top[..., k] == top[..., k - 1]
    else:
        values, idx = s.topk(k, dim=-1, sorted=False)
        ambiguous = torch.zeros(s.shape[:-1], dtype=torch.bool, device=s.device)
    valid = values != float("-inf")
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero(as_tuple=True)
        keep = topk.topk_mask(scores[rows], None if visible is None else visible.expand_as(scores)[rows], k)
        idx[rows], valid[rows] = topk.kept_indices(keep, k)
    return idx, valid


if __name__ == "__main__":
    swap_main(topk, "select_topk", _ordered)
