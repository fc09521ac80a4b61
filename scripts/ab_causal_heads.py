"""A/B of the causal kernel path in blocks of heads, in one process (issue 12).

``kernel.kernel_attention`` now runs its causal path on blocks of K/V heads whose key features
take at most ``CAUSAL_BLOCK_BYTES`` (4 MiB); before, all heads at once (``rfa``'s features are
32 MiB at N = 4096, H = 8: fresh mappings, page-faulted on every call). Both settings are
swapped in per call; each pair is timed forward+backward, causal, interleaved with dense SDPA's
causal forward+backward (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_causal_heads.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from ab_timing import interleaved

import attnzoo
from attnzoo.mechanisms import kernel


def main() -> None:
    n, names = int(sys.argv[1]), sys.argv[2].split(",")
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, n, 64)
    mechanisms = {name: attnzoo.build(name) for name in names}
    rules = {"old": 2**62, "new": kernel.CAUSAL_BLOCK_BYTES}

    def use(rule: str) -> None:
        kernel.CAUSAL_BLOCK_BYTES = rules[rule]

    def timed(fn) -> float:
        start = time.perf_counter()
        fn().backward(grad)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    calls = {name: (lambda attn=attn: attn(q, k, v, causal=True)) for name, attn in mechanisms.items()}
    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    interleaved(calls, use, dense, timed, repeats, f"N={n} causal fwd+bwd")


if __name__ == "__main__":
    main()
