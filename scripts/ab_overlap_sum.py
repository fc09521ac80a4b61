"""A/B of window key gradients summed into the real keys' blocks only, in one process (issue 12).

A window part's backward adds each window's key (and value) gradients back into the keys
(``window_parts._OverlapSum``). Where the keys' front padding is whole blocks it now keeps only
the real keys' blocks and returns that buffer itself (contiguous when the block divides N),
where it kept the padded keys' blocks and returned a slice, which autograd copied again. The old
class is loaded from git ``d0cac9c`` and swapped in per call; each pair is timed forward+backward
interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_overlap_sum.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import module_at, swap_main

from attnzoo.backends import window_parts

if __name__ == "__main__":
    old = module_at("d0cac9c", "src/attnzoo/backends/window_parts.py")._OverlapSum
    swap_main(window_parts, "_OverlapSum", old)
