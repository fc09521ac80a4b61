"""``attnzoo report RUNS... --out DIR``: one self-contained HTML page (inline CSS, PNGs beside
it, no network resources) from any number of benchmark JSONL files.

Rows are dispatched by ``kind``: ``meta`` (what made the file), ``train`` (accuracy, steps/s),
``speed`` / ``sdpa`` / ``fit`` (``bench speed``), ``profile`` (``bench profile``) and
``fidelity``; other kinds are counted and otherwise ignored. Accuracies and chance levels in
train rows are fractions in [0, 1] and shown as percentages. The tables and chart inputs are
computed by pure functions (``lra_table``, ``bubble_points``, ...) that the tests check.
"""

from __future__ import annotations

import argparse
import html
import json
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from attnzoo.bench import plots
from attnzoo.bench.plots import label, speed_ratios, train_speed_ratios, usable
from attnzoo.registry import EXACT

Row = dict[str, Any]


@dataclass
class Run:
    """One input file: its meta rows and its other rows (each tagged with ``_file``)."""

    path: str
    metas: list[Row] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)


def load_run(path: str | Path) -> Run:
    """Read one JSONL file; ValueError naming ``file:line`` for a line that is not a JSON object
    with a ``kind``, or naming the file when it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{path}: cannot read benchmark results ({error.strerror or error})") from None
    run = Run(str(path))
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
        row["_file"] = str(path)
        (run.metas if row["kind"] == "meta" else run.rows).append(row)
    return run


def of_kind(runs: list[Run], kind: str) -> list[Row]:
    return [row for run in runs for row in run.rows if row["kind"] == kind]


def lra_table(rows: list[Row]) -> dict[str, Any]:
    """Task x mechanism test accuracy (%) from train rows of one size. Several runs of a cell are
    averaged (their count kept); a cell whose runs all failed has accuracy None and the errors.
    ``average`` is over the tasks a mechanism has, ``missing`` lists the others, ``best`` the
    top mechanism(s) per task. Mechanisms are sorted by average, best first."""
    tasks = sorted({r["task"] for r in rows})
    chance = {
        t: next((100 * r["chance"] for r in rows if r["task"] == t and r.get("chance") is not None), None)
        for t in tasks
    }
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        cell = cells.setdefault(label(r), {}).setdefault(r["task"], {"accuracies": [], "errors": []})
        if "error" in r or r.get("test_accuracy") is None:
            cell["errors"].append(str(r.get("error", "no test_accuracy")))
        else:
            cell["accuracies"].append(100 * r["test_accuracy"])
    for by_task in cells.values():
        for cell in by_task.values():
            cell["accuracy"] = statistics.fmean(cell["accuracies"]) if cell["accuracies"] else None
            cell["runs"] = len(cell["accuracies"])
    have = {m: [t for t in tasks if cells[m].get(t, {}).get("accuracy") is not None] for m in cells}
    average = {m: statistics.fmean(cells[m][t]["accuracy"] for t in ts) if ts else None for m, ts in have.items()}
    missing = {m: [t for t in tasks if t not in ts] for m, ts in have.items()}
    best = {}
    for t in tasks:
        scores = {m: c[t]["accuracy"] for m, c in cells.items() if c.get(t, {}).get("accuracy") is not None}
        best[t] = sorted(m for m, s in scores.items() if s == max(scores.values())) if scores else []
    order = sorted(cells, key=lambda m: (average[m] is None, -(average[m] or 0), m))
    return {
        "tasks": tasks,
        "chance": chance,
        "mechanisms": order,
        "cells": cells,
        "average": average,
        "missing": missing,
        "best": best,
    }


def main_size(train: list[Row]) -> str | None:
    """The model size with the most train rows: the one the bubble chart is drawn for."""
    counts = Counter(str(r.get("size")) for r in train)
    return counts.most_common(1)[0][0] if counts else None


def comparable_accuracy(table: dict[str, Any]) -> tuple[dict[str, float], list[str] | None]:
    """Each mechanism's mean accuracy over the tasks that every mechanism with a result ran, so a
    mechanism that skipped a task (a non-causal one on MQAR) is not ranked on easier ground.
    Without such a common task: the task most mechanisms ran, for those mechanisms only (the
    others are then listed under the chart as not plotted). Returns (accuracy, tasks used)."""
    cells, tasks = table.get("cells", {}), table.get("tasks", [])
    scored = {m: {t for t in tasks if c.get(t, {}).get("accuracy") is not None} for m, c in cells.items()}
    scored = {m: ts for m, ts in scored.items() if ts}
    common = sorted(set(tasks).intersection(*scored.values())) if scored else []
    if not common and scored:
        # No task that all ran: use the task most mechanisms ran, and only those mechanisms.
        counts = Counter(t for ts in scored.values() for t in ts)
        common = [max(sorted(counts), key=counts.__getitem__)]
        scored = {m: ts for m, ts in scored.items() if common[0] in ts}
    if not common:
        return {}, None
    return {m: statistics.fmean(cells[m][t]["accuracy"] for t in common) for m in scored}, common


def bubble_points(train: list[Row], speed: list[Row]) -> dict[str, Any]:
    """Inputs of the bubble chart: x = speed relative to softmax (train steps/s where softmax has
    train speed, else speed rows' forward time), y = average accuracy of the main size's LRA
    table, memory = the largest train ``peak_memory_bytes`` of the mechanism (or the speed row's
    peak forward bytes). Mechanisms with only one of x, y are listed, not plotted."""
    size = main_size(train)
    rows = [r for r in train if str(r.get("size")) == size]
    accuracy, common = comparable_accuracy(lra_table(rows) if rows else {})
    basis = f"mean test accuracy over {', '.join(common)}" if common else "test accuracy"
    x = train_speed_ratios(rows)
    if x:
        peaks: dict[str, list[int]] = {}
        for r in rows:
            if usable(r, "peak_memory_bytes"):
                peaks.setdefault(label(r), []).append(r["peak_memory_bytes"])
        memory = {m: max(v) for m, v in peaks.items()}
        source = (
            f"x: train steps/s over softmax's, geometric mean over tasks; y: {basis}; "
            f"area: peak training memory (size {size})"
        )
    else:
        measured = speed_ratios(speed)
        x = {m: v[0] for m, v in measured.items()}
        memory = {m: v[1] for m, v in measured.items()}
        sizes = sorted({v[2] for v in measured.values()})
        source = (
            f"x: softmax forward time / mechanism's (speed rows, largest common N: {sizes}); "
            f"y: {basis} (size {size}); area: peak forward memory"
        )
    points = [
        {"label": m, "x": x[m], "y": accuracy[m], "memory": memory.get(m)} for m in sorted(set(x) & set(accuracy))
    ]
    return {
        "points": points,
        "source": source,
        "no_speed": sorted(set(accuracy) - set(x)),
        "no_accuracy": sorted(set(x) - set(accuracy)),
    }


def mqar_rows(train: list[Row]) -> list[dict[str, Any]]:
    """Every mechanism's mean accuracy (%) on task "mqar" per size, beside softmax's at the same
    size, best first; failed runs have accuracy None and their error."""
    table = {}
    for size in sorted({str(r.get("size")) for r in train if r["task"] == "mqar"}):
        lra = lra_table([r for r in train if r["task"] == "mqar" and str(r.get("size")) == size])
        softmax = lra["cells"].get(EXACT, {}).get("mqar", {}).get("accuracy")
        for m in lra["mechanisms"]:
            cell = lra["cells"][m]["mqar"]
            table[(m, size)] = {
                "mechanism": m,
                "size": size,
                "accuracy": cell["accuracy"],
                "exact": softmax,
                "error": "; ".join(cell["errors"]) or None,
            }
    return sorted(table.values(), key=lambda r: (r["accuracy"] is None, -(r["accuracy"] or 0), r["mechanism"]))


def _e(value: Any) -> str:
    return html.escape(str(value))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _num(value: Any, spec: str) -> str:
    return f"{value:{spec}}" if isinstance(value, (int, float)) else "-"


def _table(headers: list[str], body: list[str]) -> str:
    head = "".join(f"<th>{h}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _missing(what: str, how: str) -> str:
    return f'<p class="missing">No {what} rows in the inputs: {how}.</p>'


def _cell(cell: dict[str, Any] | None, best: bool) -> str:
    """One accuracy cell: failed runs as "failed" with the error on hover, never as 0."""
    if cell is None:
        return '<td class="absent" title="not run">&ndash;</td>'
    if cell["accuracy"] is None:
        return f'<td class="failed" title="{_e("; ".join(cell["errors"]))}">failed</td>'
    note = f"mean of {cell['runs']} runs" if cell["runs"] > 1 else ""
    if cell["errors"]:
        note += f" ({len(cell['errors'])} failed: {'; '.join(cell['errors'])})"
    text = f"<b>{_pct(cell['accuracy'])}</b>" if best else _pct(cell["accuracy"])
    return f'<td title="{_e(note)}">{text}</td>' if note else f"<td>{text}</td>"


def lra_html(table: dict[str, Any]) -> str:
    tasks = table["tasks"]
    headers = ["mechanism"] + [f"{_e(t)}<br><small>chance {_pct(table['chance'][t])}</small>" for t in tasks]
    body = []
    for m in table["mechanisms"]:
        cells = "".join(_cell(table["cells"][m].get(t), m in table["best"][t]) for t in tasks)
        missing, average = table["missing"][m], table["average"][m]
        mark = (
            f'<td title="average over {len(tasks) - len(missing)} of {len(tasks)} tasks; missing: '
            f'{_e(", ".join(missing))}">{_pct(average)}*</td>'
            if missing and average is not None
            else f"<td>{_pct(average)}</td>"
        )
        body.append(f"<tr><th>{_e(m)}</th>{cells}{mark}</tr>")
    return _table(headers + ["average"], body)


def lra_section(train: list[Row]) -> str:
    if not train:
        return _missing("train", "run attnzoo bench train to fill the accuracy table")
    parts = [
        "<p>Test accuracy (%) per task; best per task in bold; * = averaged over the tasks the "
        "mechanism has (hover for the missing ones); failed runs show their error on hover.</p>"
    ]
    for size in sorted({str(r.get("size")) for r in train}):
        parts += [f"<h3>size: {_e(size)}</h3>", lra_html(lra_table([r for r in train if str(r.get("size")) == size]))]
    body = []
    for r in sorted(train, key=lambda r: (str(r.get("size")), r["task"], label(r))):
        start = f"<tr><td>{_e(r.get('size'))}</td><td>{_e(r['task'])}</td><td>{_e(label(r))}</td>"
        if "error" in r:
            body.append(f'{start}<td class="failed" colspan="5">failed: {_e(r["error"])}</td></tr>')
            continue
        peak = r.get("peak_memory_bytes")
        figures = [
            _pct(100 * r["test_accuracy"]) if r.get("test_accuracy") is not None else "-",
            _num(r.get("steps_per_s"), ".2f"),
            _num(r.get("tokens_per_s"), ",.0f"),
            "-" if peak is None else f"{peak / 2**20:.0f}",
            _num(r.get("wall_s"), ".0f"),
        ]
        body.append(start + "".join(f"<td>{f}</td>" for f in figures) + "</tr>")
    headers = ["size", "task", "mechanism", "test acc %", "steps/s", "tokens/s", "peak MiB", "wall s"]
    return "\n".join(parts + ["<h3>Cost per run</h3>", _table(headers, body)])


def bubble_section(train: list[Row], speed: list[Row], image: Callable) -> str:
    if not train:
        return _missing("train", "the chart needs accuracy from attnzoo bench train")
    data = bubble_points(train, speed)
    parts = []
    if data["points"]:
        name = image("bubbles.png", lambda p: plots.bubble_chart(data["points"], p, data["source"]))
        parts.append(f'<img src="{name}" alt="speed vs accuracy bubble chart">' if name else "<p>chart failed</p>")
    else:
        parts.append("<p>No mechanism has both an accuracy and a speed relative to softmax.</p>")
    parts.append(f"<p>{_e(data['source'])}.</p>")
    for key, what in (
        ("no_speed", "accuracy but no speed relative to softmax"),
        ("no_accuracy", "speed but no accuracy"),
    ):
        if data[key]:
            parts.append(f"<p>Not plotted ({what}): {_e(', '.join(data[key]))}.</p>")
    return "\n".join(parts)


def _charts(groups: dict[str, list], image: Callable, stem: str, what: str, **kwargs: Any) -> list[str]:
    """One line chart per family group; the <img> tags (or a note where drawing failed)."""
    parts = []
    for fam, lines in groups.items():
        slug = "".join(c if c.isalnum() else "-" for c in fam)
        draw = lambda p, ls=lines, t=f"{what}: {fam}": plots.lines_chart(ls, p, title=t, **kwargs)  # noqa: E731
        name = image(f"{stem}-{slug}.png", draw)
        parts.append(
            f'<img src="{name}" alt="{_e(what)}: {_e(fam)}">' if name else f"<p>{_e(what)} {_e(fam)}: chart failed</p>"
        )
    return parts


def scaling_section(speed: list[Row], sdpa: list[Row], fit: list[Row], image: Callable) -> str:
    if not speed:
        return _missing("speed", "run attnzoo bench speed over several --n")
    parts = [
        "<p>Median forward time and peak forward memory (RSS growth) from <code>bench speed</code>, one line "
        "per mechanism and backend, log-log; dashed: dense SDPA (median over input files). The legend gives "
        "the fitted exponent (1 = linear, 2 = quadratic) from the fit rows, else from the points.</p>"
    ]
    for metric, stem, what, unit in (
        ("forward_s", "time", "forward time vs N", "seconds"),
        ("peak_forward_bytes", "memory", "peak forward memory vs N", "bytes"),
    ):
        parts += _charts(
            plots.speed_lines(speed, fit, metric),
            image,
            stem,
            what,
            ylabel=unit,
            references=plots.sdpa_lines(sdpa, metric),
        )
    return "\n".join(parts)


def mqar_section(train: list[Row]) -> str:
    rows = mqar_rows(train)
    if not rows:
        return _missing('train rows for task "mqar"', "run attnzoo bench train on the mqar task")
    body = []
    for r in rows:
        if r["accuracy"] is None:
            acc = f'<td class="failed" title="{_e(r["error"])}">failed</td><td>-</td>'
        else:
            gap = "-" if r["exact"] is None else f"{r['accuracy'] - r['exact']:+.1f}"
            acc = f"<td>{_pct(r['accuracy'])}</td><td>{gap}</td>"
        body.append(f"<tr><th>{_e(r['mechanism'])}</th><td>{_e(r['size'])}</td>{acc}<td>{_pct(r['exact'])}</td></tr>")
    note = "<p>Multi-query associative recall (causal): accuracy (%) beside softmax's at the same size, best first.</p>"
    return note + _table(["mechanism", "size", "accuracy %", "vs softmax", "softmax %"], body)


def gallery_section(image: Callable, gallery: bool) -> str:
    if not gallery:
        return '<p class="missing">Gallery left out (--no-gallery).</p>'
    from attnzoo.viz import gallery as draw_gallery

    drawn: list[Path] = []
    name = image("gallery/index.html", lambda p: drawn.extend(draw_gallery(p.parent, n=64, block=8)))
    if name is None:
        return "<p>The gallery failed to draw (see the list of failed images).</p>"
    pictures = "".join(
        f'<figure><img src="gallery/{_e(p)}" alt="{_e(p[:-4])} pattern"><figcaption>{_e(p[:-4])}</figcaption></figure>'
        for p in (d.name for d in drawn if d.suffix == ".png")
    )
    return (
        "<p>Which (query, key) pairs each sparse mechanism computes at N = 64, with its 8x8 kernel tiles "
        f'(<a href="gallery/index.html">captions and configs</a>).</p><div class="thumbs">{pictures}</div>'
    )


def profile_section(profile: list[Row], image: Callable) -> str:
    if not profile:
        return _missing("profile", "run attnzoo bench profile")
    parts = [
        "<p>One pre-norm layer per mechanism (<code>bench profile</code>): the attention sublayer's share of "
        "attention + feed-forward time, against N. Where it is small, a faster attention buys little.</p>"
    ]
    parts += _charts(
        plots.profile_lines(profile),
        image,
        "profile",
        "attention share of layer time",
        ylabel="attention share (%)",
        logy=False,
        ylim=(0, 100),
    )
    sizes = sorted({r["n"] for r in profile})
    cells: dict[str, dict[int, str]] = {}
    for r in profile:
        if "error" in r:
            text = f'<td class="failed" title="{_e(r["error"])}">failed</td>'
        else:
            text = (
                f'<td title="attention {r["attention_s"] * 1e3:.2f} ms, FFN {r["ffn_s"] * 1e3:.2f} ms, layer '
                f'{r["block_s"] * 1e3:.2f} ms">{100 * r["attention_share"]:.0f}%</td>'
            )
        cells.setdefault(label(r), {})[r["n"]] = text
    body = [
        f"<tr><th>{_e(m)}</th>" + "".join(c.get(n, "<td>-</td>") for n in sizes) + "</tr>"
        for m, c in sorted(cells.items())
    ]
    return "\n".join(parts + [_table(["mechanism"] + [f"N={n}" for n in sizes], body)])


def fidelity_section(fidelity: list[Row]) -> str:
    if not fidelity:
        return _missing("fidelity", "run attnzoo bench fidelity")
    body = []
    for r in sorted(fidelity, key=label):
        start = f"<tr><th>{_e(r['mechanism'])}</th><td>{_e(json.dumps(r.get('config') or {}))}</td>"
        if not r.get("applicable", True) or "error" in r:
            reason = r.get("reason") or r.get("error")
            body.append(f'{start}<td colspan="4" class="absent">not applicable: {_e(reason)}</td></tr>')
            continue
        figures = [f"{r[k]:.4f}" if isinstance(r.get(k), (int, float)) else "-" for k in ("mean_cosine", "min_cosine")]
        r1 = r.get("retrieval_at_1")
        figures += ["-" if r1 is None else f"{100 * r1:.1f}%", _e(r.get("model", "-"))]
        body.append(start + "".join(f"<td>{f}</td>" for f in figures) + "</tr>")
    note = "<p>A pretrained model's softmax attention swapped for each mechanism: cosine to the original outputs.</p>"
    return note + _table(["mechanism", "config", "mean cosine", "min cosine", "retrieval@1", "model"], body)


def provenance_section(runs: list[Run]) -> str:
    keys = ("command", "processor", "cpus", "torch_threads", "torch", "date", "git")
    parts = []
    for run in runs:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(Counter(r["kind"] for r in run.rows).items()))
        parts.append(f"<h3><code>{_e(run.path)}</code></h3><p>{counts or 'no rows'}</p>")
        for meta in run.metas:
            parts.append(
                "<ul>" + "".join(f"<li>{k}: <code>{_e(meta[k])}</code></li>" for k in keys if k in meta) + "</ul>"
            )
        commands = sorted(
            {(r.get("command"), r.get("git")) for r in run.rows if r["kind"] == "train" and r.get("command")}
        )
        parts += [f"<p>train: <code>{_e(c)}</code> at git <code>{_e(g)}</code></p>" for c, g in commands]
        if not run.metas and not commands:
            parts.append('<p class="missing">No meta row: what made these numbers is unknown.</p>')
    return "\n".join(parts)


SECTIONS = (
    ("lra", "Accuracy per task (LRA-style)"),
    ("bubbles", "Speed, accuracy and memory"),
    ("scaling", "Time and memory against N"),
    ("mqar", "MQAR: associative recall"),
    ("gallery", "Attention patterns"),
    ("profile", "Is your bottleneck really attention?"),
    ("fidelity", "Fidelity in a pretrained model"),
    ("provenance", "Provenance: what made these numbers"),
)


def page(runs: list[Run], image: Callable, gallery: bool) -> str:
    """The whole HTML page (every section, missing ones say what is missing)."""
    train, speed = of_kind(runs, "train"), of_kind(runs, "speed")
    bodies = {
        "lra": lra_section(train),
        "bubbles": bubble_section(train, speed, image),
        "scaling": scaling_section(speed, of_kind(runs, "sdpa"), of_kind(runs, "fit"), image),
        "mqar": mqar_section(train),
        "gallery": gallery_section(image, gallery),
        "profile": profile_section(of_kind(runs, "profile"), image),
        "fidelity": fidelity_section(of_kind(runs, "fidelity")),
        "provenance": provenance_section(runs),
    }
    toc = "".join(f'<li><a href="#{key}">{title}</a></li>' for key, title in SECTIONS)
    sections = "\n".join(f'<section id="{key}"><h2>{title}</h2>\n{bodies[key]}</section>' for key, title in SECTIONS)
    return _PAGE.format(files=len(runs), toc=toc, sections=sections)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>attnzoo report</title><style>
body {{ font-family: sans-serif; margin: 1.5em auto; max-width: 75em; padding: 0 1em; }}
table {{ border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
thead th {{ background: #f0f0f0; text-align: center; }} tbody th {{ text-align: left; font-weight: normal; }}
td.failed {{ color: #b00020; cursor: help; }} td.absent, .missing {{ color: #777; }}
img {{ max-width: 100%; }}
.thumbs {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 1em; }}
figure {{ margin: 0; }} figcaption {{ font-size: 0.8em; text-align: center; }}
</style></head><body><h1>attnzoo benchmark report</h1>
<p>Built from {files} result file(s); every number is from the machine and command listed under Provenance.</p>
<ul>{toc}</ul>
{sections}
</body></html>
"""


def render(runs: list[Run], out: Path, *, gallery: bool = True) -> tuple[Path, list[str]]:
    """Write ``out/index.html`` with its PNGs; returns the page and the images that failed."""
    out.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []

    def image(name: str, draw: Callable[[Path], Any]) -> str | None:
        try:
            draw(out / name)
            return name
        # A chart that cannot be drawn is reported on the page and in the return value; the
        # rest of the report is still written.
        except Exception as error:  # noqa: BLE001
            failed.append(f"{name}: {type(error).__name__}: {error}")
            return None

    text = page(runs, image, gallery)
    index = out / "index.html"
    index.write_text(text, encoding="utf-8")
    return index, failed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``attnzoo report``."""
    parser.add_argument("runs", nargs="+", metavar="RUNS.jsonl", help="benchmark result files (any kinds, any number)")
    parser.add_argument("--out", default="report", help="output folder (default report/): index.html and PNGs")
    parser.add_argument("--no-gallery", action="store_true", help="leave out the pattern gallery")


def main(args: argparse.Namespace, console: Console) -> list[str]:
    """Write the report; prints where it is and any image that failed. Returns the failures."""
    runs = [load_run(path) for path in args.runs]
    index, failed = render(runs, Path(args.out), gallery=not args.no_gallery)
    for failure in failed:
        console.print(f"[red]image failed:[/red] {html.unescape(failure)}")
    console.print(f"report: {index}")
    return failed
