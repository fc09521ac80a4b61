"""A/B of LSH's merge of its rounds accumulated in place, in one process (issue 12).

``lsh_chunks`` combines the rounds' outputs by their log-sum-exps (``_merge`` then,
``backends.call.merge_by_lse`` since). It now scales the first round's output by its share and
adds the others' with ``addcmul_``; the code before
(loaded from git ``5f1f87d``, swapped in per call) stacked the rounds' outputs and log-sum-exps
and summed the products. Each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_lsh_merge.py N CAUSAL(0|1)
NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import module_at, swap_main

from attnzoo.mechanisms import lsh_chunks

if __name__ == "__main__":
    swap_main(lsh_chunks, "merge_by_lse", module_at("5f1f87d", "src/attnzoo/mechanisms/lsh_chunks.py")._merge)
