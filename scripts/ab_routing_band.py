"""Causal ``routing`` at its default config, before and after its fast path became a band over
each cluster's sorted keys, against dense causal SDPA, interleaved in one run (SDPA, before,
after, ...); the ratios are medians of the pairwise SDPA time / routing time.

    python scripts/ab_routing_band.py [--before REV] [--n 1024,2048,4096] [--forward] [--non-causal]

"Before" is ``causal_attention`` (2w candidate keys per query) from ``routing_tiles.py`` at git
revision REV (default 2f22a14, the last one with it); "after" this tree's ``routing_band``.
B = 1, H = 8, D = 64, fp32. ``--non-causal`` times the balanced path instead (``before``: REV's
``balanced_attention``), which the band leaves alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnzoo
import attnzoo.mechanisms.routing as routing


def _old_tiles(rev: str):  # noqa: ANN202
    source = subprocess.run(
        ["git", "show", f"{rev}:src/attnzoo/mechanisms/routing_tiles.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "routing_tiles_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("routing_tiles_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="2f22a14")
    parser.add_argument("--n", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward", action="store_true", help="time the forward only")
    parser.add_argument("--non-causal", action="store_true")
    args = parser.parse_args()
    causal, old = not args.non_causal, _old_tiles(args.before)
    name = "causal_attention" if causal else "balanced_attention"
    paths = {"before": getattr(old, name), "after": getattr(routing, name)}
    torch.manual_seed(0)
    for n in (int(x) for x in args.n.split(",")):
        attn = attnzoo.build("routing").eval()
        x = [torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3)]

        def run(path: str, x: list[torch.Tensor] = x, attn: torch.nn.Module = attn) -> float:
            start = time.perf_counter()
            with torch.set_grad_enabled(not args.forward):
                if path == "sdpa":
                    out = F.scaled_dot_product_attention(*x, is_causal=causal)
                else:
                    setattr(routing, name, paths[path])
                    out = attn(*x, causal=causal)
                if not args.forward:
                    out.backward(torch.ones_like(out))
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"sdpa": [], "before": [], "after": []}
        for i in range(args.repeats + 1):  # the first round warms up
            for path, seen in times.items():
                t = run(path)
                if i:
                    seen.append(t)
        setattr(routing, name, paths["after"])
        ratio = {p: statistics.median(a / b for a, b in zip(times["sdpa"], times[p])) for p in ("before", "after")}
        ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
        print(
            f"N={n} causal={causal} {'fwd' if args.forward else 'fwd+bwd'}: SDPA {ms['sdpa']:.0f} ms, "
            f"before {ms['before']:.0f} ms ({ratio['before']:.2f}x SDPA), after {ms['after']:.0f} ms "
            f"({ratio['after']:.2f}x SDPA)",
            flush=True,
        )


if __name__ == "__main__":
    main()
