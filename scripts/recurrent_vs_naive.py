"""Time the chunkwise forms of the recurrent family against their token-by-token recurrences.

    python scripts/recurrent_vs_naive.py --n 4096 --repeats 3 > benchmarks/recurrent-vs-naive-cpu.jsonl
    python scripts/recurrent_vs_naive.py --only delta_rule,gated_delta_rule   # a subset

For each plain function (``retention``, ``gla``, ``ssd``, ``delta_rule``, ``gated_delta_rule``)
forward+backward on random inputs (B=1, H=8, D=64, fp32; decays and betas as the mechanisms make
them: negative log decays, betas in (0, 1), unit keys for the delta rule), the chunkwise fast
path and the ``naive_*`` recurrence are timed alternately (fast, naive, fast, ...) after a
warm-up of both; each line holds the median times and the median of the pairwise ratios. One
JSON line per function, after a meta line (machine, torch, git, command).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnzoo.bench.speed import machine
from attnzoo.bench.train import git_revision
from attnzoo.mechanisms import decay_functions as dec
from attnzoo.mechanisms import delta_chunks as dch


def _inputs(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, h, d = 1, 8, 64
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    return dict(
        q=q * d**-0.5,
        k=k,
        v=v,
        unit_k=F.normalize(k, dim=-1),
        log_gamma=torch.log1p(-(2.0 ** (-5 - torch.arange(h, dtype=torch.float32)))),
        log_alpha=F.logsigmoid(torch.randn(b, h, n, d, generator=g)) / 16,
        log_a=-F.softplus(torch.randn(b, h, n, generator=g)) * 0.1,
        beta=torch.rand(b, h, n, generator=g),
        log_alpha_scalar=-F.softplus(torch.randn(b, h, n, generator=g)) * 0.1,
    )


def _cases(x: dict[str, torch.Tensor]) -> dict[str, tuple[Callable, Callable, tuple]]:
    """name -> (fast, naive, positional args)."""
    return {
        "retention": (dec.retention, dec.naive_retention, (x["q"], x["k"], x["v"], x["log_gamma"])),
        "gla": (dec.gla, dec.naive_gla, (x["q"], x["k"], x["v"], x["log_alpha"])),
        "ssd": (dec.ssd, dec.naive_ssd, (x["q"], x["k"], x["v"], x["log_a"])),
        "delta_rule": (dch.delta_rule, dch.naive_delta_rule, (x["q"], x["unit_k"], x["v"], x["beta"])),
        "gated_delta_rule": (
            dch.gated_delta_rule,
            dch.naive_gated_delta_rule,
            (x["q"], x["unit_k"], x["v"], x["beta"], x["log_alpha_scalar"]),
        ),
    }


def _fwd_bwd(fn: Callable, args: tuple) -> float:
    leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    start = time.perf_counter()
    out, state = fn(*leaves)
    (out.sum() + state.sum()).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated functions to time (default: all)")
    args = parser.parse_args()
    command = "python scripts/recurrent_vs_naive.py " + " ".join(sys.argv[1:])
    print(json.dumps({"kind": "meta", **machine(), "git": git_revision(), "command": command}), flush=True)
    cases = _cases(_inputs(args.n))
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - set(cases))
    if unknown:
        parser.error(f"--only: unknown function(s) {', '.join(unknown)}; known: {', '.join(cases)}")
    for name, (fast, naive, inputs) in cases.items():
        if only and name not in only:
            continue
        _fwd_bwd(fast, inputs), _fwd_bwd(naive, inputs)  # warm-up
        pairs = [(_fwd_bwd(fast, inputs), _fwd_bwd(naive, inputs)) for _ in range(args.repeats)]
        fast_s, naive_s = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        ratio = statistics.median(n / f for f, n in pairs)
        row = {"kind": "recurrent", "function": name, "n": args.n, "fast_s": fast_s, "naive_s": naive_s}
        print(json.dumps({**row, "speedup_vs_naive": ratio}), flush=True)


if __name__ == "__main__":
    main()
