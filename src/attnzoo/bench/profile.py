"""``attnzoo bench profile``: is your bottleneck really attention?

For each mechanism, one pre-norm ``TransformerEncoderLayer`` is built and three forwards are
timed at each sequence length N: the attention sublayer ``attn(norm1(x))`` (or the token mixer
``mixer(norm1(x))``; projections included), the feed-forward sublayer ``ff(norm2(x))``, and the
whole layer. ``attention_share = attention_s / (attention_s + ffn_s)``: at small N the
feed-forward block usually dominates, and a faster attention buys little there.

The defaults (N = 256, 1024; B = 1; dim = 256; 4 heads; 3 repeats) keep a run over every
registered mechanism within about a minute on two CPU cores; pass ``--n 1024,4096,16384`` to
see where attention starts to dominate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import attnzoo
from attnzoo.bench.speed import machine, median_time, parse_mechanism, write_lines
from attnzoo.nn import TransformerEncoderLayer
from attnzoo.registry import config_fields

DEFAULT_SIZES = (256, 1024)


def default_mechanisms() -> tuple[tuple[str, dict[str, Any]], ...]:
    """Every registered attention mechanism and token mixer, each with its default config."""
    kinds = ("attention", "mixer")
    return tuple((name, {}) for name in attnzoo.names() if attnzoo.describe(name).capabilities.kind in kinds)


def build_layer(name: str, config: dict[str, Any], n: int, dim: int, heads: int) -> TransformerEncoderLayer:
    """The layer under test, with size keys the user left out filled in, so that every mechanism
    runs at its defaults where it can: the layer's ``max_len = max(n, 512)`` (learned per-position
    parameters: Linformer, Synthesizer, gMLP, MLP-Mixer; as ``bench speed``; the layer passes it
    with ``heads``/``head_dim`` in the ``attnzoo.Shape`` it builds the mechanism with), and
    ``h = w = sqrt(n)`` for 2-D patterns when N is a square. Graph patterns are defined on a
    fixed node count and report an error row unless given a graph of N nodes."""
    config = {"max_len": max(n, 512), **config}
    side = math.isqrt(n)
    if side * side == n:
        config = {**{key: side for key in ("h", "w") if key in config_fields(name)}, **config}
    return TransformerEncoderLayer(dim, heads, name, **config).eval()  # a mixer gets dim from the layer


def sublayers(layer: TransformerEncoderLayer, causal: bool) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The three forwards timed: the attention (or mixer) sublayer, the feed-forward sublayer,
    the whole layer (residuals included)."""
    mixing = layer.mixer if layer.attn is None else layer.attn
    return {
        "attention_s": lambda x: mixing(layer.norm1(x), causal=causal),
        "ffn_s": lambda x: layer.ff(layer.norm2(x)),
        "block_s": lambda x: layer(x, causal=causal),
    }


def profile_one(
    name: str,
    config: dict[str, Any],
    n: int,
    *,
    batch: int = 1,
    dim: int = 256,
    heads: int = 4,
    causal: bool = False,
    repeats: int = 3,
) -> dict[str, Any]:
    """One profile row; a mechanism that cannot run (bad config, unsupported N or causal) gives
    a row with ``error`` instead of raising."""
    row: dict[str, Any] = {
        "kind": "profile",
        "mechanism": name,
        "config": config,
        "n": n,
        "batch": batch,
        "dim": dim,
        "heads": heads,
        "causal": causal,
    }
    try:
        layer = build_layer(name, config, n, dim, heads)
        x = torch.randn(batch, n, dim)
        with torch.no_grad():
            for key, fn in sublayers(layer, causal).items():
                row[key] = median_time(lambda fn=fn: fn(x), repeats)
    # A benchmark sweep reports every failure as a row; nothing here may stop the sweep.
    except Exception as error:  # noqa: BLE001
        for key in ("attention_s", "ffn_s", "block_s"):
            row.pop(key, None)
        row["error"] = f"{type(error).__name__}: {error}"
        return row
    row["attention_share"] = row["attention_s"] / (row["attention_s"] + row["ffn_s"])
    return row


def run(
    mechanisms: tuple[tuple[str, dict[str, Any]], ...],
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    *,
    command: str = "",
    **settings: Any,
) -> Iterator[dict[str, Any]]:
    """Yield the meta row, then one profile row per N and mechanism (settings as
    ``profile_one``: batch, dim, heads, causal, repeats)."""
    yield {"kind": "meta", **machine(), "command": command}
    for n in sizes:
        for name, config in mechanisms:
            yield profile_one(name, config, n, **settings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``attnzoo bench profile``."""
    parser.add_argument(
        "--mechanism",
        action="append",
        default=[],
        metavar="NAME[:key=value,...]",
        help="repeatable; default: every registered attention mechanism and token mixer",
    )
    parser.add_argument(
        "--n",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="comma-separated sequence lengths (default 256,1024: about a minute for all)",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4: head_dim 64)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median), after one warm-up")
    parser.add_argument("--out", help="write JSON lines here")


def main(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """Run the profile, print a table, write ``--out`` if given; returns the rows."""
    mechanisms = tuple(parse_mechanism(m) for m in args.mechanism) or default_mechanisms()
    sizes = tuple(int(n) for n in str(args.n).split(","))
    argv = getattr(args, "argv", None)
    command = "attnzoo " + " ".join(sys.argv[1:] if argv is None else argv)
    table = Table(title=f"attnzoo bench profile: one layer, B={args.batch}, dim={args.dim}, {args.heads} heads")
    for column in ("mechanism", "N", "attention ms", "FFN ms", "layer ms", "attention share", "note"):
        table.add_column(column)

    def echo(row: dict[str, Any]) -> None:
        if row["kind"] == "meta":
            console.print(f"{row['processor']}, {row['cpus']} cpus, torch {row['torch']}")
            return
        label = row["mechanism"] + (f" {json.dumps(row['config'])}" if row["config"] else "")
        ms = [f"{row[k] * 1e3:.2f}" if k in row else "-" for k in ("attention_s", "ffn_s", "block_s")]
        share = f"{100 * row['attention_share']:.0f}%" if "attention_share" in row else "-"
        table.add_row(label, str(row["n"]), *ms, share, row.get("error", "")[:80])

    rows = write_lines(
        run(
            mechanisms,
            sizes,
            command=command,
            batch=args.batch,
            dim=args.dim,
            heads=args.heads,
            causal=args.causal,
            repeats=args.repeats,
        ),
        Path(args.out) if args.out else None,
        echo,
    )
    console.print(table)
    if args.out:
        console.print(f"results: {args.out}")
    return rows
