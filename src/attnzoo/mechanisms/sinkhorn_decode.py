"""Decode steps of causal ``sinkhorn`` (``SinkhornAttention``): the causal forward's rows,
block by block.

Causal, row ``i`` of the permutation sorts only the blocks ``j < i`` and is computed from their
keys alone (``sinkhorn.sortable``, ``block_summaries``), so block i's sorted keys and values
are fixed as soon as block i starts. A step computes them then, once per block, from the keys
and values of the completed blocks (kept in a ``KVCache``: every later block's sort mixes all
of them); each token then attends to its own block up to itself and to that sorted block, as in
the forward. Per token O(block D), plus O(i block D) once per block i for its sort (amortised
O(t D / block) per token); memory O(t D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from einops import rearrange
from torch import Tensor

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, default_scale, real_tokens
from attnzoo.mechanisms.base import AttendArgs, StateSpec
from attnzoo.mechanisms.cache import KVCache

if TYPE_CHECKING:
    from attnzoo.mechanisms.sinkhorn import SinkhornAttention


@dataclass(frozen=True)
class SortedBlock:
    """Block ``index``'s sorted keys ``k (B, H, block, D)`` and values ``v (B, H, block, D_v)``
    (``sum_{j < index} P[index, j] K_j``), and which of their slots hold real mass ``real (B, H,
    block)``, in the compute dtype."""

    index: int
    k: Tensor
    v: Tensor
    real: Tensor


@dataclass(frozen=True)
class SinkhornState:
    """Every token so far (``cache``) and the sorted block of the last token's block (None
    before the first token)."""

    cache: KVCache
    sorted: SortedBlock | None = None


def init_state(spec: StateSpec) -> SinkhornState:
    """An empty state; ``spec.capacity`` preallocates the cache."""
    return SinkhornState(KVCache.for_state(spec))


def step(
    attn: SinkhornAttention, state: SinkhornState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs
) -> tuple[Tensor, SinkhornState]:
    """The new tokens' rows of ``attn``'s causal forward, a block at a time (a long prefill
    visits each of its blocks once)."""
    cache = state.cache.append(k, v, args.key_mask)
    block, start = attn.config.block, state.cache.length
    sorted_block, outs = state.sorted, []
    for i in range(start // block, (cache.length - 1) // block + 1):
        if sorted_block is None or sorted_block.index != i:
            sorted_block = sort_block(attn, cache, i)
        lo, hi = max(start, i * block), min(cache.length, (i + 1) * block)
        outs.append(_rows(attn, q[:, :, lo - start : hi - start], cache, sorted_block, lo, hi))
    return torch.cat(outs, dim=2), SinkhornState(cache, sorted_block)


def sort_block(attn: SinkhornAttention, cache: KVCache, i: int) -> SortedBlock:
    """Block i's sorted keys and values from the completed blocks ``0 .. i-1`` in ``cache``:
    row i of the causal permutation (the mean of their real keys through the sort network,
    ``SinkhornAttention.sort``), applied to their keys and values as in the forward."""
    block, n = attn.config.block, i * attn.config.block
    compute = compute_dtype(cache.k)
    kb, vb = (rearrange(x[:, :, :n].to(compute), "b h (n w) d -> b h n w d", w=block) for x in (cache.k, cache.v))
    real = real_tokens(cache.key_mask, cache.k.shape[0], cache.length, cache.k.device)[:, :n]
    real = rearrange(real, "b (n w) -> b n w", w=block)
    # Padded tokens reach the cache as zeros: the sum over all keys is the sum over the real ones.
    summary = kb.sum((2, 3)) / real.sum((1, 2)).clamp(min=1)[:, None, None].to(compute)  # [B, H, D]
    P = attn.sort(summary[:, :, None], real.any(-1)[:, None, None, :], causal=True)[:, :, 0]  # [B, H, i]
    mass = torch.einsum("bhj,bjw->bhw", P, real.to(compute))
    return SortedBlock(i, torch.einsum("bhj,bhjwd->bhwd", P, kb), torch.einsum("bhj,bhjwd->bhwd", P, vb), mass > 0)


def _rows(attn: SinkhornAttention, q: Tensor, cache: KVCache, sorted_block: SortedBlock, lo: int, hi: int) -> Tensor:
    """Rows ``lo .. hi-1`` (all in block i = ``sorted_block.index``): each query over its own
    block's keys up to itself, then the block's sorted keys."""
    first, compute = sorted_block.index * attn.config.block, sorted_block.k.dtype
    own = torch.arange(lo, hi, device=q.device)[:, None] >= torch.arange(first, hi, device=q.device)  # [T, m]
    own = own.expand(q.shape[0], q.shape[1], *own.shape)
    if cache.key_mask is not None:
        own = own & cache.key_mask[:, None, None, first:hi]
    visible = torch.cat([own, sorted_block.real[:, :, None, :].expand(-1, -1, hi - lo, -1)], dim=-1)
    keys = torch.cat([cache.k[:, :, first:hi].to(compute), sorted_block.k], dim=2)  # [B, H, m + block, D]
    values = torch.cat([cache.v[:, :, first:hi].to(compute), sorted_block.v], dim=2)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.to(compute), keys) * default_scale(attn.config.scale, q.shape[-1])
    return (normalize_scores(scores, visible, "softmax") @ values).to(q.dtype)
