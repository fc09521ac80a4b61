"""Routing Transformer attention (Roy et al. 2020, https://arxiv.org/abs/2003.05997).

Per head, k-means centroids (a buffer shared by queries and keys) route the unit-normalised
queries and keys to clusters; attention runs inside clusters only.

* Non-causal (the paper's balanced routing): each cluster picks its top-w most cosine-similar
  queries and keys; a picked query attends to its cluster's picked keys, averaged over the
  clusters that picked it; a real query picked by none attends to the picked keys of its
  nearest centroid (never silently zeroed).
* Causal: top-w picks over the sequence let the future change who is picked, so routing is per
  token: query i and key j go to their nearest centroids, and query i attends to the w most
  recent keys j <= i of its centroid (alone: to its own key). Position i reads positions <= i only.

With ``share_qk`` (the official code's language-model configs) keys are the queries and
attention itself runs on the unit-normalised queries, scaled by D by default (see
``RoutingConfig``).

Fast paths gather clusters into fixed-size tiles (O(N w) memory, never N x N); ``reference_routing``
recomputes membership independently and runs dense attention under the implied mask (the oracle).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor

from attnzoo._checks import check_key_padding_mask, check_qkv
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms._ops import compute_dtype, default_scale, gather_rows, real_tokens
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity

#: (queries, keys): similarities ``(B, H, C, N)`` or unit vectors ``(B, H, N, D)``.
Pair = tuple[Tensor, Tensor]
#: ``grouped_attention``: queries per tile, and (query, key) pairs per pass (bounds working memory).
TILE, PAIRS = 128, 2**24


@dataclass(frozen=True, kw_only=True)
class RoutingConfig(Config):
    """Config of ``routing``.

    Args:
        n_clusters: k-means clusters per head. Default 4 (the paper uses about sqrt(N)).
        window: w, queries and keys per cluster (causal: keys per query); default None means
            ``ceil(N / n_clusters)``; clipped to N.
        decay: EMA decay lambda of the centroid update in training mode, in [0, 1] (1 freezes
            the centroids). Default 0.999.
        scale: score scale; default None means ``1 / sqrt(D)``, or D with ``share_qk``.
        share_qk: keys are the queries (the ``k`` argument is ignored) and attention runs on
            the unit-normalised queries: score ``scale * q^_i . q^_j``. Default False (routing
            uses unit q and k, attention the raw ones). The official code (google-research
            ``routing_transformer``, whose language-model configs set ``share_qk``) layer-norms
            q and k without a gain before both routing and attention and takes their plain dot
            product: vectors of norm sqrt(D), so ``D q^ . k^``, hence the default scale D (it
            also mean-centres them, which unit normalisation does not). A token's score with
            itself is then the largest of its row: unlike Reformer, neither masks it.
        seed: seed of the random unit centroids. Default 0.
        heads, head_dim: H and D of the inputs; when both are set (a layer's ``attnzoo.Shape``
            sets them) the centroids are drawn at construction, else on the first forward.
    """

    n_clusters: int = bounded(4, ge=1)
    window: int | None = bounded(None, ge=1, none="for ceil(N / n_clusters)")
    decay: float = bounded(0.999, ge=0.0, le=1.0)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D), or D with share_qk")
    share_qk: bool = False
    seed: int = 0
    heads: int | None = bounded(None, ge=1, none="taken from the first input")
    head_dim: int | None = bounded(None, ge=1, none="taken from the first input")


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


def _attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    """Softmax attention of ``q (..., M, D)`` over the ``visible`` (bool, broadcasting to ``(..., M, L)``)
    keys of ``k, v (..., L, D)``, fused by SDPA; a row with no visible key gives 0 and zero gradient."""
    has_key = visible.any(-1, keepdim=True)  # rows without: shown every key (finite), then times 0
    mask = None if bool(visible.all()) else (visible | ~has_key).expand(*q.shape[:-2], -1, -1)
    # SDPA's fused CPU kernel takes 4-D inputs [(...), 1, M, D]; 5-D ones fall back to M x L scores.
    flat = [None if x is None else rearrange(x, "... m d -> (...) 1 m d") for x in (q, k, v, mask)]
    out = F.scaled_dot_product_attention(*flat[:3], attn_mask=flat[3], scale=scale)
    return out.reshape(*q.shape[:-1], v.shape[-1]) * has_key


def _bincount(index: Tensor, bins: int) -> Tensor:
    """``(B, H, bins)`` counts of the values of ``index (B, H, N)``."""
    return index.new_zeros(index.shape[:2] + (bins,)).scatter_add_(-1, index, torch.ones_like(index))


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
    size = _bincount(g, n_groups + 1)
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
            _attention(
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
        keys of its nearest centroid (``grouped_attention``). Padded rows are 0.
    """
    (sim_q, sim_k), n_clusters = sims, sims[0].shape[2]
    pick_q, pick_k = top_w(sim_q, w), top_w(sim_k, w)  # [B, H, C, w]
    q_c, k_c, v_c = (
        gather_rows(q, pick_q, zero_row=True),
        gather_rows(k, pick_k, zero_row=True),
        gather_rows(v, pick_k, zero_row=True),
    )  # [B, H, C, w, D]
    per_cluster = _attention(q_c, k_c, v_c, _take(real, pick_k)[..., None, :], scale)  # [B, H, C, w, Dv]
    flat = rearrange(pick_q, "b h c w -> b h (c w)")
    per_query = rearrange(per_cluster, "b h c w e -> b h (c w) e")
    out = v.new_zeros(v.shape).scatter_add(2, flat[..., None].expand(-1, -1, -1, v.shape[-1]), per_query)
    picks = torch.zeros_like(real, dtype=v.dtype).scatter_add(-1, flat, torch.ones_like(flat, dtype=v.dtype))
    group = torch.where((picks == 0) & real, sim_q.argmax(2), -1)  # unpicked: nearest centroid

    def keys_of(tile_group: Tensor) -> Tensor:
        keys = pick_k.gather(2, tile_group.clamp(min=0)[..., None].expand(-1, -1, -1, w))  # [B, H, S, w]
        return torch.where(tile_group[..., None] >= 0, keys, -1)

    fallback = grouped_attention(q, k, v, group, n_clusters, keys_of, min(w, TILE), scale, lambda i, j: _take(real, j))
    return out / picks.clamp(min=1)[..., None] * real[..., None] + fallback


def causal_attention(q: Tensor, k: Tensor, v: Tensor, sims: Pair, w: int, real: Tensor, scale: float) -> Tensor:
    """Causal fast path: query i attends to the w most recent keys j <= i of its nearest cluster.

    Notes:
        Key j's rank r_j counts the earlier keys of its cluster; m_i counts the keys of query i's
        cluster at positions <= i; query i sees its cluster's keys with ``m_i - w <= r_j < m_i``.
        Queries sharing (cluster, t = (m_i - 1) // w) share the 2w candidate keys of ranks
        ``[(t - 1) w, (t + 1) w)``: one group of ``grouped_attention``. A real query with m_i = 0
        gets its own value (its own key alone). Padded keys join no cluster.
    """
    (sim_q, sim_k), n = sims, q.shape[2]
    n_clusters, n_chunks = sim_q.shape[2], math.ceil(n / w)
    position = torch.arange(n, device=q.device)
    a_q, a_k = sim_q.argmax(2), torch.where(real, sim_k.argmax(2), n_clusters)  # [B, H, N]; padded: none
    a_sorted, key_order = torch.sort(a_k, dim=-1, stable=True)  # keys by (cluster, position)
    n_keys = _bincount(a_k, n_clusters + 1)
    first_key = n_keys.cumsum(-1) - n_keys
    rank = torch.empty_like(a_k).scatter_(-1, key_order, position - first_key.gather(-1, a_sorted))
    sorted_code = (a_sorted * n + key_order).contiguous()  # increasing: (cluster, position)
    m = torch.searchsorted(sorted_code, (a_q * n + position).contiguous(), right=True) - first_key.gather(-1, a_q)
    group = torch.where((m > 0) & real, a_q * n_chunks + (m - 1).clamp(min=0) // w, -1)  # (cluster, chunk)

    def keys_of(tile_group: Tensor) -> Tensor:
        cluster, t = tile_group.clamp(min=0) // n_chunks, tile_group.clamp(min=0) % n_chunks
        r = (t[..., None] - 1) * w + torch.arange(2 * w, device=q.device)  # [B, H, S, 2w] ranks
        ok = (tile_group[..., None] >= 0) & (r >= 0) & (r < n_keys.gather(-1, cluster)[..., None])
        sorted_index = (first_key.gather(-1, cluster)[..., None] + r).clamp(0, n - 1)
        return torch.where(ok, _take(key_order, sorted_index), -1)

    def visible(i: Tensor, j: Tensor) -> Tensor:
        m_i, r_j = _take(m, i), _take(rank, j)
        return (r_j >= m_i - w) & (r_j < m_i)

    out = grouped_attention(q, k, v, group, n_clusters * n_chunks, keys_of, min(w, TILE), scale, visible)
    return out + ((m == 0) & real)[..., None] * v  # nothing of its cluster visible: its own key


def _ranked_first(sims: Tensor, w: int) -> Tensor:
    """``(B, H, C, N)`` bool: position i is among the w most similar of its cluster, ties going
    to the lower position (i.e. fewer than w positions rank ahead of it)."""
    s_i, s_j = sims[..., :, None], sims[..., None, :]
    position = torch.arange(sims.shape[-1], device=sims.device)
    ahead = (s_j > s_i) | ((s_j == s_i) & (position[None, :] < position[:, None]))
    return ahead.sum(-1) < w


def _dense_weights(q: Tensor, k: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """Softmax weights ``(B, H, N, N)`` of dense attention restricted to ``mask``."""
    lookup = lambda b, h, i, j: mask[b, h, i, j]  # noqa: E731
    return reference_attention(q, k, q[..., :1], mask_mod=lookup, scale=scale, return_weights=True)[1]


def _reference_balanced(q: Tensor, k: Tensor, sims: Pair, w: int, real: Tensor, scale: float | None) -> Tensor:
    """Averaged per-cluster attention weights of balanced routing, ``(B, H, N, N)``."""
    (sim_q, sim_k), n = sims, q.shape[2]
    picked_q, picked_k = _ranked_first(sim_q, w), _ranked_first(sim_k, w)  # [B, H, C, N]
    count = picked_q.sum(2).clamp(min=1).to(q.dtype)[..., None]  # [B, H, N, 1] clusters per query
    pair_real = real[..., :, None] & real[..., None, :]
    weights = 0
    for c in range(sim_q.shape[2]):
        member = picked_q[:, :, c, :, None]
        mask = member & picked_k[:, :, c, None, :] & pair_real
        weights = weights + _dense_weights(q, k, mask, scale) * member / count
    # A real query no cluster picked: the picked keys of its nearest centroid.
    nearest_keys = picked_k.gather(2, sim_q.argmax(2)[..., None].expand(-1, -1, -1, n))  # [i, j]
    fallback = (~picked_q.any(2) & real)[..., None] & nearest_keys & pair_real
    return weights + _dense_weights(q, k, fallback, scale)


def _reference_causal(sims: Pair, w: int, real: Tensor) -> Tensor:
    """Causal routing mask ``(B, H, N, N)``: query i sees key j <= i routed to i's nearest
    centroid when fewer than w keys of that centroid lie in (j, i]; itself if none is visible."""
    (sim_q, sim_k), n, n_clusters = sims, real.shape[-1], sims[0].shape[2]
    a_q, a_k = sim_q.argmax(2), torch.where(real, sim_k.argmax(2), n_clusters)
    upto = F.one_hot(a_k, n_clusters + 1).cumsum(2)  # [B, H, N, C + 1]: keys per cluster at <= j
    upto = rearrange(upto, "b h n c -> b h c n").gather(2, a_q[..., None].expand(-1, -1, -1, n))  # [i, j]
    m = upto.diagonal(dim1=-2, dim2=-1)  # [B, H, N]: keys of i's cluster at positions <= i
    earlier = torch.ones(n, n, dtype=torch.bool, device=real.device).tril()  # j <= i
    same = a_q[..., :, None] == a_k[..., None, :]
    visible = same & earlier & (m[..., :, None] - upto < w) & real[..., :, None] & real[..., None, :]
    alone = (m == 0) & real  # nothing of its cluster visible: the query sees its own key
    return visible | (torch.eye(n, dtype=torch.bool, device=real.device) & alone[..., None])


def reference_routing(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    centroids: Tensor,
    *,
    window: int | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    share_qk: bool = False,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Routing attention as dense attention under the masks the routing implies (the oracle):
    ``(B, H, N, D_v)`` in the dtype of ``q``, and the weights when asked.

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)`` (self-attention).
        centroids: ``(H, C, D)``, normalised here.
        window: w; default None means ``ceil(N / C)``; clipped to N.
        causal: per-token routing with a window of w recent same-cluster keys (module docstring).
        key_padding_mask: bool ``(B, N)``, True = real; it marks padded queries too.
        scale: score scale; default ``1 / sqrt(D)``, or D with ``share_qk``.
        share_qk: keys are the unit-normalised queries (``k`` is ignored), for routing and
            for attention (``RoutingConfig.share_qk``).
        return_weights: also return the ``(B, H, N, N)`` effective weights.

    Notes:
        Cluster c picks the queries (keys) of which fewer than w rank ahead in cosine similarity
        to centroid c, ties to the lower position. Padded rows are 0; low precision runs in float32.
    """
    check_qkv(q, k, v, cross_attention=False)
    b, _, n, _ = q.shape
    real = check_key_padding_mask(key_padding_mask, b, n, q.device)
    real = real_tokens(real, b, n, q.device)
    real = real[:, None, :].expand(-1, q.shape[1], -1)
    compute = compute_dtype(q)
    qc, kc = q.to(compute), k.to(compute)
    if share_qk:
        qc = kc = F.normalize(qc, dim=-1)
        scale = float(q.shape[-1]) if scale is None else scale
    sims = similarities(qc, kc, centroids, real[:, 0])
    w = min(math.ceil(n / centroids.shape[1]) if window is None else window, n)
    weights = (
        _dense_weights(qc, kc, _reference_causal(sims, w, real), scale)
        if causal
        else _reference_balanced(qc, kc, sims, w, real, scale)
    )
    out = einsum(weights, v.to(compute), "b h i j, b h j e -> b h i e").to(q.dtype)
    return (out, weights) if return_weights else out


@torch.no_grad()
def ema_centroids(centroids: Tensor, sims: Pair, units: Pair, real: Tensor, decay: float) -> Tensor:
    """New ``(H, C, D)`` centroids after one EMA k-means step: ``mu_c <- unit(decay mu_c + (1 - decay)
    unit(sum of the real unit q and k nearest to c, over the batch))``; unassigned ones stay."""
    mu = F.normalize(centroids.to(units[0].dtype), dim=-1)
    total, count = torch.zeros_like(mu), mu.new_zeros(mu.shape[:2])
    for sim, unit in zip(sims, units):
        assigned = F.one_hot(sim.argmax(2), mu.shape[1]).to(unit.dtype) * real[..., None]  # [B, H, N, C]
        total = total + einsum(assigned, unit, "b h n c, b h n d -> h c d")
        count = count + assigned.sum((0, 2))
    moved = F.normalize(decay * mu + (1 - decay) * F.normalize(total, dim=-1), dim=-1)
    return torch.where(count[..., None] > 0, moved, mu).to(centroids.dtype)


@register(
    "routing",
    config=RoutingConfig,
    family="content",
    summary="Routing Transformer: online k-means clusters of q and k, attention inside clusters.",
    paper="Roy et al. 2020, Efficient Content-Based Sparse Attention with Routing Transformers, "
    "https://arxiv.org/abs/2003.05997",
    capabilities=Capabilities(causal=True, key_padding=True, independent_queries=False),
    complexity=Complexity(time="O(N (w + C) D), w = N / C", memory="O(N (w + C))", subquadratic_memory=True),
    notes=(
        "swapped in untrained: k-means centroids at their random initial value (no EMA updates in eval)",
        "centroids (H, C, D): a buffer made at construction when heads and head_dim are set (a layer's Shape), "
        "else on the first forward; EMA updates in training mode only",
        "non-causal: balanced top-w queries and keys per cluster; an unpicked query uses its nearest cluster's keys",
        "causal: per-token nearest-centroid routing; query i sees the w most recent keys j <= i of its cluster",
        "padded query rows are 0; padded keys are never attended and never move centroids",
        "default: routing uses unit-normalised q and k, attention the raw q and k (scale 1/sqrt(D)); share_qk=True: "
        "keys are the queries, and attention uses the unit q with scale D (the official code's LM setting)",
    ),
)
class RoutingAttention(Attention):
    """Routing attention (module docstring); config in ``RoutingConfig``.

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``; self-attention only.

    Notes:
        The ``centroids`` buffer ``(H, n_clusters, D)`` (random unit vectors from ``seed``) is made
        at construction when the config sets ``heads`` and ``head_dim`` (a layer's
        ``attnzoo.Shape`` does), so a layer's state dict is complete before its first forward.
        Built without them, for bare ``(B, H, N, D)`` tensors, only the first input says H and D:
        the buffer is made then, and such a module has no ``centroids`` to load into before it
        has run (build it with ``heads`` and ``head_dim`` to load a checkpoint).
    """

    config: RoutingConfig

    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self.register_buffer("centroids", None)
        if config.heads is not None and config.head_dim is not None:
            self.centroids = self._draw((config.heads, config.n_clusters, config.head_dim))

    def _draw(self, shape: tuple[int, int, int]) -> Tensor:
        g = torch.Generator().manual_seed(self.config.seed)
        return F.normalize(torch.randn(shape, generator=g), dim=-1)

    def centroids_for(self, q: Tensor) -> Tensor:
        """The centroid buffer for inputs shaped like ``q``, created on the first call."""
        shape = (q.shape[1], self.config.n_clusters, q.shape[3])
        if self.centroids is None:
            self.centroids = self._draw(shape).to(q.device)
        elif tuple(self.centroids.shape) != shape:
            raise ValueError(
                f"routing centroids (H, n_clusters, D) = {tuple(self.centroids.shape)} come from earlier "
                f"inputs; q {tuple(q.shape)} needs {shape}: build a new module for another H or D"
            )
        return self.centroids

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        b, h, n, d = q.shape
        qc, kc, vc = (x.to(compute_dtype(q)) for x in (q, k, v))
        qc, kc, scale = attention_inputs(qc, kc, self.config)
        real = real_tokens(args.key_padding_mask, b, n, q.device)
        sims = similarities(qc, kc, self.centroids_for(q), real)
        real = real[:, None, :].expand(-1, h, -1)
        w = min(math.ceil(n / self.config.n_clusters) if self.config.window is None else self.config.window, n)
        scale = default_scale(scale, d)
        out = (causal_attention if args.causal else balanced_attention)(qc, kc, vc, sims, w, real, scale)
        # A non-finite query is routed last; its row is NaN (a causal one alone would read its own value).
        out = out.masked_fill(~torch.isfinite(qc).all(-1, keepdim=True), math.nan)
        if self.training:
            # A non-finite token moves no centroid (its unit vector is NaN): the buffer stays finite.
            units = tuple(F.normalize(x.detach(), dim=-1).nan_to_num(0.0) for x in (qc, kc))
            self.centroids.copy_(ema_centroids(self.centroids, sims, units, real, self.config.decay))
        return out.to(q.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """``reference_routing`` under the current centroids (no EMA update)."""
        return reference_routing(
            q,
            k,
            v,
            self.centroids_for(q),
            window=self.config.window,
            causal=args.causal,
            key_padding_mask=args.key_padding_mask,
            scale=self.config.scale,
            share_qk=self.config.share_qk,
            return_weights=return_weights,
        )
