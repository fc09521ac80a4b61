"""A/B of the window paths' padding in one process (issue 12).

Before ``43385de`` the structured path padded with ``F.pad`` everywhere: ``rows_to_blocks`` ran it
even with nothing to add (a full copy of q, and in backward of the gradient), and the key windows'
padded copy was zero-filled whole before the keys were copied in. The old functions are swapped
in and out of ``attnzoo.backends.window_parts`` per call; each pair is timed interleaved with
dense SDPA (B=1, H=8, D=64, fwd+bwd unless FWD is given, median of the repeats).
Usage: ``python scripts/ab_pad_rows.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS] [fwd]``; the name
``local256`` is ``local`` with ``left = right = 256``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from ab_timing import interleaved
from einops import rearrange
from torch import Tensor

import attnzoo
from attnzoo.backends import window_parts

NEW = window_parts.pad_rows, window_parts.rows_to_blocks


def old_pad_rows(x: Tensor, front: int, back: int) -> Tensor:
    return F.pad(x, (0, 0, front, back)).contiguous()


def old_rows_to_blocks(x: Tensor, blocks: int, block: int, groups: int) -> Tensor:
    x = F.pad(x, (0, 0, 0, blocks * block - x.shape[2]))
    return rearrange(x, "b (h g) (t l) e -> (b h) t (g l) e", g=groups, l=block)


def use(rule: str) -> None:
    fns = NEW if rule == "new" else (old_pad_rows, old_rows_to_blocks)
    window_parts.pad_rows, window_parts.rows_to_blocks = fns


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    backward = not (len(sys.argv) > 5 and sys.argv[5] == "fwd")
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=backward) for _ in range(3))
    grad = torch.randn(1, 8, n, 64)

    def build(name: str):
        return attnzoo.build("local", left=256, right=256) if name == "local256" else attnzoo.build(name)

    mechanisms = {name: build(name) for name in names}

    def timed(fn) -> float:
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = fn()
            if backward:
                out.backward(grad)
        return time.perf_counter() - start

    def call(attn):
        return lambda: attn(q, k, v, causal=causal)

    calls = {name: call(attn) for name, attn in mechanisms.items()}
    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    title = f"N={n} causal={causal} {'fwd+bwd' if backward else 'fwd'}"
    interleaved(calls, use, dense, timed, repeats, title)


if __name__ == "__main__":
    main()
