"""Configs sized for a sequence length, for benchmarks on short sequences.

Most defaults are sized for long inputs (windows of 64, blocks of 64 or 128, 64 landmarks): on
the quick tasks (64–100 tokens) they cover the whole sequence, so `local` or `bigbird` would be
full attention and the comparison would say nothing. ``sized(name, n)`` keeps roughly a quarter
of the keys per query (windows of n/4, blocks of n/8, k = n/4 landmarks or features), and fits
the mechanisms that are defined on a fixed shape (axial and block2d on an h×w grid, graphs on a
ring with chords) to n. Mechanisms without a length-dependent setting keep their defaults.
"""

from __future__ import annotations

import math
from typing import Any

from attnzoo import patterns as P


def _grid(n: int) -> tuple[int, int]:
    """The most square h×w = n."""
    h = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return h, n // h


def sized(name: str, n: int) -> dict[str, Any]:
    """A config for ``name`` at sequence length ``n`` (see the module docstring)."""
    q, e = max(2, n // 4), max(2, n // 8)  # a quarter of the keys; an eighth for blocks
    h, w = _grid(n)
    ring = tuple((i, (i + s) % n) for i in range(n) for s in (1, -1)) + tuple(
        (i, (i + n // 2) % n) for i in range(0, n, 8)
    )
    table: dict[str, dict[str, Any]] = {
        "local": dict(left=q, right=q),
        "dilated": dict(left=q // 2, right=q // 2, dilation=2),
        "strided": dict(stride=4),
        "global": dict(indices=(0,)),
        "random": dict(r=q),
        "block_local": dict(size=q),
        "longformer": dict(window=q, global_indices=(0,)),
        "bigbird": dict(block=e, window_blocks=3, global_blocks=1, random_blocks=1),
        "etc": dict(window=q, n_global=1),
        "sparse_transformer_strided": dict(l=e),
        "sparse_transformer_fixed": dict(l=q, c=min(4, q)),  # c <= l
        "block2d": dict(h=h, w=w, query_block=(max(1, h // 2), max(1, w // 2)), memory_margin=(1, 1)),
        "axial": dict(h=h, w=w),
        "graph": dict(edges=ring, n=n),
        "graph_attention": dict(edges=ring, n=n),
        "pattern": dict(pattern=P.per_head([P.local(e), P.strided(e)])),
        "lsh": dict(n_buckets=4, chunk=e),
        "sinkhorn": dict(block=e),
        "topk": dict(topk=q),
        "sac": dict(topk=e, candidates=q),
        "linformer": dict(k=q),
        "nystrom": dict(landmarks=e),
        "performer": dict(features=q),
        "rfa": dict(features=q),
    }
    return dict(table.get(name, {}))
