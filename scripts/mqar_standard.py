"""MQAR standard (256 tokens, 16 pairs) for causal mechanisms, with the curriculum: 600 quick
steps (64 tokens), then up to 1000 standard steps from the quick run's best weights, stopping at
99% — the command pair of the committed softmax row, with each mechanism's config sized for 256
tokens (``Config.for_length(256)``) in both stages, except where that config cannot run 64
tokens (a 16x16 grid or a 256-node graph: ``axial``, ``block2d``, ``graph``), whose quick stage
takes the config sized for 64 (the weights are the same). Token mixers (gMLP) get no positional
encoding inside attention (``--positional auto``; RoPE for attention). Resumable: mechanisms with a standard row
(or an error row) in ``--results`` are skipped. The standard result lines go to ``--results``;
the quick stage's to ``--stage1-results`` (a curriculum step at the standard config, not a quick
result: a report must not read it as one).

    OMP_NUM_THREADS=1 python scripts/mqar_standard.py --results out.jsonl [--only local,linear]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

import attnzoo
from attnzoo.bench.configs import sized
from attnzoo.bench.models import build_model
from attnzoo.registry import config_fields


def _done(results: Path) -> set[str]:
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    return {r.get("mechanism") for r in rows if r.get("size") == "standard" or r.get("kind") == "error"}


def _runs_at(name: str, config: dict, seq_len: int) -> bool:
    """Whether a benchmark language model of ``name`` with ``config`` runs ``seq_len`` tokens
    (a grid or graph config sized for 256 positions does not run 64)."""
    model = build_model(
        **dict(kind="lm", vocab_size=8, n_classes=0, seq_len=seq_len, dim=16, depth=1, heads=2),
        **dict(mechanism=name, config=config, positional=None, ff_mult=1, dropout=0.0),
    )
    try:
        model(torch.zeros(1, seq_len, dtype=torch.long), torch.ones(1, seq_len, dtype=torch.bool))
    except ValueError:
        return False
    return True


def _sets(config: dict) -> list[str]:
    return [a for k, v in config.items() for a in ("--set", f"{k}={v!r}")]


def run(name: str, results: Path, stage1: Path, work: Path, data: str) -> None:
    # max_len=256 in both stages: a mechanism whose weights are sized by it (synthesizer, gMLP)
    # then keeps their shape from the quick stage to the standard one.
    standard = {**sized(name, 256), **({"max_len": 256} if "max_len" in config_fields(name) else {})}
    quick_config = standard if _runs_at(name, standard, 64) else {**standard, **sized(name, 64)}
    base = [sys.executable, "-m", "attnzoo.cli", "bench", "train", "--task", "mqar", "--mechanism", name]
    base += ["--positional", "auto", "--quiet", "--data-dir", data]  # auto: rope in attention
    quick = work / name / "s1"
    stage = ["--size", "quick", "--steps", "600", "--eval-every", "100", "--run-dir", str(quick)]
    done = subprocess.run([*base, *_sets(quick_config), *stage, "--results", str(stage1)])
    best = quick / "best.safetensors"
    if done.returncode or not best.exists():
        with results.open("a") as f:
            f.write(json.dumps(dict(kind="error", mechanism=name, stage="quick", rc=done.returncode)) + "\n")
        return
    stage2 = ["--size", "standard", "--batch-size", "32", "--init-from", str(best), "--steps", "1000"]
    stage2 += ["--eval-every", "100", "--stop-at", "0.99", "--run-dir", str(work / name / "s2")]
    subprocess.run([*base, *_sets(standard), *stage2, "--results", str(results)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--stage1-results", type=Path, help="the quick stage's lines (default: RESULTS.stage1.jsonl)")
    parser.add_argument("--only", default="", help="comma-separated mechanisms (default: every causal one)")
    parser.add_argument("--work", default="/tmp/mqar-standard", type=Path, help="checkpoints")
    parser.add_argument("--data-dir", default="/tmp/adata")
    args = parser.parse_args()
    causal = [n for n in attnzoo.names() if attnzoo.describe(n).capabilities.causal]
    names = args.only.split(",") if args.only else causal
    stage1 = args.stage1_results or args.results.with_suffix(".stage1.jsonl")
    for name in names:
        if name not in _done(args.results):
            run(name, args.results, stage1, args.work, args.data_dir)


if __name__ == "__main__":
    main()
