"""A/B of the CSR structures' index tensors in int32 (``sparse_rows.csr_index_dtype``, new) against
int64 (old), in one process: given int64, torch's CPU ``addmm`` converts the column indices to int32
on every call and ``sampled_addmm`` copies them twice more. Forward+backward interleaved with dense
SDPA's (B=1, H=8, D=64, medians); the gathered path's cached row plans are kept apart per rule.
Usage: ``python scripts/ab_csr_int32.py N CAUSAL NAME[,NAME...] [REPEATS]`` (``cd scripts;
PYTHONPATH=../src``).
"""

from __future__ import annotations

import sys

import torch
from ab_timing import fwd_bwd_ab, split_names

from attnzoo.backends import gathered, sparse_rows
from attnzoo.backends.call import PlanCache

RULES = {"old": lambda m, n, nnz: torch.int64, "new": sparse_rows.csr_index_dtype}
TABLES = {rule: PlanCache(maxsize=32) for rule in RULES}


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", split_names(sys.argv[3])
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5

    def use(rule: str) -> None:
        sparse_rows.csr_index_dtype = RULES[rule]
        gathered.TABLES = TABLES[rule]

    fwd_bwd_ab(n, causal, names, repeats, use)


if __name__ == "__main__":
    main()
