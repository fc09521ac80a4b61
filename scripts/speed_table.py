"""Print the README's practical-speed tables (markdown) from an ``attnzoo bench speed`` file.

    python scripts/speed_table.py benchmarks/speed-practical-cpu.jsonl

One table per causality: per mechanism, the forward+backward speed-up over dense SDPA at each N
(median of interleaved pairs; in brackets the density bound 1/density where the pattern fixes
it), the forward speed-up at the largest N, and the crossover N (smallest N from which it stays
ahead of SDPA, forward+backward; "—" where the run was cut before its fit rows). A † marks a
default config sized for that N (``sized_for``: the default is not defined there, e.g.
``axial``'s 32 x 32 grid).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _cell(row: dict | None) -> str:
    if row is None:
        return "—"
    if "error" in row:
        return "error"
    ratio = row.get("speedup_forward_backward_vs_sdpa")
    if ratio is None:
        return "unchecked" if row.get("correct") is None else "—"
    bound = row.get("density_bound")
    text = f"{ratio:.2f}×" + (f" ({bound:.0f})" if bound else "")
    text = f"**{text}**" if ratio >= 1 else text
    return text + "†" if row.get("sized_for") else text  # a default not defined at N, sized for it


def tables(rows: list[dict]) -> str:
    speed = [r for r in rows if r["kind"] == "speed"]
    fits = {(r["mechanism"], r.get("causal", False)): r for r in rows if r["kind"] == "fit"}
    sizes = sorted({r["n"] for r in speed})
    out = []
    for causal in (False, True):
        group = [r for r in speed if r.get("causal", False) == causal]
        names = sorted({r["mechanism"] for r in group if "error" not in r and r.get("correct") is not None})
        if not names:
            continue
        head = ["mechanism", *(f"N={n}" for n in sizes), f"fwd N={sizes[-1]}", "crossover N"]
        out += [
            f"**{'Causal' if causal else 'Non-causal'}** (vs SDPA{' causal' if causal else ''}, fwd+bwd; "
            "bold: faster than SDPA; (bound) = 1/density)",
            "",
            "| " + " | ".join(head) + " |",
            "|" + " --- |" * len(head),
        ]
        for name in names:
            by_n = {r["n"]: r for r in group if r["mechanism"] == name}
            last = by_n.get(sizes[-1], {})
            fwd = last.get("speedup_forward_vs_sdpa")
            fit = fits.get((name, causal), {})
            cross = fit.get("crossover_n")
            out.append(
                "| "
                + " | ".join(
                    [
                        f"`{name}`",
                        *(_cell(by_n.get(n)) for n in sizes),
                        f"{fwd:.2f}×" if fwd else "—",
                        str(cross) if cross else "never" if fit else "—",  # no fit: a run cut short
                    ]
                )
                + " |"
            )
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    lines = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    meta = lines[0]
    print(
        f"`{meta.get('command')}` at git `{meta.get('git')}`, {meta.get('processor')} ({meta.get('cpus')} cores, "
        f"torch {meta.get('torch')}), {meta.get('date')}; B=1, H=8, D=64, fp32.\n"
    )
    print(tables(lines))
