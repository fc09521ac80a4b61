"""``attnzoo bench suite``: the main job. Sweep every registered mechanism for speed and memory,
profile attention against the feed-forward network, train every mechanism on the quick tasks,
and write the report.

Two presets:

* ``quick`` (default; ``make demo``): fits in under 10 minutes on 2 CPU cores. Speed and memory
  at N = 256 and 1024 (forward), the profile at the same sizes, and a deliberately short
  training run per mechanism and task, with configs sized to the task's length
  (``attnzoo.bench.configs.sized``: defaults would cover these short sequences entirely).
  Short budgets rank mechanisms only roughly; the committed results under ``benchmarks/`` are the longer runs.
* ``full``: the Long Range Arena configuration — ListOps (500 < length < 2000), Pathfinder-32,
  byte-level text at 4096, MQAR at Zoology's size — with each task's full training budget
  (``attnzoo.bench.train.PRESETS``), and speed from 1K to 16K tokens with backward passes. Meant
  for a GPU or a long CPU run; every training run checkpoints, so rerunning the same command
  resumes an interrupted suite where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

import attnzoo
from attnzoo.bench import profile, speed
from attnzoo.bench.tasks import load_task
from attnzoo.bench.train import TrainConfig, TrainingDiverged, train


@dataclass(frozen=True, kw_only=True)
class Preset:
    speed_sizes: tuple[int, ...]
    speed_repeats: int
    backward: bool
    profile_sizes: tuple[int, ...]
    # (task, task size, TrainConfig values on top of the task's preset budget)
    tasks: tuple[tuple[str, str, dict[str, Any]], ...]
    notes: str = ""
    fidelity_passages: int = 0  # 0: all packaged passages


# The quick preset gives every run the same few seconds of training (evaluation excluded): at
# equal compute, which mechanism learns most? Far too short for final accuracies; the committed
# results under benchmarks/ are the longer runs.
_QUICK_DATA = dict(n_train=2000, n_val=100, n_test=200)
PRESETS: dict[str, Preset] = {
    "quick": Preset(
        speed_sizes=(256, 1024),
        speed_repeats=2,
        backward=False,
        profile_sizes=(256, 1024),
        tasks=(
            ("mqar", "quick", dict(steps=2000, eval_every=2000, max_seconds=4.0, task_overrides=_QUICK_DATA)),
            ("listops", "quick", dict(steps=2000, eval_every=2000, max_seconds=2.0, task_overrides=_QUICK_DATA)),
        ),
        notes="4 s (MQAR) and 2 s (ListOps) of training per mechanism: accuracies are indicative only",
        fidelity_passages=16,
    ),
    "full": Preset(
        speed_sizes=(1024, 2048, 4096, 8192, 16384),
        speed_repeats=5,
        backward=True,
        profile_sizes=(1024, 4096, 16384),
        tasks=(("listops", "full", {}), ("text", "full", {}), ("pathfinder", "full", {}), ("mqar", "full", {})),
        notes="LRA lengths and budgets",
    ),
}


def _speed_rows(preset: Preset, command: str) -> Iterator[dict[str, Any]]:
    setting = speed.Setting(
        mechanisms=tuple((name, {}) for name in attnzoo.names()),
        backends=("auto",),
        sizes=preset.speed_sizes,
        batch=1,
        heads=8,
        dim=64,
        causal_modes=(False,),
        repeats=preset.speed_repeats,
        backward=preset.backward,
        sdpa_max_n=max(preset.speed_sizes),
        extra={"command": command},
    )
    return speed.run(setting)


def _train_rows(preset: Preset, out: Path, data_dir: str | None, console: Console) -> Iterator[dict[str, Any]]:
    """One train row per (task, mechanism); mechanisms that cannot run causally are skipped for
    language-model tasks (said once), other failures become rows with an ``error``."""
    for task, size, values in preset.tasks:
        try:
            # Generates (or reads) the cache once; the splits are dropped here, train() reads them.
            info = load_task(task, size=size, data_dir=data_dir, **values.get("task_overrides", {}))[0]
        except ImportError as error:  # the text task's optional corpus
            console.print(f"[yellow]skipping {task}:[/yellow] {error}")
            continue
        names = [n for n in attnzoo.names() if info.kind != "lm" or attnzoo.describe(n).capabilities.causal]
        skipped = sorted(set(attnzoo.names()) - set(names))
        if skipped:
            console.print(f"{task} is a causal language model: skipping {', '.join(skipped)} (not causal)")
        for name in names:
            yield _train_one(task, size, name, values, out, data_dir, console)


def _train_one(
    task: str, size: str, name: str, values: dict[str, Any], out: Path, data_dir: str | None, console: Console
) -> dict[str, Any]:
    try:
        cfg = TrainConfig.with_preset(task, size, mechanism=name, sized=True, **values)
        row = train(
            cfg,
            run_dir=out / "runs" / f"{task}-{size}-{name}",
            data_dir=data_dir,
            console=console,
            progress=sys.stdout.isatty(),
        )
    except TrainingDiverged as error:
        console.print(f"  {task}/{size} {name}: [yellow]{escape(str(error))}[/yellow]")
        return error.row
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        return {
            "kind": "train",
            "task": task,
            "size": size,
            "mechanism": name,
            "config": {},
            "error": f"{type(error).__name__}: {error}",
        }
    if row is None:
        raise KeyboardInterrupt  # checkpoint saved; rerunning the suite resumes this run
    console.print(
        f"  {task}/{size} {name}: test {row['test_accuracy']:.3f} (chance {row['chance']:.3f}), "
        f"{row['steps_per_s']:.1f} steps/s"
    )
    return row


def _write(rows: Iterator[dict[str, Any]], path: Path, console: Console | None = None) -> None:
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row, default=str) + "\n")
            handle.flush()
            if console is not None:
                _echo(row, console)


def _echo(row: dict[str, Any], console: Console) -> None:
    """One short line per measurement, so a long stage shows that it is moving."""
    where = f"  {row.get('mechanism', 'SDPA')} N={row.get('n')}"
    if row.get("error"):
        console.print(f"{where}: [yellow]{row['error'][:100]}[/yellow]", highlight=False)
    elif row["kind"] in ("speed", "sdpa"):
        ratio = row.get("speedup_forward_vs_sdpa")
        console.print(
            f"{where}: {row['forward_s'] * 1e3:.1f} ms" + (f" ({ratio:.2f}x SDPA)" if ratio else ""), highlight=False
        )
    elif row["kind"] == "fidelity":
        cosine = row.get("mean_cosine")
        console.print(
            f"  {row['mechanism']}: "
            + (
                f"mean cosine {cosine:.3f}, retrieval@1 {row['retrieval_at_1']:.3f}"
                if cosine is not None
                else "not applicable"
            ),
            highlight=False,
        )
    elif row["kind"] == "profile":
        console.print(f"{where}: attention {row['attention_share']:.0%} of attention + FFN time", highlight=False)


def _fidelity(preset: Preset, path: Path, command: str, console: Console) -> bool:
    """The fidelity table, where the optional Hugging Face packages are installed."""
    from attnzoo.bench import fidelity

    try:
        import attnzoo.hf  # noqa: F401
    except ImportError as error:
        console.print(f"[yellow]skipping fidelity:[/yellow] {error}")
        return False
    passages = fidelity.load_passages(None, preset.fidelity_passages)
    _write(fidelity.run(passages=passages, command=command), path, console)
    return True


def _with_meta(meta: dict[str, Any], rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield meta
    yield from rows


def run(preset_name: str, out: Path, *, data_dir: str | None, report_dir: Path, console: Console, command: str) -> Path:
    """Run every stage of the preset into ``out`` (speed.jsonl, profile.jsonl, train.jsonl) and
    write the report into ``report_dir``; returns the report's index.html."""
    from attnzoo.bench import report

    preset = PRESETS[preset_name]
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    console.rule(f"1/5 speed and memory of {len(attnzoo.names())} mechanisms at N = {preset.speed_sizes}")
    _write(_speed_rows(preset, command), out / "speed.jsonl", console)
    console.rule(f"2/5 attention vs feed-forward time at N = {preset.profile_sizes}")
    _write(
        profile.run(profile.default_mechanisms(), preset.profile_sizes, command=command, repeats=3),
        out / "profile.jsonl",
        console,
    )
    console.rule(f"3/5 training ({preset.notes})")
    meta = {"kind": "meta", **speed.machine(), "command": command, "preset": preset_name}
    _write(_with_meta(meta, _train_rows(preset, out, data_dir, console)), out / "train.jsonl")
    console.rule("4/5 fidelity: swapping each mechanism into all-MiniLM-L6-v2 (no retraining)")
    files = ["speed.jsonl", "profile.jsonl", "train.jsonl"]
    if _fidelity(preset, out / "fidelity.jsonl", command, console):
        files.append("fidelity.jsonl")
    console.rule("5/5 report")
    index, failed = report.render([report.load_run(out / f) for f in files], report_dir)
    for failure in failed:
        console.print(f"[red]image failed:[/red] {failure}")
    console.print(f"suite finished in {time.perf_counter() - started:.0f} s")
    return index


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--full", action="store_true", help="the LRA-sized preset (GPU or a long CPU run)")
    parser.add_argument("--out", default="runs/suite", help="result files and checkpoints (default runs/suite)")
    parser.add_argument("--report", default="report", help="report folder (default report/)")
    parser.add_argument("--data-dir", help="task cache (default $ATTNZOO_DATA or ~/.cache/attnzoo)")


def main(args: argparse.Namespace, console: Console) -> int:
    preset = "full" if args.full else "quick"
    command = "attnzoo " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    index = run(
        preset,
        Path(args.out) / preset,
        data_dir=args.data_dir,
        report_dir=Path(args.report),
        console=console,
        command=command,
    )
    console.print(f"report: {index}")
    return 0
