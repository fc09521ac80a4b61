"""Decode steps of ``routing``: the new tokens' rows of the causal forward, from the last w keys
of each cluster.

Causally, query i sees the w most recent keys j <= i routed to its nearest centroid (itself
alone when there are none), so the state keeps, per cluster, only its last w keys and values
as attention runs on them (``GroupWindows``: O(n_clusters w (D + D_v)) memory, whatever the
length decoded). A step routes the new key and query to their nearest centroids, appends the
key to its cluster and attends the query's cluster: O((w + n_clusters) D) per token. w must be
set (``window=``): the default ``ceil(N / n_clusters)`` depends on the final length N, which a
step cannot know. In training mode every forward moves the centroids, which no step can
follow: decode steps run in eval mode only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnzoo.mechanisms._ops import argmax_over, default_scale, real_tokens
from attnzoo.mechanisms.base import AttendArgs, StateSpec
from attnzoo.mechanisms.group_windows import GroupWindows, attend_gathered, state_dtype
from attnzoo.mechanisms.routing_tiles import attention_inputs, similarities

if TYPE_CHECKING:
    from attnzoo.mechanisms.routing import RoutingAttention

#: A step of more tokens (a prompt) runs this many at a time: a query of the block sees its
#: cluster's window and the block's keys up to itself, O((w + BLOCK) D) work per query.
BLOCK = 16


@dataclass(frozen=True)
class RoutingState:
    """``windows``: per cluster, the last w keys and values attention runs on (with
    ``share_qk``, the unit queries), in the compute dtype."""

    windows: GroupWindows


def check_eval(attn: RoutingAttention) -> None:
    """Refuse a decode step in training mode, where every forward moves the centroids (EMA)."""
    if attn.training:
        raise ValueError(
            "routing: decode steps run in eval mode only: in training mode every forward moves the centroids "
            "(EMA k-means), which no step can follow; call .eval()"
        )


def init_state(attn: RoutingAttention, spec: StateSpec) -> RoutingState:
    """Empty windows of ``window`` keys per cluster; refused without an explicit ``window``."""
    check_eval(attn)
    if (cfg := attn.config).window is None:
        raise ValueError(
            "routing: a decode step needs window= set: the default (None) means ceil(N / n_clusters), which "
            "depends on the final length N that a step cannot know; build with window=w (e.g. ceil(N / "
            "n_clusters) for the length N you decode to)"
        )
    attn.centroids_for(spec.heads, spec.head_dim, spec.device)  # made here if the module has not run yet
    kinds = ((spec.head_dim, state_dtype(spec)), (spec.value_dim, state_dtype(spec)))
    return RoutingState(GroupWindows.for_state(spec, cfg.n_clusters, cfg.window, kinds))


def step(
    attn: RoutingAttention, state: RoutingState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs
) -> tuple[Tensor, RoutingState]:
    """The new tokens' rows ``(B, H, T, D_v)`` of the causal forward, ``BLOCK`` tokens at a time;
    a prompt longer than that before any real key is the causal forward itself (its fast path)."""
    check_eval(attn)
    mask, outs = args.key_mask, []
    if q.shape[2] > BLOCK and not bool(state.windows.count.any()):  # nothing seen can be attended
        new = _routed(attn, state, q, k, v, mask)
        return attn(q, k, v, causal=True, key_mask=mask), RoutingState(new.windows)
    for lo in range(0, q.shape[2], BLOCK):
        block = slice(lo, lo + BLOCK)
        new = _routed(attn, state, *(x[:, :, block] for x in (q, k, v)), None if mask is None else mask[:, block])
        outs.append(_block(attn, state, new).to(q.dtype))
        state = RoutingState(new.windows)
    return torch.cat(outs, 2), state


@dataclass(frozen=True)
class _Routed:
    """New tokens as routing and attention see them: ``q, k, v (B, H, T, .)`` in the compute
    dtype (``share_qk``: k is the unit q), the score ``scale``, ``real (B, T)``, the clusters of
    the queries and keys ``(B, H, T)`` (a padded key: none, n_clusters), the keys' ranks in
    their clusters, and the ``windows`` once the keys are appended."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    real: Tensor
    query_cluster: Tensor
    key_cluster: Tensor
    key_rank: Tensor
    windows: GroupWindows


def _routed(
    attn: RoutingAttention, state: RoutingState, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
) -> _Routed:
    cfg, (b, _, t, dim), windows = attn.config, q.shape, state.windows
    qc, kc, vc = (x.to(windows.buffers[0].dtype) for x in (q, k, v))
    qc, kc, scale = attention_inputs(qc, kc, cfg)
    real = real_tokens(mask, b, t, q.device)
    sim_q, sim_k = similarities(qc, kc, attn.centroids, real)
    a_q, a_k = argmax_over(sim_q, 2), torch.where(real[:, None, :], argmax_over(sim_k, 2), cfg.n_clusters)
    new = windows.append(a_k, (kc, vc))
    return _Routed(qc, kc, vc, default_scale(scale, dim), real, a_q, a_k, windows.ranks(a_k), new)


def _block(attn: RoutingAttention, state: RoutingState, new: _Routed) -> Tensor:
    """The new tokens' rows: each query over its cluster's held keys and the new keys up to it,
    the cluster's last w."""
    t, windows, a_q, real = new.q.shape[2], state.windows, new.query_cluster, new.real[:, None, :]
    # [B, H, T, T]: key j of the block is in query i's cluster and j <= i
    mine = (a_q[..., :, None] == new.key_cluster[..., None, :]) & torch.ones(
        t, t, dtype=torch.bool, device=a_q.device
    ).tril()
    upto = windows.count.gather(-1, a_q) + mine.sum(-1)  # keys of i's cluster at positions <= i
    low = upto - attn.config.window  # the w most recent: ranks in [upto - w, upto)
    (k_held, v_held), held_rank = windows.recent(a_q)  # [B, H, T, w, D]
    sees_held = (held_rank >= 0) & (held_rank >= low[..., None])
    sees = torch.cat([sees_held, mine & (new.key_rank[..., None, :] >= low[..., None])], -1) & real[..., None]
    keys, values = (
        torch.cat([held, x[:, :, None].expand(-1, -1, t, -1, -1)], 3) for held, x in ((k_held, new.k), (v_held, new.v))
    )
    out = attend_gathered(new.q[..., None, :], keys, values, sees[..., None, :], new.scale)[..., 0, :]
    out = out + ((upto == 0) & real)[..., None] * new.v  # nothing of its cluster: its own key
    # A non-finite query is routed last; its row is NaN (a lone one would read its own value).
    return out.masked_fill(~torch.isfinite(new.q).all(-1, keepdim=True), math.nan)
