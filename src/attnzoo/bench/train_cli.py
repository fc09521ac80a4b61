"""``attnzoo bench train`` on the command line: flags -> ``TrainConfig`` -> ``train``, and the
results line appended to ``--results``."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rich.markup import escape

from attnzoo.bench.train import TrainConfig, TrainingDiverged, train
from attnzoo.registry import EXACT


def config_from_args(args: Any) -> TrainConfig:
    """The TrainConfig an ``attnzoo bench train`` command line asks for (preset, then flags)."""
    from attnzoo.bench.speed import parse_mechanism, parse_settings

    overrides = {
        key: value for item in args.task_set for key, value in parse_settings(item, where=f"--task-set {item}").items()
    }
    name, config = parse_mechanism(args.mechanism, args.set)
    if args.redraw_every is not None:
        config = with_redraw_every(name, config, args.redraw_every)
    flags = {
        key: getattr(args, key)
        for key in (
            "seed",
            "dim",
            "depth",
            "heads",
            "ff_mult",
            "batch_size",
            "steps",
            "lr",
            "warmup",
            "eval_every",
            "patience",
            "checkpoint_every",
            "stop_at",
            "max_seconds",
        )
    }
    if args.positional is not None:
        flags["positional"] = None if args.positional == "none" else args.positional
    flags["init_from"], flags["sized"] = args.init_from, args.sized or None
    flags["causal_encoder"] = args.causal_encoder or None
    return TrainConfig.with_preset(
        args.task, args.size, mechanism=name, config=config, task_overrides=overrides, **flags
    )


def with_redraw_every(name: str, config: dict[str, Any], every: int) -> dict[str, Any]:
    """``--redraw-every N``: ``config`` with the mechanism's ``redraw_every`` field set to N (the
    random-feature mechanisms redraw their projection every N training forwards). A mechanism
    without the field, or ``--set redraw_every`` with another value, is refused."""
    from attnzoo.registry import config_fields, names

    if "redraw_every" not in config_fields(name):
        able = [n for n in names() if "redraw_every" in config_fields(n)]
        raise ValueError(
            f"--redraw-every: {name!r} has no random features to redraw (no redraw_every in its "
            f"config); mechanisms that have it: {', '.join(able)}"
        )
    if config.get("redraw_every", every) != every:
        raise ValueError(
            f"--redraw-every {every} contradicts redraw_every={config['redraw_every']} in the "
            f"mechanism's settings; give one of them"
        )
    return {**config, "redraw_every": every}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def default_run_dir(cfg: TrainConfig) -> Path:
    """runs/<task>-<size>-<mechanism>-<hash of the whole config>: one folder per distinct run."""
    key = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:8]
    return Path("runs") / f"{cfg.task}-{cfg.size}-{cfg.mechanism}-{key}"


def finite_float(text: str) -> float:
    """argparse type: a float that is a number (``inf`` and ``nan`` are refused like a typo)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def add_arguments(parser: Any) -> None:
    parser.add_argument("--task", required=True, help="listops, mqar, pathfinder or text")
    parser.add_argument("--size", default="quick", help="task preset: quick, full (mqar also: standard)")
    parser.add_argument("--mechanism", default=EXACT, metavar="NAME[:key=value,...]")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="mechanism config")
    parser.add_argument(
        "--sized",
        action="store_true",
        help="size the mechanism's config to the task's length (attnzoo.bench.configs.sized); --set values win",
    )
    parser.add_argument(
        "--causal-encoder",
        action="store_true",
        help="classification tasks: run the encoder causally and classify the last real token (how causally "
        "defined mechanisms such as retnet run them; a different model from the default bidirectional one)",
    )
    parser.add_argument(
        "--redraw-every",
        type=positive_int,
        metavar="N",
        help="random-feature mechanisms (performer, rfa): redraw the random projection every N "
        "training forward passes (sets the mechanism's redraw_every); others refuse it",
    )
    parser.add_argument("--task-set", action="append", default=[], metavar="KEY=VALUE", help="task parameter")
    for flag, kind in (
        ("seed", int),
        ("dim", int),
        ("depth", int),
        ("heads", int),
        ("ff-mult", int),
        ("batch-size", int),
        ("steps", int),
        ("lr", finite_float),
        ("warmup", int),
        ("eval-every", int),
        ("patience", int),
        ("checkpoint-every", int),
        ("stop-at", finite_float),
        ("max-seconds", finite_float),
    ):
        parser.add_argument(f"--{flag}", type=kind, help="default: the task preset's (see attnzoo.bench.train.PRESETS)")
    parser.add_argument(
        "--positional",
        help="auto (default: rope for language models, sinusoidal added to the "
        "input otherwise and for token mixers), sinusoidal, rope, alibi or none",
    )
    parser.add_argument("--init-from", help="start from the weights of this checkpoint (same model shape)")
    parser.add_argument("--run-dir", help="checkpoints; rerunning with the same folder resumes (default: runs/...)")
    parser.add_argument("--results", default="runs/train.jsonl", help="append the results line here")
    parser.add_argument("--data-dir", help="task cache (default $ATTNZOO_DATA or ~/.cache/attnzoo)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def check_paths(args: Any, run_dir: Path) -> Path:
    """Refuse, before any training, paths the run could not use; returns the results file."""
    results = Path(args.results)
    if results.is_dir():
        raise ValueError(
            f"--results {results} is a directory; name a file to append the results line to, "
            f"e.g. --results {results / 'train.jsonl'}"
        )
    for flag, path in (("--results", results.parent), ("--run-dir", run_dir.parent)):
        blocked = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocked is not None:
            raise ValueError(f"{flag}: {blocked} is a file, so no folder can be made under it")
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(
            f"--run-dir {run_dir} is a file; name a folder for the checkpoints (a new one starts a "
            f"run, an earlier run's resumes it)"
        )
    if args.init_from is not None and not Path(args.init_from).is_file():
        raise ValueError(
            f"--init-from {args.init_from}: no such checkpoint file; pass the best.safetensors or "
            f"last.safetensors of an earlier run with the same model"
        )
    return results


def _append(results: Path, row: dict[str, Any]) -> None:
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as handle:
        handle.write(json.dumps(row, default=str) + "\n")


def main(args: Any, console: Any) -> int:
    cfg = config_from_args(args)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    results = check_paths(args, run_dir)
    command = "attnzoo " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    main_process = int(os.environ.get("RANK", "0")) == 0
    try:
        row = train(
            cfg, run_dir=run_dir, data_dir=args.data_dir, device=args.device, progress=not args.quiet, console=console
        )
    except TrainingDiverged as error:
        if main_process:
            _append(results, {**error.row, "command": command})
            console.print(
                f"[red]error:[/red] {escape(str(error))}; recorded as failed in {escape(str(results))}", soft_wrap=True
            )
        return 1
    if not main_process:
        return 0
    if row is None:
        console.print(f"interrupted; checkpoint saved in {run_dir}: run the same command to resume")
        return 130
    _append(results, {**row, "command": command})
    console.print(
        f"{cfg.mechanism} on {cfg.task}/{cfg.size}: test accuracy {row['test_accuracy']:.4f} "
        f"(val {row['val_accuracy']:.4f} at step {row['best_step']}, chance {row['chance']:.3f}), "
        f"{row['steps']} steps, {row['steps_per_s']:.1f} steps/s; results: {results}; checkpoints: {run_dir}"
    )
    return 0
