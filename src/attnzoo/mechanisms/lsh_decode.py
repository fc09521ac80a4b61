"""Decode steps of ``lsh``: the new tokens' rows of the causal forward, from the recent tokens of
their buckets.

Causally, a query with m real tokens of its bucket before it (its rank) sees in that round the
keys of the bucket with ranks in ``[(m // c - 1) c, m)``: fewer than 2c keys, all among the
bucket's last 2c. The state keeps every unit key and value in a ``KVCache`` (O(t (D + D_v))
memory) and, per round and bucket, the positions of its last 2c real tokens (``GroupWindows``,
O(n_hashes n_buckets c)). A step hashes the new tokens in every round under the module's fixed
rotations, gathers those candidates from the cache and attends them as one softmax over the
union of the rounds' keys (a key found in several rounds counts once, or once per round with
``dedupe=False``): O(n_hashes c D) per token, whatever the position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from attnzoo.backends.call import gather_rows
from attnzoo.mechanisms._ops import default_scale, real_tokens
from attnzoo.mechanisms.base import AttendArgs, StateSpec, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.group_windows import GroupWindows, attend_gathered, state_dtype
from attnzoo.mechanisms.lsh_chunks import buckets

if TYPE_CHECKING:
    from attnzoo.mechanisms.lsh import LSHAttention

#: A step of more tokens (a prompt) runs this many at a time: a query of the block sees the
#: windows and the block's earlier tokens, O(n_hashes (2c + BLOCK) D) work per query.
BLOCK = 16


@dataclass(frozen=True)
class LSHState:
    """``cache``: the unit keys (the keys of shared QK) and the values seen so far, in the compute
    dtype; ``windows``: per group ``round * n_buckets + bucket``, the positions of its last 2c real
    tokens; ``rotation (n_hashes, H, D, n_buckets / 2)``: the module's, fixed when the state was made."""

    cache: KVCache
    windows: GroupWindows
    rotation: Tensor


def check_fixed_rotations(attn: LSHAttention) -> None:
    """Refuse a decode step in training mode with ``resample``: there, every forward draws new
    rotations, so there is no one causal forward for the steps to follow."""
    if attn.training and attn.config.resample:
        raise ValueError(
            "lsh: a decode step needs fixed rotations, but in training mode with resample=True every forward "
            "draws fresh ones: call .eval() (rotations from rotation_seed) or build with resample=False"
        )


def init_state(attn: LSHAttention, spec: StateSpec) -> LSHState:
    """An empty ``LSHState`` under the module's rotations."""
    check_fixed_rotations(attn)
    groups, keep = attn.config.n_hashes * attn.config.n_buckets, 2 * attn.config.block
    cache = KVCache.for_state(dataclasses.replace(spec, dtype=state_dtype(spec)))
    windows = GroupWindows.for_state(spec, groups, keep, ((1, torch.long),))
    return LSHState(cache, windows, attn.rotations(spec.heads, spec.head_dim, spec.device))


def step(attn: LSHAttention, state: LSHState, q: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, LSHState]:
    """The new tokens' rows ``(B, H, T, D_v)`` of the causal forward, ``BLOCK`` tokens at a time;
    a prompt longer than that before any real token is the causal forward itself (its fast path)."""
    check_fixed_rotations(attn)
    mask, outs = args.key_mask, []
    if q.shape[2] > BLOCK and not bool(state.windows.count.any()):  # nothing seen can be attended
        return attn(q, q, v, causal=True, key_mask=mask), _appended(attn, state, q, v, mask)[0]
    for lo in range(0, q.shape[2], BLOCK):
        block = slice(lo, lo + BLOCK)
        new, group, rank = _appended(
            attn, state, q[:, :, block], v[:, :, block], None if mask is None else mask[:, block]
        )
        outs.append(_block(attn, state, new, q[:, :, block], group, rank))
        state = new
    return torch.cat(outs, 2), state


def _appended(
    attn: LSHAttention, state: LSHState, q: Tensor, v: Tensor, mask: Tensor | None
) -> tuple[LSHState, Tensor, Tensor]:
    """The state after the new tokens, and their groups (round, bucket) and ranks ``(B, H, T,
    n_hashes)``; a padded token joins no group (G) and its rank is meaningless."""
    cfg, (b, h, t, _), windows = attn.config, q.shape, state.windows
    compute = state.cache.k_buffer.dtype
    keys, real = F.normalize(q.to(compute), dim=-1), real_tokens(mask, b, t, q.device)
    table = torch.stack([buckets(keys, rotation, real) for rotation in state.rotation], -1)  # [B, H, T, R]
    offset = cfg.n_buckets * torch.arange(cfg.n_hashes, device=q.device)
    group = rearrange(torch.where(table < cfg.n_buckets, table + offset, windows.groups), "b h t r -> b h (t r)")
    position = state.cache.length + torch.arange(t, device=q.device)
    windows = windows.append(group, (repeat(position, "t -> b h (t r) 1", b=b, h=h, r=cfg.n_hashes),))
    rank = rearrange(state.windows.ranks(group), "b h (t r) -> b h t r", t=t)
    group = rearrange(group, "b h (t r) -> b h t r", t=t)
    return LSHState(state.cache.append(keys, v.to(compute), mask), windows, state.rotation), group, rank


def _block(attn: LSHAttention, old: LSHState, new: LSHState, q: Tensor, group: Tensor, rank: Tensor) -> Tensor:
    """The rows of the new tokens of ``new`` (those past ``old``), each over the held keys of its
    groups in ``old`` and the new tokens before it, as the chunk rule allows."""
    cfg, (b, h, t, dim), groups = attn.config, q.shape, old.windows.groups
    low = (rank // cfg.block - 1) * cfg.block  # the first rank a token's rank-chunk sees
    (held,), held_rank = old.windows.recent(group.clamp(max=groups - 1))  # [B, H, T, R, 2c]
    sees_held = (held_rank >= 0) & (held_rank >= low[..., None])
    # The block's own tokens j: same group, rank in [low_i, rank_i) (so j < i).
    group_j, rank_j = (rearrange(x, "b h t r -> b h 1 r t") for x in (group, rank))
    sees_new = (group[..., None] == group_j) & (rank_j >= low[..., None]) & (rank_j < rank[..., None])
    sees = torch.cat([sees_held, sees_new], -1) & (group < groups)[..., None]
    new_position = (old.cache.length + torch.arange(t, device=q.device)).expand(b, h, t, cfg.n_hashes, t)
    position = rearrange(torch.cat([held[..., 0], new_position], -1), "b h t r l -> b h t (r l)")
    sees = rearrange(sees, "b h t r l -> b h t (r l)")
    if cfg.dedupe:  # one softmax over the union: a key found in several rounds counts once
        sees = sees & ~_repeated(position, sees)
    qc = q.to(new.cache.k_buffer.dtype)
    keys, values = (gather_rows(x, position) for x in (new.cache.k_buffer, new.cache.v_buffer))  # [B, H, T, L, D]
    out = attend_gathered(qc[..., None, :], keys, values, sees[..., None, :], default_scale(cfg.scale, dim))
    # A real token that sees nothing in any round attends to itself.
    alone = ~sees.any(-1, keepdim=True) & (group < groups)[..., :1]
    out = torch.where(alone, new.cache.v[:, :, old.cache.length :], out[..., 0, :]).to(q.dtype)
    return nan_rows_of_non_finite_queries(out, q)


def _repeated(position: Tensor, sees: Tensor) -> Tensor:
    """``(..., L)`` bool: a seen candidate whose position another seen candidate before it (in
    sorted order) holds too. One sort, not L x L."""
    key = torch.where(sees, position, -1)
    ordered, order = key.sort(dim=-1, stable=True)
    again = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    return torch.zeros_like(sees).scatter_(-1, order[..., 1:], again)
