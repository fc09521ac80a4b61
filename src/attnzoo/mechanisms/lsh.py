"""Reformer LSH attention (Kitaev et al. 2020, https://arxiv.org/abs/2001.04451).

Per hashing round, random rotations put each token in a bucket; tokens are sorted by (bucket,
position) and split into chunks; a query attends to the keys of its bucket in its own chunk and
the previous one. Rounds are combined by their log-sum-exp. The fast path runs each round
through the blocked backend in sorted order (O(N * chunk) memory); ``reference_lsh`` computes
the same buckets and chunks, then dense attention under the mask they imply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo import patterns as P
from attnzoo.backends.blocked import blocked_attention, make_plan
from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms.base import Attention
from attnzoo.registry import Config, register
from attnzoo.spec import Capabilities, Complexity, ScoreMod


@dataclass(frozen=True, kw_only=True)
class LSHConfig(Config):
    """Config of ``lsh``.

    Args:
        n_hashes: hashing rounds. Default 2.
        n_buckets: buckets per round: even, or 1 (no hashing: every token in one bucket). Default 8.
        chunk: chunk size c (positions ranked within a bucket). Default 64.
        seed: seed of the random rotations (fixed: the same buckets every call). Default 0.
        scale: score scale; default ``1 / sqrt(D)``.
    """

    n_hashes: int = 2
    n_buckets: int = 8
    chunk: int = 64
    seed: int = 0
    scale: float | None = None

    def validate(self) -> None:
        for name in ("n_hashes", "n_buckets", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_buckets % 2 and self.n_buckets != 1:
            raise ValueError(f"n_buckets must be 1 or even (buckets come from argmax([xR; -xR])), got {self.n_buckets}")


@dataclass(frozen=True)
class Routing:
    """One hashing round in sorted order, all ``(B, H, N)``: ``order`` sorts positions by
    (bucket, position); ``bucket``, ``rank`` (position among the bucket's real tokens),
    ``position`` and ``real`` are read in that order."""

    order: Tensor
    bucket: Tensor
    rank: Tensor
    position: Tensor
    real: Tensor


def rotations(config: LSHConfig, dim: int, device: torch.device) -> Tensor:
    """``(n_hashes, D, n_buckets / 2)`` random rotations, fixed by the seed."""
    g = torch.Generator().manual_seed(config.seed)
    return torch.randn(config.n_hashes, dim, config.n_buckets // 2, generator=g).to(device)


def route(keys: Tensor, rotation: Tensor, real: Tensor) -> Routing:
    """Buckets ``argmax([xR; -xR])`` of the unit keys ``(B, H, N, D)``; padded tokens go to an
    extra last bucket so they never shift real tokens' ranks."""
    n, n_buckets = keys.shape[2], max(2 * rotation.shape[-1], 1)
    if rotation.shape[-1]:
        projected = keys.float() @ rotation.float()  # [B, H, N, n_buckets/2]
        bucket = torch.cat([projected, -projected], dim=-1).argmax(-1)
    else:
        bucket = torch.zeros(keys.shape[:3], dtype=torch.long, device=keys.device)
    bucket = torch.where(real[:, None, :], bucket, n_buckets)
    position = torch.arange(n, device=keys.device).expand_as(bucket)
    order = torch.argsort(bucket * n + position, dim=-1)
    bucket_s, position_s = bucket.gather(-1, order), position.gather(-1, order)
    # rank within the bucket = sorted index - index where the bucket starts
    rank = torch.arange(n, device=keys.device) - torch.searchsorted(bucket_s, bucket_s)
    return Routing(order, bucket_s, rank, position_s, real[:, None, :].expand_as(bucket).gather(-1, order))


def visible_in_order(r: Routing, chunk: int, causal: bool):  # noqa: ANN201 - returns a MaskMod
    """Pairs of sorted indices ``(s, t)``: same bucket, key in the query's rank-chunk or the one
    before, key real, not the query itself (and ``t <= s`` when causal, which is position
    order inside a bucket)."""
    last = r.bucket.shape[-1] - 1

    def mask(b: Tensor, h: Tensor, qs: Tensor, ks: Tensor) -> Tensor:
        # The kernel also asks about its padding rows/columns (beyond N); clamp to index safely.
        qs, ks = qs.clamp(max=last), ks.clamp(max=last)
        same = r.bucket[b, h, qs] == r.bucket[b, h, ks]
        group = torch.div(r.rank[b, h, qs], chunk, rounding_mode="floor")
        rank_k = r.rank[b, h, ks]
        near = (rank_k >= (group - 1) * chunk) & (rank_k < (group + 1) * chunk)
        ok = same & near & r.real[b, h, ks] & (qs != ks)
        return ok & (ks <= qs) if causal else ok

    return mask


def combine_rounds(outs: list[Tensor], lses: list[Tensor], v: Tensor, real: Tensor) -> Tensor:
    """``sum_r softmax_r(lse_r) * out_r``; a row that saw no key in any round attends to itself
    (its own value; zero if it is padding)."""
    lse = torch.stack(lses, dim=-1)  # [B, H, N, rounds]
    total = torch.logsumexp(lse, dim=-1, keepdim=True)
    weights = torch.where(torch.isinf(total), 0.0, torch.exp(lse - torch.where(torch.isinf(total), 0.0, total)))
    out = (torch.stack(outs, dim=-1) * weights[..., None, :].to(outs[0].dtype)).sum(-1)
    alone = torch.isinf(total[..., 0])[..., None] & real[:, None, :, None]
    return torch.where(alone, v, out)


def reference_lsh(q: Tensor, v: Tensor, config: LSHConfig, *, causal: bool = False,
                  key_padding_mask: Tensor | None = None, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """LSH attention as the paper reads, densely: per round, the N x N mask of (same bucket, key
    in the query's chunk or the previous one, key real, not self, causal), masked softmax, and
    the rounds combined by their log-sum-exp. Keys are the unit-normalised queries (shared QK).
    ``return_weights`` also gives the combined ``(B, H, N, N)`` attention matrix."""
    real = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    keys = F.normalize(q, dim=-1)
    scale = q.shape[-1] ** -0.5 if config.scale is None else config.scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("bhid,bhjd->bhij", q.to(compute), keys.to(compute)) * scale
    outs, lses, probs = [], [], []
    for rotation in rotations(config, q.shape[-1], q.device):
        r = route(keys, rotation, real)
        inverse = torch.argsort(r.order, dim=-1)
        b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)
        h = torch.arange(q.shape[1], device=q.device).view(1, -1, 1, 1)
        s = inverse[..., :, None].expand(*inverse.shape, inverse.shape[-1])  # sorted index of query i
        t = inverse[..., None, :].expand_as(s)  # sorted index of key j
        visible = visible_in_order(r, config.chunk, causal)(b, h, s, t)
        lses.append(torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1))
        probs.append(normalize_scores(scores, visible, "softmax"))
        outs.append(probs[-1] @ v.to(compute))
    out = combine_rounds(outs, lses, v.to(compute), real).to(q.dtype)
    if not return_weights:
        return out
    total = torch.logsumexp(torch.stack(lses, -1), -1, keepdim=True)
    w = sum(p * torch.nan_to_num(torch.exp(lse[..., None] - total), nan=0.0) for p, lse in zip(probs, lses))
    alone = torch.isinf(total[..., 0]) & real[:, None, :]
    eye = torch.eye(q.shape[2], dtype=w.dtype, device=q.device)
    return out, torch.where(alone[..., None], eye, w)


@register(
    "lsh",
    config=LSHConfig,
    family="content",
    summary="Reformer LSH attention: hash to buckets, sort, attend within chunks of a bucket.",
    paper="Kitaev et al. 2020, Reformer, https://arxiv.org/abs/2001.04451",
    capabilities=Capabilities(causal=True, key_padding=True, backends=("blocked", "reference")),
    complexity=Complexity(time="O(n_hashes N c D)", memory="O(n_hashes N c)", subquadratic_memory=True),
    notes=(
        "shared QK: keys are the unit-normalised queries; the k argument is not used",
        "chunks are taken within each bucket by position rank (Reformer chunks the whole sorted "
        "sequence, which lets future tokens move chunk boundaries); this makes routing causal",
        "a token attends to itself only when it sees nothing else in any round",
        "rotations are fixed by the seed: the same input always gets the same buckets",
    ),
)
class LSHAttention(Attention):
    """Reformer LSH attention; see the module docstring and ``reference_lsh``."""

    config: LSHConfig

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_padding_mask: Tensor | None,
                score_mod: ScoreMod | None) -> Tensor:
        cfg, (batch, heads, n, _) = self.config, q.shape
        real = torch.ones(batch, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
        keys = F.normalize(q, dim=-1)
        scale = q.shape[-1] ** -0.5 if cfg.scale is None else cfg.scale
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        # In sorted order a query's visible keys lie at most 2c - 1 before and c - 1 after it.
        band = P.sliding_window(2 * cfg.chunk - 1, 0 if causal else cfg.chunk - 1)
        tiles = band.blocks(n, n, cfg.chunk)
        plan = make_plan(tiles.with_full(torch.zeros_like(tiles.full)), torch.zeros(heads, dtype=torch.long))
        outs, lses = [], []
        for rotation in rotations(cfg, q.shape[-1], q.device):
            r = route(keys, rotation, real)
            order = r.order[..., None]
            sort = lambda x: x.gather(2, order.expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
            out, lse = blocked_attention(sort(q), sort(keys), sort(v), plan, scale=scale, return_lse=True,
                                         mask_mod=visible_in_order(r, cfg.chunk, causal))
            inverse = torch.argsort(r.order, dim=-1)
            outs.append(out.gather(2, inverse[..., None].expand_as(out)).to(compute))
            lses.append(lse.gather(2, inverse).to(compute))
        return combine_rounds(outs, lses, v.to(compute), real).to(q.dtype)

    def implied_attention(self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None) -> Tensor:
        """The combined ``(B, H, N, N)`` attention of a forward pass on ``q`` (small N)."""
        return reference_lsh(q, q[..., :1], self.config, causal=causal, key_padding_mask=key_padding_mask,
                             return_weights=True)[1]
