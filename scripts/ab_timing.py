"""The timing loop of the one-process A/B scripts (``ab_pad_rows.py``, ``ab_forward_blocks.py``, ...):
dense SDPA, then each mechanism under the old and the new rule, round after round, the rules'
order alternating per round; medians after the first round (a warm-up), and each median as a
ratio to SDPA's."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench.monitor import release_mmap_threshold
from attnzoo.bench.speed import parse_mechanism


def interleaved(
    mechanisms: dict[str, Any],
    use: Callable[[str], None],
    dense: Callable[[], Any],
    timed: Callable[[Callable[[], Any]], float],
    repeats: int,
    title: str,
) -> None:
    """Print ``title`` with SDPA's median, then each mechanism's median under ``use("old")`` and
    ``use("new")``; ``timed(fn)`` times one call of ``fn`` (forward, or forward and backward)."""
    times: dict[tuple[str, str], list[float]] = {(name, r): [] for name in mechanisms for r in ("old", "new")}
    dense_times = []
    for i in range(repeats + 1):
        dense_times.append(timed(dense))
        for name, attn in mechanisms.items():
            for rule in ("old", "new") if i % 2 == 0 else ("new", "old"):
                use(rule)
                times[(name, rule)].append(timed(attn))
    sdpa = statistics.median(dense_times[1:])  # the first round warms up
    print(f"{title} SDPA {sdpa * 1e3:.1f} ms")
    for (name, rule), ts in times.items():
        median = statistics.median(ts[1:])
        print(f"{name:28s} {rule}: {median * 1e3:7.2f} ms  {sdpa / median:5.2f}x SDPA")


def fwd_bwd_timer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> Callable:
    """``timed(fn)`` for ``interleaved``: the seconds of one ``fn()`` and its backward from ``grad``,
    the gradients of ``q``, ``k``, ``v`` cleared after."""

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        start = time.perf_counter()
        fn().backward(grad)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    return timed


def fwd_bwd_ab(
    n: int,
    causal: bool,
    names: list[str],
    repeats: int,
    use: Callable[[str], None],
    built: dict[str, Any] | None = None,
) -> None:
    """``interleaved`` for forward+backward of the registered ``names`` (``local`` or with
    config values, ``local:left=256,right=256``, as ``bench speed`` reads them), and of the
    mechanisms in ``built`` (name -> module, for configs a name cannot spell), on
    ``(1, 8, n, 64)`` inputs, against dense SDPA's (causal or not), with ``use(rule)`` switching
    between the old and the new code. Under the malloc thresholds ``attnzoo bench speed`` sets
    (``monitor.release_mmap_threshold``), so temporaries of up to 32 MiB reuse resident memory
    there as here (the A/B files written before this line ran under glibc's initial ones)."""
    release_mmap_threshold()
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, n, 64)

    timed = fwd_bwd_timer(q, k, v, grad)
    mechanisms = {text: attnzoo.build(name, **config) for text in names for name, config in [parse_mechanism(text)]}
    mechanisms.update(built or {})
    calls = {name: (lambda attn=attn: attn(q, k, v, causal=causal)) for name, attn in mechanisms.items()}
    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    interleaved(calls, use, dense, timed, repeats, f"N={n} causal={causal} fwd+bwd")


def alibi_ab(n: int, causal: bool, built: dict[str, Any], repeats: int, use: Callable[[str], None]) -> None:
    """``interleaved`` for forward+backward of the modules in ``built`` (name -> module) with
    ALiBi as their ``score_mod`` (``positional.ALiBi(8)``), on ``(1, 8, n, 64)`` inputs, against
    dense SDPA's without it, under the malloc thresholds ``attnzoo bench speed`` sets."""
    release_mmap_threshold()
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, n, 64)
    alibi = attnzoo.positional.ALiBi(8).score_mod(q, n)

    timed = fwd_bwd_timer(q, k, v, grad)
    calls = {f"{name}+alibi": (lambda a=a: a(q, k, v, causal=causal, score_mod=alibi)) for name, a in built.items()}
    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    interleaved(calls, use, dense, timed, repeats, f"N={n} causal={causal} fwd+bwd")


def alibi_swap_main(module: Any, attr: str, old: Any) -> None:
    """The ``main`` of an A/B script of ALiBi on mechanisms that swaps ``module.attr`` between
    ``old`` and the value it has now: ``N CAUSAL(0|1) NAME[;NAME...] [REPEATS]`` from the command
    line (names with their configs, ``axial:h=64,w=64``, as ``bench speed`` reads them), timed
    forward+backward by ``alibi_ab`` (5 repeats by default)."""
    rules = {"old": old, "new": getattr(module, attr)}
    use = lambda rule: setattr(module, attr, rules[rule])  # noqa: E731
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(";")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    built = {text: attnzoo.build(name, **config) for text in names for name, config in [parse_mechanism(text)]}
    alibi_ab(n, causal, built, repeats, use)


def module_at(rev: str, path: str) -> types.ModuleType:
    """The module in ``path`` (``src/attnzoo/...py``) as git revision ``rev`` had it, loaded apart
    from the package (its imports resolve to the current code): the old rule of an A/B."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"{Path(path).stem}_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up while they are made
    exec(compile(source, f"{path}@{rev}", "exec"), module.__dict__)  # noqa: S102
    return module


def random_edges(n: int, degree: int) -> tuple[tuple[int, int], ...]:
    """A graph's edge list for the graph mechanisms' A/Bs: each of ``n`` nodes attends ``degree``
    distinct random nodes (seed 0)."""
    g = torch.Generator().manual_seed(0)
    return tuple((i, int(j)) for i in range(n) for j in torch.randperm(n, generator=g)[:degree])


def split_names(text: str) -> list[str]:
    """``"local:left=256,right=256,dilated"`` -> ``["local:left=256,right=256", "dilated"]``: a
    piece with ``=`` and no ``:`` continues the config of the name before it, and so does one
    inside brackets (``query_block=(32,32)``)."""
    names: list[str] = []
    depth = 0
    for piece in text.split(","):
        inside = depth > 0
        depth += sum(piece.count(c) for c in "([{") - sum(piece.count(c) for c in ")]}")
        if names and (inside or ("=" in piece and ":" not in piece)):
            names[-1] += "," + piece
        else:
            names.append(piece)
    return names


def parse_ab_args(args: list[str], causal: bool | None = None) -> tuple[int, bool, list[str], int]:
    """``N [CAUSAL(0|1)] NAME[,NAME...] [REPEATS]`` (CAUSAL where ``causal`` is None; 7 repeats
    by default) -> ``(n, causal, names, repeats)``."""
    args = list(args)
    n = int(args.pop(0))
    if causal is None:
        causal = args.pop(0) == "1"
    names = split_names(args.pop(0))
    return n, causal, names, int(args[0]) if args else 7


def ab_main(use: Callable[[str], None], args: list[str] | None = None) -> None:
    """The ``main`` of an A/B script whose ``use(rule)`` switches between the old and the new
    code: ``N CAUSAL(0|1) NAME[,NAME...] [REPEATS]`` from ``args`` (default the command line),
    timed forward+backward by ``fwd_bwd_ab``."""
    n, causal, names, repeats = parse_ab_args(sys.argv[1:] if args is None else args)
    fwd_bwd_ab(n, causal, names, repeats, use)


def swap_main(module: Any, attr: str, old: Any, *, causal: bool | None = None) -> None:
    """The ``main`` of an A/B script that swaps ``module.attr`` between ``old`` and the value it
    has now: ``N [CAUSAL(0|1)] NAME[,NAME...] [REPEATS]`` from the command line (CAUSAL where
    ``causal`` is None), timed forward+backward by ``fwd_bwd_ab``."""
    if not hasattr(module, attr):
        sys.exit(f"{module.__name__} has no {attr!r} now: run this A/B at the revision its docstring names")
    n, causal, names, repeats = parse_ab_args(sys.argv[1:], causal)
    rules = {"old": old, "new": getattr(module, attr)}
    fwd_bwd_ab(n, causal, names, repeats, lambda rule: setattr(module, attr, rules[rule]))
