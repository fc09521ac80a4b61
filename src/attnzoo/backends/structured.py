"""The blocked backend's structured path: patterns whose rows see one *contiguous run* of keys
run as one call of PyTorch's CPU flash kernel over zero-copy windows of K and V, with no tile
pieces, no gathers and no per-piece merging.

What it recognises (``structure(pattern, ...)``; anything else returns None and the call runs
on the generic tile plan in ``blocked.py``):

- ``Band(lo, hi, 1)`` with finite ends (``local``, ``sliding_window``, causal windows): query
  block ``t`` of ``b`` rows sees the keys ``[t*b + start, t*b + start + width)``, a window of K/V
  taken with ``as_strided`` (no copy). One additive mask ``(1, blocks, b, width)``, computed
  once per plan from the pattern's own ``mask_mod``, removes the pairs outside the band.
- ``block_local(s)`` (and ``block_local(s) & causal()``): the same with non-overlapping windows.
- ``Band(lo, hi, m)`` with ``m > 1`` (``dilated``, ``strided``): positions ``p`` and keys ``j``
  with ``m | j - p`` lie in the same residue class, so the sequence is *de-interleaved* into
  ``m`` sub-sequences (a reshape) and the band ``[ceil(lo/m), floor(hi/m)]`` runs on each;
  unbounded bands become dense (or causal) attention over the sub-sequences, unmasked.
- ``window | global tokens`` (Longformer, ETC, Star, ``global``), ``& causal()`` too: the window
  call plus every row against the g global keys (pairs the window holds excluded), merged by
  log-sum-exp; the global tokens' own rows are computed densely and replace theirs. Sparse
  Transformer's summary columns run the same way (columns, no rows).
- ``axial(h, w)`` (row ∪ column of a grid, one softmax; ``& causal()`` too): the row as
  ``block_local(w)`` windows and the column de-interleaved by ``w`` into dense sub-sequences
  with the diagonal removed (it is in the row), merged by log-sum-exp.
- ``per_head([...])`` of the above: one part per head group.

An additive bias (``score_mods.plain_bias``: ALiBi) joins the window masks (``B H N width``
values), dense sub-sequences' masks (the pattern's pair count), the global columns and rows, per
head group (``plan._takes_bias``; ``window_parts._with_bias``, ``_dense_with_bias``,
``windowed._bias_at``, ``_group_opts``); ``axial``'s merged parts take the tile path with it.

This module builds the plans; ``attnzoo.backends.windowed`` runs them. Backward recomputes
from q, k, v, the output and the log-sum-exp through the flash kernel's backward; key gradients
of overlapping windows are added back block by block. Nothing ``N x N`` is allocated: windows
hold ``N * width`` scores per head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnzoo.patterns.algebra import Intersection, Pattern, PerHead
from attnzoo.patterns.algebra import Union as PatternUnion
from attnzoo.patterns.atomic import Band, BlockLocal, GlobalTokens, KeyColumns, PeriodicColumns
from attnzoo.patterns.compound import Axial, GlobalBlocks


@dataclass(frozen=True)
class Windows:
    """Query blocks of ``block`` rows, each attending ``width`` keys (a multiple of ``block``)
    from ``start`` (<= 0, or a multiple of ``block``) relative to the block's first row, on
    sub-sequences of stride ``stride``. ``allowed (1, blocks, block, width)`` is the additive
    pattern mask (0 / -inf), None when every pair in every window is allowed; dense parts
    (``width == 0``) attend the whole sub-sequence, causally when ``causal``."""

    stride: int
    block: int = 0
    start: int = 0
    width: int = 0
    allowed: Tensor | None = None
    causal: bool = False


@dataclass(frozen=True)
class WithGlobals:
    """A window part (or none) united with global tokens (Longformer, ETC, Star): every row
    also attends the global keys ``tokens`` where ``columns (N, g)`` allows it (pairs the
    window already holds are excluded, so each pair counts once), merged by log-sum-exp; the
    global tokens' own rows attend every key (causally when ``causal``) and replace theirs."""

    windows: Windows | None
    tokens: Tensor
    columns: Tensor
    causal: bool
    #: False for key-only columns (Sparse Transformer's summary columns): no global rows.
    rows: bool = True


@dataclass(frozen=True)
class Merged:
    """Window parts with disjoint pair sets (each later part's mask leaves out the pairs of
    the earlier ones), merged by log-sum-exp into one softmax over their union."""

    parts: tuple[Windows, ...]


@dataclass(frozen=True)
class Structure:
    """One part per head group: ``heads`` (None = all heads) and how they run."""

    n: int
    parts: tuple[tuple[Tensor | None, Windows | WithGlobals | Merged], ...]


def structure(pattern: Pattern, n_q: int, n_kv: int, heads: int, *, train: bool = True) -> Structure | None:
    """The structured plan of ``pattern`` for self-attention of length ``n_q == n_kv``, or None
    when the pattern has no contiguous-run structure this path knows. ``train``: the plan will
    run backward too (band windows then take the blocks that suit the kernel's backward; a
    forward alone runs faster on smaller ones, ``choose_block``)."""
    if n_q != n_kv:
        return None
    if isinstance(pattern, PerHead):
        groups = pattern.resolve_heads(heads).head_groups()
        parts = []
        for index, part in enumerate(pattern.patterns):
            plan = _part(part, n_q, train)
            if plan is None:
                return None
            parts.append(((groups == index).nonzero().flatten(), plan))
        return Structure(n_q, tuple(parts))
    plan = _part(pattern, n_q, train)
    return None if plan is None else Structure(n_q, ((None, plan),))


def _part(pattern: Pattern, n: int, train: bool) -> Windows | WithGlobals | Merged | None:
    return _windows(pattern, n, train) or _with_globals(pattern, n, train) or _axial(pattern, n, train)


def _causal_part(pattern: Pattern) -> tuple[Pattern, bool]:
    """``p & causal()`` -> (p, True); anything else -> (pattern, False)."""
    if isinstance(pattern, Intersection) and len(pattern.parts) == 2:
        for inner, other in (pattern.parts, pattern.parts[::-1]):
            if isinstance(other, Band) and (other.lo, other.hi, other.modulus) == (None, 0, 1):
                return inner, True
    return pattern, False


def _axial(pattern: Pattern, n: int, train: bool) -> Merged | None:
    """``axial(h, w)``: its row (``block_local(w)``) and its column (positions ``w`` apart:
    de-interleaved by ``w`` into dense sub-sequences of length ``h``, self removed)."""
    grid, causal = _causal_part(pattern)
    if not isinstance(grid, Axial) or grid.h * grid.w != n:
        return None
    row = _windows(BlockLocal(grid.w) & Band(None, 0, 1) if causal else BlockLocal(grid.w), n, train)
    own = torch.ones(grid.h, grid.h, dtype=torch.bool)
    own = own.tril(-1) if causal else own.fill_diagonal_(False)
    column = Windows(grid.w, allowed=torch.zeros(grid.h, grid.h).masked_fill_(~own, float("-inf")), causal=causal)
    return None if row is None else Merged((row, column))


def _with_globals(pattern: Pattern, n: int, train: bool) -> WithGlobals | None:
    """``window | global tokens`` (optionally ``& causal()``), with at most one window part."""
    pattern, causal = _causal_part(pattern)
    if isinstance(pattern, Intersection):
        return None
    parts = pattern.parts if isinstance(pattern, PatternUnion) else (pattern,)
    tokens = [p for p in parts if isinstance(p, (GlobalTokens, GlobalBlocks, *_COLUMNS))]
    others = [p for p in parts if not isinstance(p, (GlobalTokens, GlobalBlocks, *_COLUMNS))]
    if not tokens or len(others) > 1:
        return None
    window = None
    if others:
        window = _windows(others[0] & Band(None, 0, 1) if causal else others[0], n, train)
        if window is None:
            return None
    indices = [_column_keys(p, n) for p in tokens]
    index = torch.cat(indices).unique()
    index = index[index < n]
    rows, cols = torch.arange(n)[:, None], index[None, :]
    columns = torch.ones(n, index.numel(), dtype=torch.bool) if not causal else cols <= rows
    if others:
        zero = torch.zeros((), dtype=torch.long)
        columns = columns & ~others[0].mask_mod_for(n, n)(zero, zero, rows, cols)
    rows = any(not isinstance(p, _COLUMNS) for p in tokens)
    if rows and any(isinstance(p, _COLUMNS) for p in tokens):
        return None  # rows for some columns only: not this shape
    return WithGlobals(window, index, columns, causal, rows)


#: Key-only columns (no rows of their own): Sparse Transformer's summary columns, attention sinks.
_COLUMNS = (PeriodicColumns, KeyColumns)


def _column_keys(pattern: Pattern, n: int) -> Tensor:
    if isinstance(pattern, GlobalBlocks):
        return pattern._tokens(n).indices
    if isinstance(pattern, _COLUMNS):
        return pattern.keys(n)
    return pattern.indices


def _windows(pattern: Pattern, n: int, train: bool) -> Windows | None:
    if isinstance(pattern, Band):
        return _band(pattern, n, train)
    block_local = _block_local(pattern)
    if block_local is not None:
        size, causal = block_local
        mask = BlockLocal(size).mask_mod_for(n, n) if not causal else pattern.mask_mod_for(n, n)
        return _window_plan(mask, n, 1, size, 0, size)
    return None


def _block_local(pattern: Pattern) -> tuple[int, bool] | None:
    """``block_local(s)`` -> (s, False); ``block_local(s) & causal()`` -> (s, True)."""
    inner, causal = _causal_part(pattern)
    return (inner.size, causal) if isinstance(inner, BlockLocal) else None


def _band(band: Band, n: int, train: bool) -> Windows | None:
    m = band.modulus
    if m > n:
        return None
    lo = None if band.lo is None else -((-band.lo) // m)  # ceil(lo / m): sub-sequence offsets
    hi = None if band.hi is None else band.hi // m
    sub = -(-n // m)  # sub-sequence length
    if lo is None or hi is None:
        if hi is None and lo is None:
            return Windows(m)
        if lo is None and hi == 0:
            return Windows(m, causal=True)
        return None
    if lo > hi or hi - lo + 1 >= sub:
        return None
    block = choose_block(hi - lo + 1, train)
    # A window may start anywhere at or before the band: where it starts at lo <= 0 the key
    # padding in front lines the windows up with the blocks (what the backward's overlap-add
    # needs), so only a band wholly to the right is aligned down to a block multiple.
    start = lo if lo <= 0 else (lo // block) * block
    width = -(-(block + hi - start) // block) * block
    return _window_plan(Band(lo, hi, 1).mask_mod_for(sub, sub), sub, m, block, start, width)


def choose_block(keys: int, train: bool = True) -> int:
    """Query rows per window for a band of ``keys`` keys per row: small blocks waste fewer keys
    at the window's ends (a window holds ``block + keys - 1`` keys, rounded up to a multiple of
    the block), large ones run the kernel at a better rate, its backward most of all. Measured
    on a 2-core EPYC, one process, the blocks side by side: for training (fwd+bwd, N = 4096,
    ``benchmarks/ab-band-block-cpu.txt``) 32 while its window fits in 128 keys (up to 97 keys: 65
    keys ran 1.2x faster than with 64), 64 up to 384 keys, else 128; for a forward alone
    (``benchmarks/ab-forward-blocks-cpu.txt``) 32 up to 384 keys, else 64 (129 keys: 32 rows 14%
    faster than 64; 513 keys at 16K: 64 rows 13% faster than 128)."""
    if not train:
        return 32 if keys <= 384 else 64
    return 32 if keys + 31 <= 128 else 64 if keys <= 384 else 128


def _window_plan(mask_mod: Any, n: int, stride: int, block: int, start: int, width: int) -> Windows:
    """Evaluate the pattern on every window once: ``(1, blocks, block, width)`` additive."""
    blocks = -(-n // block)
    rows = torch.arange(blocks)[:, None, None] * block + torch.arange(block)[None, :, None]
    keys = torch.arange(blocks)[:, None, None] * block + start + torch.arange(width)[None, None, :]
    zero = torch.zeros((), dtype=torch.long)
    ok = mask_mod(zero, zero, rows, keys) & (keys >= 0) & (keys < n) & (rows < n)
    additive = None if bool(ok.all()) else torch.zeros(ok.shape).masked_fill_(~ok, float("-inf"))[None]
    return Windows(stride, block, start, width, additive)
