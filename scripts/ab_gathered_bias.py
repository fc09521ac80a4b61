"""A/B of an additive bias (ALiBi) on patterns that name their keys row by row (``random``,
``logsparse``) or by query group (``block2d``): the tile path it ran on before (old) against the
gathered path with the bias added at each listed pair (``sparse_rows.pair_bias``) or the key-sets
path with it in each group's mask (``key_sets._bias_values``) (new), in one process; each pair
timed forward+backward interleaved with dense SDPA's (no bias; B=1, H=8, D=64, median of the
repeats). Old: both paths' reasons (``call.plain_softmax_reasons``) refuse every score_mod.

    python scripts/ab_gathered_bias.py N CAUSAL(0|1) NAME[;NAME...] [REPEATS]
"""

from __future__ import annotations

import sys

from ab_timing import alibi_ab

import attnzoo
from attnzoo.backends import call
from attnzoo.bench.speed import parse_mechanism

PLAIN_BIAS = call.plain_bias


def use(rule: str) -> None:
    call.plain_bias = PLAIN_BIAS if rule == "new" else (lambda score_mod, device: None)


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(";")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    built = {text: attnzoo.build(name, **config) for text in names for name, config in [parse_mechanism(text)]}
    alibi_ab(n, causal, built, repeats, use)


if __name__ == "__main__":
    main()
