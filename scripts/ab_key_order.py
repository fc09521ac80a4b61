"""A/B of ``sparse_rows.key_order`` (one stable radix sort of flat int32 keys) against the
row-wise int64 ``torch.sort(col, dim=-1, stable=True)`` it replaced, in one process: each pair
timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats).
Usage: ``python scripts/ab_key_order.py N CAUSAL(0|1) topk[,dsa] [REPEATS]``.
"""

from __future__ import annotations

import torch
from ab_timing import swap_main

from attnzoo.backends import sparse_rows


def _row_wise(col: torch.Tensor, n: int) -> torch.Tensor:
    return torch.sort(col, dim=-1, stable=True).indices


if __name__ == "__main__":
    swap_main(sparse_rows, "key_order", _row_wise)
