"""What an additive ``score_mod`` (ALiBi) costs each mechanism that takes one: fwd+bwd time with
and without it, and dense SDPA's (no bias) in the same process, interleaved; B=1, H=8, D=64, each
mechanism at its default config (``graph`` is skipped: its default is defined on 2 positions).

    python scripts/score_mod_cost.py N [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench.monitor import release_mmap_threshold


def main() -> None:
    n = int(sys.argv[1])
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    release_mmap_threshold()
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, n, 64)
    alibi = attnzoo.positional.ALiBi(8).score_mod(q, n)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn().backward(grad)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v)

    print(f"N={n}, fwd+bwd medians of {repeats} (after one warm-up each), ms")
    for name in attnzoo.names(score_mod=True):
        if name == "graph":
            continue
        attn = attnzoo.build(name)
        calls = {"alibi": lambda a=attn: a(q, k, v, score_mod=alibi), "plain": lambda a=attn: a(q, k, v), "sdpa": sdpa}
        times = {key: [] for key in calls}
        for _ in range(repeats + 1):
            for key, fn in calls.items():
                times[key].append(timed(fn))
        ms = {key: statistics.median(ts[1:]) * 1e3 for key, ts in times.items()}
        print(
            f"{name:28s} +alibi {ms['alibi']:8.1f}  plain {ms['plain']:8.1f}  ({ms['alibi'] / ms['plain']:5.1f}x)  "
            f"SDPA {ms['sdpa']:7.1f}  +alibi vs SDPA {ms['sdpa'] / ms['alibi']:5.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
