"""The sections of ``attnzoo report``'s page, each a function from rows to an HTML fragment
(``report.page`` puts them together; ``attnzoo.bench.pick`` computes what they show)."""

from __future__ import annotations

import html
import itertools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnzoo.bench import pick, plots
from attnzoo.bench.pick import BUBBLE_N, FWD, FWD_BWD, Column, accuracy, is_dirty, source_label
from attnzoo.bench.plots import label
from attnzoo.bench.results import Row, Run
from attnzoo.bench.speed import crossover


def lra_table(train: list[Row]) -> dict[str, Any]:
    """Per mechanism and task, the reference row's accuracy (%) or its errors: a task-keyed view
    of ``pick.accuracy_table`` (one column per task; the first column of a task wins)."""
    table = pick.accuracy_table(train)
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    for m, by in table["cells"].items():
        for c, r in by.items():
            cells.setdefault(m, {}).setdefault(
                c.task, {"accuracy": accuracy(r), "errors": [str(r["error"])] if "error" in r else []}
            )
    return {"cells": cells}


def _e(value: Any) -> str:
    return html.escape(str(value))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _num(value: Any, spec: str) -> str:
    return f"{value:{spec}}" if isinstance(value, (int, float)) else "-"


def _mib(value: Any) -> str:
    return f"{value / 2**20:.0f} MiB" if isinstance(value, (int, float)) else "-"


def _table(headers: list[str], body: list[str]) -> str:
    head = "".join(f"<th>{h}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _missing(what: str, how: str) -> str:
    return f'<p class="missing">No {what} rows in the inputs: {how}.</p>'


def _dagger(row: Row) -> str:
    return '<sup class="dirty" title="made at a dirty revision">&dagger;</sup>' if is_dirty(row.get("_rev")) else ""


def _names(columns: list[Column]) -> str:
    return ", ".join(c.name for c in columns)


# ---- which to pick -----------------------------------------------------------------------------


def pick_section(table: dict[str, Any], speed: list[Row]) -> str:
    if not speed or not table["columns"]:
        return _missing("speed and train", "which to pick needs both a speed sweep and accuracy")
    parts = [
        "<p>For each length and causality: the mechanisms on the Pareto front of speed (higher), peak forward "
        "memory (lower) and mean accuracy (higher); no other mechanism measured there is at least as good on all "
        "three. Speed is each row's own interleaved speed-up over dense SDPA (forward+backward where measured); "
        "accuracy is the mean over an equal set of tasks that softmax learned (causal tasks for causal picks), "
        "measured at the tasks' own short lengths with configs sized to them. Speed measured on: "
        f"{_e('; '.join(pick.machine_groups(speed)))}.</p>"
    ]
    for causal, n in itertools.product((False, True), pick.PICK_SIZES):
        result = pick.pick(table, speed, n, causal)
        title = f"N = {n}, {'causal' if causal else 'not causal'}"
        if not result["front"]:
            parts.append(f'<h3>{title}</h3><p class="missing">No mechanism has a speed row and an accuracy here.</p>')
            continue
        rows = result["rows"]
        items = "".join(
            f'<li title="{_e(source_label(rows[m]))}">{_e(pick.sentence(m, result))}{_dagger(rows[m])}</li>'
            for m in result["front"]
        )
        others = len(result["points"]) - len(result["front"])
        parts.append(
            f"<h3>{title}</h3><ul>{items}</ul><p><small>Accuracy over: {_e(_names(result['tasks']))}. "
            f"{others} other mechanism(s) measured here are dominated"
            + (f"; no accuracy or memory for: {_e(', '.join(result['unranked']))}" if result["unranked"] else "")
            + ".</small></p>"
        )
    return "\n".join(parts)


# ---- accuracy ----------------------------------------------------------------------------------


def _column_header(c: Column, info: dict[str, Any]) -> str:
    budget = "-".join(str(b) for b in info["budgets"][:1] + info["budgets"][-1:][len(info["budgets"]) < 2 :])
    note = {
        True: "",
        False: '<br><span class="unlearned">not learned at this budget</span>',
        None: '<br><span class="unlearned">no softmax run: not judged</span>',
    }[info["learned"]]
    return (
        f"{_e(c.name)}<br><small>chance {_pct(info['chance'])} &middot; softmax {_pct(info['softmax'])} "
        f"&middot; {budget or '?'} steps &middot; {c.origin}</small>{note}"
    )


def _accuracy_cell(row: Row | None, best: bool, learned: bool | None) -> str:
    if row is None:
        return '<td class="absent" title="not run">&ndash;</td>'
    where = source_label(row) + (f"; config {json.dumps(row.get('config'))}" if row.get("config") else "")
    if "error" in row:
        return f'<td class="failed" title="{_e(str(row["error"]) + "; " + where)}">failed</td>'
    acc = _pct(accuracy(row))
    text = f"<b>{acc}</b>" if best else acc
    return f'<td class="{"" if learned else "unlearned"}" title="{_e(where)}">{text}{_dagger(row)}</td>'


def accuracy_section(table: dict[str, Any]) -> str:
    columns, info, cells = table["columns"], table["info"], table["cells"]
    used, means = pick.common_tasks(table)
    best = pick.best_per_column(table)
    order = sorted(means, key=lambda m: (-means[m], m)) + sorted(set(cells) - set(means))
    headers = ["mechanism"] + [_column_header(c, info[c]) for c in columns]
    headers.append(f"mean over<br><small>{_e(_names(used)) or 'no common learned task'}</small>")
    body = []
    for m in order:
        row = "".join(_accuracy_cell(cells[m].get(c), m in best[c], info[c]["learned"]) for c in columns)
        mean = f"<td><b>{_pct(means[m])}</b></td>" if m in means else '<td class="absent" title="not ranked: '
        if m not in means:
            lacking = [c.name for c in used if accuracy(cells[m].get(c)) is None]
            mean += f'no result on {_e(", ".join(lacking))}">&ndash;</td>'
        body.append(f"<tr><th>{_e(m)}</th>{row}{mean}</tr>")
    note = (
        f"<p>Test accuracy (%), one reference row per mechanism and column (fresh, then uncommitted, then "
        f"committed files; a clean revision before a dirty one, then the longer training budget, then the "
        f"latest); hover a cell for its source (file, date, git revision). "
        f"A column counts only where softmax reaches chance + {pick.MARGIN:.0f} points; the others are greyed "
        f"and never ranked. The mean is over the same columns for every ranked mechanism "
        f"({_e(_names(used)) or 'none'}); best per counted column in bold; &dagger; = made at a dirty revision.</p>"
    )
    return note + _table(headers, body)


def lra_section(train: list[Row]) -> str:
    """The accuracy table and the cost of every run (failed runs with their error)."""
    if not train:
        return _missing("train", "run attnzoo bench train to fill the accuracy table")
    body = []
    for r in sorted(train, key=lambda r: (r.get("_origin", ""), r["task"], str(r.get("size")), label(r))):
        start = f"<tr><td>{_e(r.get('_origin', 'fresh'))}</td><td>{_e(r['task'])} {_e(r.get('size'))}</td>"
        start += f"<td>{_e(label(r))}</td>"
        if "error" in r:
            body.append(f'{start}<td class="failed" colspan="6">failed: {_e(r["error"])}</td></tr>')
            continue
        figures = [
            _pct(accuracy(r)),
            _num(r.get("steps"), "d"),
            _num(r.get("steps_per_s"), ".2f"),
            _mib(r.get("peak_memory_bytes")),
            _num(r.get("wall_s"), ".0f"),
            _e(r.get("_rev") or "-") + _dagger(r),
        ]
        body.append(start + "".join(f"<td>{f}</td>" for f in figures) + "</tr>")
    headers = ["source", "task", "mechanism", "test acc %", "steps", "steps/s", "peak", "wall s", "git"]
    return (
        accuracy_section(pick.accuracy_table(train))
        + f"<details><summary>Cost of every run ({len(train)})</summary>{_table(headers, body)}</details>"
    )


# ---- speed -------------------------------------------------------------------------------------


def bubble_section(table: dict[str, Any], speed: list[Row], image: Callable) -> str:
    rows = pick.speed_points(speed, BUBBLE_N, False, FWD_BWD)
    # x is speed without a causal mask: accuracy on the tasks without one too, where any was learned.
    used, means = pick.common_tasks(table, causal=False)
    if not used:
        used, means = pick.common_tasks(table)
    plotted = sorted(set(rows) & set(means))
    if not plotted:
        return _missing("speed and train", f"the chart needs forward+backward speed at N={BUBBLE_N} and accuracy")
    points = [
        {"label": m, "x": rows[m][FWD_BWD], "y": means[m], "memory": rows[m].get("peak_forward_bytes")} for m in plotted
    ]
    source = (
        f"x: forward+backward speed-up over dense SDPA at N={BUBBLE_N}, not causal (each row's interleaved "
        f"timing); y: mean test accuracy over {_names(used)}; area: peak forward memory at N={BUBBLE_N}"
    )
    name = image("bubbles.png", lambda p: plots.bubble_chart(points, p, source))
    parts = [f'<img src="{name}" alt="speed vs accuracy bubble chart">' if name else "<p>chart failed</p>"]
    parts.append(f"<p>{_e(source)}. Speed from: {_e(', '.join(sorted({rows[m]['_file'] for m in plotted})))}.</p>")
    for missing, what in (
        (sorted(set(means) - set(rows)), f"no forward+backward speed at N={BUBBLE_N}"),
        (sorted(set(rows) - set(means)), "no accuracy on that task set"),
    ):
        if missing:
            parts.append(f"<p>Not plotted ({what}): {_e(', '.join(missing))}.</p>")
    return "\n".join(parts)


def _speed_cell(row: Row | None) -> str:
    if row is None:
        return '<td class="absent">&ndash;</td>'
    ratio, mark = (row[FWD_BWD], "") if FWD_BWD in row else (row[FWD], " fwd")
    where = source_label(row) + (f"; config {json.dumps(row['config'])}" if row.get("config") else "")
    memory = _mib(row.get("peak_forward_bytes"))
    return f'<td title="{_e(where)}">{ratio:.2g}x{mark}<br><small>{memory}</small>{_dagger(row)}</td>'


def speed_table(speed: list[Row], causal: bool) -> str:
    """Mechanism x N: the speed-up over SDPA (forward+backward, else forward, marked) and peak
    forward memory, and the crossover N (smallest N from which it beats SDPA)."""
    sizes = sorted({r["n"] for r in speed if bool(r.get("causal")) == causal and r.get("_origin") == "fresh"})
    sizes = sorted(set(sizes) | set(pick.PICK_SIZES))
    by_n = {n: {**pick.speed_points(speed, n, causal, FWD), **pick.speed_points(speed, n, causal)} for n in sizes}
    names = sorted({m for rows in by_n.values() for m in rows})
    if not names:
        return ""
    body = []
    for m in names:
        measured = [by_n[n][m] for n in sizes if m in by_n[n]]
        # One metric per crossover: forward+backward where measured, else forward.
        cross = crossover([r for r in measured if FWD_BWD in r] or measured)
        cells = "".join(_speed_cell(by_n[n].get(m)) for n in sizes)
        body.append(f"<tr><th>{_e(m)}</th>{cells}<td>{cross or 'never'}</td></tr>")
    return f"<h3>{'causal' if causal else 'not causal'}</h3>" + _table(
        ["mechanism"] + [f"N={n}" for n in sizes] + ["beats SDPA from N"], body
    )


def scaling_section(speed: list[Row], sdpa: list[Row], image: Callable) -> str:
    if not speed:
        return _missing("speed", "run attnzoo bench speed over several --n")
    parts = [
        "<p>Speed-up over dense SDPA timed interleaved with it (the machine is shared: only same-run ratios "
        "mean anything), forward+backward unless marked fwd, with peak forward memory; hover for the source. "
        "Then time and memory against N, log-log, one line per mechanism and config; dashed: dense SDPA. "
        "The legend gives the fitted exponent (1 = linear, 2 = quadratic).</p>",
        speed_table(speed, False),
        speed_table(speed, True),
    ]
    rows = list(
        pick.one_per(
            [r for r in speed if r.get("backend", "auto") == "auto"],
            lambda r: (label(r), bool(r.get("causal")), r.get("n"), r.get("heads")),
        ).values()
    )
    for metric, stem, what, unit in (
        ("forward_backward_s", "time-fwd-bwd", "forward+backward time vs N", "seconds"),
        ("forward_s", "time", "forward time vs N", "seconds"),
        ("peak_forward_bytes", "memory", "peak forward memory vs N", "bytes"),
    ):
        parts += _charts(
            plots.speed_lines(rows, metric), image, stem, what, ylabel=unit, references=plots.sdpa_lines(sdpa, metric)
        )
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
    keys = ("command", "processor", "cpu_flags", "cpus", "torch_threads", "torch", "date", "git")
    parts = []
    for run in runs:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(Counter(r["kind"] for r in run.rows).items()))
        revisions = sorted({str(r.get("_rev")) for r in run.rows if r.get("_rev")})
        dirty = [rev for rev in revisions if is_dirty(rev)]
        origin = run.origin + (f" (last commit {run.committed_in})" if run.committed_in else "")
        parts.append(
            f"<h3><code>{_e(run.path)}</code></h3><p>{_e(origin)}; {counts or 'no rows'}; git revisions: "
            f"{_e(', '.join(revisions) or 'unknown')}"
            + (f' <span class="dirty">&dagger; dirty: {_e(", ".join(dirty))}</span>' if dirty else "")
            + "</p>"
        )
        for meta in run.metas:
            parts.append(
                "<ul>" + "".join(f"<li>{k}: <code>{_e(meta[k])}</code></li>" for k in keys if k in meta) + "</ul>"
            )
        commands = sorted({str(r.get("command")) for r in run.rows if r["kind"] == "train" and r.get("command")})
        parts += [f"<p>train: <code>{_e(c)}</code></p>" for c in commands[:3]]
        if len(commands) > 3:
            parts.append(f"<p>... and {len(commands) - 3} more train commands (one per row, in the file).</p>")
        if not run.metas and not commands:
            parts.append('<p class="missing">No meta row: what made these numbers is unknown.</p>')
    return "\n".join(parts)
