"""A/B of an additive bias (ALiBi) on stride-1 window plans: the tile path it ran on before (old)
against the structured path with the bias in the window mask (new, ``window_parts._with_bias``),
in one process; each pair timed forward+backward interleaved with dense SDPA's (no bias; B=1,
H=8, D=64, median of the repeats).

    python scripts/ab_window_bias.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from ab_timing import interleaved

import attnzoo
from attnzoo.backends import plan
from attnzoo.bench.monitor import release_mmap_threshold
from attnzoo.bench.speed import parse_mechanism

TAKES_BIAS = plan._takes_bias


def use(rule: str) -> None:
    plan._takes_bias = TAKES_BIAS if rule == "new" else (lambda structure, one_kv_head_each: False)


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(";")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    release_mmap_threshold()
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, n, 64)
    alibi = attnzoo.positional.ALiBi(8).score_mod(q, n)

    def timed(fn):
        start = time.perf_counter()
        fn().backward(grad)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    built = {text: attnzoo.build(name, **config) for text in names for name, config in [parse_mechanism(text)]}
    calls = {f"{text}+alibi": (lambda a=a: a(q, k, v, causal=causal, score_mod=alibi)) for text, a in built.items()}
    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    interleaved(calls, use, dense, timed, repeats, f"N={n} causal={causal} fwd+bwd")


if __name__ == "__main__":
    main()
