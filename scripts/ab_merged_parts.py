"""A/B of the structured path's merged parts combined by ``call.merge_by_lse``, in one process
(issue 12).

``windowed._MergedAttention`` (``axial``: its row windows and its de-interleaved columns)
combined its parts by stacking their log-sum-exps and summing each output times its share; it
now accumulates the shares in place (``merge_by_lse``, shared with ``lsh``). The old class is
loaded from git ``748e1ec`` and swapped in per call; each pair is timed forward+backward
interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_merged_parts.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import module_at, swap_main

from attnzoo.backends import windowed

if __name__ == "__main__":
    old = module_at("748e1ec", "src/attnzoo/backends/windowed.py")._MergedAttention
    swap_main(windowed, "_MergedAttention", old)
