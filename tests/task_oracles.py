"""Independent evaluators for the benchmark tasks, written from the task definitions (the
docstrings of ``attnzoo.bench.tasks.*``) without importing the generators. They read only what a
model sees (tokens) and say what the label must be."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from functools import reduce

# ListOps vocabulary as documented: 0 pad, 1..10 digits 0..9, 11..14 [MIN [MAX [MED [SM, 15 ].
_LISTOPS_OPS = {11: "MIN", 12: "MAX", 13: "MED", 14: "SM"}
_LISTOPS_CLOSE = 15


@dataclass(frozen=True)
class ListOpsTree:
    value: int
    length: int  # tokens, pad excluded
    depth: int  # nodes on the longest root-to-leaf path, leaf included
    min_args: int
    max_args: int


def _listops_apply(name: str, args: list[int]) -> int:
    if name == "MIN":
        return sorted(args)[0]
    if name == "MAX":
        return sorted(args)[-1]
    if name == "MED":
        return math.floor(statistics.median(args))
    return reduce(lambda acc, a: (acc + a) % 10, args, 0)


def listops_eval(tokens) -> ListOpsTree:
    """Evaluate one token row with an explicit stack (the generator recurses). Raises
    AssertionError on a malformed sequence, including padding before the end."""
    ids = [int(t) for t in tokens]
    length = next((i for i, t in enumerate(ids) if t == 0), len(ids))
    assert all(t == 0 for t in ids[length:]), "padding must be at the end"
    stack: list[tuple[str, list[int]]] = []
    result, depth, arg_counts = None, 0, []
    for t in ids[:length]:
        assert result is None, "tokens after a complete expression"
        if t in _LISTOPS_OPS:
            stack.append((_LISTOPS_OPS[t], []))
            continue
        if t == _LISTOPS_CLOSE:
            assert stack, "unbalanced ]"
            name, args = stack.pop()
            arg_counts.append(len(args))
            value = _listops_apply(name, args)
        else:
            assert 1 <= t <= 10, f"unknown token {t}"
            value = t - 1
            depth = max(depth, len(stack) + 1)
        if stack:
            stack[-1][1].append(value)
        else:
            result = value
    assert result is not None and not stack, "incomplete expression"
    return ListOpsTree(
        value=result,
        length=length,
        depth=depth,
        min_args=min(arg_counts, default=0),
        max_args=max(arg_counts, default=0),
    )


def mqar_check(tokens, labels, *, vocab_size: int, n_pairs: int) -> None:
    """Assert one MQAR row is well formed: pairs (key from 1..V/2-1, value from V/2..V-1, keys
    distinct) then queries; every scored position holds a key seen earlier in a pair, scored
    once, and its label is the value that followed that key."""
    ids, targets = [int(t) for t in tokens], [int(y) for y in labels]
    half = vocab_size // 2
    assert all(1 <= t < vocab_size for t in ids), "token outside 1..V-1"
    pairs = {}
    for i in range(n_pairs):
        key, value = ids[2 * i], ids[2 * i + 1]
        assert 1 <= key < half and half <= value < vocab_size, (key, value)
        assert key not in pairs, f"key {key} repeated in the pairs"
        pairs[key] = value
    scored = [i for i, y in enumerate(targets) if y != -100]
    assert len(scored) == n_pairs, f"{len(scored)} scored positions, expected {n_pairs}"
    queried = set()
    for i in scored:
        assert i >= 2 * n_pairs, f"scored position {i} inside the pairs"
        key = ids[i]
        assert key in pairs and key not in queried, f"position {i} holds {key}"
        queried.add(key)
        assert targets[i] == pairs[key], f"label {targets[i]} != value {pairs[key]} of key {key}"


def pathfinder_markers_connected(tokens, *, side: int, radius: int) -> bool:
    """Whether the two markers are joined by drawn pixels, linking lit pixels at Chebyshev
    distance <= ``radius`` (1 = 8-connectivity). Markers are the pixels at the top intensity
    (token 256); asserts there are one or two marker blobs and each touches contour pixels."""
    values = [int(t) for t in tokens]
    assert len(values) == side * side and 0 not in values, "an image has no padding"
    lit = {(i // side, i % side) for i, v in enumerate(values) if v > 1}
    marker = {(i // side, i % side) for i, v in enumerate(values) if v == 256}
    blobs = _components(marker, 1)
    assert len(blobs) in (1, 2), f"{len(blobs)} marker blobs"
    component_of = {}
    for index, component in enumerate(_components(lit, radius)):
        assert component - marker, "a marker that lies on no contour"
        for pixel in component:
            component_of[pixel] = index
    return len({component_of[next(iter(blob))] for blob in blobs}) == 1


def _components(pixels: set, radius: int) -> list[set]:
    """Connected components of ``pixels`` under Chebyshev distance <= radius (BFS)."""
    left, out = set(pixels), []
    while left:
        start = left.pop()
        component, queue = {start}, deque([start])
        while queue:
            r, c = queue.popleft()
            for dr in range(-radius, radius + 1):
                for dc in range(-radius, radius + 1):
                    neighbour = (r + dr, c + dc)
                    if neighbour in left:
                        left.remove(neighbour)
                        component.add(neighbour)
                        queue.append(neighbour)
        out.append(component)
    return out
