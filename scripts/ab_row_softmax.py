"""A/B of the CSR path's row softmax by ``torch.softmax`` instead of ``logsumexp`` and ``exp``, in
one process (issue 12).

``sparse_rows._row_softmax`` turns each (b, h)'s pair scores into weights. It took each row's
``logsumexp`` and ``exp(scores - lse)``; torch's elementwise ``exp`` (and ``logsumexp``, built on
it) leaves its vector path on -inf (unused slots, padded keys) and on exponents below -87
(``_ops.exp_floor``), ``torch.softmax`` does not. The old ``_row_softmax`` is loaded from git
``5f676fe`` and swapped in per call; each pair is timed forward+backward interleaved with dense
SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python scripts/ab_row_softmax.py N
CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import module_at, swap_main

from attnzoo.backends import sparse_rows

if __name__ == "__main__":
    swap_main(sparse_rows, "_row_softmax", module_at("5f676fe", "src/attnzoo/backends/sparse_rows.py")._row_softmax)
