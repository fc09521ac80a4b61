"""Pictures of attention patterns and weights, drawn headless with matplotlib (no pyplot).

>>> from attnzoo import patterns as P
>>> from attnzoo.viz import draw_pattern, gallery
>>> draw_pattern(P.longformer(3, [0]), 64, "longformer.png", block=8)  # doctest: +SKIP
>>> gallery("gallery/")  # one PNG per sparse mechanism + index.html   # doctest: +SKIP

Rows are queries i (top to bottom), columns keys j, as in the Longformer and BigBird papers.
"""

from __future__ import annotations

import html
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.collections import PatchCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from attnzoo import patterns as P
from attnzoo._checks import check_positive_int
from attnzoo.registry import EXACT, build, describe, names

STRONG, PARTIAL_FILL, PARTIAL_EDGE, FULL_EDGE, GRID = "#1f4e9c", "#fde2c0", "#e07b00", "#9ecae1", "#c8c8c8"


def _figure(rows: int, cols: int, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    # A bare Figure (no pyplot) draws headless and leaves the user's matplotlib backend alone.
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _save(fig: Figure, out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _wrap(text: str, width: int) -> str:
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def _label(ax: Any) -> None:
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_mask(ax: Any, mask: np.ndarray, tiles: np.ndarray | None, block: int | None) -> None:
    """One (n, n) bool mask on ``ax``; with ``tiles`` (0 absent, 1 partial, 2 full per tile)
    the tile grid, partial tiles shaded where masked, listed tiles outlined by kind."""
    n_q, n_kv = mask.shape
    rgb = np.ones((n_q, n_kv, 3))
    if tiles is not None:
        rgb[np.kron(tiles == 1, np.ones((block, block), dtype=bool))[:n_q, :n_kv]] = to_rgb(PARTIAL_FILL)
    rgb[mask] = to_rgb(STRONG)
    ax.imshow(rgb, interpolation="nearest")
    _label(ax)
    if tiles is None:
        return
    ax.set_xticks(np.arange(block, n_kv, block) - 0.5, minor=True)
    ax.set_yticks(np.arange(block, n_q, block) - 0.5, minor=True)
    ax.grid(which="minor", color=GRID, linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    qb, kb = np.nonzero(tiles)
    rects = [
        Rectangle((k * block - 0.5, q * block - 0.5), min(block, n_kv - k * block), min(block, n_q - q * block))
        for q, k in zip(qb.tolist(), kb.tolist())
    ]
    colours = [FULL_EDGE if kind == 2 else PARTIAL_EDGE for kind in tiles[qb, kb].tolist()]
    ax.add_collection(PatchCollection(rects, facecolor="none", edgecolor=colours, linewidth=1.0))


def draw_pattern(
    pattern: P.Pattern,
    n: int,
    out: str | Path,
    *,
    block: int | None = None,
    title: str | None = None,
    causal: bool = False,
) -> Path:
    """Draw ``pattern`` on ``n`` positions as a PNG at ``out``: computed (query, key) pairs in
    blue, rows = queries, columns = keys. With ``block``, the ``block x block`` tile grid of
    ``pattern.blocks(n, n, block)``: full tiles outlined light blue, partial tiles outlined
    orange with their masked pairs shaded (the kernel computes both kinds, skips the rest).
    Per-head patterns get one panel per head group. ``causal`` intersects with ``causal()``.
    The title defaults to the pattern's repr and its density. O(n^2): for small n."""
    check_positive_int(n, "n")
    if block is not None:
        check_positive_int(block, "block")
    pattern = pattern & P.causal() if causal else pattern
    mask = pattern.dense(n, n).reshape(-1, n, n).numpy()
    tiles = pattern.blocks(n, n, block).to_dense().numpy() if block else None
    groups = mask.shape[0]
    parts = getattr(pattern, "patterns", None) or [pattern] * groups
    heading = _wrap(title or f"{pattern!r}  ({100 * mask.mean():.1f}% of pairs)", 58 * groups)
    height = 4.8 + 0.2 * heading.count("\n") + 0.4 * (groups > 1)  # room for wrapped titles
    fig, axes = _figure(1, groups, (4.2 * groups + 0.4, height))
    for g, ax in enumerate(axes[0]):
        _draw_mask(ax, mask[g], None if tiles is None else tiles[g], block)
        if groups > 1:
            ax.set_title(_wrap(f"head group {g}: {parts[g]!r} ({100 * mask[g].mean():.1f}%)", 55), fontsize=8)
    fig.suptitle(heading, fontsize=10)
    if tiles is not None:
        handles = [
            Patch(color=STRONG, label="computed pair"),
            Patch(facecolor="white", edgecolor=FULL_EDGE, label=f"full {block}x{block} tile"),
            Patch(facecolor=PARTIAL_FILL, edgecolor=PARTIAL_EDGE, label="partial tile (masked pairs shaded)"),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncol=3 if groups > 1 else 2, fontsize=7, frameon=False)
    return _save(fig, out)


def draw_weights(weights: torch.Tensor | np.ndarray, out: str | Path, *, title: str | None = None) -> Path:
    """Draw attention weights ``(H, N_q, N_kv)`` or ``(N_q, N_kv)`` (or ``(1, H, N_q, N_kv)``
    as returned by ``implied_attention`` for one sequence) as heat maps, one panel per head
    (the first 8 heads at most), on a shared colour scale from 0. Returns the PNG path."""
    w = torch.as_tensor(weights).detach().float().cpu()
    if w.dim() == 4 and w.shape[0] == 1:
        w = w[0]
    if w.dim() == 2:
        w = w[None]
    if w.dim() != 3:
        raise ValueError(
            f"weights must be (H, N_q, N_kv) or (N_q, N_kv) (or (1, H, N_q, N_kv)), got shape "
            f"{tuple(w.shape)}; pass weights[b] to draw batch element b"
        )
    heads, shown = w.shape[0], w[:8].numpy()
    cols, rows = min(len(shown), 4), -(-len(shown) // 4)
    fig, axes = _figure(rows, cols, (3.6 * cols + 1.0, 3.8 * rows + 0.4))
    top = max(float(np.nanmax(shown)), 1e-12)
    for h, ax in enumerate(axes.flat):
        if h >= len(shown):
            ax.set_axis_off()
            continue
        image = ax.imshow(shown[h], cmap="Blues", vmin=0.0, vmax=top, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        _label(ax)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="weight")
    default = f"attention weights, {heads} head{'s' if heads > 1 else ''}" + (" (first 8 shown)" if heads > 8 else "")
    fig.suptitle(_wrap(title or default, 40 * cols), fontsize=10)
    return _save(fig, out)


def mechanism_pattern(name: str, n: int, /, **config: Any) -> P.Pattern:
    """The pattern (``.pattern``) of the registered sparse mechanism ``name`` built with
        ``config``, checked to be defined on ``n`` positions (graph, axial and block2d are defined
        on a fixed number). ``name`` and ``n`` are positional-only, so ``config`` may hold an ``n``
    (graph's). ``describe(name).config.length_values(n)`` is a config that suits ``n``."""
    if describe(name).family != "sparse":
        raise ValueError(f"{name!r} is not a sparse mechanism; sparse ones: {', '.join(names(family='sparse'))}")
    pattern = build(name, **config).pattern
    pattern.mask_mod_for(n, n)  # raises ValueError where the pattern does not fit n positions
    return pattern


def _show_config(config: dict[str, Any]) -> str:
    def short(value: Any) -> str:
        return f"({len(value)} items)" if isinstance(value, tuple) and len(value) > 6 else repr(value)

    return ", ".join(f"{key}={short(value)}" for key, value in config.items()) or "(defaults)"


def gallery(out_dir: str | Path, *, n: int = 64, block: int = 8) -> list[Path]:
    """Draw every registered sparse mechanism, each with the config it gives itself for ``n``
    tokens (``Config.for_length``), into ``out_dir/<name>.png`` (tile grid ``block``; a
    mechanism whose ``tile`` defaults to its own blocks, bigbird, draws those), plus
    ``softmax.png`` (full) and ``causal.png``, and ``index.html`` showing them in a grid.
    Returns the PNG paths, then the index. The configs come from the mechanisms, so a new
    sparse mechanism appears here without touching this module."""
    out_dir = Path(out_dir)
    sparse = names(family="sparse")
    entries = [
        (EXACT, P.full(), block, describe(EXACT).summary, "full attention"),
        ("causal", P.causal(), block, "Exact attention with causal=True.", "j <= i"),
    ]
    for name in sparse:
        config = describe(name).config.length_values(n)
        built = build(name, **config).config
        entries.append(
            (
                name,
                mechanism_pattern(name, n, **config),
                built.backend_tile() if built.tile is None else block,
                describe(name).summary,
                _show_config(config),
            )
        )
    paths = [draw_pattern(pattern, n, out_dir / f"{name}.png", block=tile) for name, pattern, tile, _, _ in entries]
    figures = "\n".join(
        f'<figure><img src="{html.escape(path.name)}" alt="{html.escape(name)} pattern">'
        f"<figcaption><b>{html.escape(name)}</b>: {html.escape(summary)}<br><code>{html.escape(config)}</code>"
        "</figcaption></figure>"
        for path, (name, _, _, summary, config) in zip(paths, entries)
    )
    index = out_dir / "index.html"
    index.write_text(_INDEX.format(n=n, block=block, figures=figures), encoding="utf-8")
    return [*paths, index]


_INDEX = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>attnzoo attention patterns (n = {n})</title><style>
body {{ font-family: sans-serif; margin: 1.5em; }} figure {{ margin: 0; }} img {{ width: 100%; }}
.grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 1.5em; }}
figcaption {{ font-size: 0.85em; }}</style></head>
<body><h1>attnzoo attention patterns, n = {n}</h1>
<p>Rows are queries i (top to bottom), columns keys j; blue pairs are computed. Grid: {block}x{block} kernel
tiles (bigbird: its own block), full tiles outlined light blue, partial tiles orange with masked pairs shaded.</p>
<div class="grid">
{figures}
</div></body></html>
"""
