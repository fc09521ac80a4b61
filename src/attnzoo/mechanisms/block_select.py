"""Trainable sparse attention over content-selected key blocks: MoBA here, NSA in ``nsa.py``.

MoBA (Mixture of Block Attention, Lu et al. 2025, https://arxiv.org/abs/2502.13189) cuts the
keys into blocks, gates each (query, block) pair by ``q_i . mean(k in block)`` and lets every
query attend to the keys of its ``topk`` best blocks (causal: its own block always, the rest
among earlier blocks). NSA (``nsa.py``) selects blocks by the attention of a compressed branch.

Both run on ``attend_blocks``: each query attends to the keys of its own few selected blocks.
The (query, block) pairs are sorted by block and packed into tiles of up to ``TILE`` queries
that share one key block, so a tile is two small dense products (scores, then weights times
values); the scores are moved to a (query, slot, key) layout for one softmax per query over the
union of its blocks. Memory and time are O(N * slots * block): no N x N tensor, and every key
block is read once per tile, not once per query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, default_scale
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.topk import select_topk, topk_mask
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity

#: Queries per tile of ``attend_blocks`` (fewer when there are fewer query rows, as in decoding).
TILE = 64


def block_means(k: Tensor, real: Tensor | None, block: int) -> tuple[Tensor, Tensor]:
    """The mean key of each block, over its real keys only: ``k (B, H, N, D)``, ``real (B, N)``
    (None: all real) -> ``means (B, H, C, D)``, ``has_real (B, C)`` bool, ``C = ceil(N / block)``
    (the last block may be short). A block with no real key has mean 0 and ``has_real`` False."""
    n = k.shape[2]
    c = -(-n // block)
    real = torch.ones(k.shape[0], n, dtype=torch.bool, device=k.device) if real is None else real
    weight = F.pad(real.to(k.dtype), (0, c * block - n))  # (B, C * block)
    sums = torch.einsum("bhcjd,bcj->bhcd", _blocks(k, block), rearrange(weight, "b (c j) -> b c j", j=block))
    count = rearrange(weight, "b (c j) -> b c j", j=block).sum(-1)
    return sums / count.clamp(min=1)[:, None, :, None], count > 0


def _blocks(x: Tensor, block: int) -> Tensor:
    """``(B, H, N, D)`` -> ``(B, H, C, block, D)``, zero-padded to whole blocks."""
    c = -(-x.shape[2] // block)
    return rearrange(F.pad(x, (0, 0, 0, c * block - x.shape[2])), "b h (c j) d -> b h c j d", j=block)


def moba_selection(gates: Tensor, positions: Tensor, has_real: Tensor, block: int, topk: int, causal: bool) -> Tensor:
    """MoBA's blocks of each query: ``gates (B, H, R, C)`` of the query rows at ``positions (R,)``,
    ``has_real (B, C)`` -> bool ``(B, H, R, C)``, True for the blocks the row attends to.

    Not causal: the ``topk`` highest-gated blocks. Causal: the own block (``position // block``)
    and the ``topk - 1`` highest-gated earlier blocks (all of them when fewer exist). Ties go to
    the lower block index (``select_topk``); a block with no real key is never chosen."""
    blocks = torch.arange(gates.shape[-1], device=gates.device)
    eligible = has_real[:, None, None, :]  # (B, 1, 1, C)
    own = blocks == torch.div(positions, block, rounding_mode="floor")[:, None]  # (R, C)
    if causal:
        eligible, topk = eligible & (blocks < torch.div(positions, block, rounding_mode="floor")[:, None]), topk - 1
    keep = own.expand(gates.shape) if causal else torch.zeros_like(gates, dtype=torch.bool)
    if topk > 0:
        idx, valid = select_topk(gates, eligible, min(topk, gates.shape[-1]))
        # Unused slots may repeat a kept index: count the used ones instead of writing booleans.
        keep = keep | (
            torch.zeros(gates.shape, dtype=torch.long, device=gates.device).scatter_add_(-1, idx, valid.long()) > 0
        )
    return keep


@dataclass(frozen=True)
class _Tiles:
    """Where the (query row, block) pairs of ``attend_blocks`` go (integers only, no gradient).

    ``slot_row (n_tiles * tile,)``: the flat query row ``(b h r)`` in each tile slot, ``B H R``
    for an empty slot; ``tile_group (n_tiles,)``: the flat key block ``(b h c)`` that every slot
    of a tile reads (ascending: a block's tiles are adjacent); ``per_group (B H C,)``: tiles per
    block; ``masked (M,)`` the tiles where some pair is hidden (a future key, a padded or missing
    one) and ``visible (M, tile, block)`` their visible pairs."""

    slot_row: Tensor
    tile_group: Tensor
    per_group: Tensor
    masked: Tensor
    visible: Tensor
    n_tiles: int
    tile: int


def _tiles(keep: Tensor, n: int, block: int, causal: bool, real: Tensor | None) -> _Tiles:
    """Pack the pairs of ``keep (B, H, R, C)`` into tiles: pairs ordered by flat key block, then
    by row (``nonzero`` of the block-major mask lists them so: no sort), each block's pairs
    filling ``ceil(count / tile)`` tiles of ``tile`` slots."""
    batch, heads, rows, n_blocks = keep.shape
    tile, bh, device = min(TILE, rows), batch * heads, keep.device
    by_block = rearrange(keep, "b h r c -> (b h c) r")
    size = by_block.sum(-1)  # (B H C,) pairs per key block
    per_group = (size + tile - 1) // tile
    n_tiles = int(per_group.sum())
    group, row = by_block.nonzero(as_tuple=True)  # ordered by group, then row
    first_pair, first_tile = size.cumsum(0) - size, per_group.cumsum(0) - per_group
    slot = first_tile[group] * tile + torch.arange(group.shape[0], device=device) - first_pair[group]
    flat_row = torch.div(group, n_blocks, rounding_mode="floor") * rows + row
    slot_row = torch.full((n_tiles * tile,), bh * rows, device=device).scatter_(0, slot, flat_row)
    tile_group = torch.repeat_interleave(torch.arange(bh * n_blocks, device=device), per_group, output_size=n_tiles)
    key_pos = (tile_group % n_blocks)[:, None] * block + torch.arange(block, device=device)  # (n_tiles, block)
    key_ok = key_pos < n
    if real is not None:
        flat = rearrange(F.pad(real, (0, n_blocks * block - n)), "b (c j) -> (b c) j", j=block)
        batch_of = torch.div(tile_group, heads * n_blocks, rounding_mode="floor")
        key_ok = key_ok & flat[batch_of * n_blocks + tile_group % n_blocks]
    # Most tiles hide nothing (causal: only a query's own block holds future keys): mask only the rest.
    hides = ~key_ok.all(-1)
    query_pos = (slot_row % rows + (n - rows)).view(n_tiles, tile)
    if causal:
        hides |= key_pos[:, -1] > query_pos.min(-1).values
    masked = hides.nonzero()[:, 0]
    visible = key_ok[masked][:, None, :].expand(-1, tile, -1)
    if causal:
        visible = visible & (key_pos[masked][:, None, :] <= query_pos[masked][:, :, None])
    return _Tiles(slot_row, tile_group, per_group, masked, visible, n_tiles, tile)


def _rows(x: Tensor) -> Tensor:
    """``(B, H, R, E)`` -> ``(B H R + 1, E)``: one row per query and a zero row for empty slots."""
    return F.pad(x.reshape(-1, x.shape[-1]), (0, 0, 0, 1))


def _per_slot(x: Tensor, t: _Tiles) -> Tensor:
    """Row values ``(B H R + 1,)`` -> ``(n_tiles, tile, 1)``, the value of each slot's row."""
    return x[t.slot_row].view(t.n_tiles, t.tile, 1)


def _per_block(x: Tensor, t: _Tiles, shape: torch.Size) -> Tensor:
    """Tile values ``(n_tiles, block, E)`` summed per key block -> ``shape`` ``(B H C, block, E)``."""
    return torch.segment_reduce(x, "sum", lengths=t.per_group, axis=0, unsafe=True).view(shape)


class _BlockAttention(torch.autograd.Function):
    """``attend_blocks``: forward in tiles (scores, masked, exponentiated against each row's
    max, summed per row by ``index_add``), backward in the same tiles from the saved weights
    (``dS = P (dP - rowsum(dO O))``), key and value gradients summed per block (adjacent tiles)."""

    @staticmethod
    def forward(ctx, q: Tensor, k_blocks: Tensor, v_blocks: Tensor, t: _Tiles, scale: float) -> Tensor:  # type: ignore[override]
        rows = q.shape[0] * q.shape[1] * q.shape[2]
        q_t = _rows(q * scale).index_select(0, t.slot_row).view(t.n_tiles, t.tile, -1)  # scaled once, per row
        k_t, v_t = k_blocks.index_select(0, t.tile_group), v_blocks.index_select(0, t.tile_group)
        scores = torch.bmm(q_t, k_t.transpose(1, 2))  # (n_tiles, tile, block)
        scores[t.masked] = scores[t.masked].masked_fill_(~t.visible, float("-inf"))
        row_max = scores.new_full((rows + 1,), float("-inf"))
        row_max.scatter_reduce_(0, t.slot_row, scores.amax(-1).flatten(), "amax")
        row_max = torch.where(row_max.isinf(), 0.0, row_max)  # a row that sees nothing: exp(-inf) = 0
        weights = scores.sub_(_per_slot(row_max, t)).exp_()
        total = weights.new_zeros(rows + 1).index_add_(0, t.slot_row, weights.sum(-1).flatten())
        weights.mul_(_per_slot(torch.where(total > 0, 1 / total, 0.0), t))
        out = q.new_zeros(rows + 1, v_t.shape[-1]).index_add_(0, t.slot_row, torch.bmm(weights, v_t).flatten(0, 1))
        out = out[:-1].view(*q.shape[:3], -1)
        ctx.save_for_backward(q_t, k_t, v_t, weights, out)
        ctx.tiles, ctx.scale, ctx.shapes = t, scale, (q.shape, k_blocks.shape, v_blocks.shape)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q_t, k_t, v_t, weights, out = ctx.saved_tensors
        t, scale, (q_shape, k_shape, v_shape) = ctx.tiles, ctx.scale, ctx.shapes
        grad_t = _rows(grad).index_select(0, t.slot_row).view(t.n_tiles, t.tile, -1)
        delta = _per_slot(_rows((grad * out).sum(-1, keepdim=True))[:, 0], t)
        d_scores = torch.bmm(grad_t, v_t.transpose(1, 2)).sub_(delta).mul_(weights)
        d_q = q_t.new_zeros(q_shape.numel() // q_shape[-1] + 1, q_shape[-1])
        d_q.index_add_(0, t.slot_row, torch.bmm(d_scores, k_t).flatten(0, 1))
        d_k = _per_block(torch.bmm(d_scores.transpose(1, 2), q_t), t, k_shape)  # q_t carries the scale
        d_v = _per_block(torch.bmm(weights.transpose(1, 2), grad_t), t, v_shape)
        return d_q[:-1].view(q_shape) * scale, d_k, d_v, None, None


def attend_blocks(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor, *, block: int, scale: float, causal: bool, real: Tensor | None
) -> Tensor:
    """Each query row attends (one softmax) to the keys of its selected blocks.

    Args:
        q: ``(B, H, R, D)``: rows at the last R key positions (R = N: self-attention).
        k, v: ``(B, H, N, D)``, ``(B, H, N, D_v)``, cut into blocks of ``block`` (the last may be short).
        keep: ``(B, H, R, C)`` bool: the blocks each row attends to.
        scale: score scale. causal: keys after a row's position are never attended.
        real: ``(B, N)`` bool or None: padded keys are never attended.

    Returns:
        ``(B, H, R, D_v)``; a row with no visible key gets zeros (and passes zero gradient).

    Notes:
        The weights of the tiles are kept for backward: O(R S block) numbers for S blocks per
        row, besides the gathered queries, keys and values, O(R S D).
    """
    (batch, heads, rows, _), n, d_v = q.shape, k.shape[2], v.shape[-1]
    with torch.no_grad():
        t = _tiles(keep, n, block, causal, real)
    if t.n_tiles == 0:
        return v.new_zeros(batch, heads, rows, d_v)
    k_blocks = rearrange(_blocks(k, block), "b h c j d -> (b h c) j d")
    v_blocks = rearrange(_blocks(v, block), "b h c j d -> (b h c) j d")
    return _BlockAttention.apply(q, k_blocks, v_blocks, t, scale)


def _check_blocks(block: int, topk: int, what: str) -> None:
    for name, value in (("block", block), (what, topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _moba_gates(q: Tensor, k: Tensor, real: Tensor | None, block: int) -> tuple[Tensor, Tensor]:
    """``q_i . mean(k in b)`` for every query and block, ``(B, H, N_q, C)``, and ``has_real
    (B, C)``; no gradient (the selection is discrete)."""
    with torch.no_grad():
        means, has_real = block_means(k, real, block)
        return torch.einsum("bhnd,bhcd->bhnc", q, means), has_real


def moba(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block: int,
    topk: int,
    causal: bool,
    scale: float,
    key_mask: Tensor | None = None,
) -> Tensor:
    """MoBA (Lu et al. 2025, https://arxiv.org/abs/2502.13189), the fast path.

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)`` (self-attention).
        block: keys per block (the last block may be short). topk: blocks per query.
        causal: blocks starting after the query are excluded; the own block (keys ``j <= i``
            only) is always selected and counts toward ``topk``.
        scale: score scale (of the softmax; the gates are ``q_i . mean(k in b)`` unscaled).
        key_mask: ``(B, N)`` bool, True = real, or None: padded keys are never attended and
            never averaged into a block mean; a block with no real key is never selected.

    Returns:
        ``(B, H, N, D_v)`` in the dtype of q. Ties between gates go to the lower block index.
    """
    _check_blocks(block, topk, "topk")
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    gates, has_real = _moba_gates(qc, kc, key_mask, block)
    positions = torch.arange(q.shape[2], device=q.device) + (k.shape[2] - q.shape[2])
    keep = moba_selection(gates, positions, has_real, block, topk, causal)
    out = attend_blocks(qc, kc, vc, keep, block=block, scale=scale, causal=causal, real=key_mask)
    return out.to(q.dtype)


def reference_moba(
    q: Tensor, k: Tensor, v: Tensor, *, block: int, topk: int, causal: bool, scale: float, key_mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Dense MoBA (Lu et al. 2025, https://arxiv.org/abs/2502.13189) as the paper writes it: gate
    ``s_ib = q_i . mean(K_b)``; causal: ``s_ib = -inf`` for blocks after i's own, ``+inf`` for
    i's own block; the query keeps its ``topk`` highest-gated blocks (``topk_mask``: ties to the
    lower index); softmax over the kept blocks' keys (causal: ``j <= i``; padded keys never).

    Returns:
        ``(out (B, H, N, D_v), weights (B, H, N, N))``. Allocates N x N by design.
    """
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    n = k.shape[2]
    gates, has_real = _moba_gates(qc, kc, key_mask, block)
    blocks = torch.arange(gates.shape[-1], device=q.device)
    key_block, pos = torch.arange(n, device=q.device) // block, torch.arange(n, device=q.device)
    eligible = has_real[:, None, None, :]
    if causal:
        own = blocks == (pos // block)[:, None]  # (N, C)
        others = topk_mask(gates, eligible & (blocks < (pos // block)[:, None]), topk - 1) if topk > 1 else own & False
        keep_block = own | others
    else:
        keep_block = topk_mask(gates, eligible, topk)
    visible = keep_block[..., key_block]  # (B, H, N, N): key j is kept with its block
    if causal:
        visible = visible & (pos[None, :] <= pos[:, None])
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    weights = normalize_scores(torch.einsum("bhid,bhjd->bhij", qc, kc) * scale, visible, "softmax")
    return torch.einsum("bhij,bhjd->bhid", weights, vc).to(q.dtype), weights


@dataclass(frozen=True, kw_only=True)
class MoBAConfig(Config):
    """Config of ``moba``.

    Args:
        block: keys per block (the last may be short). Default 64.
        topk: blocks per query, the own block included when causal. Default 8.
        scale: score scale; default None means ``1 / sqrt(D)``.
    """

    block: int = bounded(64, ge=1)
    topk: int = bounded(8, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Blocks of about n / 64 keys (at least 2), about an eighth of the keys selected (at least 2 blocks)."""
        block = max(2, n // 64)
        return dict(block=block, topk=max(2, n // (8 * block)))


@dataclass(frozen=True)
class MoBAState:
    """``moba``'s decode state: every key and value (``cache``), and the mean of the real keys of
    each block so far, ``means (B, H, C, D)``, with ``has_real (B, C)``."""

    cache: KVCache
    means: Tensor
    has_real: Tensor


@register(
    "moba",
    config=MoBAConfig,
    family="content",
    summary="Mixture of Block Attention: each query attends to the key blocks whose mean key it gates highest.",
    paper="Lu et al. 2025, MoBA: Mixture of Block Attention for Long-Context LLMs, https://arxiv.org/abs/2502.13189",
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True),
    complexity=Complexity(
        time="O(N^2 D / block) gates + O(N topk block D) attention",
        memory="O(N^2 / block) gates, O(N topk (block + D)) attention",
        subquadratic_memory=True,
    ),
    notes=(
        "gate of query i and block b: q_i . mean(k in b), unscaled; the topk highest-gated blocks are kept, "
        "ties to the lower block index; gates pass no gradient (the selection is discrete)",
        "causal: blocks after the query's own are excluded; the own block (keys j <= i) is always kept and "
        "counts toward topk",
        "key_mask: padded keys are never attended and never averaged into a block mean; a block with no real "
        "key is never selected",
        "fast path: (query, block) pairs sorted by block into tiles of 64 queries that share one key block; "
        "scores, softmax (per query, across its tiles) and backward in those tiles: never N x N",
        "decode step: a KV cache and the running mean of each block's real keys; O(t D / block) gates and "
        "O(topk block D) attention per token",
    ),
)
class MoBAAttention(Attention):
    """MoBA; ``_attend`` runs ``moba``, ``_reference`` the dense ``reference_moba``."""

    config: MoBAConfig

    def _options(self, q: Tensor, args: AttendArgs) -> dict[str, Any]:
        cfg = self.config
        scale = default_scale(cfg.scale, q.shape[-1])
        return dict(block=cfg.block, topk=cfg.topk, causal=args.causal, scale=scale, key_mask=args.key_mask)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return moba(q, k, v, **self._options(q, args))

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        out, weights = reference_moba(q, k, v, **self._options(q, args))
        return (out, weights) if return_weights else out

    def _init_state(self, spec: StateSpec) -> MoBAState:
        """An empty cache and no blocks."""
        dtype = compute_dtype(torch.empty((), dtype=spec.dtype))
        means = torch.zeros(spec.batch, spec.kv_heads, 0, spec.head_dim, device=spec.device, dtype=dtype)
        return MoBAState(KVCache.for_state(spec), means, torch.zeros(spec.batch, 0, dtype=torch.bool))

    def _step(self, state: MoBAState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, MoBAState]:
        """The new rows of the causal forward: the means of the blocks the new tokens touch are
        recomputed from the cache (at most ``T + block`` keys), the rest are kept."""
        cfg, start = self.config, state.cache.length
        cache = state.cache.append(k, v, args.key_mask)
        first = start // cfg.block
        real = cache.key_mask
        with torch.no_grad():
            tail = cache.k[:, :, first * cfg.block :].to(state.means.dtype)
            means, has_real = block_means(tail, None if real is None else real[:, first * cfg.block :], cfg.block)
        means = torch.cat([state.means[:, :, :first], means], 2)
        has_real = torch.cat([state.has_real[:, :first].to(has_real.device), has_real], 1)
        qc, kc, vc = (x.to(compute_dtype(q)) for x in (q, cache.k, cache.v))
        positions = torch.arange(start, cache.length, device=q.device)
        gates = torch.einsum("bhnd,bhcd->bhnc", qc.detach(), means)
        keep = moba_selection(gates, positions, has_real, cfg.block, cfg.topk, True)
        scale = default_scale(cfg.scale, q.shape[-1])
        out = attend_blocks(qc, kc, vc, keep, block=cfg.block, scale=scale, causal=True, real=real).to(q.dtype)
        return nan_rows_of_non_finite_queries(out, q), MoBAState(cache, means, has_real)
