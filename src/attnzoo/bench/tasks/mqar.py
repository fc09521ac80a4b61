"""MQAR: multi-query associative recall (Zoology; Arora et al. 2023,
https://arxiv.org/abs/2312.04927, ``zoology/data/associative_recall.py::multiquery_ar``).

A sequence of ``seq_len`` tokens starts with ``n_pairs`` key-value pairs ``k1 v1 k2 v2 ...``
(keys distinct within a sequence, drawn from the lower half of the vocabulary; values distinct,
drawn from the upper half). The rest is the query region: every key appears there once more, and
the model must output that key's value at the key's position. Causal LM style: ``labels`` are
-100 everywhere except at the query positions, where the label is the paired value.

Query placement follows Zoology: the query region is read as ``space = (seq_len - 2 n_pairs) // 2``
even slots; slot ``g`` (0-based, so slot 0 is right after the pairs) is drawn with probability
proportional to ``(g + 1) ** (power_a - 1)``, without replacement, and key ``i`` goes to the
``i``-th drawn slot. With ``power_a = 0.01`` the gap law is close to ``1/g``: most queries come
soon after the pairs, a few far. All other query-region positions hold noise tokens drawn
uniformly from ``1..vocab_size-1``.

Notes:
    Zoology draws keys from ``1..vocab_size//2 - 1`` and values from ``vocab_size//2 ..
    vocab_size-1``; so do we. Zoology's noise is uniform over the whole vocabulary including 0;
    here 0 is the pad token, so noise avoids it (and ``mask`` stays all-True). Noise may repeat a
    key at an unscored position, as in Zoology.

    Weighted sampling without replacement is done with exponential clocks (Efraimidis &
    Spirakis): the ``n_pairs`` slots with the smallest ``Exp(1) / p`` -- the same distribution
    as numpy's sequential ``choice(..., replace=False, p=p)`` that Zoology uses.

    ``chance`` is ``1 / (number of values)``. Presets: ``quick`` (seq 64, 4 pairs, vocab 64,
    keys 1-31, values 32-63); ``standard`` (seq 256, 16 pairs, vocab 64: keys 1-31, values
    32-63), the committed benchmark target -- the quick vocabulary, so a model trained on the
    quick size can continue on this one (``attnzoo bench train --init-from``): a width-64, 2-layer
    softmax model trained from scratch at this length sat on its plateau for 1000+ CPU steps;
    ``full`` (Zoology-sized: seq 512, 64 pairs, vocab 8192, 100k train examples).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnzoo._checks import check_int_fields

VERSION = 1
_CHUNK = 4096  # rows per vectorised block: bounds memory at vocab 8192

SIZES = {
    "quick": dict(seq_len=64, n_pairs=4, vocab_size=64, n_train=5000, n_val=500, n_test=500),
    "standard": dict(seq_len=256, n_pairs=16, vocab_size=64, n_train=20_000, n_val=1000, n_test=1000),
    "full": dict(seq_len=512, n_pairs=64, vocab_size=8192, n_train=100_000, n_val=3000, n_test=3000),
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """MQAR generator parameters.

    Args:
        seq_len: tokens per sequence; needs ``seq_len >= 4 * n_pairs`` (Zoology's bound).
        n_pairs: key-value pairs (and queries) per sequence.
        vocab_size: including pad 0; needs ``vocab_size // 2 - 1 >= n_pairs`` distinct keys.
        power_a: exponent of the gap law, ``p(g) ∝ g ** (power_a - 1)`` (default 0.01).
        n_train, n_val, n_test: sequences per split.
    """

    seq_len: int = 256
    n_pairs: int = 16
    vocab_size: int = 512
    power_a: float = 0.01
    n_train: int = 20_000
    n_val: int = 1000
    n_test: int = 1000

    def __post_init__(self) -> None:
        check_int_fields(self, seq_len=4, n_pairs=1, vocab_size=6, n_train=1, n_val=1, n_test=1)
        if isinstance(self.power_a, bool) or not isinstance(self.power_a, (int, float)) or not self.power_a > 0:
            raise ValueError(f"power_a must be a positive number, got {self.power_a!r}")
        if 4 * self.n_pairs > self.seq_len:
            raise ValueError(f"seq_len ({self.seq_len}) must be at least 4 * n_pairs ({4 * self.n_pairs})")
        if self.vocab_size // 2 - 1 < self.n_pairs:
            raise ValueError(
                f"vocab_size ({self.vocab_size}) gives {self.vocab_size // 2 - 1} "
                f"keys, fewer than n_pairs ({self.n_pairs})"
            )


def describe(cfg: Config) -> dict:
    n_values = cfg.vocab_size - cfg.vocab_size // 2
    return dict(
        kind="lm",
        seq_len=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        n_classes=cfg.vocab_size,
        causal=True,
        chance=1.0 / n_values,
    )


def _distinct(rng: np.random.Generator, rows: int, low: int, high: int, k: int) -> np.ndarray:
    """``(rows, k)`` draws without replacement from ``low..high-1``, in random order."""
    scores = rng.random((rows, high - low))
    picked = np.argpartition(scores, k - 1, axis=1)[:, :k]
    # argpartition's output order follows its algorithm, not the scores: re-sort by score so
    # the order of keys in the context carries no information about their ids.
    picked = np.take_along_axis(picked, np.argsort(np.take_along_axis(scores, picked, 1), 1), 1)
    return picked + low


def _block(rng: np.random.Generator, cfg: Config, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` sequences as ``(tokens, labels)``."""
    n, half, context = cfg.n_pairs, cfg.vocab_size // 2, 2 * cfg.n_pairs
    keys = _distinct(rng, rows, 1, half, n)
    values = _distinct(rng, rows, half, cfg.vocab_size, n)
    tokens = rng.integers(1, cfg.vocab_size, size=(rows, cfg.seq_len))
    tokens[:, 0:context:2] = keys
    tokens[:, 1:context:2] = values
    space = (cfg.seq_len - context) // 2
    p = np.arange(1, space + 1, dtype=np.float64) ** (cfg.power_a - 1)
    clocks = rng.exponential(size=(rows, space)) / (p / p.sum())
    order = np.argsort(clocks, axis=1, kind="stable")[:, :n]
    positions = context + 2 * order  # (rows, n_pairs)
    np.put_along_axis(tokens, positions, keys, axis=1)
    labels = np.full((rows, cfg.seq_len), -100, dtype=np.int64)
    np.put_along_axis(labels, positions, values, axis=1)
    return tokens, labels


def generate(cfg: Config, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    splits = {}
    for index, (name, n) in enumerate([("train", cfg.n_train), ("val", cfg.n_val), ("test", cfg.n_test)]):
        # One independent stream per split, so growing n_train leaves val/test unchanged.
        rng = np.random.default_rng([seed, index, 0x6D716172])
        blocks = [_block(rng, cfg, min(_CHUNK, n - start)) for start in range(0, n, _CHUNK)]
        tokens = torch.from_numpy(np.concatenate([b[0] for b in blocks]).astype(np.int64))
        labels = torch.from_numpy(np.concatenate([b[1] for b in blocks]).astype(np.int64))
        splits[name] = (tokens, labels)
    return splits
