"""``attnzoo report RUNS... --out DIR``: one self-contained HTML page (inline CSS, PNGs beside
it, no network resources) from any number of benchmark JSONL files.

Rows are dispatched by ``kind``: ``meta`` (what made the file: machine, date, git revision),
``train`` (accuracy), ``speed`` / ``sdpa`` (``bench speed``), ``profile`` (``bench profile``) and
``fidelity``; other kinds are counted and otherwise ignored. Every figure on the page is labelled
with its source: fresh (made by this suite run), committed (a file git tracks unmodified) or an
uncommitted file, the file,
its date and the git revision that made it; rows made at a "+dirty" revision are flagged.

What is computed (``attnzoo.bench.pick``): one reference row per mechanism and task; a task
counts only where softmax beats chance by 10 points; averages only over equal task sets; speed
as each row's interleaved speed-up over dense SDPA; "which to pick", the Pareto front of (speed,
memory, accuracy) at N = 1K, 4K, 16K, causal and not. Speed rows from different machines are
refused (ValueError): their ratios would compare the machines.
"""

from __future__ import annotations

import argparse
import html
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from attnzoo.bench import pick
from attnzoo.bench.pick import BUBBLE_N, is_dirty
from attnzoo.bench.results import Run, load_run, of_kind
from attnzoo.bench.sections import (
    _e,
    _missing,
    bubble_section,
    fidelity_section,
    gallery_section,
    lra_section,
    pick_section,
    profile_section,
    provenance_section,
    scaling_section,
)

SECTIONS = (
    ("pick", "Which mechanism should I use?"),
    ("accuracy", "Accuracy per task (LRA-style)"),
    ("bubbles", f"Speed, accuracy and memory at N = {BUBBLE_N}"),
    ("scaling", "Speed and memory against N"),
    ("profile", "Is your bottleneck really attention?"),
    ("fidelity", "Fidelity in a pretrained model"),
    ("gallery", "Attention patterns"),
    ("provenance", "Provenance: what made these numbers"),
)


def page(runs: list[Run], image: Callable, gallery: bool) -> str:
    """The whole HTML page. Optional sections without rows (profile, fidelity) are left out and
    named at the top. Raises ValueError when speed rows come from several machines. Speed rows
    timed on scaled inputs (``bench speed --input-scale``) are another experiment: left out."""
    train = of_kind(runs, "train")
    speed, sdpa = ([r for r in of_kind(runs, kind) if r.get("input_scale", 1) == 1] for kind in ("speed", "sdpa"))
    pick.check_one_machine(speed + sdpa)
    table = pick.accuracy_table(train)
    profile, fidelity = of_kind(runs, "profile"), of_kind(runs, "fidelity")
    bodies = {
        "pick": pick_section(table, speed),
        "accuracy": lra_section(train),
        "bubbles": bubble_section(table, speed, image) if train else _missing("train", "the chart needs accuracy"),
        "scaling": scaling_section(speed, sdpa, image),
        "profile": profile_section(profile, image) if profile else None,
        "fidelity": fidelity_section(fidelity) if fidelity else None,
        "gallery": gallery_section(image, gallery),
        "provenance": provenance_section(runs),
    }
    absent = [title for key, title in SECTIONS if bodies[key] is None]
    shown = [(key, title) for key, title in SECTIONS if bodies[key] is not None]
    toc = "".join(f'<li><a href="#{key}">{title}</a></li>' for key, title in shown)
    sections = "\n".join(f'<section id="{key}"><h2>{title}</h2>\n{bodies[key]}</section>' for key, title in shown)
    dirty = sum(is_dirty(r.get("_rev")) for run in runs for r in run.rows)
    notes = (f"<p>Not in the inputs (left out): {_e(', '.join(absent))}.</p>" if absent else "") + (
        f'<p class="dirty">&dagger; {dirty} row(s) were made at a dirty git revision (uncommitted changes).</p>'
        if dirty
        else ""
    )
    sources = Counter(run.origin for run in runs)
    summary = ", ".join(f"{n} {origin}" for origin, n in sorted(sources.items()))
    return _PAGE.format(files=f"{len(runs)} result file(s) ({summary})", toc=toc, notes=notes, sections=sections)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>attnzoo report</title><style>
body {{ font-family: sans-serif; margin: 1.5em auto; max-width: 75em; padding: 0 1em; }}
table {{ border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
thead th {{ background: #f0f0f0; text-align: center; }} tbody th {{ text-align: left; font-weight: normal; }}
td.failed {{ color: #b00020; cursor: help; }} td.absent, .missing, .unlearned {{ color: #999; }}
.dirty {{ color: #b06000; }} td[title] {{ cursor: help; }}
img {{ max-width: 100%; }}
.thumbs {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 1em; }}
figure {{ margin: 0; }} figcaption {{ font-size: 0.8em; text-align: center; }}
</style></head><body><h1>attnzoo benchmark report</h1>
<p>Built from {files}; every number names its source (hover): fresh (this run), a committed or an
uncommitted file, its date and git revision; the machines are under Provenance.</p>
{notes}<ul>{toc}</ul>
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
