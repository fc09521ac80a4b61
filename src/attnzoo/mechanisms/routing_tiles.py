"""Routing attention's building blocks (``routing`` is registered in
``attnzoo.mechanisms.routing``, beside the dense ``reference_routing``): what attention and
routing run on, similarities to the centroids, and the non-causal fast path, which gathers
clusters into fixed-size tiles (O(N w) memory, never N x N); the causal one is ``routing_band``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor

from attnzoo.backends.call import gather_rows
from attnzoo.mechanisms._ops import argmax_over
from attnzoo.mechanisms.group_windows import attend_gathered, counts, earlier_of_same_group

if TYPE_CHECKING:
    from attnzoo.mechanisms.routing import RoutingConfig

#: (queries, keys): similarities ``(B, H, C, N)`` or unit vectors ``(B, H, N, D)``.
Pair = tuple[Tensor, Tensor]
#: ``grouped_attention``: queries per tile, and (query, key) pairs per pass (bounds working memory).
TILE, PAIRS = 128, 2**24
#: ``balanced_attention`` runs the unpicked queries as extra rows of their cluster's call while the
#: largest group of them is at most ``SPARE * w`` (then the padded rows cost at most what the picked
#: ones do), in tiles otherwise. On random inputs at 4K the largest group is 430 of w = 1024.
SPARE = 1.0


def attention_inputs(q: Tensor, k: Tensor, config: RoutingConfig) -> tuple[Tensor, Tensor, float | None]:
    """The queries, keys and score scale attention runs on: ``q, k, config.scale`` (None:
    ``1 / sqrt(D)``), or with ``share_qk`` the unit queries twice and scale D by default."""
    if not config.share_qk:
        return q, k, config.scale
    unit = F.normalize(q, dim=-1)
    return unit, unit, float(q.shape[-1]) if config.scale is None else config.scale


def similarities(q: Tensor, k: Tensor, centroids: Tensor, real: Tensor) -> Pair:
    """Cosine similarities ``(B, H, C, N)`` of the queries and of the keys to the unit centroids
    ``(H, C, D)``; padded positions get -inf (picked last, never before a real token), and so does
    a query or key that is not finite (NaN similarities would break the top-w counts; its own
    output row comes out NaN). Detached: routing is discrete and passes no gradient."""
    mu = F.normalize(centroids.to(q.dtype), dim=-1)
    padded = ~real[:, None, None, :]
    sims = [einsum(F.normalize(x.detach(), dim=-1), mu, "b h n d, h c d -> b h c n") for x in (q, k)]
    return tuple(s.masked_fill(padded | s.isnan(), -math.inf) for s in sims)


def top_w(sims: Tensor, w: int) -> Tensor:
    """``(B, H, C, w)`` positions of the w largest similarities of each cluster, in position
    order; ties at the w-th value go to the lower positions (topk alone leaves ties open)."""
    threshold = sims.topk(w, dim=-1).values[..., -1:]
    above, tied = sims > threshold, sims == threshold
    room = w - above.sum(-1, keepdim=True)
    crowded = (tied.sum(-1, keepdim=True) > room)[..., 0]  # rows with more ties than room
    if crowded.any():
        tied[crowded] &= tied[crowded].cumsum(-1) <= room[crowded]
    return (above | tied).nonzero()[:, -1].reshape(*sims.shape[:-1], w)  # w per row


def _take(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, h, index[b, h, ...]]`` for ``x (B, H, M)``; index M reads 0 (False)."""
    return gather_rows(x[..., None], index, zero_row=True)[..., 0]


def grouped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Tensor,
    n_groups: int,
    keys_of: Callable[[Tensor], Tensor],
    width: int,
    scale: float,
    visible: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """Each query attends to the keys of its group, in fixed-size tiles.

    Args:
        group: ``(B, H, N)``, each query's group in ``[0, n_groups)``, or -1 (its row is 0).
        keys_of: group ids ``(B, H, S)`` (-1: unused tile) -> key indices ``(B, H, S, L)``
            (-1: empty slot).
        width: queries per tile; a group's queries fill ``ceil(size / width)`` tiles.
        visible: ``(query index, key index)`` -> bool broadcastable to a tile's pairs, the
            pairs that count (index N: an empty slot; empty key slots never count).

    Notes:
        At most ``N / width + n_groups`` tiles (one host sync counts them), attended ``PAIRS``
        (query, key) pairs at a time: the working memory is bounded, never N x N.
    """
    b, h, n, _ = q.shape
    g = torch.where(group < 0, n_groups, group)
    g_sorted, order = torch.sort(g, dim=-1, stable=True)  # [B, H, N] queries by (group, position)
    size = counts(g, n_groups + 1)
    size[..., -1] = 0
    tiles = (size + width - 1) // width
    n_tiles = int(tiles.sum(-1).max())
    if n_tiles == 0:
        return v.new_zeros(b, h, n, v.shape[-1])
    first_query, first_tile = size.cumsum(-1) - size, tiles.cumsum(-1) - tiles
    rank = torch.arange(n, device=q.device) - first_query.gather(-1, g_sorted)
    slot = (first_tile.gather(-1, g_sorted) + rank // width) * width + rank % width
    slot = torch.where(g_sorted < n_groups, slot, n_tiles * width)  # non-members: a dump slot
    query_slot = torch.empty_like(slot).scatter_(-1, order, slot)
    slot_query = torch.full((b, h, n_tiles * width + 1), n, device=q.device).scatter_(-1, slot, order)
    slot_query = rearrange(slot_query[..., :-1], "b h (s w) -> b h s w", w=width)
    first = slot_query[..., 0]  # [B, H, S]: a tile's first slot is filled when the tile is used
    tile_group = torch.where(first < n, group.gather(-1, first.clamp(max=n - 1)), -1)
    key_index = keys_of(tile_group) % (n + 1)  # [B, H, S, L]; -1 (an empty slot) -> n
    step, parts = max(1, PAIRS // (b * h * width * key_index.shape[-1])), []  # tiles per pass
    for s in range(0, n_tiles, step):
        queries, keys = slot_query[:, :, s : s + step], key_index[:, :, s : s + step]
        pairs = (keys < n)[..., None, :] & visible(queries[..., :, None], keys[..., None, :])
        parts.append(
            attend_gathered(
                gather_rows(q, queries, zero_row=True),
                gather_rows(k, keys, zero_row=True),
                gather_rows(v, keys, zero_row=True),
                pairs,
                scale,
            )
        )
    return gather_rows(rearrange(torch.cat(parts, dim=2), "b h s w e -> b h (s w) e"), query_slot, zero_row=True)


def balanced_attention(q: Tensor, k: Tensor, v: Tensor, sims: Pair, w: int, real: Tensor, scale: float) -> Tensor:
    """Non-causal fast path: each cluster's top-w queries attend to its top-w keys.

    Args:
        sims: query and key similarities ``(B, H, C, N)`` from ``similarities``.
        real: ``(B, H, N)`` bool, True = a real token.

    Notes:
        Top-w ties go to the lower position. Outputs are summed over the clusters that picked a
        query and divided by their count; a real query no cluster picked attends to the picked
        keys of its nearest centroid. Those queries join their cluster's call as extra rows
        (``_unpicked_rows``) while the largest such group holds at most ``SPARE * w`` of them,
        else they run in tiles (``grouped_attention``). Padded rows are 0.
    """
    (sim_q, sim_k), n_clusters = sims, sims[0].shape[2]
    pick_q, pick_k = top_w(sim_q, w), top_w(sim_k, w)  # [B, H, C, w]
    flat = rearrange(pick_q, "b h c w -> b h (c w)")
    picks = torch.zeros_like(real, dtype=v.dtype).scatter_add(-1, flat, torch.ones_like(flat, dtype=v.dtype))
    group = torch.where((picks == 0) & real, argmax_over(sim_q, 2), -1)  # unpicked: nearest centroid
    extra, slot = _unpicked_rows(group, n_clusters, w)
    rows = pick_q if extra is None else torch.cat([pick_q, extra], -1)  # [B, H, C, w + M]
    k_c, v_c = gather_rows(k, pick_k, zero_row=True), gather_rows(v, pick_k, zero_row=True)  # [B, H, C, w, D]
    q_c = gather_rows(q, rows, zero_row=True)  # [B, H, C, w + M, D]
    per_cluster = attend_gathered(q_c, k_c, v_c, _take(real, pick_k)[..., None, :], scale)
    per_query = rearrange(per_cluster[..., :w, :], "b h c w e -> b h (c w) e")
    out = v.new_zeros(v.shape).scatter_add(2, flat[..., None].expand(-1, -1, -1, v.shape[-1]), per_query)
    out = out / picks.clamp(min=1)[..., None] * real[..., None]
    if extra is not None:  # each unpicked query's row of its cluster's extra rows (slot C M: none)
        return out + gather_rows(rearrange(per_cluster[..., w:, :], "b h c m e -> b h (c m) e"), slot, zero_row=True)

    def keys_of(tile_group: Tensor) -> Tensor:
        keys = pick_k.gather(2, tile_group.clamp(min=0)[..., None].expand(-1, -1, -1, w))  # [B, H, S, w]
        return torch.where(tile_group[..., None] >= 0, keys, -1)

    tiles = grouped_attention(q, k, v, group, n_clusters, keys_of, min(w, TILE), scale, lambda i, j: _take(real, j))
    return out + tiles


def _unpicked_rows(group: Tensor, n_clusters: int, w: int) -> tuple[Tensor | None, Tensor]:
    """The unpicked queries as extra rows of their clusters' calls: ``(rows (B, H, C, M), slot
    (B, H, N))``, M the largest group (rows past a group's size read position N, a zero row; a
    query's slot is ``c M + rank``, C M where it is in no group). ``rows`` is None (and the
    queries go to ``grouped_attention``) when M exceeds ``SPARE * w``: a skewed routing would
    pad every cluster to its largest group. With no unpicked query M is 0 (``rows`` (B, H, C, 0))."""
    groups = torch.where(group < 0, n_clusters, group)
    size = counts(groups, n_clusters + 1)[..., :n_clusters]
    most = int(size.max()) if size.numel() else 0
    if most > SPARE * w:
        return None, group
    b, h, n = group.shape
    slot = torch.where(group < 0, n_clusters * most, groups * most + earlier_of_same_group(groups, n_clusters))
    positions = torch.arange(n, device=group.device).expand(b, h, n)
    rows = torch.full((b, h, n_clusters * most + 1), n, device=group.device).scatter_(-1, slot, positions)
    return rows[..., :-1].view(b, h, n_clusters, most), slot
