"""What the report computes from result rows, as pure functions the tests check: one reference
row per mechanism, which tasks count (softmax must beat chance by ``MARGIN`` points), averages
over equal task sets, speed-ups at a length, and "which to pick": the Pareto front of (speed,
memory, accuracy) per length and causality.

Rows are the JSON objects of result files, annotated by ``results.load_run`` with where they come
from: ``_origin`` ("fresh": this suite run; "committed": a file git tracks unmodified;
"uncommitted": any other file), ``_file``, ``_date``, ``_when`` (its file's full timestamp),
``_rev`` (the git revision that made the row), ``_machine`` (the machine identity of its file's
meta row) and ``_order`` (input order: later rows supersede earlier ones).
"""

from __future__ import annotations

import importlib
import statistics
from dataclasses import dataclass
from typing import Any

from attnzoo.registry import EXACT

Row = dict[str, Any]
#: A task counts (is "learned at this budget") only where softmax reaches chance + MARGIN points.
MARGIN = 10.0
#: The lengths "which to pick" answers for.
PICK_SIZES = (1024, 4096, 16384)
#: The bubble chart's length (LRA's).
BUBBLE_N = 4096
FWD_BWD, FWD = "speedup_forward_backward_vs_sdpa", "speedup_forward_vs_sdpa"


def is_dirty(revision: Any) -> bool:
    return str(revision or "").endswith("+dirty")


#: Which source wins where several have a figure (fresh first).
ORIGINS = ("fresh", "uncommitted", "committed")


def rank(origin: str | None) -> int:
    return ORIGINS.index(origin) if origin in ORIGINS else 0


def budget(row: Row) -> int:
    """A training row's steps (0 for rows that are not training runs)."""
    return (row.get("optim") or {}).get("steps") or row.get("steps") or 0


def preference(row: Row) -> tuple:
    """Sort key, best last: fresh, then uncommitted, then committed files; a clean revision before
    a dirty one; then the larger training budget (a committed file with a short demo run must not
    stand in for the full run of the same task, or one column would mix budgets); then the newer
    measurement (its file's timestamp, else its date: a committed demo run must not hide a later
    sweep, nor a file whose name sorts later a sweep made after it the same day); then the later
    row (input order)."""
    date = str(row.get("_when") or row.get("_date") or "")
    return -rank(row.get("_origin")), not is_dirty(row.get("_rev")), budget(row), date, row.get("_order", 0)


def one_per(rows: list[Row], key: Any) -> dict[Any, Row]:
    """One reference row per ``key(row)`` (see ``preference``); rows whose key is None are dropped."""
    chosen: dict[Any, Row] = {}
    for row in sorted(rows, key=preference):
        k = key(row)
        if k is not None:
            chosen[k] = row
    return chosen


def source_label(row: Row) -> str:
    """Where a figure comes from: fresh or committed, file, date, revision (dirty flagged)."""
    rev = row.get("_rev") or "unknown"
    flag = " (DIRTY: uncommitted changes)" if is_dirty(rev) else ""
    date = row.get("_date") or "date unknown"
    return f"{row.get('_origin', 'fresh')}: {row.get('_file', '?')}, {date}, git {rev}{flag}"


# ---- accuracy --------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Column:
    """One accuracy column: a task at a size and sequence length (0: not recorded), from fresh or
    committed results (their budgets differ). A size run at another length (``--task-set
    seq_len=1024``) is another task: its own column, named with its length; so is a classifier
    run with a causal encoder (``--causal-encoder``: another model, measured in causal mode)."""

    task: str
    size: str
    origin: str
    length: int = 0
    causal_encoder: bool = False

    @property
    def name(self) -> str:
        length = f" @ {self.length} tokens" if self.length else ""
        length += ", causal encoder" if self.causal_encoder else ""
        return f"{self.task} {self.size}{length}" + {"fresh": " (this run)", "uncommitted": " (uncommitted)"}.get(
            self.origin, ""
        )


def column(row: Row) -> Column:
    causal_encoder = bool((row.get("model") or {}).get("causal_encoder"))
    return Column(
        row["task"], str(row.get("size")), row.get("_origin", "fresh"), int(row.get("seq_len") or 0), causal_encoder
    )


def task_is_causal(task: str, params: dict[str, Any] | None = None) -> bool:
    """Whether a task is a causal language model (its generator's ``describe``)."""
    try:
        module = importlib.import_module(f"attnzoo.bench.tasks.{task}")
        return bool(module.describe(module.Config(**(params or {})))["causal"])
    except (ImportError, AttributeError, TypeError, ValueError, KeyError):
        return False


def accuracy_table(train: list[Row]) -> dict[str, Any]:
    """Columns, one reference row per (column, mechanism), and which columns count.

    ``learned[c]``: softmax's accuracy reaches chance + MARGIN points (None: no softmax row, so
    it cannot be judged and does not count either). Accuracies are percentages."""
    cells: dict[str, dict[Column, Row]] = {}
    for (col, mechanism), row in one_per(train, lambda r: (column(r), r["mechanism"])).items():
        cells.setdefault(mechanism, {})[col] = row
    columns = sorted({c for by in cells.values() for c in by}, key=lambda c: (rank(c.origin), c))
    info: dict[Column, dict[str, Any]] = {}
    for c in columns:
        rows = [by[c] for by in cells.values() if c in by]
        chance = next((100 * r["chance"] for r in rows if r.get("chance") is not None), None)
        softmax = accuracy(cells.get(EXACT, {}).get(c))
        learned = None if softmax is None or chance is None else softmax >= chance + MARGIN
        budgets = sorted({budget(r) for r in rows} - {0})
        causal = c.causal_encoder or task_is_causal(c.task, rows[0].get("task_params"))
        info[c] = dict(chance=chance, softmax=softmax, learned=learned, budgets=budgets, causal=causal)
    return {"columns": columns, "info": info, "cells": cells}


def accuracy(row: Row | None) -> float | None:
    if row is None or "error" in row or row.get("test_accuracy") is None:
        return None
    return 100 * row["test_accuracy"]


def common_tasks(
    table: dict[str, Any], mechanisms: set[str] | None = None, causal: bool | None = None
) -> tuple[list[Column], dict[str, float]]:
    """An equal task set and each mechanism's mean accuracy over it: the learned column with the
    most mechanisms (``mechanisms`` only, where given; columns of that causality only, where
    given), then every other learned column all of those mechanisms have. Returns (columns,
    mechanism -> mean %); mechanisms missing a column of the set are not in the mean."""
    has = {
        c: {m for m, by in table["cells"].items() if accuracy(by.get(c)) is not None}
        for c in table["columns"]
        if table["info"][c]["learned"] and (causal is None or table["info"][c]["causal"] == causal)
    }
    if mechanisms is not None:
        has = {c: ms & mechanisms for c, ms in has.items()}
    has = {c: ms for c, ms in has.items() if ms}
    if not has:
        return [], {}
    # Most mechanisms first; on a tie the committed (longer) budget, then by name.
    first = min(has, key=lambda c: (-len(has[c]), -rank(c.origin), c))
    chosen = set(has[first])
    used = sorted((c for c, ms in has.items() if chosen <= ms), key=lambda c: (rank(c.origin), c))
    means = {m: statistics.fmean(accuracy(table["cells"][m][c]) for c in used) for m in chosen}
    return used, means


def best_per_column(table: dict[str, Any]) -> dict[Column, set[str]]:
    """The top mechanism(s) of each learned column (none where the task was not learned)."""
    best = {}
    for c in table["columns"]:
        scores = {m: accuracy(by.get(c)) for m, by in table["cells"].items()}
        scores = {m: s for m, s in scores.items() if s is not None}
        best[c] = {m for m, s in scores.items() if s == max(scores.values())} if table["info"][c]["learned"] else set()
    return best


# ---- speed -----------------------------------------------------------------------------------


def speed_points(speed: list[Row], n: int, causal: bool, metric: str = FWD_BWD) -> dict[str, Row]:
    """One speed row per mechanism at (n, causal) with ``metric`` (the interleaved speed-up over
    SDPA measured in that row): the default config before any other, then ``preference``."""
    rows = [
        r
        for r in speed
        if r.get("n") == n and bool(r.get("causal")) == causal and isinstance(r.get(metric), (int, float))
    ]
    chosen: dict[str, Row] = {}
    for row in sorted(rows, key=lambda r: (not r.get("config"), preference(r))):
        chosen[row["mechanism"]] = row
    return chosen


def speed_metric(speed: list[Row], n: int, causal: bool) -> str:
    """Forward+backward where at least two mechanisms and half as many as forward have it at
    (n, causal), else forward (the committed 16K sweeps are mostly forward-only)."""
    both, forward = len(speed_points(speed, n, causal, FWD_BWD)), len(speed_points(speed, n, causal, FWD))
    return FWD_BWD if both >= max(2, forward / 2) else FWD


def machine_groups(rows: list[Row]) -> dict[str, list[str]]:
    """Machine identity -> the files whose rows came from it."""
    groups: dict[str, set[str]] = {}
    for r in rows:
        groups.setdefault(r.get("_machine") or "unknown machine (no meta row)", set()).add(r.get("_file", "?"))
    return {m: sorted(files) for m, files in groups.items()}


def check_one_machine(rows: list[Row]) -> None:
    """ValueError when speed rows come from more than one machine: a speed-up ranking (or any
    ratio) across machines compares the machines, not the mechanisms."""
    groups = machine_groups(rows)
    if len(groups) > 1:
        listing = "; ".join(f"{m}: {', '.join(files)}" for m, files in sorted(groups.items()))
        raise ValueError(
            f"speed rows come from {len(groups)} different machines ({listing}); a speed ratio or ranking "
            "must not mix machines: pass one machine's speed files to attnzoo report at a time"
        )


# ---- which to pick ---------------------------------------------------------------------------


def pareto(points: dict[str, tuple[float, float, float]]) -> list[str]:
    """Labels not dominated on (speed: higher, memory: lower, accuracy: higher), by name."""

    def dominates(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
        at_least = a[0] >= b[0] and a[1] <= b[1] and a[2] >= b[2]
        return at_least and (a[0] > b[0] or a[1] < b[1] or a[2] > b[2])

    return sorted(m for m, p in points.items() if not any(dominates(q, p) for k, q in points.items() if k != m))


def pick(table: dict[str, Any], speed: list[Row], n: int, causal: bool) -> dict[str, Any]:
    """The Pareto front at (n, causal): mechanisms with a speed row there and an accuracy on an
    equal task set (tasks of the same causality where any was learned, else any learned task)."""
    metric = speed_metric(speed, n, causal)
    rows = speed_points(speed, n, causal, metric)
    # A peak of 0 is below what the RSS probe resolves, not "no memory": it cannot be ranked.
    rows = {m: r for m, r in rows.items() if (r.get("peak_forward_bytes") or 0) > 0}
    tasks, means = common_tasks(table, set(rows), causal)
    if not tasks:
        tasks, means = common_tasks(table, set(rows))
    points = {m: (rows[m][metric], rows[m]["peak_forward_bytes"], means[m]) for m in means}
    front = pareto(points)
    return {
        "n": n,
        "causal": causal,
        "metric": metric,
        "tasks": tasks,
        "points": points,
        "rows": {m: rows[m] for m in points},
        "front": sorted(front, key=lambda m: -points[m][2]),
        "unranked": sorted(set(rows) - set(points)),
    }


def sentence(name: str, result: dict[str, Any]) -> str:
    """One sentence on a front member: its figures and what it is best at on the front."""
    points, front = result["points"], result["front"]
    speed, memory, acc = points[name]
    roles = []
    if acc == max(points[m][2] for m in front):
        roles.append("the most accurate on the front")
    if speed == max(points[m][0] for m in front):
        roles.append("the fastest")
    if memory == min(points[m][1] for m in front):
        roles.append("the least memory")
    if not roles:
        top = max(front, key=lambda m: (points[m][2], points[m][0]))
        roles.append(
            f"{points[top][2] - acc:.1f} points below {top} at {speed / points[top][0]:.2g}x its speed "
            f"and {memory / points[top][1]:.2g}x its memory"
        )
    what = "forward+backward" if result["metric"] == FWD_BWD else "forward"
    config = result["rows"][name].get("config")
    shown = name + (":" + ",".join(f"{k}={v}" for k, v in sorted(config.items())) if config else "")
    return (
        f"{shown}: {speed:.2g}x dense SDPA's {what} speed, {memory / 2**20:.0f} MiB peak forward memory, "
        f"{acc:.1f}% mean accuracy; {' and '.join(roles)}."
    )
