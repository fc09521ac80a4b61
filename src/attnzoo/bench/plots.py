"""The report's charts, drawn headless with matplotlib's Agg canvas (no pyplot state, no
display): the speed/accuracy bubble chart, time and memory against N, and attention's share of
a layer's time against N. Each function writes one PNG and returns its path."""

from __future__ import annotations

import itertools
import math
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from attnzoo.bench.speed import fitted_exponent

#: One style per line: ten colours times five markers, so ~35 mechanisms stay apart. Dashed
#: lines are kept for the SDPA reference.
STYLES = [dict(color=c, marker=m) for m, c in itertools.product("os^Dv", [f"C{i}" for i in range(10)])]

Row = dict[str, Any]
Line = tuple[str, Sequence[float], Sequence[float]]  # (legend label, xs, ys)


def label(row: Row) -> str:
    """``name`` or ``name:key=value,...`` (the ``--mechanism`` syntax) for a row's mechanism;
    ``name:sized`` for a train row whose config was sized to its task."""
    config = row.get("config") or {}
    if row.get("sized") and config:
        # Sized to each task's length (bench train --sized): one label across tasks of any length.
        return row["mechanism"] + ":sized"
    return row["mechanism"] + (":" + ",".join(f"{k}={v}" for k, v in sorted(config.items())) if config else "")


def family(name: str) -> str:
    """The registry's family of ``name``; "other" for names this installation does not know."""
    from attnzoo.registry import describe

    try:
        return describe(name).family
    except (KeyError, ValueError):
        return "other"


def usable(row: Row, key: str) -> bool:
    return "error" not in row and isinstance(row.get(key), (int, float)) and row[key] > 0


def speed_lines(speed: list[Row], metric: str) -> dict[str, list[Line]]:
    """Lines of ``metric`` ("forward_s", "forward_backward_s" or "peak_forward_bytes") against N
    per family, one per (mechanism and config, backend, causal, heads), with the exponent fitted
    to the drawn points in the legend. Families with fewer than three lines are pooled under
    "other families"."""
    groups: dict[tuple, dict[int, float]] = {}
    for r in speed:
        if usable(r, metric) and r.get("correct") is not False:
            key = (label(r), r["mechanism"], r.get("backend"), bool(r.get("causal")), r.get("heads"))
            groups.setdefault(key, {})[r["n"]] = r[metric]
    several_heads = len({k[4] for k in groups}) > 1
    by_family: dict[str, list[Line]] = {}
    for (text, name, backend, causal, heads), points in sorted(groups.items(), key=str):
        ns = sorted(points)
        exponent = fitted_exponent(ns, [points[n] for n in ns])
        text += f" [{backend}]" + (" causal" if causal else "") + (f" H={heads}" if several_heads else "")
        text += f"  N^{exponent:.2f}" if exponent is not None else ""
        by_family.setdefault(family(name), []).append((text, ns, [points[n] for n in ns]))
    return _pool_small(by_family)


def _pool_small(by_family: dict[str, list]) -> dict[str, list]:
    pooled: dict[str, list] = {}
    for fam, lines in sorted(by_family.items()):
        pooled.setdefault(fam if len(lines) >= 3 else "other families", []).extend(lines)
    return pooled


def sdpa_lines(sdpa: list[Row], metric: str) -> list[Line]:
    """Dense SDPA reference lines (non-causal, causal): the median over input files at each N."""
    lines = []
    for causal in (False, True):
        values: dict[int, list[float]] = {}
        for r in sdpa:
            if bool(r.get("causal")) == causal and usable(r, metric):
                values.setdefault(r["n"], []).append(r[metric])
        ns = sorted(values)
        if ns:
            ys = [statistics.median(values[n]) for n in ns]
            exponent = fitted_exponent(ns, ys)
            lines.append(
                (f"SDPA dense{' causal' if causal else ''}" + (f"  N^{exponent:.2f}" if exponent else ""), ns, ys)
            )
    return lines


def profile_lines(profile: list[Row]) -> dict[str, list[Line]]:
    """Attention share of (attention + FFN) time in % against N, one line per mechanism."""
    groups: dict[str, dict[int, float]] = {}
    for r in profile:
        if usable(r, "attention_share"):
            groups.setdefault(label(r) + (" causal" if r.get("causal") else ""), {})[r["n"]] = (
                100 * r["attention_share"]
            )
    by_family: dict[str, list[Line]] = {}
    for text, points in sorted(groups.items()):
        ns = sorted(points)
        by_family.setdefault(family(text.split(":")[0].split(" ")[0]), []).append((text, ns, [points[n] for n in ns]))
    return _pool_small(by_family)


def _bytes(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _save(fig: Figure, out: Path) -> Path:
    FigureCanvasAgg(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return out


def bubble_chart(
    points: list[dict[str, Any]],
    out: Path,
    title: str,
    xlabel: str = "forward+backward speed over dense SDPA at N=4096 (log scale; > 1 is faster)",
) -> Path:
    """One bubble per mechanism at ``(x, y)`` with area proportional to ``memory`` (bytes; None
    draws a hollow bubble of the smallest size). ``points``: dicts with label, x, y, memory."""
    fig = Figure(figsize=(9, 6.2))
    ax = fig.add_subplot()
    known = [p["memory"] for p in points if p.get("memory")]
    top = max(known, default=1)
    # Area in points^2: the largest memory gets 2000, so bubbles overlap little at ~35 labels.
    area = lambda m: 30 + 2000 * m / top if m else 30  # noqa: E731
    for i, p in enumerate(points):
        colour = STYLES[i % 10]["color"]
        face = colour if p.get("memory") else "none"
        ax.scatter([p["x"]], [p["y"]], s=area(p.get("memory")), facecolors=face, edgecolors=colour, alpha=0.55)
        ax.annotate(p["label"], (p["x"], p["y"]), xytext=(6, 4), textcoords="offset points", fontsize=7)
    ax.set_xscale("log")
    # "0.5x", "2x" instead of matplotlib's "5 x 10^-1" on a log axis.
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if f"{v:.0e}"[0] in "25" else ""))
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean test accuracy (%)")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if known:
        sizes = sorted({top, top / 4, top / 16})
        handles = [
            Line2D(
                [],
                [],
                linestyle="none",
                marker="o",
                color="grey",
                alpha=0.5,
                markersize=math.sqrt(area(m)),
                label=_bytes(m),
            )
            for m in sizes
        ]
        ax.legend(
            handles=handles,
            title="peak memory",
            loc="upper left",
            bbox_to_anchor=(1.01, 1),
            labelspacing=2.2,
            borderpad=1.2,
            frameon=False,
            fontsize=8,
        )
    return _save(fig, out)


def lines_chart(
    lines: list[Line],
    out: Path,
    *,
    title: str,
    ylabel: str,
    logy: bool = True,
    references: Sequence[Line] = (),
    ylim: tuple[float, float] | None = None,
) -> Path:
    """Log-x line chart, one styled line per entry, ``references`` dashed in black/grey, the
    legend outside on the right."""
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    for (label, xs, ys), style in zip(lines, itertools.cycle(STYLES)):
        ax.plot(xs, ys, label=label, linewidth=1.2, markersize=4, **style)
    for (label, xs, ys), colour in zip(references, itertools.cycle(["black", "dimgrey"])):
        ax.plot(xs, ys, label=label, color=colour, linestyle="--", linewidth=1.6, marker="x")
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_xlabel("sequence length N (log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if lines or references:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    return _save(fig, out)
