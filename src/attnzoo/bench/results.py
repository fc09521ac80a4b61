"""Benchmark result files as the report reads them: ``load_run`` annotates every row with its
source (file, fresh / committed / uncommitted, date, git revision, machine), so each figure on
the page can name where it comes from."""

from __future__ import annotations

import itertools
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Row = dict[str, Any]
_ORDER = itertools.count()  # input order across files: later rows supersede earlier ones


@dataclass
class Run:
    """One input file: its meta rows and its other rows (each annotated, see ``load_run``)."""

    path: str
    origin: str = "fresh"
    committed_in: str | None = None  # "<hash> <date>" of the last commit of a committed file
    metas: list[Row] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)


def _git(path: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", "-C", str(path.parent), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None


def committed_state(path: Path) -> str | None:
    """``"<hash> <date>"`` of the last commit of ``path`` when git tracks it unmodified, else None."""
    tracked = _git(path, "ls-files", "--error-unmatch", path.name)
    if tracked is None or tracked.returncode != 0:
        return None
    changed = _git(path, "diff", "--quiet", "HEAD", "--", path.name)
    if changed is None or changed.returncode != 0:
        return None
    log = _git(path, "log", "-1", "--format=%h %cs", "--", path.name)
    return (log.stdout.strip() if log is not None else "") or None


def machine_identity(meta: Row | None) -> str | None:
    """What a speed figure depends on: processor, its kernel-relevant CPU flags (``cpu_flags``,
    recorded since the two Xeons of ``benchmarks/`` shared a processor name; a file without them
    is not the same machine as one with), CPU count, torch threads (and device)."""
    if not meta or not any(k in meta for k in ("processor", "cpus")):
        return None
    flags = f" [{' '.join(meta['cpu_flags'])}]" if "cpu_flags" in meta else ""
    cpus, threads = meta.get("cpus", "?"), meta.get("torch_threads", "?")
    text = f"{meta.get('processor', '?')}{flags}, {cpus} CPUs, {threads} threads"
    return text + (f", {meta['device']}" if meta.get("device") else "")


def load_run(path: str | Path, *, origin: str | None = None) -> Run:
    """Read one JSONL file and annotate every row with its source (``_file``, ``_origin``,
    ``_date``, ``_when``, ``_rev``, ``_machine``, ``_order``) from the meta row above it (else the first).
    ``origin``: "fresh" or "committed"; None asks git ("committed" where it tracks the file
    unmodified, else "uncommitted"). ValueError naming
    ``file:line`` for a line that is not a JSON object with a ``kind``, or naming the file when
    it cannot be read."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{path}: cannot read benchmark results ({error.strerror or error})") from None
    state = committed_state(path) if origin in (None, "committed") else None
    run = Run(str(path), origin or ("committed" if state else "uncommitted"), state)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path}:{number}: not valid JSON ({error.msg}); each line must be one JSON object"
            ) from None
        if not isinstance(row, dict) or "kind" not in row:
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'kind' field, got {line[:60]!r}")
        (run.metas if row["kind"] == "meta" else run.rows).append(row)
        row["_meta"] = run.metas[-1] if run.metas else None
    for row in run.rows:
        meta = row.pop("_meta") or (run.metas[0] if run.metas else {})
        row.update(
            _file=str(path),
            _origin=run.origin,
            _date=str(meta.get("date") or "")[:10] or (run.committed_in or "").partition(" ")[2] or None,
            _when=str(meta.get("date") or "") or None,  # the full timestamp: orders runs of one day
            _rev=row.get("git") or meta.get("git"),
            _machine=machine_identity(meta),
            _order=next(_ORDER),
        )
    for meta in run.metas:
        meta.pop("_meta", None)
    return run


def of_kind(runs: list[Run], kind: str) -> list[Row]:
    return [row for run in runs for row in run.rows if row["kind"] == kind]
