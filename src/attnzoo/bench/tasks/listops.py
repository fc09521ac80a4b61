"""ListOps: evaluate a nested list expression over digits (LRA's ListOps task).

Nangia & Bowman 2018, https://arxiv.org/abs/1804.06028; the long version used by the Long Range
Arena (Tay et al. 2020, https://arxiv.org/abs/2011.04006, ``lra_benchmarks/data/listops.py``).

An expression is a digit 0-9 or ``[OP a1 ... ak ]`` with OP one of MIN, MAX, MED (median,
rounded down: for an even count, the floor of the mean of the two middle values) and SM (sum mod
10). The label is the expression's value, so there are 10 classes.

Tree growth follows LRA's ``generate_tree``: a node at depth ``d < max_depth`` (the root has depth
1) is an operator with probability 0.25, else a digit; nodes at ``max_depth`` are digits; an
operator draws its argument count uniformly from ``2..max_args`` and its operator uniformly.
So ``max_depth`` counts nodes on a root-to-leaf path, leaves included. Like LRA, a tree is kept
only when its token length lies strictly between ``min_length`` and ``max_length`` and it is
new (trees are unique across all three splits).

Notes:
    Speed: growth stops as soon as a tree reaches ``max_length`` tokens, since it would be
    rejected anyway. The kept trees have exactly the distribution of LRA's grow-then-reject
    loop (the rejected ones are simply never finished); only the random stream differs.

    Vocabulary (``vocab_size = 16``): 0 pad, 1-10 the digits 0-9, 11 ``[MIN``, 12 ``[MAX``,
    13 ``[MED``, 14 ``[SM``, 15 ``]``. LRA's text also wraps arguments in ``( )``, which carry no
    information; they are dropped, so the token length is LRA's ``length`` (digits + 2 per
    operator).

    Presets: ``full`` is LRA's (500 < length < 2000, ``seq_len`` 2000, 96k/2k/2k). ``quick``
    keeps 10 < length < 100 (``seq_len`` 100) with LRA's depth and argument limits, 4000/500/500
    examples: short enough for a tiny CPU model, long enough to need nesting.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from attnzoo._checks import check_int_fields

VERSION = 1
OP_PROB = 0.25
OPERATORS = ("MIN", "MAX", "MED", "SM")
DIGIT0 = 1  # token of digit 0
OPEN0 = 11  # token of the first operator opener
CLOSE = 15
VOCAB_SIZE = 16

SIZES = {
    "quick": dict(min_length=10, max_length=100, n_train=4000, n_val=500, n_test=500),
    "full": dict(min_length=500, max_length=2000, n_train=96_000, n_val=2000, n_test=2000),
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """ListOps generator parameters (defaults: LRA's).

    Args:
        min_length, max_length: keep trees with ``min_length < tokens < max_length``;
            ``seq_len = max_length``.
        max_depth: nodes on the longest root-to-leaf path, at most (default 10).
        max_args: most arguments of one operator (default 10; the least is 2).
        n_train, n_val, n_test: examples per split.
    """

    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    n_train: int = 96_000
    n_val: int = 2000
    n_test: int = 2000

    def __post_init__(self) -> None:
        check_int_fields(self, min_length=0, max_length=4, max_depth=2, max_args=2, n_train=1, n_val=1, n_test=1)
        if self.max_length - self.min_length < 2:
            raise ValueError(f"max_length ({self.max_length}) must exceed min_length ({self.min_length}) by at least 2")


def describe(cfg: Config) -> dict:
    return dict(kind="classify", seq_len=cfg.max_length, vocab_size=VOCAB_SIZE, n_classes=10, causal=False)


def apply(op: int, args: list[int]) -> int:
    """Value of operator ``op`` (index into ``OPERATORS``) over ``args``."""
    if op == 0:
        return min(args)
    if op == 1:
        return max(args)
    if op == 2:
        ordered = sorted(args)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) // 2
    return sum(args) % 10


class _TooLong(Exception):
    pass


def _grow(rng: random.Random, depth: int, cfg: Config, out: list[int]) -> int:
    """Append one random subtree's tokens to ``out``; return its value. Raises ``_TooLong`` once
    ``out`` reaches ``max_length`` tokens."""
    if depth < cfg.max_depth and rng.random() < OP_PROB:
        n_args = 2 + int(rng.random() * (cfg.max_args - 1))
        op = int(rng.random() * len(OPERATORS))
        out.append(OPEN0 + op)
        args = [_grow(rng, depth + 1, cfg, out) for _ in range(n_args)]
        out.append(CLOSE)
        value = apply(op, args)
    else:
        value = int(rng.random() * 10)
        out.append(DIGIT0 + value)
    if len(out) >= cfg.max_length:
        raise _TooLong
    return value


def sample_tree(rng: random.Random, cfg: Config) -> tuple[list[int], int] | None:
    """One tree grown from the root as ``(tokens, value)``, or None when it is rejected for its
    length."""
    out: list[int] = []
    try:
        value = _grow(rng, 1, cfg, out)
    except _TooLong:
        return None
    return (out, value) if len(out) > cfg.min_length else None


def generate(cfg: Config, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Unique trees for train, val and test (drawn as one pool, then cut in order)."""
    rng = random.Random(f"listops/{seed}")
    sizes = {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}
    total = sum(sizes.values())
    seen: set[tuple[int, ...]] = set()
    trees: list[tuple[list[int], int]] = []
    attempts = 0
    while len(trees) < total:
        attempts += 1
        if attempts > 1000 * total + 100_000:
            raise ValueError(
                f"could not find {total} unique trees with {cfg.min_length} < length "
                f"< {cfg.max_length}; widen the range or ask for fewer examples"
            )
        tree = sample_tree(rng, cfg)
        if tree is not None and tuple(tree[0]) not in seen:
            seen.add(tuple(tree[0]))
            trees.append(tree)
    splits, start = {}, 0
    for name, n in sizes.items():
        chunk = trees[start : start + n]
        start += n
        tokens = torch.zeros(n, cfg.max_length, dtype=torch.int64)
        for i, (toks, _) in enumerate(chunk):
            tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        labels = torch.tensor([value for _, value in chunk], dtype=torch.int64)
        splits[name] = (tokens, labels)
    return splits


def detokenize(tokens) -> str:
    """Text form of one token sequence, e.g. ``"[MAX 2 9 [MIN 4 7 ] 0 ]"``; padding is dropped."""
    names = {DIGIT0 + d: str(d) for d in range(10)}
    names.update({OPEN0 + i: f"[{op}" for i, op in enumerate(OPERATORS)})
    names[CLOSE] = "]"
    return " ".join(names[int(t)] for t in tokens if int(t) != 0)
