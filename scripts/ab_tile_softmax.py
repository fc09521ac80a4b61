"""A/B of the tile path's einsum pieces (a ``score_mod``, dropout) with ALiBi: ``blocked`` as it
was at git ``05a25b8`` (``logsumexp`` and ``exp`` over ``-inf`` and far pairs, autograd through
an additive bias in backward) against the current one (``_softmax_lse``, ``flushed_exp_``, no
autograd for a ``bias_mod``), in one process: each pair timed forward+backward interleaved with
dense SDPA's (no bias; B=1, H=8, D=64, median of the repeats).

    python scripts/ab_tile_softmax.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]
"""

from __future__ import annotations

import sys

from ab_timing import alibi_ab, module_at

import attnzoo
from attnzoo.backends import blocked

OLD = module_at("05a25b8", "src/attnzoo/backends/blocked.py")
NEW = {"piece_forward": blocked.piece_forward, "piece_backward": blocked.piece_backward}


def use(rule: str) -> None:
    for name, fn in NEW.items():
        setattr(blocked, name, fn if rule == "new" else getattr(OLD, name))


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    alibi_ab(n, causal, {name: attnzoo.build(name) for name in names}, repeats, use)


if __name__ == "__main__":
    main()
