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

``reference_routing`` (here) recomputes membership independently and runs dense attention under
the implied mask (the oracle). The non-causal fast path (``routing_tiles``) gathers clusters into
fixed-size tiles; the causal one (``routing_band``) is a band over each cluster's keys sorted by
position: tiles of one cluster's queries attend only the key blocks their bands cover, one SDPA
call per span width (both O(N w) memory, never N x N). A decode step (``routing_decode``) keeps
each cluster's last w keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor

from attnzoo._checks import check_key_mask, check_qkv
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms import routing_decode
from attnzoo.mechanisms._ops import argmax_over, compute_dtype, default_scale, real_tokens
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.mechanisms.routing_band import causal_attention
from attnzoo.mechanisms.routing_decode import RoutingState
from attnzoo.mechanisms.routing_tiles import Pair, attention_inputs, balanced_attention, similarities
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


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

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """The default's window at length n, ``ceil(n / 4)`` for the default 4 clusters, set
        explicitly: a decode step cannot know N, so it needs the window given."""
        return dict(window=math.ceil(n / 4))


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
    nearest_keys = picked_k.gather(2, argmax_over(sim_q, 2)[..., None].expand(-1, -1, -1, n))  # [i, j]
    fallback = (~picked_q.any(2) & real)[..., None] & nearest_keys & pair_real
    return weights + _dense_weights(q, k, fallback, scale)


def _reference_causal(sims: Pair, w: int, real: Tensor) -> Tensor:
    """Causal routing mask ``(B, H, N, N)``: query i sees key j <= i routed to i's nearest
    centroid when fewer than w keys of that centroid lie in (j, i]; itself if none is visible."""
    (sim_q, sim_k), n, n_clusters = sims, real.shape[-1], sims[0].shape[2]
    a_q, a_k = argmax_over(sim_q, 2), torch.where(real, argmax_over(sim_k, 2), n_clusters)
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
    config: RoutingConfig,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Routing attention as dense attention under the masks the routing implies (the oracle):
    ``(B, H, N, D_v)`` in the dtype of ``q``, and the weights when asked.

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)`` (self-attention).
        centroids: ``(H, C, D)``, normalised here.
        config: read for ``window`` (None: ``ceil(N / C)``; clipped to N), ``scale`` and
            ``share_qk`` (keys are the unit queries, ``k`` is ignored: ``RoutingConfig``).
        causal: per-token routing with a window of w recent same-cluster keys (module docstring).
        key_mask: bool ``(B, N)``, True = real; it marks padded queries too.
        return_weights: also return the ``(B, H, N, N)`` effective weights.

    Notes:
        Cluster c picks the queries (keys) of which fewer than w rank ahead in cosine similarity
        to centroid c, ties to the lower position. Padded rows are 0; low precision runs in float32.
    """
    check_qkv(q, k, v, cross_attention=False)
    b, _, n, _ = q.shape
    real = check_key_mask(key_mask, b, n, q.device)
    real = real_tokens(real, b, n, q.device)
    real = real[:, None, :].expand(-1, q.shape[1], -1)
    compute = compute_dtype(q)
    qc, kc, scale = q.to(compute), k.to(compute), config.scale
    if config.share_qk:
        qc = kc = F.normalize(qc, dim=-1)
        scale = float(q.shape[-1]) if scale is None else scale
    sims = similarities(qc, kc, centroids, real[:, 0])
    w = min(math.ceil(n / centroids.shape[1]) if config.window is None else config.window, n)
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
        assigned = F.one_hot(argmax_over(sim, 2), mu.shape[1]).to(unit.dtype) * real[..., None]  # [B, H, N, C]
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
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True, independent_queries=False),
    complexity=Complexity(time="O(N (w + C) D), w = N / C", memory="O(N (w + C))", subquadratic_memory=True),
    notes=(
        "swapped in untrained: k-means centroids at their random initial value (no EMA updates in eval)",
        "centroids (H, C, D): a buffer made at construction when heads and head_dim are set (a layer's Shape), "
        "else on the first forward; EMA updates in training mode only",
        "non-causal: balanced top-w queries and keys per cluster; an unpicked query uses its nearest cluster's keys",
        "causal: per-token nearest-centroid routing; query i sees the w most recent keys j <= i of its cluster: a band "
        "over the cluster's keys sorted by position, run as tiles of 128 queries of one cluster over the key blocks "
        "their bands cover (O(N (w + 128)) pairs), one SDPA call per span width",
        "padded query rows are 0; padded keys are never attended and never move centroids",
        "default: routing uses unit-normalised q and k, attention the raw q and k (scale 1/sqrt(D)); share_qk=True: "
        "keys are the queries, and attention uses the unit q with scale D (the official code's LM setting)",
        "decode step: routes each new key and query to their nearest centroids and attends the query cluster's last w "
        "keys, O((w + n_clusters) D) per token; memory O(n_clusters w (D + D_v)) (each cluster's last w keys and "
        "values), whatever the length; needs window= set (None means ceil(N / n_clusters), unknown to a step); "
        "eval mode only (training moves the centroids every forward)",
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

    def centroids_for(self, heads: int, head_dim: int, device: torch.device | None = None) -> Tensor:
        """The centroid buffer ``(H, n_clusters, D)`` for inputs of ``heads`` heads of size
        ``head_dim``, created on the first call."""
        shape = (heads, self.config.n_clusters, head_dim)
        if self.centroids is None:
            self.centroids = self._draw(shape).to(device)
        elif tuple(self.centroids.shape) != shape:
            raise ValueError(
                f"routing centroids (H, n_clusters, D) = {tuple(self.centroids.shape)} come from earlier "
                f"inputs; H = {heads}, D = {head_dim} needs {shape}: build a new module for another H or D"
            )
        return self.centroids

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        b, h, n, d = q.shape
        qc, kc, vc = (x.to(compute_dtype(q)) for x in (q, k, v))
        qc, kc, scale = attention_inputs(qc, kc, self.config)
        real = real_tokens(args.key_mask, b, n, q.device)
        sims = similarities(qc, kc, self.centroids_for(h, d, q.device), real)
        real = real[:, None, :].expand(-1, h, -1)
        w = min(math.ceil(n / self.config.n_clusters) if self.config.window is None else self.config.window, n)
        scale = default_scale(scale, d)
        out = (causal_attention if args.causal else balanced_attention)(qc, kc, vc, sims, w, real, scale)
        if self.training:
            # A non-finite token moves no centroid (its unit vector is NaN): the buffer stays finite.
            units = tuple(F.normalize(x.detach(), dim=-1).nan_to_num(0.0) for x in (qc, kc))
            self.centroids.copy_(ema_centroids(self.centroids, sims, units, real, self.config.decay))
        return out.to(q.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """``reference_routing`` under the current centroids (no EMA update)."""
        centroids = self.centroids_for(q.shape[1], q.shape[3], q.device)
        kw = dict(causal=args.causal, key_mask=args.key_mask, return_weights=return_weights)
        return reference_routing(q, k, v, centroids, self.config, **kw)

    def _init_state(self, spec: StateSpec) -> RoutingState:
        return routing_decode.init_state(self, spec)

    def _step(
        self, state: RoutingState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs
    ) -> tuple[Tensor, RoutingState]:
        return routing_decode.step(self, state, q, k, v, args)
