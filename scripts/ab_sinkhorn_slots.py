"""``sinkhorn`` at its default config, before and after its slots went through SDPA, against
dense SDPA, forward+backward, interleaved in one run (SDPA, before, after, ...).

    python scripts/ab_sinkhorn_slots.py

"Before" is the explicit path ``sinkhorn_attention`` still takes with ``return_weights=True``
(scores, a masked softmax, weights @ v); "after" the SDPA call per query block. B = 1, H = 8,
D = 64, fp32, non-causal; N = 1024, 4096, 8192. The density bound is N / (2 block): each query
sees its own block and one sorted block.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.mechanisms import sinkhorn as sk

AFTER = sk.sinkhorn_attention


def before(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    return AFTER(*args, **kwargs, return_weights=True)[0]


def _clock(fn: Callable, inputs: tuple[torch.Tensor, ...]) -> float:
    x = [t.clone().requires_grad_() for t in inputs]
    start = time.perf_counter()
    out = fn(*x)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def _path(attn: torch.nn.Module, fn: Callable) -> Callable:
    def run(*x: torch.Tensor) -> torch.Tensor:
        sk.sinkhorn_attention = fn
        return attn(*x)

    return run


def main() -> None:
    torch.manual_seed(0)
    print(f"# python scripts/ab_sinkhorn_slots.py; torch {torch.__version__}, {torch.get_num_threads()} threads")
    for n, repeats in ((1024, 7), (4096, 5), (8192, 3)):
        attn = attnzoo.build("sinkhorn").eval()
        inputs = tuple(torch.randn(1, 8, n, 64) for _ in range(3))

        variants = (F.scaled_dot_product_attention, _path(attn, before), _path(attn, AFTER))
        for fn in variants:
            _clock(fn, inputs)  # warm-up
        rows = [[_clock(fn, inputs) for fn in variants] for _ in range(repeats)]
        old = statistics.median(s / b for s, b, _ in rows)
        new = statistics.median(s / a for s, _, a in rows)
        block = attn.config.block
        bound = n / (2 * block)
        print(f"N={n} block={block} fwd+bwd x SDPA: before {old:.2f}  after {new:.2f}  (density bound {bound:.0f})")
    sk.sinkhorn_attention = AFTER


if __name__ == "__main__":
    main()
