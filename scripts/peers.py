"""attnzoo against its closest peers on equal budgets, timed interleaved in one process.

The peers are not dependencies: install them into a scratch directory without their
dependencies (they need only torch and einops, which the venv has) and put it on the path::

    .venv/bin/python -m pip install --no-deps --target /tmp/peers reformer-pytorch \\
        sinkhorn-transformer local-attention==1.9.0 axial-positional-embedding product-key-memory==0.1.10
    PYTHONPATH=/tmp/peers .venv/bin/python scripts/peers.py --n 4096

(newer local-attention and product-key-memory releases import packages the two peers never use).

Pairs (B=1, H=8, D=64, fp32, eval mode, non-causal):

- ``lsh``: reformer-pytorch's ``LSHAttention(bucket_size=64, n_hashes=1)`` (N / 64 buckets,
  each chunk attends itself and the previous one) against ``lsh:n_hashes=1,n_buckets=N/64,block=64``.
- ``sinkhorn``: sinkhorn-transformer's ``SinkhornAttention(bucket_size=256, sinkhorn_iter=7)``
  against ``sinkhorn:block=256,n_iters=7``.

Each line gives the peer's time over ours (> 1: ours is faster), forward and forward+backward,
as the median of pairwise ratios with their spread (``attnzoo.bench.speed.interleaved``).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
from collections.abc import Callable

import torch

import attnzoo
from attnzoo.bench.monitor import release_mmap_threshold
from attnzoo.bench.speed import interleaved


def _pairs(n: int) -> dict[str, tuple[Callable, Callable]]:
    from reformer_pytorch.reformer_pytorch import LSHAttention
    from sinkhorn_transformer.sinkhorn_transformer import SinkhornAttention

    reformer = LSHAttention(bucket_size=64, n_hashes=1).eval()
    ours_lsh = attnzoo.build("lsh", n_hashes=1, n_buckets=n // 64, block=64).eval()
    peer_sinkhorn = SinkhornAttention(
        bucket_size=256, dim=512, dim_heads=64, heads=8, max_seq_len=n, sinkhorn_iter=7
    ).eval()
    ours_sinkhorn = attnzoo.build("sinkhorn", block=256, n_iters=7).eval()
    return {
        # reformer-pytorch takes heads folded into the batch, and one tensor for q and k (shared QK)
        "lsh": (lambda q, k, v: reformer(q.flatten(0, 1), v.flatten(0, 1))[0], lambda q, k, v: ours_lsh(q, k, v)),
        "sinkhorn": (lambda q, k, v: peer_sinkhorn(q, k, v), lambda q, k, v: ours_sinkhorn(q, k, v)),
    }


def _timed(fn: Callable, inputs: tuple[torch.Tensor, ...], backward: bool) -> Callable[[], None]:
    def run() -> None:
        if not backward:
            with torch.no_grad():
                fn(*inputs)
            return
        for x in inputs:
            x.grad = None
        fn(*inputs).sum().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--pair", choices=("lsh", "sinkhorn"), action="append", help="run only these pairs (repeatable)"
    )
    args = parser.parse_args()
    release_mmap_threshold()
    torch.manual_seed(0)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"# scripts/peers.py --n {args.n} --repeats {args.repeats} at git {git}, "
        f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; B=1, H=8, D=64, fp32, eval, non-causal"
    )
    print("# ratio = peer time / attnzoo time (> 1: attnzoo faster), median of pairwise ratios [spread]")
    for name, (peer, ours) in _pairs(args.n).items():
        if args.pair and name not in args.pair:
            continue
        for backward in (False, True):
            inputs = tuple(torch.randn(1, 8, args.n, 64, requires_grad=backward) for _ in range(3))
            timed = interleaved(_timed(peer, inputs, backward), _timed(ours, inputs, backward), args.repeats)
            what = "fwd+bwd" if backward else "fwd"
            print(
                f"{name:9s} N={args.n} {what:8s} peer {timed['reference_s'] * 1e3:8.1f} ms  "
                f"attnzoo {timed['s'] * 1e3:8.1f} ms"
                f"  ratio {timed['ratio']:.2f} [{timed['spread'][0]:.2f}, {timed['spread'][1]:.2f}]"
            )


if __name__ == "__main__":
    main()
