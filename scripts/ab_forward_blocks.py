"""A/B of the band windows' block for a forward alone, in one process (issue 12).

A forward that no backward follows (``torch.no_grad()``, or inputs without ``requires_grad``)
takes its band windows' block from ``structured.choose_block(keys, train=False)``; before, it
took the training rule. Both plans are built once and swapped in per call (``plan._structure``
patched); each pair is timed interleaved with dense SDPA's forward (B=1, H=8, D=64, median of
the repeats). Usage: ``python scripts/ab_forward_blocks.py N CAUSAL(0|1) NAME[,NAME...]
[REPEATS]``; the name ``local256`` is ``local`` with ``left = right = 256``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from ab_timing import interleaved

import attnzoo
from attnzoo.backends import plan, structured


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    q, k, v = (torch.randn(1, 8, n, 64) for _ in range(3))

    def build(name: str):
        return attnzoo.build("local", left=256, right=256) if name == "local256" else attnzoo.build(name)

    mechanisms = {name: build(name) for name in names}
    plans: dict[tuple, structured.Structure | None] = {}
    rule = ["new"]

    def swapped(pattern, n_q, n_kv, heads, train):  # plan._structure, by rule
        train = rule[0] == "old"  # the training rule was the only one
        key = (pattern, n_q, n_kv, heads, train)
        if key not in plans:
            plans[key] = structured.structure(pattern, n_q, n_kv, heads, train=train)
        return plans[key]

    plan._structure = swapped

    def timed(fn) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        return time.perf_counter() - start

    def call(attn):
        return lambda: attn(q, k, v, causal=causal)

    calls = {name: call(attn) for name, attn in mechanisms.items()}
    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    interleaved(calls, lambda r: rule.__setitem__(0, r), dense, timed, repeats, f"N={n} causal={causal} forward")


if __name__ == "__main__":
    main()
