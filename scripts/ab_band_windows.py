"""A/B of the band-window rule in one process (issue 12).

The old rule (windows aligned down to a block multiple; 32-row blocks only up to 48 keys) against
the current ``structured._band`` and ``choose_block``. Both plans are built once and swapped in per
call; each pair is timed interleaved with dense SDPA (fwd+bwd, B=1, H=8, D=64, median of the
repeats). Usage: ``python scripts/ab_band_windows.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.backends import plan, structured
from attnzoo.patterns import Band

NEW_BAND = structured._band


def old_band(band: Band, n: int, train: bool = True) -> structured.Windows | None:
    """``structured._band`` as it was before the window could start at the band."""
    m = band.modulus
    lo = None if band.lo is None else -((-band.lo) // m)
    hi = None if band.hi is None else band.hi // m
    sub = -(-n // m)
    if m > n or lo is None or hi is None or lo > hi or hi - lo + 1 >= sub:
        return NEW_BAND(band, n, train)  # the cases this rule did not touch
    keys = hi - lo + 1
    block = 32 if keys <= 48 else 64 if keys <= 384 else 128
    start = (lo // block) * block
    width = -(-(block + hi - start) // block) * block
    return structured._window_plan(Band(lo, hi, 1).mask_mod_for(sub, sub), sub, m, block, start, width)


def main() -> None:
    n, causal, names = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    mechanisms = {name: attnzoo.build(name) for name in names}
    plans: dict[tuple, structured.Structure | None] = {}
    rule = ["new"]

    def swapped(pattern, n_q, n_kv, heads, train):  # plan._structure, by rule
        key = (rule[0], pattern, n_q, n_kv, heads, train)
        if key not in plans:
            structured._band = NEW_BAND if rule[0] == "new" else old_band
            plans[key] = structured.structure(pattern, n_q, n_kv, heads, train=train)
        return plans[key]

    plan._structure = swapped

    def timed(fn) -> float:
        start = time.perf_counter()
        fn().sum().backward()
        return time.perf_counter() - start

    times: dict[tuple[str, str], list[float]] = {(name, r): [] for name in names for r in ("old", "new")}
    dense = []
    for _ in range(repeats + 1):
        dense.append(timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
        for name, attn in mechanisms.items():
            for r in ("old", "new"):
                rule[0] = r
                times[(name, r)].append(timed(lambda attn=attn: attn(q, k, v, causal=causal)))
    sdpa = statistics.median(dense[1:])  # the first round warms up
    print(f"N={n} causal={causal} SDPA {sdpa * 1e3:.1f} ms")
    for (name, r), ts in times.items():
        median = statistics.median(ts[1:])
        print(f"{name:28s} {r}: {median * 1e3:7.2f} ms  {sdpa / median:5.2f}x SDPA")


if __name__ == "__main__":
    main()
