"""A/B of the tile path's einsum pieces (a ``score_mod``, dropout) with ALiBi: ``blocked`` as it
was at git ``05a25b8`` (``logsumexp`` and ``exp`` over ``-inf`` and far pairs, autograd through
an additive bias in backward) against the current one (``_softmax_lse``, ``flushed_exp_``, no
autograd for a ``bias_mod``), in one process: each pair timed forward+backward interleaved with
dense SDPA's (no bias; B=1, H=8, D=64, median of the repeats).

    python scripts/ab_tile_softmax.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from ab_timing import interleaved, module_at

import attnzoo
from attnzoo.backends import blocked
from attnzoo.bench.monitor import release_mmap_threshold

OLD = module_at("05a25b8", "src/attnzoo/backends/blocked.py")
NEW = {"piece_forward": blocked.piece_forward, "piece_backward": blocked.piece_backward}


def use(rule: str) -> None:
    for name, fn in NEW.items():
        setattr(blocked, name, fn if rule == "new" else getattr(OLD, name))


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
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

    built = {name: attnzoo.build(name) for name in names}
    calls = {f"{name}+alibi": (lambda a=a: a(q, k, v, causal=causal, score_mod=alibi)) for name, a in built.items()}
    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    interleaved(calls, use, dense, timed, repeats, f"N={n} causal={causal} fwd+bwd")


if __name__ == "__main__":
    main()
