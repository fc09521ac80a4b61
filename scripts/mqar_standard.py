"""MQAR standard (256 tokens, 16 pairs) for causal mechanisms, with the curriculum: 600 quick
steps (64 tokens), then up to 1000 standard steps from the quick run's best weights, stopping at
99% — the command pair of the committed softmax row, with each mechanism's config sized for 256
tokens (``Config.for_length(256)``) in both stages. Resumable: mechanisms with a standard row
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

import attnzoo
from attnzoo.bench.configs import sized


def _done(results: Path) -> set[str]:
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    return {r.get("mechanism") for r in rows if r.get("size") == "standard" or r.get("kind") == "error"}


def run(name: str, results: Path, stage1: Path, work: Path, data: str) -> None:
    sets = [a for k, v in sized(name, 256).items() for a in ("--set", f"{k}={v!r}")]
    base = [sys.executable, "-m", "attnzoo.cli", "bench", "train", "--task", "mqar", "--mechanism", name, *sets]
    base += ["--positional", "rope", "--quiet", "--data-dir", data]
    quick = work / name / "s1"
    stage = ["--size", "quick", "--steps", "600", "--eval-every", "100", "--run-dir", str(quick)]
    done = subprocess.run([*base, *stage, "--results", str(stage1)])
    best = quick / "best.safetensors"
    if done.returncode or not best.exists():
        with results.open("a") as f:
            f.write(json.dumps(dict(kind="error", mechanism=name, stage="quick", rc=done.returncode)) + "\n")
        return
    stage2 = ["--size", "standard", "--batch-size", "32", "--init-from", str(best), "--steps", "1000"]
    stage2 += ["--eval-every", "100", "--stop-at", "0.99", "--run-dir", str(work / name / "s2")]
    subprocess.run([*base, *stage2, "--results", str(results)])


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
