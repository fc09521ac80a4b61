"""A/B of an additive bias (ALiBi) on patterns that name their keys row by row (``random``,
``logsparse``) or by query group (``block2d``): the tile path it ran on before (old) against the
gathered path with the bias added at each listed pair (``sparse_rows.pair_bias``) or the key-sets
path with it in each group's mask (``key_sets._bias_values``) (new), in one process; each pair
timed forward+backward interleaved with dense SDPA's (no bias; B=1, H=8, D=64, median of the
repeats). Old: both paths' reasons (``call.plain_softmax_reasons``) refuse every score_mod.

    python scripts/ab_gathered_bias.py N CAUSAL(0|1) NAME[;NAME...] [REPEATS]
"""

from __future__ import annotations

from ab_timing import alibi_swap_main

from attnzoo.backends import call

if __name__ == "__main__":
    alibi_swap_main(call, "plain_bias", lambda score_mod, device: None)
