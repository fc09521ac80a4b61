"""Grouped-query K/V attended natively vs repeated per query head, forward + backward, timed
interleaved in one run (native, repeated, native, ... after one warm-up each).

    python scripts/ab_gqa.py [N=4096] [rounds=5]

"repeated" is what a mechanism without ``Capabilities.gqa`` gets: K/V repeated to H heads
(``repeat_interleave``, inside the timed region, as ``Attention.forward`` does) and attended at H
heads. B = 1, H = 8, H_kv = 2, D = 64, float32, causal; ``linear`` (chunkwise) and ``local``
(left = right = 64; causal: 64 keys back, the blocked backend's band windows). Prints per
mechanism the native median, the repeated median and the median of the pairwise ratios
repeated / native (> 1: native faster).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import attnzoo

B, H, H_KV, D = 1, 8, 2, 64


def _clock(fn, inputs: tuple[torch.Tensor, ...]) -> float:  # noqa: ANN001
    for x in inputs:
        x.grad = None
    start = time.perf_counter()
    fn().sum().backward()
    return time.perf_counter() - start


def main(n: int = 4096, rounds: int = 5) -> None:
    torch.manual_seed(0)
    q = torch.randn(B, H, n, D, requires_grad=True)
    k, v = (torch.randn(B, H_KV, n, D, requires_grad=True) for _ in range(2))
    groups = H // H_KV
    print(f"B={B} H={H} H_kv={H_KV} D={D} N={n} float32 causal, fwd+bwd, {rounds} rounds, torch {torch.__version__}")
    for name in ("linear", "local"):
        attn = attnzoo.build(name)
        paths = {
            "native": lambda attn=attn: attn(q, k, v, causal=True),
            "repeated": lambda attn=attn: attn(
                q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), causal=True
            ),
        }
        for fn in paths.values():
            _clock(fn, (q, k, v))  # warm-up (plans, allocator)
        times: dict[str, list[float]] = {key: [] for key in paths}
        for _ in range(rounds):
            for key, fn in paths.items():
                times[key].append(_clock(fn, (q, k, v)))
        ratios = [r / a for a, r in zip(times["native"], times["repeated"])]
        native, repeated = statistics.median(times["native"]), statistics.median(times["repeated"])
        print(
            f"{name:8s} native {native * 1e3:8.1f} ms  repeated {repeated * 1e3:8.1f} ms  "
            f"repeated/native median {statistics.median(ratios):.2f} (pairs {', '.join(f'{r:.2f}' for r in ratios)})"
        )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
