"""Compound patterns (MECHANISMS.md §B): each is a composition of atomic ones, and says which.

``p`` is the end-aligned query position, ``j`` the key index (see ``attnzoo.spec``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnzoo._checks import check_positive_int
from attnzoo.patterns.algebra import BlockList, Pattern, PerHead, per_head
from attnzoo.patterns.atomic import (
    BlockLocal,
    GlobalTokens,
    GroupKeyed,
    KeySets,
    PeriodicColumns,
    RandomBlocks,
    causal,
    dilated,
    global_tokens,
    key_columns,
    local,
    rectangles_to_tiles,
    sliding_window,
    strided,
)
from attnzoo.spec import Device, MaskMod


def longformer(window: int, global_indices: Sequence[int] = (0,), dilation: int | Sequence[int] = 1) -> Pattern:
    """Longformer (Beltagy et al. 2020, https://arxiv.org/abs/2004.05150):
    ``dilated(window, window, d) | global_tokens(global_indices)``; ``window`` keys on each side
    (``local(window)`` when ``d == 1``). A list of dilations gives ``per_head``: one group of
    heads per dilation. ``global_indices`` are internal global tokens, e.g. ``[0]`` for CLS."""
    glob = global_tokens(global_indices) if len(global_indices) else None
    if isinstance(dilation, int):
        band = local(window) if dilation == 1 else dilated(window, window, dilation)
        return band if glob is None else band | glob
    bands = [dilated(window, window, d) for d in dilation]
    return per_head([b if glob is None else b | glob for b in bands])


def bigbird(
    block: int, window_blocks: int = 3, global_blocks: int = 2, random_blocks: int = 3, seed: int = 0
) -> Pattern:
    """BigBird (Zaheer et al. 2020, https://arxiv.org/abs/2007.14062), at block level with
    ``qb = p // block``, ``kb = j // block``:
    ``|qb - kb| <= window_blocks // 2`` | global blocks | ``random_blocks(r, block, seed)``.
    Global blocks are the first ``ceil(g / 2)`` and last ``floor(g / 2)`` blocks (rows and
    columns). Random blocks may repeat window or global blocks (the union is unchanged)."""
    check_positive_int(block, "block")
    check_positive_int(window_blocks, "window_blocks")
    check_positive_int(global_blocks, "global_blocks", allow_zero=True)
    check_positive_int(random_blocks, "random_blocks", allow_zero=True)
    parts: list[Pattern] = [BlockBand(block, window_blocks // 2)]
    if global_blocks:
        parts.append(GlobalBlocks(block, (global_blocks + 1) // 2, global_blocks // 2))
    if random_blocks:
        parts.append(RandomBlocks(random_blocks, block, seed))
    pattern = parts[0]
    for part in parts[1:]:
        pattern = pattern | part
    pattern.name = f"bigbird(block={block}, window={window_blocks}, global={global_blocks}, random={random_blocks})"
    return pattern


class BlockBand(Pattern):
    """``|p // block - j // block| <= reach``: the block-level sliding window of BigBird."""

    def __init__(self, block: int, reach: int) -> None:
        self.size, self.reach = block, reach
        self.name = f"block_band({block}, ±{reach})"

    def _value(self) -> tuple:
        return self.size, self.reach

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        def block_band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            qb = torch.div(q_idx, self.size, rounding_mode="floor")
            return (qb - torch.div(kv_idx, self.size, rounding_mode="floor")).abs() <= self.reach

        return block_band

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        offset, starts = n_kv - n_q, torch.arange(0, n_kv, self.size)
        rows_lo, rows_hi = starts - offset, starts + self.size - 1 - offset
        rects = torch.stack(
            [rows_lo, rows_hi, starts - self.reach * self.size, starts + (self.reach + 1) * self.size - 1], dim=1
        )
        return rectangles_to_tiles(n_q, n_kv, block, rects)


class GlobalBlocks(Pattern):
    """The first ``first`` and last ``last`` blocks of ``block`` keys are global (rows and
    columns). Which blocks are last depends on ``N_kv``, so this is ``global_tokens`` over
    positions resolved per length."""

    def __init__(self, block: int, first: int, last: int) -> None:
        self.size, self.first, self.last = block, first, last
        self.name = f"global_blocks(first {first}, last {last}, block {block})"

    def _value(self) -> tuple:
        return self.size, self.first, self.last

    def _tokens(self, n_kv: int) -> GlobalTokens:
        n_blocks = -(-n_kv // self.size)
        chosen = set(range(min(self.first, n_blocks))) | set(range(max(n_blocks - self.last, 0), n_blocks))
        return GlobalTokens([i for b in sorted(chosen) for i in range(b * self.size, min((b + 1) * self.size, n_kv))])

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        if n_kv is None:
            raise ValueError(f"{self.name} depends on the sequence length: use mask_mod_for(n_q, n_kv)")
        return self._tokens(n_kv).mask_mod_for(n_q, n_kv, device)

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        return self._tokens(n_kv)._blocks(n_q, n_kv, block)


def star(relay: int = 0) -> Pattern:
    """Star-Transformer (Guo et al. 2019, https://arxiv.org/abs/1902.09113):
    ``local(1) | global_tokens([relay])`` — each satellite sees its neighbours and the relay,
    the relay sees all. Prepend the relay with ``attnzoo.nn.GlobalTokens(dim, 1)``. The band
    does not wrap: the first and last satellites are not neighbours (the paper's satellites form
    a ring), so this is the paper's ring cut open between them."""
    return local(1) | global_tokens([relay])


def etc(window: int, n_global: int) -> Pattern:
    """ETC (Ainslie et al. 2020, https://arxiv.org/abs/2004.08483):
    ``global_tokens(range(n_global)) | local(window)``: the first ``n_global`` positions are the
    external global tokens that ``attnzoo.nn.GlobalTokens(dim, n_global)`` prepends."""
    check_positive_int(n_global, "n_global")
    return global_tokens(range(n_global)) | local(window)


def sinks(n_sinks: int, left: int, right: int) -> Pattern:
    """Attention sinks (StreamingLLM, Xiao et al. 2023, https://arxiv.org/abs/2309.17453):
    ``sliding_window(left, right) | key_columns(range(n_sinks))`` — every query keeps the first
    ``n_sinks`` keys beside its window. The paper's setting is causal (``right`` is then cut to
    0 by ``& causal()``); the sinks have no rows of their own, unlike ETC's global tokens."""
    check_positive_int(n_sinks, "n_sinks")
    return sliding_window(left, right) | key_columns(range(n_sinks))


def sparse_transformer_strided(l: int) -> PerHead:  # noqa: E741  (the paper's name)
    """Sparse Transformer strided (Child et al. 2019, https://arxiv.org/abs/1904.10509):
    ``per_head([sliding_window(l - 1, 0), strided(l) & causal()])`` — the first half of the
    heads attend to the previous ``l`` positions, the second half to every ``l``-th one."""
    check_positive_int(l, "l")
    return per_head([sliding_window(l - 1, 0), strided(l) & causal()])


def sparse_transformer_fixed(l: int, c: int) -> PerHead:  # noqa: E741
    """Sparse Transformer fixed: ``per_head([block_local(l) & causal(), columns & causal()])``
    where the columns are ``j mod l >= l - c`` (the last ``c`` positions of each block)."""
    check_positive_int(l, "l")
    check_positive_int(c, "c")
    if c > l:
        raise ValueError(f"sparse_transformer_fixed needs c <= l, got c={c}, l={l}")
    return per_head([BlockLocal(l) & causal(), PeriodicColumns(l, l - c, l - 1) & causal()])


class GridPattern(Pattern):
    """A pattern on the positions of a row-major ``h x w`` grid: defined for N = h * w only."""

    h: int
    w: int

    def _check(self, n_q: int | None, n_kv: int | None) -> None:
        if n_q not in (None, self.h * self.w) or n_kv not in (None, self.h * self.w):
            raise ValueError(f"{self.name} is defined on exactly h*w = {self.h * self.w} positions, got {n_q}, {n_kv}")


class Block2D(GroupKeyed, GridPattern):
    """Image Transformer 2-D local attention (Parmar et al. 2018,
    https://arxiv.org/abs/1802.05751) on a row-major ``h x w`` image: the query block
    ``(r // qh, c // qw)`` attends to its own block extended by ``memory_margin = (mh, mw)``
    pixels on every side. Compose with ``causal()`` for the autoregressive version. Every
    query of a block sees the same keys (``key_sets``)."""

    def __init__(self, h: int, w: int, query_block: tuple[int, int], memory_margin: tuple[int, int]) -> None:
        for value, name in ((h, "h"), (w, "w"), (query_block[0], "query_block[0]"), (query_block[1], "query_block[1]")):
            check_positive_int(value, name)
        for value, name in ((memory_margin[0], "memory_margin[0]"), (memory_margin[1], "memory_margin[1]")):
            check_positive_int(value, name, allow_zero=True)
        self.h, self.w, self.query_block, self.margin = h, w, tuple(query_block), tuple(memory_margin)
        self.name = f"block2d({h}x{w}, query_block={self.query_block}, margin={self.margin})"

    def _value(self) -> tuple:
        return self.h, self.w, self.query_block, self.margin

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        self._check(n_q, n_kv)
        (qh, qw), (mh, mw), w = self.query_block, self.margin, self.w

        def block2d(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            br = torch.div(torch.div(q_idx, w, rounding_mode="floor"), qh, rounding_mode="floor")
            bc = torch.div(q_idx % w, qw, rounding_mode="floor")
            r2, c2 = torch.div(kv_idx, w, rounding_mode="floor"), kv_idx % w
            rows = (r2 >= br * qh - mh) & (r2 <= br * qh + qh - 1 + mh)
            return rows & (c2 >= bc * qw - mw) & (c2 <= bc * qw + qw - 1 + mw)

        return block2d

    def key_sets(self, n_q: int, n_kv: int) -> KeySets:
        """One group per query block: its ``qh x qw`` pixels and the ``(qh + 2 mh) x (qw + 2
        mw)`` pixels of its extended block, the slots outside the image empty."""
        self._check(n_q, n_kv)
        (qh, qw), (mh, mw), h, w = self.query_block, self.margin, self.h, self.w
        blocks = torch.cartesian_prod(torch.arange(-(-h // qh)), torch.arange(-(-w // qw)))  # [G, 2]

        def pixels(height: int, width: int, margin: tuple[int, int]) -> tuple[Tensor, Tensor]:
            r = (blocks[:, 0] * qh - margin[0])[:, None, None] + torch.arange(height)[None, :, None]
            c = (blocks[:, 1] * qw - margin[1])[:, None, None] + torch.arange(width)[None, None, :]
            inside = (r >= 0) & (r < h) & (c >= 0) & (c < w)  # [G, height, width]
            return torch.where(inside, r * w + c, 0).flatten(1), inside.flatten(1)

        return KeySets(*pixels(qh, qw, (0, 0)), *pixels(qh + 2 * mh, qw + 2 * mw, (mh, mw)))

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        # One rectangle per (query image row, key image row) of each query block: the query
        # row's run of pixels in the block times the key row's run in the extended block.
        self._check(n_q, n_kv)
        (qh, qw), (mh, mw), w = self.query_block, self.margin, self.w
        rects = []
        for br in range(-(-self.h // qh)):
            for bc in range(-(-w // qw)):
                c_lo, c_hi = bc * qw, min(bc * qw + qw, w) - 1
                for r in range(br * qh, min(br * qh + qh, self.h)):
                    for r2 in range(max(br * qh - mh, 0), min(br * qh + qh + mh, self.h)):
                        rects.append(
                            [r * w + c_lo, r * w + c_hi, r2 * w + max(c_lo - mw, 0), r2 * w + min(c_hi + mw, w - 1)]
                        )
        return rectangles_to_tiles(n_q, n_kv, block, torch.tensor(rects, dtype=torch.long))


def block2d(h: int, w: int, query_block: tuple[int, int] = (8, 8), memory_margin: tuple[int, int] = (4, 4)) -> Block2D:
    """Image Transformer 2-D block-local attention; see ``Block2D``."""
    return Block2D(h, w, query_block, memory_margin)


class Axial(GridPattern):
    """Same row or same column of a row-major ``h x w`` grid: ``block_local(w) | strided(w)`` on
    exactly ``h * w`` positions.

    Attention over this pattern is one softmax over the row and the column together (h + w - 1
    keys): the criss-cross pattern of CCNet (Huang et al. 2019, https://arxiv.org/abs/1811.11721).
    It is not the axial attention of Ho et al. 2019 (https://arxiv.org/abs/1912.12180), a row
    pass then a column pass with a softmax each, which is ``attnzoo.nn.AxialAttention``. The
    name stays ``axial`` because configs and benchmarks refer to it."""

    def __init__(self, h: int, w: int) -> None:
        check_positive_int(h, "h")
        check_positive_int(w, "w")
        self.h, self.w = h, w
        self.inner = BlockLocal(w) | strided(w)
        self.name = f"axial({h}x{w})"

    def _value(self) -> tuple:
        return self.h, self.w

    def mask_mod_for(self, n_q: int | None = None, n_kv: int | None = None, device: Device = None) -> MaskMod:
        self._check(n_q, n_kv)
        return self.inner.mask_mod_for(n_q, n_kv, device)

    def _blocks(self, n_q: int, n_kv: int, block: int) -> BlockList:
        self._check(n_q, n_kv)
        return self.inner._blocks(n_q, n_kv, block)


def axial(h: int, w: int) -> Axial:
    """Row-or-column (criss-cross) pattern on an ``h x w`` grid; see ``Axial``."""
    return Axial(h, w)
