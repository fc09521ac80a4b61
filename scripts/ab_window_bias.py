"""A/B of an additive bias (ALiBi) on stride-1 window plans: the tile path it ran on before (old)
against the structured path with the bias in the window mask (new, ``window_parts._with_bias``),
in one process; each pair timed forward+backward interleaved with dense SDPA's (no bias; B=1,
H=8, D=64, median of the repeats).

    python scripts/ab_window_bias.py N CAUSAL(0|1) NAME[;NAME...] [REPEATS]
"""

from __future__ import annotations

from ab_timing import alibi_swap_main

from attnzoo.backends import plan

if __name__ == "__main__":
    alibi_swap_main(plan, "_takes_bias", lambda structure, one_kv_head_each: False)
