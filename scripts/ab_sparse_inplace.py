"""A/B of ``SparseRowsAttention``'s CSR products written in place (``addmm_`` into the output and
gradient slices, the scale as ``alpha``) against the old ones (a product, then a copy into the
slice, a multiplication by the scale and an addition in passes of their own), in one process.

The old class (``sparse_rows.py`` at ``OLD_REV``, loaded by ``ab_timing.module_at``) is swapped
in per call; each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64,
median of the repeats). Usage: ``python
scripts/ab_sparse_inplace.py N CAUSAL(0|1) random[,logsparse,topk] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import ab_main, module_at

from attnzoo.backends import gathered
from attnzoo.backends import sparse_rows as S
from attnzoo.mechanisms import selected

#: The revision before the change (``a177e64``): its ``SparseRowsAttention`` is the old rule.
OLD_REV = "b4fe74c"

if __name__ == "__main__":
    rules = {
        "old": module_at(OLD_REV, "src/attnzoo/backends/sparse_rows.py").SparseRowsAttention,
        "new": S.SparseRowsAttention,
    }

    def use(rule: str) -> None:  # where the class is used: the gathered path and topk's / dsa's
        gathered.SparseRowsAttention = selected.SparseRowsAttention = rules[rule]

    ab_main(use)
