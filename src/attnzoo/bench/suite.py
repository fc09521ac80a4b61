"""``attnzoo bench suite``: the main job. Speed and memory of every registered mechanism where
mechanisms differ (forward+backward at long N, each timed interleaved with dense SDPA), the
attention-vs-feed-forward profile, a training run per mechanism of a representative set, and the
report, which shows the committed full results under ``benchmarks/`` beside the fresh ones.

Two presets:

* ``quick`` (default; ``make demo``): under 10 minutes on 2 quiet CPU cores. Speed and memory,
  forward+backward, at N = 1K and 4K (not causal); N = 16K and causal 1K and 4K come
  from the committed speed files where they were measured on the same machine (the report refuses
  to rank speed from different machines). The profile and ListOps training (equal steps, one run
  per family) for ``REPRESENTATIVE``, where softmax beats chance by more than 10 points; accuracy
  for every other mechanism is the committed files'. Stage times are printed and saved.
* ``full``: the Long Range Arena configuration (ListOps, Pathfinder-32, byte-level text at 4096,
  MQAR at Zoology's size) with each task's full training budget (``attnzoo.bench.train.PRESETS``)
  for every mechanism, and speed from 1K to 16K both ways. Meant for a GPU or a long CPU run;
  every training run checkpoints, so rerunning the same command resumes where it stopped.
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
from attnzoo.bench.train import TrainConfig, TrainingDiverged, git_revision, train

#: One mechanism per family (two for the larger families), the demo's training and profile set.
REPRESENTATIVE = (
    "softmax",
    "local",
    "bigbird",
    "lsh",
    "routing",
    "linformer",
    "nystrom",
    "linear",
    "performer",
    "fnet",
)


@dataclass(frozen=True, kw_only=True)
class Preset:
    speed: tuple[tuple[bool, tuple[int, ...]], ...]  # (causal, sizes) sweeps, forward+backward
    speed_repeats: int
    profile_sizes: tuple[int, ...]
    # (task, task size, TrainConfig values on top of the task's preset budget)
    tasks: tuple[tuple[str, str, dict[str, Any]], ...]
    mechanisms: tuple[str, ...] | None = None  # trained and profiled; None: every registered one
    notes: str = ""
    fidelity_passages: int | None = None  # None: no fidelity stage; 0: all packaged passages


# ListOps is the quick task where softmax clearly learns in a few steps (600 steps: 45.6% against
# 15.1% chance; 31.6% at 100 in a timed demo, so 150 for a clearer margin). Every mechanism gets
# the same steps, so the accuracies compare learning, not speed at ListOps' 100 tokens; the time
# cap only guards a much slower machine.
_QUICK_STEPS = 150
PRESETS: dict[str, Preset] = {
    "quick": Preset(
        speed=((False, (1024, 4096)),),
        speed_repeats=2,
        profile_sizes=(1024, 4096),
        tasks=(
            (
                "listops",
                "quick",
                dict(
                    steps=_QUICK_STEPS,
                    eval_every=_QUICK_STEPS,
                    max_seconds=45.0,
                    task_overrides=dict(n_train=2000, n_val=200, n_test=500),
                ),
            ),
        ),
        mechanisms=REPRESENTATIVE,
        notes=f"ListOps, {_QUICK_STEPS} steps per mechanism",
    ),
    "full": Preset(
        speed=((False, (1024, 4096, 16384)), (True, (1024, 4096, 16384))),
        speed_repeats=5,
        profile_sizes=(1024, 4096, 16384),
        tasks=(("listops", "full", {}), ("text", "full", {}), ("pathfinder", "full", {}), ("mqar", "full", {})),
        notes="LRA lengths and budgets",
        fidelity_passages=0,
    ),
}


def _speed_rows(preset: Preset, command: str) -> Iterator[dict[str, Any]]:
    for causal, sizes in preset.speed:
        setting = speed.Setting(
            mechanisms=tuple((name, {}) for name in attnzoo.names()),
            backends=("auto",),
            sizes=sizes,
            batch=1,
            heads=8,
            dim=64,
            causal_modes=(causal,),
            repeats=preset.speed_repeats,
            backward=True,
            sdpa_max_n=max(sizes),
            extra={"command": command},
        )
        yield from speed.run(setting)


def _names(preset: Preset) -> list[str]:
    return [n for n in attnzoo.names() if preset.mechanisms is None or n in preset.mechanisms]


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
        names = [n for n in _names(preset) if info.kind != "lm" or attnzoo.describe(n).capabilities.causal]
        skipped = sorted(set(_names(preset)) - set(names))
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


def committed_files(folder: Path | None, console: Console) -> list[Path]:
    """The committed results shown beside the fresh ones: every train and fidelity file, and the
    speed files measured on this machine (the report refuses to mix machines in a ratio)."""
    from attnzoo.bench.results import load_run, machine_identity

    if folder is None or not folder.is_dir():
        return []
    here = machine_identity(speed.machine())
    files = sorted(folder.glob("train-*.jsonl")) + sorted(folder.glob("fidelity-*.jsonl"))
    others = set()
    for path in sorted(folder.glob("speed-*.jsonl")):
        metas = load_run(path, origin="committed").metas
        if metas and all(machine_identity(m) == here for m in metas):
            files.append(path)
        else:
            others.add(machine_identity(metas[0]) if metas else "unknown")
    if others:
        console.print(f"committed speed files from other machines left out: {', '.join(sorted(map(str, others)))}")
    return files


def run(
    preset_name: str,
    out: Path,
    *,
    data_dir: str | None,
    report_dir: Path,
    console: Console,
    command: str,
    committed: Path | None = None,
) -> Path:
    """Run every stage of the preset into ``out`` (speed.jsonl, profile.jsonl, train.jsonl,
    fidelity.jsonl, stages.jsonl) and write the report, with the committed files of ``committed``
    beside them, into ``report_dir``; returns the report's index.html."""
    from attnzoo.bench import report, results

    preset = PRESETS[preset_name]
    out.mkdir(parents=True, exist_ok=True)
    stages: dict[str, float] = {}
    sweeps = ", ".join(f"N = {sizes}{' causal' if causal else ''}" for causal, sizes in preset.speed)
    console.rule(f"1/5 speed and memory (forward+backward, vs SDPA) of {len(attnzoo.names())} mechanisms: {sweeps}")
    started = time.perf_counter()
    _write(_speed_rows(preset, command), out / "speed.jsonl", console)
    stages["speed"] = time.perf_counter() - started
    console.rule(f"2/5 attention vs feed-forward time at N = {preset.profile_sizes}")
    started = time.perf_counter()
    profiled = tuple((n, {}) for n in _names(preset) if attnzoo.describe(n).capabilities.kind in ("attention", "mixer"))
    _write(profile.run(profiled, preset.profile_sizes, command=command, repeats=2), out / "profile.jsonl", console)
    stages["profile"] = time.perf_counter() - started
    console.rule(f"3/5 training ({preset.notes})")
    started = time.perf_counter()
    meta = {"kind": "meta", **speed.machine(), "git": git_revision(), "command": command, "preset": preset_name}
    _write(_with_meta(meta, _train_rows(preset, out, data_dir, console)), out / "train.jsonl")
    stages["train"] = time.perf_counter() - started
    files = [out / f for f in ("speed.jsonl", "profile.jsonl", "train.jsonl")]
    if preset.fidelity_passages is not None:
        console.rule("4/5 fidelity: swapping each mechanism into all-MiniLM-L6-v2 (no retraining)")
        started = time.perf_counter()
        if _fidelity(preset, out / "fidelity.jsonl", command, console):
            files.append(out / "fidelity.jsonl")
        stages["fidelity"] = time.perf_counter() - started
    else:
        console.rule("4/5 fidelity: the committed results (not rerun by this preset)")
    console.rule("5/5 report")
    started = time.perf_counter()
    runs = [results.load_run(f, origin="fresh") for f in files]
    runs += [results.load_run(f) for f in committed_files(committed, console)]
    index, failed = report.render(runs, report_dir)
    stages["report"] = time.perf_counter() - started
    for failure in failed:
        console.print(f"[red]image failed:[/red] {failure}")
    _write(iter([{"kind": "meta", **meta, "stage_seconds": stages}]), out / "stages.jsonl")
    console.print(
        "stage times: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
        + f"; total {sum(stages.values()):.0f} s"
    )
    return index


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--full", action="store_true", help="the LRA-sized preset (GPU or a long CPU run)")
    parser.add_argument("--out", default="runs/suite", help="result files and checkpoints (default runs/suite)")
    parser.add_argument("--report", default="report", help="report folder (default report/)")
    parser.add_argument("--data-dir", help="task cache (default $ATTNZOO_DATA or ~/.cache/attnzoo)")
    parser.add_argument(
        "--committed",
        default="benchmarks",
        help="folder of committed results shown beside the fresh ones (default benchmarks/; '' for none)",
    )


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
        committed=Path(args.committed) if args.committed else None,
    )
    console.print(f"report: {index}")
    return 0
