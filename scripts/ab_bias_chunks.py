"""A/B of ALiBi (an additive bias, ``score_mods.bias_mod``) on the ``softmax`` mechanism: the dense
reference it ran on before (old) against ``score_chunks.softmax_chunks`` (new), and the same for
``softcap`` with ALiBi under its cap (old: the checkpointed reference chunks). Each pair is timed
forward+backward interleaved with dense SDPA's (without the bias; B=1, H=8, D=64, median of the
repeats), in one process.

    python scripts/ab_bias_chunks.py N CAUSAL(0|1) [REPEATS]
"""

from __future__ import annotations

import sys

from ab_timing import alibi_ab

import attnzoo
from attnzoo.mechanisms import softmax_variants as sv
from attnzoo.mechanisms.softmax import SoftmaxAttention

CHUNKS = SoftmaxAttention._bias_chunks
PLAIN_BIAS = sv.plain_bias


def use(rule: str) -> None:
    """old: no bias is plain, so both mechanisms take their general paths."""
    SoftmaxAttention._bias_chunks = CHUNKS if rule == "new" else (lambda self, q, k, v, args: None)
    sv.plain_bias = PLAIN_BIAS if rule == "new" else (lambda score_mod, device: None)


def main() -> None:
    n, causal = int(sys.argv[1]), sys.argv[2] == "1"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    alibi_ab(n, causal, {name: attnzoo.build(name) for name in ("softmax", "softcap")}, repeats, use)


if __name__ == "__main__":
    main()
