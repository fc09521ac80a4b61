"""The pattern algebra: ``Pattern``, its block structure ``BlockList``, and ``|``, ``&``,
``per_head``.

A ``Pattern`` answers two questions about one set of (query, key) pairs:

- ``mask_mod_for(n_q, n_kv, device)`` -> ``mask_mod(b, h, q_idx, kv_idx)``: is this pair
  computed? (FlexAttention's signature, vectorised; ``q_idx`` is end-aligned, see
  ``attnzoo.spec``.) Lookup tables (global tokens, random keys, head groups) are placed on
  ``device`` here, never inside the mask: a compiled mask on CUDA may not copy between devices.
- ``blocks(n_q, n_kv, block)`` -> ``BlockList``: for each query block, the key blocks holding
  any pair, each flagged full (every pair in it is computed) or partial. It is derived from the
  pattern's own structure in time proportional to the blocks it lists, never by evaluating all
  N^2 pairs. Unions and intersections combine block lists, not matrices.

Guarantees of ``blocks()`` (checked by tests against dense oracles): every pair lies in a listed
block; every listed block holds a pair; a block flagged full holds every pair. Atomic patterns
also flag every full block as full; a union may flag a block partial that is full only through
the combination of both sides (the kernel then evaluates the mask there: slower, never wrong).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnzoo._checks import check_positive_int
from attnzoo.spec import Device, MaskMod


class TileGrid:
    """Tile counts of an ``n_q x n_kv`` grid of ``block x block`` tiles (a mixin for the
    dataclasses that carry ``n_q``, ``n_kv`` and ``block``)."""

    n_q: int
    n_kv: int
    block: int

    @property
    def n_q_blocks(self) -> int:
        return -(-self.n_q // self.block)

    @property
    def n_kv_blocks(self) -> int:
        return -(-self.n_kv // self.block)


@dataclass(frozen=True)
class BlockList(TileGrid):
    """The tiles of a ``(n_q, n_kv)`` pattern on a ``block x block`` grid, as sorted, unique
    COO entries ``(group, qb, kb, full)``. ``group`` indexes ``head_group``'s values: head ``h``
    uses the entries of group ``head_group[h]`` (one group, 0, for head-independent patterns).
    """

    n_q: int
    n_kv: int
    block: int
    group: Tensor
    qb: Tensor
    kb: Tensor
    full: Tensor
    n_groups: int = 1

    def __len__(self) -> int:
        return int(self.qb.numel())

    def keys(self) -> Tensor:
        return (self.group * self.n_q_blocks + self.qb) * self.n_kv_blocks + self.kb

    @classmethod
    def build(
        cls,
        n_q: int,
        n_kv: int,
        block: int,
        qb: Tensor,
        kb: Tensor,
        full: Tensor,
        group: Tensor | None = None,
        n_groups: int = 1,
    ) -> BlockList:
        """Sort and de-duplicate entries; a tile listed twice is full if either says so."""
        group = torch.zeros_like(qb) if group is None else group
        shell = cls(n_q, n_kv, block, group, qb, kb, full, n_groups)
        keys, inverse = torch.unique(shell.keys(), return_inverse=True)
        merged = torch.zeros(keys.numel(), dtype=torch.long).index_add_(0, inverse, full.long()) > 0
        return cls._from_keys(n_q, n_kv, block, keys, merged, n_groups)

    @classmethod
    def _from_keys(cls, n_q: int, n_kv: int, block: int, keys: Tensor, full: Tensor, n_groups: int) -> BlockList:
        n_qb, n_kb = -(-n_q // block), -(-n_kv // block)
        return cls(n_q, n_kv, block, keys // (n_qb * n_kb), (keys // n_kb) % n_qb, keys % n_kb, full, n_groups)

    @classmethod
    def empty(cls, n_q: int, n_kv: int, block: int) -> BlockList:
        none = torch.zeros(0, dtype=torch.long)
        return cls(n_q, n_kv, block, none, none, none, none.bool())

    def union(self, other: BlockList) -> BlockList:
        return BlockList.build(
            self.n_q,
            self.n_kv,
            self.block,
            torch.cat([self.qb, other.qb]),
            torch.cat([self.kb, other.kb]),
            torch.cat([self.full, other.full]),
            torch.cat([self.group, other.group]),
            max(self.n_groups, other.n_groups),
        )

    def intersect(self, other: BlockList) -> BlockList:
        """Tiles listed by both; full only where both are full (partial tiles still need a
        check that they hold a pair: see ``Intersection``)."""
        mine, theirs = self.keys(), other.keys()
        pos = torch.searchsorted(theirs, mine).clamp(max=max(theirs.numel() - 1, 0))
        both = (theirs[pos] == mine) if theirs.numel() else torch.zeros_like(mine, dtype=torch.bool)
        full = self.full[both] & other.full[pos[both]]
        return BlockList._from_keys(
            self.n_q, self.n_kv, self.block, mine[both], full, max(self.n_groups, other.n_groups)
        )

    def select(self, keep: Tensor) -> BlockList:
        return BlockList(
            self.n_q,
            self.n_kv,
            self.block,
            self.group[keep],
            self.qb[keep],
            self.kb[keep],
            self.full[keep],
            self.n_groups,
        )

    def with_full(self, full: Tensor) -> BlockList:
        return BlockList(self.n_q, self.n_kv, self.block, self.group, self.qb, self.kb, full, self.n_groups)

    def regroup(self, group: int, n_groups: int) -> BlockList:
        return BlockList(
            self.n_q, self.n_kv, self.block, torch.full_like(self.qb, group), self.qb, self.kb, self.full, n_groups
        )

    def to_dense(self) -> Tensor:
        """``(n_groups, n_q_blocks, n_kv_blocks)`` int8: 0 absent, 1 partial, 2 full (tests)."""
        grid = torch.zeros(self.n_groups, self.n_q_blocks, self.n_kv_blocks, dtype=torch.int8)
        grid[self.group, self.qb, self.kb] = 1 + self.full.to(torch.int8)
        return grid


class _Immutable(type):
    """Freezes every pattern once its ``__init__`` returns: patterns are hashed by value and
    used as keys of the backends' plan caches, so a pattern changed after a plan was cached
    for it would silently run the old plan."""

    def __call__(cls, *args: object, **kwargs: object) -> object:
        obj = super().__call__(*args, **kwargs)
        object.__setattr__(obj, "_frozen", True)
        return obj


class Pattern(metaclass=_Immutable):
    """Base class. Subclasses implement ``mask_mod_for`` and ``_blocks``. Instances are
    immutable once built (only the display ``name`` may be changed) and compare by ``_value``."""

    _frozen = False

    name: str = "pattern"
    #: True when the pattern differs per head (``per_head``); see ``resolve_heads``.
    per_head: bool = False

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        raise NotImplementedError

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The pair predicate, for patterns that do not depend on the sequence length."""
        return self.mask_mod_for(None, None, q_idx.device)(b, h, q_idx, kv_idx)

    def blocks(self, n_q: int, n_kv: int | None = None, block: int = 128) -> BlockList:
        """Tiles of the ``block x block`` grid holding pairs (see module docstring)."""
        n_kv = n_q if n_kv is None else n_kv
        check_positive_int(n_q, "n_q")
        check_positive_int(n_kv, "n_kv")
        check_positive_int(block, "block")
        return self._blocks(n_q, n_kv, block)

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        raise NotImplementedError

    def resolve_heads(self, heads: int) -> Pattern:
        """The pattern for a layer with ``heads`` heads (only ``per_head`` patterns change)."""
        return self

    def group_heads(self) -> Tensor:
        """``(groups,)``: a head index that ``mask_mod`` maps to each tile group."""
        return torch.arange(getattr(self, "n_groups", 1))

    def dense(self, n_q: int, n_kv: int | None = None) -> Tensor:
        """The bool matrix ``(n_q, n_kv)`` — ``(groups, n_q, n_kv)`` for per-head patterns.
        O(N^2): for tests and pictures only."""
        n_kv = n_q if n_kv is None else n_kv
        groups = getattr(self, "n_groups", 1)
        h = torch.arange(groups).view(-1, 1, 1)
        q_idx = (torch.arange(n_q) + (n_kv - n_q)).view(1, -1, 1)
        kv_idx = torch.arange(n_kv).view(1, 1, -1)
        mask = self.mask_mod_for(n_q, n_kv)(torch.zeros((), dtype=torch.long), h, q_idx, kv_idx)
        mask = mask.expand(groups, n_q, n_kv)
        return mask if self.per_head else mask[0]

    def density(self, n: int, block: int = 64) -> float:
        """Fraction of the ``n x n`` pairs computed (averaged over head groups). Counts full
        tiles by area and evaluates the mask on partial tiles only."""
        tiles = self.blocks(n, n, block)
        area = tile_area(tiles, tiles.qb, tiles.kb).double()
        pairs = area[tiles.full].sum() + count_pairs(self, tiles.select(~tiles.full)).double().sum()
        return float(pairs) / (n * n * tiles.n_groups)

    def _value(self) -> tuple | None:
        """What makes two patterns of one class equal; None compares by identity. Plans are
        cached by it, so ``local(64) & causal()`` built afresh per call reuses its plan."""
        return None

    def __setattr__(self, attr: str, value: object) -> None:
        if self._frozen and attr != "name":
            raise AttributeError(f"patterns are immutable: build a new {type(self).__name__} instead of setting {attr}")
        object.__setattr__(self, attr, value)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(self) is not type(other):
            return False
        mine = self._value()
        return mine is not None and mine == other._value()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        value = self._value()
        return id(self) if value is None else hash((type(self).__name__, value))

    def __or__(self, other: Pattern) -> Pattern:
        return combine(self, other, union=True)

    def __and__(self, other: Pattern) -> Pattern:
        return combine(self, other, union=False)

    def __repr__(self) -> str:
        return self.name


def tile_area(tiles: BlockList, qb: Tensor, kb: Tensor) -> Tensor:
    """Number of in-range pairs in each tile (edge tiles are smaller)."""
    rows = torch.clamp(tiles.n_q - qb * tiles.block, max=tiles.block)
    cols = torch.clamp(tiles.n_kv - kb * tiles.block, max=tiles.block)
    return rows * cols


def evaluate_tiles(pattern: Pattern, tiles: BlockList, chunk: int = 4096) -> Tensor:
    """The mask inside each listed tile, ``(len(tiles), block, block)``, out-of-range pairs False.
    Memory is bounded by evaluating ``chunk`` tiles at a time (callers reduce each chunk)."""
    mask_mod = pattern.mask_mod_for(tiles.n_q, tiles.n_kv)
    offset, arange = tiles.n_kv - tiles.n_q, torch.arange(tiles.block)
    rows = tiles.qb[:, None] * tiles.block + arange  # [T, block]
    cols = tiles.kb[:, None] * tiles.block + arange
    inside = (rows < tiles.n_q)[:, :, None] & (cols < tiles.n_kv)[:, None, :]
    heads = pattern.group_heads()[tiles.group].view(-1, 1, 1)
    return mask_mod(torch.zeros((), dtype=torch.long), heads, (rows + offset)[:, :, None], cols[:, None, :]) & inside


def count_pairs(pattern: Pattern, tiles: BlockList, chunk: int = 2048) -> Tensor:
    """Pairs of ``pattern`` inside each listed tile (evaluates only those tiles)."""
    counts = [
        evaluate_tiles(pattern, tiles.select(slice(s, s + chunk))).sum((1, 2)) for s in range(0, len(tiles), chunk)
    ]
    return torch.cat(counts) if counts else torch.zeros(0, dtype=torch.long)


class Union(Pattern):
    def __init__(self, parts: Sequence[Pattern]) -> None:
        self.parts = tuple(parts)
        self.name = " | ".join(_wrap(p) for p in self.parts)

    def _value(self) -> tuple:
        return self.parts

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        mods = [p.mask_mod_for(n_q, n_kv, device) for p in self.parts]

        def union(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            out = mods[0](b, h, q_idx, kv_idx)
            for mod in mods[1:]:
                out = out | mod(b, h, q_idx, kv_idx)
            return out

        return union

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        tiles = self.parts[0]._blocks(n_q, n_kv, block)
        for part in self.parts[1:]:
            tiles = tiles.union(part._blocks(n_q, n_kv, block))
        return tiles


class Intersection(Pattern):
    def __init__(self, parts: Sequence[Pattern]) -> None:
        self.parts = tuple(parts)
        self.name = " & ".join(_wrap(p) for p in self.parts)

    def _value(self) -> tuple:
        return self.parts

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        mods = [p.mask_mod_for(n_q, n_kv, device) for p in self.parts]

        def intersection(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            out = mods[0](b, h, q_idx, kv_idx)
            for mod in mods[1:]:
                out = out & mod(b, h, q_idx, kv_idx)
            return out

        return intersection

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        tiles = self.parts[0]._blocks(n_q, n_kv, block)
        for part in self.parts[1:]:
            tiles = tiles.intersect(part._blocks(n_q, n_kv, block))
        # Two partial tiles may not overlap at all: evaluate the mask on the partial tiles only,
        # drop the empty ones and mark the ones that turn out complete.
        partial = (~tiles.full).nonzero().flatten()
        if partial.numel() == 0:
            return tiles
        counts = count_pairs(self, tiles.select(partial))
        full = tiles.full.clone()
        full[partial] = counts == tile_area(tiles, tiles.qb[partial], tiles.kb[partial])
        keep = torch.ones_like(full)
        keep[partial] = counts > 0
        return tiles.with_full(full).select(keep)


class PerHead(Pattern):
    """Different heads, different patterns. ``per_head([p0, p1, ...])`` splits the heads into
    ``len(patterns)`` contiguous groups: with H heads and P patterns (H a multiple of P), head
    ``h`` uses ``patterns[h // (H // P)]``. ``resolve_heads(H)`` fixes H; ``blocks()`` then lists
    tiles per group."""

    per_head = True

    def __init__(self, patterns: Sequence[Pattern], heads: int | None = None) -> None:
        if not patterns or not all(isinstance(p, Pattern) and not p.per_head for p in patterns):
            raise ValueError("per_head takes a non-empty list of (non-per-head) patterns")
        self.patterns, self.heads = tuple(patterns), heads
        self.n_groups = len(self.patterns)
        if heads is not None and heads % self.n_groups:
            raise ValueError(
                f"per_head with {self.n_groups} patterns needs a multiple of {self.n_groups} heads, got {heads}"
            )
        self.name = "per_head[" + ", ".join(p.name for p in self.patterns) + "]"

    def _value(self) -> tuple:
        return self.patterns, self.heads

    def resolve_heads(self, heads: int) -> PerHead:
        return PerHead(self.patterns, heads)

    def group_heads(self) -> Tensor:
        # Once resolved, mask_mod reads h as a head: use the first head of each group.
        if self.heads is None:
            return torch.arange(self.n_groups)
        return torch.arange(self.n_groups) * (self.heads // self.n_groups)

    def head_groups(self) -> Tensor:
        """``(H,)``: the pattern index of every head."""
        if self.heads is None:
            raise ValueError(f"{self.name} needs the number of heads: call .resolve_heads(H) first")
        return torch.arange(self.heads) // (self.heads // self.n_groups)

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        mods = [p.mask_mod_for(n_q, n_kv, device) for p in self.patterns]
        # ``h`` indexes heads once resolved, else pattern groups (for dense() / pictures).
        groups = (self.head_groups() if self.heads is not None else torch.arange(self.n_groups)).to(device)

        def per_head(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            g = groups[h]
            out = (g == 0) & mods[0](b, h, q_idx, kv_idx)
            for index, mod in enumerate(mods[1:], start=1):
                out = out | ((g == index) & mod(b, h, q_idx, kv_idx))
            return out

        return per_head

    def dense(self, n_q: int, n_kv: int | None = None) -> Tensor:
        """``(groups, n_q, n_kv)``: one matrix per pattern (resolve heads for one per head)."""
        return torch.stack([p.dense(n_q, n_kv) for p in self.patterns])

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        parts = [p._blocks(n_q, n_kv, block).regroup(i, self.n_groups) for i, p in enumerate(self.patterns)]
        tiles = parts[0]
        for part in parts[1:]:
            tiles = tiles.union(part)
        return tiles


def per_head(patterns: Sequence[Pattern]) -> PerHead:
    """Head groups with different patterns; see ``PerHead``."""
    return PerHead(patterns)


def combine(a: Pattern, b: Pattern, *, union: bool) -> Pattern:
    if not isinstance(a, Pattern) or not isinstance(b, Pattern):
        raise TypeError(f"patterns combine only with patterns, got {type(a).__name__} and {type(b).__name__}")
    if a.per_head or b.per_head:
        return _combine_per_head(a, b, union)
    merged = a._merge(b, union) if hasattr(a, "_merge") else None
    if merged is not None:
        return merged
    cls = Union if union else Intersection
    parts: list[Pattern] = []
    for part in (*(a.parts if isinstance(a, cls) else (a,)), *(b.parts if isinstance(b, cls) else (b,))):
        if part not in parts:  # A & A == A | A == A (patterns compare by value)
            parts.append(part)
    return parts[0] if len(parts) == 1 else cls(parts)


def _combine_per_head(a: Pattern, b: Pattern, union: bool) -> PerHead:
    left = a.patterns if isinstance(a, PerHead) else None
    right = b.patterns if isinstance(b, PerHead) else None
    if left is not None and right is not None and len(left) != len(right):
        raise ValueError(f"cannot combine per_head patterns with {len(left)} and {len(right)} groups")
    n = len(left if left is not None else right)
    left = left or (a,) * n
    right = right or (b,) * n
    heads = getattr(a, "heads", None) or getattr(b, "heads", None)
    return PerHead([combine(x, y, union=union) for x, y in zip(left, right)], heads)


def _wrap(p: Pattern) -> str:
    return f"({p.name})" if isinstance(p, (Union, Intersection)) else p.name


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)
