"""Causal ``routing``'s fast path (registered in ``attnzoo.mechanisms.routing``): each query
attends to a band of ranks over its cluster's keys sorted by position, in tiles of queries that
share one SDPA call per span width (O(N (w + BAND)) pairs, never N x N).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.mechanisms._ops import argmax_over
from attnzoo.mechanisms.group_windows import counts

#: Queries per tile, and ranks per block of a tile's key span (at most w); (query, key) pairs per
#: SDPA call (bounds working memory).
BAND, PAIRS = 128, 2**24


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, sims: tuple[Tensor, Tensor], w: int, real: Tensor, scale: float
) -> Tensor:
    """Causal fast path: query i attends to the w most recent keys j <= i of its nearest cluster.

    Args:
        sims: query and key similarities ``(B, H, C, N)`` (``routing_tiles.similarities``).
        real: ``(B, H, N)`` bool, True = a real token.

    Notes:
        Keys sorted by (cluster, position) rank each cluster's keys; m_i counts the keys of query
        i's cluster at positions <= i, and query i sees the ranks ``[m_i - w, m_i)``: a band over
        its cluster's sorted keys (``band_attention``). A real query with m_i = 0 gets its own
        value (its own key alone). Padded keys join no cluster.
    """
    (sim_q, sim_k), n = sims, q.shape[2]
    n_clusters = sim_q.shape[2]
    position = torch.arange(n, device=q.device)
    a_q, a_k = argmax_over(sim_q, 2), torch.where(real, argmax_over(sim_k, 2), n_clusters)  # [B, H, N]; padded: none
    a_sorted, key_order = torch.sort(a_k, dim=-1, stable=True)  # keys by (cluster, position)
    n_keys = counts(a_k, n_clusters + 1)
    first_key = n_keys.cumsum(-1) - n_keys
    sorted_code = (a_sorted * n + key_order).contiguous()  # increasing: (cluster, position)
    m = torch.searchsorted(sorted_code, (a_q * n + position).contiguous(), right=True) - first_key.gather(-1, a_q)
    group = torch.where((m > 0) & real, a_q, n_clusters)  # n_clusters: attends nothing here
    out = band_attention(q, k, v, group, m, (key_order, first_key[..., :-1], n_keys[..., :-1]), w, scale)
    return out + ((m == 0) & real)[..., None] * v  # nothing of its cluster visible: its own key


class _Picks(torch.autograd.Function):
    """``x[index]`` for a flat ``index`` into the rows of ``x (M, ...)``, split into parts of
    ``sizes`` rows (views, one gather): the backward accumulates the parts' gradients into one
    ``(M, ...)`` buffer with ``index_add_`` (per-part gathers would each write a whole zero
    gradient; ``index_add_`` adds rows in parallel, where ``index_put_(accumulate=True)`` adds them
    one by one: causal routing fwd+bwd 250 vs 291 ms at 4K)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, sizes: list[int]) -> tuple[Tensor, ...]:
        ctx.save_for_backward(index)
        ctx.shape, ctx.sizes = x.shape, sizes
        return x.index_select(0, index).split(sizes)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        (index,) = ctx.saved_tensors
        grad = grads[0].new_zeros(ctx.shape)
        for part, g in zip(index.split(ctx.sizes), grads):  # no concatenation of the parts
            grad.index_add_(0, part, g)
        return grad, None, None


class _Place(torch.autograd.Function):
    """The rows of ``parts`` (each ``(..., E)``) written to rows ``index`` (flat, split as the
    parts) of a zero ``(rows + 1, E)`` output whose last row takes the writes nobody reads;
    returns its first ``rows`` (no concatenation of the parts, forward or backward)."""

    @staticmethod
    def forward(ctx, index: Tensor, rows: int, *parts: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.shapes = [x.shape for x in parts]
        indices = index.split([x.numel() // x.shape[-1] for x in parts])
        out = parts[0].new_zeros(rows + 1, parts[0].shape[-1])
        for part, x in zip(indices, parts):
            out.index_copy_(0, part, x.reshape(-1, x.shape[-1]))
        return out[:-1]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        (index,) = ctx.saved_tensors
        grad = F.pad(grad, (0, 0, 0, 1))
        indices = index.split([math.prod(shape[:-1]) for shape in ctx.shapes])
        return None, None, *(grad.index_select(0, part).view(shape) for part, shape in zip(indices, ctx.shapes))


def _query_tiles(group: Tensor, m: Tensor, n_clusters: int, width: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """The queries sorted by (cluster, position), cut into tiles of ``width`` per cluster.

    Returns:
        ``bhc (T,)``: each tile's flat (batch, head, cluster); ``query (T, width)``: each slot's
        flat row in ``(B H N)``, ``B H N`` for an empty slot; ``m_slot (T, width)``: its m, an
        empty slot copying its tile's first (always filled). None when no query attends.
    """
    b, h, n = group.shape
    n_q = counts(group, n_clusters + 1)[..., :n_clusters].flatten()  # [B H C] queries per cluster
    tiles = (n_q + width - 1) // width
    total = int(tiles.sum())  # the one host sync of the tiling
    if total == 0:
        return None
    bhc = torch.repeat_interleave(torch.arange(b * h * n_clusters, device=m.device), tiles, output_size=total)
    bh = bhc[:, None] // n_clusters
    nth = torch.arange(total, device=m.device) - (tiles.cumsum(0) - tiles)[bhc]  # tile's index in its cluster
    rank = nth[:, None] * width + torch.arange(width, device=m.device)  # [T, width] among the cluster's queries
    filled = rank < n_q[bhc, None]
    first_q = rearrange(n_q, "(bh c) -> bh c", c=n_clusters).cumsum(-1).flatten() - n_q  # [B H C]
    query_order = torch.sort(group, dim=-1, stable=True)[1].flatten()  # queries by (cluster, position)
    query = bh * n + query_order[bh * n + (first_q[bhc, None] + rank).clamp(max=n - 1)]
    m_slot = m.flatten()[query]
    return bhc, torch.where(filled, query, b * h * n), torch.where(filled, m_slot, m_slot[:, :1])


def band_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Tensor,
    m: Tensor,
    sorted_keys: tuple[Tensor, Tensor, Tensor],
    w: int,
    scale: float,
) -> Tensor:
    """Each query of ``group`` c < C attends to the keys of cluster c ranked ``[m - w, m)``.

    Args:
        group: ``(B, H, N)`` each query's cluster, or ``C`` (its row is 0).
        m: ``(B, H, N)`` one past the last rank each query sees (>= 1 where ``group < C``).
        sorted_keys: ``key_order (B, H, N)``, the key positions sorted by (cluster, position),
            and ``first_key, n_keys (B, H, C)``: where each cluster starts in it, and its size.

    Notes:
        Queries sorted by (cluster, position) are cut into tiles of ``BAND``, one cluster each,
        along which m does not decrease; a tile attends the ranks from its first query's band
        start to its last query's m, rounded out to blocks of ``min(BAND, w)`` ranks and up to
        one of 8 span widths per doubling, masked to each query's own band. Tiles of one span
        width run as one SDPA call (``PAIRS`` pairs at most): O(N (w + BAND)) pairs in all.
    """
    b, h, n, _ = q.shape
    dump = b * h * n  # the zero row after the flat (B H N) rows
    n_clusters, block = sorted_keys[2].shape[-1], min(BAND, w)
    tiled = _query_tiles(group, m, n_clusters, BAND)
    if tiled is None:
        return v.new_zeros(b, h, n, v.shape[-1])
    bhc, query, m_slot = tiled
    lo = (m_slot[:, 0] - w).clamp(min=0) // block * block  # [T]: first rank of each tile's span
    spans, order = torch.sort(_coarse((m_slot.amax(-1) - lo + block - 1) // block) * block, stable=True)
    bhc, query, m_slot, lo = (x[order] for x in (bhc, query, m_slot, lo))  # tiles by span: each call a slice
    chunks = _chunks(spans)
    key_rows, first_block = _key_blocks(sorted_keys, block, dump)
    # A tile's span as whole blocks: past its cluster the next cluster's (masked) or the zero block.
    n_blocks = spans // block
    blocks = torch.repeat_interleave(first_block[bhc] + lo // block - (n_blocks.cumsum(0) - n_blocks), n_blocks)
    blocks = (blocks + torch.arange(blocks.shape[0], device=q.device)).clamp(max=key_rows.shape[0] - 1)
    rows = lambda x: F.pad(x.reshape(dump, x.shape[-1]), (0, 0, 0, 1))  # noqa: E731  [B H N + 1, D]
    (kb,), (vb,) = (_Picks.apply(rows(x), key_rows.flatten(), [key_rows.numel()]) for x in (k, v))
    sizes = [c.stop - c.start for c, _ in chunks]
    q_t = _Picks.apply(rows(q), query.flatten(), [size * BAND for size in sizes])
    key_sizes = [(c.stop - c.start) * span // block for c, span in chunks]
    k_t, v_t = (_Picks.apply(rearrange(x, "(k j) e -> k (j e)", j=block), blocks, key_sizes) for x in (kb, vb))
    masks = _BandMasks(m_slot - w - lo[:, None], int(spans[-1]), w, q.dtype)
    parts = []
    for (c, span), q_c, *kv in zip(chunks, q_t, k_t, v_t):
        q_c = rearrange(q_c, "(t w) e -> t 1 w e", w=BAND)
        k_c, v_c = (rearrange(x, "(t k) (j e) -> t 1 (k j) e", k=span // block, j=block) for x in kv)
        mask = masks.rows(c, span)[:, None]
        parts.append(F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=mask, scale=scale))
    return _Place.apply(query.flatten(), dump, *parts).view(b, h, n, v.shape[-1])


def _key_blocks(sorted_keys: tuple[Tensor, Tensor, Tensor], block: int, dump: int) -> tuple[Tensor, Tensor]:
    """The keys laid out in blocks of ``block`` ranks, each cluster's from rank 0 and padded to
    whole blocks: ``(blocks + 1, block)`` flat rows (``dump``: the zero row; the last block is all
    zeros), and each flat (batch, head, cluster)'s first block ``(B H C,)``."""
    key_order, first_key, n_keys = (x.flatten() for x in sorted_keys)
    n, n_clusters = sorted_keys[0].shape[-1], sorted_keys[2].shape[-1]
    size = (n_keys + block - 1) // block
    total = int(size.sum())
    bhc = torch.repeat_interleave(torch.arange(size.shape[0], device=size.device), size, output_size=total)
    first_block = size.cumsum(0) - size
    rank = (torch.arange(total, device=size.device) - first_block[bhc])[:, None] * block
    rank = rank + torch.arange(block, device=size.device)  # [blocks, block]
    bh = bhc[:, None] // n_clusters
    key = bh * n + key_order[bh * n + (first_key[bhc, None] + rank).clamp(max=n - 1)]
    key = torch.where(rank < n_keys[bhc, None], key, dump)
    return F.pad(key, (0, 0, 0, 1), value=dump), first_block


def _chunks(spans: Tensor) -> list[tuple[slice, int]]:
    """The tiles of each SDPA call (``spans (T,)`` sorted) and their span: one span each,
    ``PAIRS`` pairs at most."""
    widths, sizes = torch.unique_consecutive(spans, return_counts=True)
    chunks, done = [], 0
    for span, size in zip(widths.tolist(), sizes.tolist()):
        step = max(1, PAIRS // (BAND * span))
        chunks += [(slice(s, min(s + step, done + size)), span) for s in range(done, done + size, step)]
        done += size
    return chunks


class _BandMasks:
    """Additive masks, 0 on the ranks ``[start, start + w)`` of a span and -inf elsewhere, for
    ``start (T, width)`` in ``[1 - w, span - w]``: rows of one strided line of ``2 S + w``
    values (S: the widest span), one row gather per call rather than comparisons per pair."""

    def __init__(self, start: Tensor, widest: int, w: int, dtype: torch.dtype) -> None:
        self.line = torch.full((2 * widest + w,), -math.inf, dtype=dtype, device=start.device)
        self.line[widest : widest + w] = 0
        self.offset = (widest - start).contiguous()

    def rows(self, tiles: slice, span: int) -> Tensor:
        """``(t, width, span)``: the masks of the tiles ``tiles``, spans of ``span`` ranks."""
        offset = self.offset[tiles]
        return self.line.unfold(0, span, 1).index_select(0, offset.flatten()).view(*offset.shape, span)


def _coarse(blocks: Tensor) -> Tensor:
    """``blocks`` rounded up to one of 8 values per doubling (1-8 exact, then 10, 12, 14, 16,
    20, ...): few distinct span widths, hence few SDPA calls, for at most 1/8 more keys."""
    step = torch.exp2((torch.log2(blocks.clamp(min=1).double()).floor() - 3).clamp(min=0)).long()
    return (blocks + step - 1) // step * step
