"""Atomic patterns (MECHANISMS.md §B). ``q_idx``/``p`` below is the end-aligned query position
(``i + N_kv - N_q``); ``j`` is the key index. Windows are explicit offsets: ``sliding_window(2,
0)`` is ``p - 2 <= j <= p``, three keys.

Each pattern derives ``blocks()`` from its own structure:
- ``Band`` (full, causal, sliding_window, dilated, strided) by interval arithmetic on the
  differences ``j - p`` a tile spans — exact, no pair is evaluated;
- ``GlobalTokens`` and ``PeriodicColumns`` from their index sets;
- ``Random`` / ``RandomBlocks`` / ``Graph`` from their tables or edge lists, with exact full
  flags from per-tile pair counts;
- ``BlockLocal`` and ``RandomBlocks`` through ``rectangles_to_tiles``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

from attnzoo._checks import check_positive_int
from attnzoo.patterns.algebra import BlockList, Pattern, lcm
from attnzoo.spec import Device, MaskMod


def _q_ranges(n_q: int, n_kv: int, block: int) -> tuple[Tensor, Tensor]:
    """Aligned first and last query position of every query block."""
    starts = torch.arange(0, n_q, block)
    return starts + (n_kv - n_q), torch.clamp(starts + block, max=n_q) - 1 + (n_kv - n_q)


def _expand_ranges(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """For rows r with ranges [lo_r, hi_r]: every (r, x) with x in the range (empty if hi < lo)."""
    counts = (hi - lo + 1).clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(lo.numel()), counts)
    starts = torch.repeat_interleave(lo, counts)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return rows, starts + within


class Band(Pattern):
    """Pairs whose difference ``d = j - p`` lies in ``[lo, hi]`` (None = unbounded) with
    ``d % modulus == 0``. Every difference pattern is one: ``full`` (-inf, inf, 1), ``causal``
    (-inf, 0, 1), ``sliding_window(l, r)`` (-l, r, 1), ``dilated(l, r, s)`` (-l*s, r*s, s),
    ``strided(s)`` (-inf, inf, s). Two bands intersect into a band."""

    def __init__(self, lo: int | None, hi: int | None, modulus: int = 1, name: str | None = None) -> None:
        self.lo, self.hi, self.modulus = lo, hi, modulus
        self.name = name or f"band({lo}, {hi}, mod {modulus})"

    def _value(self) -> tuple:
        return self.lo, self.hi, self.modulus

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        lo, hi, mod = self.lo, self.hi, self.modulus

        def band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            d = kv_idx - q_idx
            ok = torch.ones_like(d, dtype=torch.bool) if mod == 1 else (d % mod == 0)
            if lo is not None:
                ok = ok & (d >= lo)
            if hi is not None:
                ok = ok & (d <= hi)
            return ok

        return band

    def _merge(self, other: Pattern, union: bool) -> Pattern | None:
        if union or not isinstance(other, Band):
            return None
        lo = max((x for x in (self.lo, other.lo) if x is not None), default=None)
        hi = min((x for x in (self.hi, other.hi) if x is not None), default=None)
        return Band(lo, hi, lcm(self.modulus, other.modulus), name=f"{self.name} & {other.name}")

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        q_lo, q_hi = _q_ranges(n_q, n_kv, block)
        big = n_kv + abs(n_q) + 1  # stands in for an unbounded side
        lo = -big if self.lo is None else self.lo
        hi = big if self.hi is None else self.hi
        kb_lo = ((q_lo + lo).clamp(0, n_kv - 1)) // block
        kb_hi = ((q_hi + hi).clamp(0, n_kv - 1)) // block
        empty = (q_lo + lo > n_kv - 1) | (q_hi + hi < 0)
        qb, kb = _expand_ranges(kb_lo, torch.where(empty, kb_lo - 1, kb_hi))
        k_lo, k_hi = kb * block, torch.clamp(kb * block + block, max=n_kv) - 1
        # Differences j - p that the tile spans: every integer in [k_lo - q_hi, k_hi - q_lo].
        d_lo, d_hi = k_lo - q_hi[qb], k_hi - q_lo[qb]
        a, b = torch.clamp(d_lo, min=lo), torch.clamp(d_hi, max=hi)
        exists = (a <= b) & (torch.div(b, self.modulus, rounding_mode="floor") * self.modulus >= a)
        full = (d_lo >= lo) & (d_hi <= hi) & ((self.modulus == 1) | ((d_lo == d_hi) & (d_lo % self.modulus == 0)))
        return BlockList(n_q, n_kv, block, torch.zeros_like(qb[exists]), qb[exists], kb[exists], full[exists])


def full() -> Band:
    """Every pair."""
    return Band(None, None, 1, name="full")


def causal() -> Band:
    """``j <= p``."""
    return Band(None, 0, 1, name="causal")


def sliding_window(left: int, right: int) -> Band:
    """``p - left <= j <= p + right`` (``left + right + 1`` keys). Truncated attention is this."""
    check_positive_int(left, "left", allow_zero=True)
    check_positive_int(right, "right", allow_zero=True)
    return Band(-left, right, 1, name=f"sliding_window({left}, {right})")


def local(w: int) -> Band:
    """``sliding_window(w, w)``."""
    check_positive_int(w, "w", allow_zero=True)
    return Band(-w, w, 1, name=f"local({w})")


def dilated(left: int, right: int, dilation: int) -> Band:
    """``j = p + dilation * t`` for integer ``t`` in ``[-left, right]``."""
    check_positive_int(left, "left", allow_zero=True)
    check_positive_int(right, "right", allow_zero=True)
    check_positive_int(dilation, "dilation")
    return Band(-left * dilation, right * dilation, dilation, name=f"dilated({left}, {right}, {dilation})")


def strided(stride: int) -> Band:
    """``(p - j) mod stride == 0``: every stride-th position, unbounded."""
    check_positive_int(stride, "stride")
    return Band(None, None, stride, name=f"strided({stride})")


def row_contains(table: Tensor, row: Tensor, value: Tensor) -> Tensor:
    """``value in table[row]``, as an OR unrolled over the table's width: FlexAttention's
    compiler lowers only pointwise mask code, so no reduction (``.any``) may appear here."""
    hit = table[row, 0] == value
    for t in range(1, table.shape[1]):
        hit = hit | (table[row, t] == value)
    return hit


def _index_table(indices: Tensor, size: int) -> Tensor:
    table = torch.zeros(size, dtype=torch.bool)
    table[indices] = True
    return table


def _positions(indices: Sequence[int], what: str) -> tuple[Tensor, str]:
    """``indices`` as a sorted unique long tensor (one or more, non-negative) and how a
    pattern's name shows them; a ValueError names ``what`` otherwise."""
    index = torch.as_tensor(list(indices), dtype=torch.long).unique()
    if index.numel() == 0 or int(index.min()) < 0:
        raise ValueError(f"{what} needs one or more non-negative indices, got {list(indices)}")
    return index, str(index.tolist()) if index.numel() <= 8 else f"{index.numel()} positions"


def _member_of(indices: Tensor, device: Device) -> Callable[[Tensor], Tensor]:
    """``x -> x in indices`` elementwise, by a lookup table on ``device`` (``torch.isin`` does
    not compile with inductor inside a FlexAttention mask, nor does a copy between devices)."""
    top = int(indices.max())
    table = _index_table(indices, top + 1).to(device)

    def member(x: Tensor) -> Tensor:
        return (x >= 0) & (x <= top) & table[x.clamp(0, top)]

    return member


class GlobalTokens(Pattern):
    """``p in G or j in G``: the global tokens' rows and columns."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices, shown = _positions(indices, "global_tokens")
        self.name = f"global_tokens({shown})"

    def _value(self) -> tuple:
        return tuple(self.indices.tolist())

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        is_global = _member_of(self.indices, device)

        def global_tokens(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return is_global(q_idx) | is_global(kv_idx)

        return global_tokens

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        offset, n_qb, n_kb = n_kv - n_q, -(-n_q // block), -(-n_kv // block)
        rows = self.indices - offset
        rows = rows[(rows >= 0) & (rows < n_q)]
        cols = self.indices[self.indices < n_kv]
        # A tile is full when all its rows, or all its columns, are global.
        row_qb, row_count = torch.unique(rows // block, return_counts=True)
        col_kb, col_count = torch.unique(cols // block, return_counts=True)
        row_full = row_count == torch.clamp(n_q - row_qb * block, max=block)
        col_full = col_count == torch.clamp(n_kv - col_kb * block, max=block)
        qb = torch.cat([row_qb.repeat_interleave(n_kb), torch.arange(n_qb).repeat(col_kb.numel())])
        kb = torch.cat([torch.arange(n_kb).repeat(row_qb.numel()), col_kb.repeat_interleave(n_qb)])
        flags = torch.cat([row_full.repeat_interleave(n_kb), col_full.repeat_interleave(n_qb)])
        return BlockList.build(n_q, n_kv, block, qb, kb, flags)


def global_tokens(indices: Sequence[int]) -> GlobalTokens:
    """Tokens at ``indices`` attend to all and are attended by all."""
    return GlobalTokens(indices)


class PeriodicColumns(Pattern):
    """``first <= j mod period <= last``: keys attended by every query (Sparse Transformer's
    'fixed' summary columns)."""

    def __init__(self, period: int, first: int, last: int) -> None:
        check_positive_int(period, "period")
        if not 0 <= first <= last < period:
            raise ValueError(f"need 0 <= first <= last < period, got {first}, {last}, {period}")
        self.period, self.first, self.last = period, first, last
        self.name = f"columns({first}..{last} mod {period})"

    def _value(self) -> tuple:
        return self.period, self.first, self.last

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        def columns(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            r = kv_idx % self.period
            # "| (q_idx < q_idx)" adds nothing but broadcasts the result over the query axis.
            return ((r >= self.first) & (r <= self.last)) | (q_idx < q_idx)

        return columns

    def keys(self, n_kv: int) -> Tensor:
        """The column keys below ``n_kv``, ascending."""
        j = torch.arange(n_kv)
        r = j % self.period
        return j[(r >= self.first) & (r <= self.last)]

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        return column_tiles(n_q, n_kv, block, self.keys(n_kv))


class KeyColumns(Pattern):
    """``j in G``: keys every query attends, without rows of their own (unlike
    ``global_tokens``). StreamingLLM's attention sinks are ``key_columns(range(s))``."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices, shown = _positions(indices, "key_columns")
        self.name = f"key_columns({shown})"

    def _value(self) -> tuple:
        return tuple(self.indices.tolist())

    def keys(self, n_kv: int) -> Tensor:
        """The column keys below ``n_kv``, ascending."""
        return self.indices[self.indices < n_kv]

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        is_column = _member_of(self.indices, device)

        def key_columns(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            # "| (q_idx < q_idx)" adds nothing but broadcasts the result over the query axis.
            return is_column(kv_idx) | (q_idx < q_idx)

        return key_columns

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        return column_tiles(n_q, n_kv, block, self.keys(n_kv))


def key_columns(indices: Sequence[int]) -> KeyColumns:
    """Keys at ``indices`` are attended by every query (no rows of their own)."""
    return KeyColumns(indices)


def column_tiles(n_q: int, n_kv: int, block: int, keys: Tensor) -> BlockList:
    """Tiles of a pattern that is columns ``keys`` for every query: every query block against
    each key block holding a column, full where the key block holds nothing else."""
    kb, count = torch.unique(keys // block, return_counts=True)
    n_qb = -(-n_q // block)
    full = count == torch.clamp(n_kv - kb * block, max=block)
    return BlockList.build(
        n_q,
        n_kv,
        block,
        torch.arange(n_qb).repeat(kb.numel()),
        kb.repeat_interleave(n_qb),
        full.repeat_interleave(n_qb),
    )


def count_tiles(n_q: int, n_kv: int, block: int, rows: Tensor, cols: Tensor) -> BlockList:
    """Tiles holding the given unique (query row, key) pairs, full where a tile holds as many
    pairs as it has cells."""
    n_kb = -(-n_kv // block)
    tile, count = torch.unique((rows // block) * n_kb + cols // block, return_counts=True)
    qb, kb = tile // n_kb, tile % n_kb
    area = torch.clamp(n_q - qb * block, max=block) * torch.clamp(n_kv - kb * block, max=block)
    return BlockList.build(n_q, n_kv, block, qb, kb, count == area)


@lru_cache(maxsize=64)
def sample_without_replacement(seed: int, rows: int, population: int, r: int) -> Tensor:
    """``(rows, min(r, population))`` distinct draws from ``range(population)`` per row, by
    Floyd's algorithm (O(rows * r^2)), deterministic for ``(seed, rows, population, r)``."""
    r = min(r, population)
    g = torch.Generator().manual_seed(seed)
    picks = torch.empty(rows, r, dtype=torch.long)
    for t, top in enumerate(range(population - r, population)):
        candidate = torch.randint(0, top + 1, (rows,), generator=g)
        seen = (picks[:, :t] == candidate[:, None]).any(dim=1)
        picks[:, t] = torch.where(seen, torch.full_like(candidate, top), candidate)
    return picks


class RowKeyed(Pattern):
    """A pattern that lists a few keys per query row (``random``, ``logsparse``, ``graph``): the
    blocked backend's ``gathered`` path attends over each row's own keys as a sparse matrix,
    where tiles would hold the whole matrix under a mask."""

    def row_table(self, n_q: int, n_kv: int) -> tuple[Tensor, Tensor] | None:
        """``(keys, valid)``, each ``(N_q, S)``: the keys of each (end-aligned) query row,
        distinct where ``valid``; ``keys`` in range everywhere. None where a table would not pay
        (``Graph``: degrees too uneven); the pattern then runs on tiles."""
        raise NotImplementedError

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        table = self.row_table(n_q, n_kv)
        assert table is not None, "a RowKeyed pattern without a row table defines _blocks itself"
        keys, valid = table
        rows = torch.arange(n_q)[:, None].expand_as(keys)
        return count_tiles(n_q, n_kv, block, rows[valid], keys[valid])


class KeySets(NamedTuple):
    """Query groups that each see one set of keys (``GroupKeyed.key_sets``): ``rows (G, S_q)``
    the positions of each group's queries, ``rows_valid`` the slots that hold one (every query
    in exactly one slot), ``keys (G, S_k)`` the group's keys, ``keys_valid`` the slots that hold
    one. Empty slots hold position 0."""

    rows: Tensor
    rows_valid: Tensor
    keys: Tensor
    keys_valid: Tensor


class GroupKeyed(Pattern):
    """A pattern whose queries fall into groups that each see one set of keys (``block2d``: a
    query block sees its block extended by the margin): the blocked backend's ``key_sets`` path
    gathers each group's queries and keys and runs one kernel call over every group, where tiles
    cut the 2-D blocks into runs of the raster under masks."""

    def key_sets(self, n_q: int, n_kv: int) -> KeySets:
        raise NotImplementedError


class Random(RowKeyed):
    """Each query row gets ``r`` keys drawn without replacement, fixed by ``(seed, N_q, N_kv)``."""

    def __init__(self, r: int, seed: int = 0) -> None:
        check_positive_int(r, "r")
        self.r, self.seed = r, seed
        self.name = f"random({r}, seed={seed})"

    def _value(self) -> tuple:
        return self.r, self.seed

    def table(self, n_q: int, n_kv: int) -> Tensor:
        """``(N_q, min(r, N_kv))``: the keys of each query row."""
        return sample_without_replacement(self.seed, n_q, n_kv, self.r)

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        if n_q is None or n_kv is None:
            raise ValueError(f"{self.name} depends on the sequence length: use mask_mod_for(n_q, n_kv)")
        table, offset = self.table(n_q, n_kv).to(device), n_kv - n_q

        def random(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return row_contains(table, (q_idx - offset).clamp(0, n_q - 1), kv_idx)

        return random

    def row_table(self, n_q: int, n_kv: int) -> tuple[Tensor, Tensor]:
        table = self.table(n_q, n_kv)
        return table, torch.ones(table.shape, dtype=torch.bool)


def random(r: int, seed: int = 0) -> Random:
    """``r`` random keys per query row (without replacement, deterministic per seed and N)."""
    return Random(r, seed)


class LogSparse(RowKeyed):
    """LogSparse (Li et al. 2019, https://arxiv.org/abs/1907.00235): ``|j - p|`` is 0 or a power
    of two up to ``2^(levels - 1)``: each position, and the positions at distance 1, 2, 4, ....
    The paper's setting is causal (``& causal()`` keeps the earlier ones); without it the
    distances go both ways. ``2^levels >= N`` gives the paper's pattern at N positions."""

    def __init__(self, levels: int) -> None:
        check_positive_int(levels, "levels")
        self.levels = levels
        self.name = f"logsparse({levels})"

    def _value(self) -> tuple:
        return (self.levels,)

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        top = 1 << (self.levels - 1)

        def logsparse(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            d = (kv_idx - q_idx).abs()
            return ((d & (d - 1)) == 0) & (d <= top)  # d & (d - 1) clears d's lowest set bit

        return logsparse

    def row_table(self, n_q: int, n_kv: int) -> tuple[Tensor, Tensor]:
        steps = [1 << m for m in range(self.levels)]
        offsets = torch.tensor([-s for s in reversed(steps)] + [0] + steps)  # ascending
        keys = torch.arange(n_q)[:, None] + (n_kv - n_q) + offsets  # [N_q, 2 levels + 1]
        valid = (keys >= 0) & (keys < n_kv)
        return keys.clamp(0, max(n_kv - 1, 0)), valid


def logsparse(levels: int) -> LogSparse:
    """Each position and those at distances 1, 2, 4, ..., ``2^(levels - 1)`` (``LogSparse``)."""
    return LogSparse(levels)


def rectangles_to_tiles(n_q: int, n_kv: int, block: int, rects: Tensor) -> BlockList:
    """Tiles covered by *disjoint* rectangles ``(R, 4)`` = ``[row_lo, row_hi, col_lo, col_hi]``
    (inclusive; query rows and keys). Because the rectangles do not overlap, a tile is full
    exactly when the areas they cover inside it add up to the tile's area."""
    rects = rects.clone()
    rects[:, 0].clamp_(min=0)
    rects[:, 1].clamp_(max=n_q - 1)
    rects[:, 2].clamp_(min=0)
    rects[:, 3].clamp_(max=n_kv - 1)
    rects = rects[(rects[:, 0] <= rects[:, 1]) & (rects[:, 2] <= rects[:, 3])]
    r_idx, qb = _expand_ranges(rects[:, 0] // block, rects[:, 1] // block)
    t_idx, kb = _expand_ranges(rects[r_idx, 2] // block, rects[r_idx, 3] // block)
    rect, qb = rects[r_idx[t_idx]], qb[t_idx]
    q_lo, q_hi = qb * block, torch.clamp(qb * block + block, max=n_q) - 1
    k_lo, k_hi = kb * block, torch.clamp(kb * block + block, max=n_kv) - 1
    rows = torch.minimum(rect[:, 1], q_hi) - torch.maximum(rect[:, 0], q_lo) + 1
    cols = torch.minimum(rect[:, 3], k_hi) - torch.maximum(rect[:, 2], k_lo) + 1
    n_kb = -(-n_kv // block)
    tile, inverse = torch.unique(qb * n_kb + kb, return_inverse=True)
    covered = torch.zeros(tile.numel(), dtype=torch.long).index_add_(0, inverse, rows * cols)
    qb, kb = tile // n_kb, tile % n_kb
    area = torch.clamp(n_q - qb * block, max=block) * torch.clamp(n_kv - kb * block, max=block)
    return BlockList.build(n_q, n_kv, block, qb, kb, covered == area)


class BlockLocal(Pattern):
    """``p // size == j // size``: non-overlapping local blocks."""

    def __init__(self, size: int) -> None:
        check_positive_int(size, "size")
        self.size = size
        self.name = f"block_local({size})"

    def _value(self) -> tuple:
        return (self.size,)

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        def block_local(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return torch.div(q_idx, self.size, rounding_mode="floor") == torch.div(
                kv_idx, self.size, rounding_mode="floor"
            )

        return block_local

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        offset = n_kv - n_q
        starts = torch.arange(0, n_kv, self.size)
        ends = starts + self.size - 1
        rects = torch.stack([starts - offset, ends - offset, starts, ends], dim=1)
        return rectangles_to_tiles(n_q, n_kv, block, rects)


def block_local(size: int) -> BlockLocal:
    """Attention inside consecutive, non-overlapping blocks of ``size`` positions."""
    return BlockLocal(size)


class RandomBlocks(Pattern):
    """Each query block of ``block`` positions (end-aligned coordinates) gets ``r`` key blocks
    drawn without replacement, fixed by ``(seed, N_kv)`` (BigBird's random attention)."""

    def __init__(self, r: int, block: int, seed: int = 0) -> None:
        check_positive_int(r, "r")
        check_positive_int(block, "block")
        self.r, self.block, self.seed = r, block, seed
        self.name = f"random_blocks({r}, {block}, seed={seed})"

    def _value(self) -> tuple:
        return self.r, self.block, self.seed

    def table(self, n_kv: int) -> Tensor:
        n_blocks = -(-n_kv // self.block)
        return sample_without_replacement(self.seed, n_blocks, n_blocks, self.r)

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        if n_kv is None:
            raise ValueError(f"{self.name} depends on the sequence length: use mask_mod_for(n_q, n_kv)")
        table, size = self.table(n_kv).to(device), self.block

        def random_blocks(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            qb = torch.div(q_idx, size, rounding_mode="floor").clamp(0, table.shape[0] - 1)
            hit = row_contains(table, qb, torch.div(kv_idx, size, rounding_mode="floor"))
            return hit & (q_idx >= 0)

        return random_blocks

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        table, offset = self.table(n_kv), n_kv - n_q
        qbs = torch.arange(table.shape[0]).repeat_interleave(table.shape[1])
        kbs = table.flatten()
        rects = torch.stack(
            [
                qbs * self.block - offset,
                qbs * self.block + self.block - 1 - offset,
                kbs * self.block,
                kbs * self.block + self.block - 1,
            ],
            dim=1,
        )
        return rectangles_to_tiles(n_q, n_kv, block, rects)


def random_blocks(r: int, block: int, seed: int = 0) -> RandomBlocks:
    """``r`` random key blocks per query block of size ``block``."""
    return RandomBlocks(r, block, seed)


#: ``Graph.row_table`` lists each node's keys in a table as wide as the largest degree, so the
#: table holds ``n * max degree`` slots for the edges: up to this many times their number.
#: Beyond it (a hub with most nodes as neighbours) the graph runs on tiles, as a star would.
GRAPH_TABLE_SLOTS_PER_EDGE = 4


class Graph(RowKeyed):
    """The pairs of an edge list: ``edge_index[0]`` are query indices, ``edge_index[1]`` the keys
    they attend (plus ``(i, i)`` with ``self_loops``), on ``n`` nodes. Row-keyed (each node's
    neighbours as a sparse row, O(E D)) while the degrees are even enough
    (``GRAPH_TABLE_SLOTS_PER_EDGE``); else on tiles (a random graph's edges reach nearly every
    tile there)."""

    def __init__(self, edge_index: Tensor, n: int, self_loops: bool = True) -> None:
        check_positive_int(n, "n")
        edge_index = torch.as_tensor(edge_index, dtype=torch.long)
        if edge_index.ndim != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}")
        if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= n):
            raise ValueError(f"edge_index entries must lie in [0, n={n})")
        if self_loops:
            loops = torch.arange(n)
            edge_index = torch.cat([edge_index, torch.stack([loops, loops])], dim=1)
        self.n = n
        self.edge_keys = torch.unique(edge_index[0] * n + edge_index[1])  # sorted by (query, key)
        self.name = f"graph({n} nodes, {self.edge_keys.numel()} edges)"
        self._degree = torch.bincount(self.edge_keys // n, minlength=n)  # [n]: keys per query
        # Computed once: plans are looked up by this value on every call (bytes cache their hash).
        self._identity = (n, self.edge_keys.numpy().tobytes())

    def _value(self) -> tuple:
        return self._identity

    def neighbours(self) -> Tensor:
        """``(n, max degree)``: the keys each query attends, padded with -1."""
        rows, degree = self.edge_keys // self.n, self._degree
        table = torch.full((self.n, max(int(degree.max()) if rows.numel() else 0, 1)), -1, dtype=torch.long)
        position = torch.arange(rows.numel()) - (torch.cumsum(degree, 0) - degree)[rows]
        table[rows, position] = self.edge_keys % self.n
        return table

    def row_table(self, n_q: int, n_kv: int) -> tuple[Tensor, Tensor] | None:
        self._check(n_q, n_kv)
        # Decided from the degrees, before the table exists: a hub's would be n x n.
        if self.n * max(int(self._degree.max()), 1) > GRAPH_TABLE_SLOTS_PER_EDGE * max(self.edge_keys.numel(), 1):
            return None
        table = self.neighbours()
        return table.clamp(min=0), table >= 0

    def _check(self, n_q: int | None, n_kv: int | None) -> None:
        if n_q not in (None, self.n) or n_kv not in (None, self.n):
            raise ValueError(f"{self.name} is defined on exactly {self.n} positions, got N_q={n_q}, N_kv={n_kv}")

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        self._check(n_q, n_kv)
        table = self.neighbours().to(device)

        def graph(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return row_contains(table, q_idx.clamp(0, self.n - 1), kv_idx)

        return graph

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        self._check(n_q, n_kv)
        return count_tiles(n_q, n_kv, block, self.edge_keys // self.n, self.edge_keys % self.n)


def graph(edge_index: Tensor, n: int, self_loops: bool = True) -> Graph:
    """Attention along the edges of a graph; see ``Graph``."""
    return Graph(edge_index, n, self_loops)
