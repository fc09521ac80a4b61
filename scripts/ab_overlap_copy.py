"""A/B of window key gradients copied in, then added, in one process (issue 12).

A window part's backward sums overlapping windows' key (and value) gradients into the keys
(``window_parts._OverlapSum``). It zero-filled the keys' gradient and added every window part
into it; now each window's last part, which lands on a block no earlier window reached, is
copied there and the other parts added after it, so only the blocks no last part reaches are
zero-filled. The old class is loaded from git ``1d43ac5`` and swapped in per call; each pair is
timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats).
Usage: ``python scripts/ab_overlap_copy.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import module_at, swap_main

from attnzoo.backends import window_parts

if __name__ == "__main__":
    swap_main(window_parts, "_OverlapSum", module_at("1d43ac5", "src/attnzoo/backends/window_parts.py")._OverlapSum)
