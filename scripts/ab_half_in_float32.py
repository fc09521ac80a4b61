"""A/B of the blocked backend on bfloat16 inputs run in float32 (``blocked.in_kernel_dtype``: cast
up, run, cast the output back; new) against torch's CPU flash kernel in bfloat16 (old), in one
process; the title line says whether this CPU has AMX tiles (torch's probe). Each mechanism is timed
forward+backward interleaved with dense SDPA's, all on bfloat16 ``(1, 8, N, 64)`` inputs (SDPA
runs its own bfloat16 kernel, the user's baseline). Usage: ``python scripts/ab_half_in_float32.py
N CAUSAL(0|1) NAME[,NAME...] [REPEATS]`` (``cd scripts; PYTHONPATH=../src``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from ab_timing import fwd_bwd_timer, interleaved, split_names

import attnzoo
from attnzoo.backends import blocked
from attnzoo.bench.monitor import release_mmap_threshold
from attnzoo.bench.speed import parse_mechanism

RULES = {"old": lambda call: call, "new": blocked.in_kernel_dtype}


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", split_names(sys.argv[3])
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    release_mmap_threshold()
    q, k, v = (torch.randn(1, 8, n, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, n, 64, dtype=torch.bfloat16)

    timed = fwd_bwd_timer(q, k, v, grad)
    built = {text: attnzoo.build(name, **config) for text in names for name, config in [parse_mechanism(text)]}
    calls = {name: (lambda attn=attn: attn(q, k, v, causal=causal)) for name, attn in built.items()}

    def use(rule: str) -> None:
        blocked.in_kernel_dtype = RULES[rule]

    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()  # private; absent in some builds
    interleaved(calls, use, dense, timed, repeats, f"N={n} causal={causal} bfloat16 fwd+bwd AMX tiles={amx}")


if __name__ == "__main__":
    main()
