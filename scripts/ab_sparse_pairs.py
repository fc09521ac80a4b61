"""A/B of ``sparse_rows``' per-pair gathers in ``SparseRowsAttention``'s backward
(``per_pair``: a row value repeated k times where every row keeps k slots; ``by_key``:
``take``) against the old ones (``x[r.rows]``, ``values[r.perm]``), in one process: each pair
timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats).
Usage: ``python scripts/ab_sparse_pairs.py N CAUSAL(0|1) random[,logsparse] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import ab_main
from torch import Tensor

from attnzoo.backends import sparse_rows as S


def _old_per_pair(x: Tensor, r: S.SparseRows) -> Tensor:
    return x[r.rows]


def _old_by_key(values: Tensor, r: S.SparseRows) -> Tensor:
    return values[r.perm]


if __name__ == "__main__":
    rules = {"old": (_old_per_pair, _old_by_key), "new": (S.per_pair, S.by_key)}

    def use(rule: str) -> None:
        S.per_pair, S.by_key = rules[rule]

    ab_main(use)
