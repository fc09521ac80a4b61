"""Trainable sparse attention over content-selected key blocks: MoBA here, NSA in ``nsa.py``.

MoBA (Mixture of Block Attention, Lu et al. 2025, https://arxiv.org/abs/2502.13189) cuts the
keys into blocks, gates each (query, block) pair by ``q_i . mean(k in block)`` and lets every
query attend to the keys of its ``topk`` best blocks (causal: its own block always, the rest
among earlier blocks). NSA (``nsa.py``) selects blocks by the attention of a compressed branch.

Both run on ``attend_blocks`` (``block_attend.py``): each query attends to the keys of its own
few selected blocks, one softmax over their union. The rows that attend one key block are
gathered and run through PyTorch's CPU flash kernel against that block, many such groups per
call, and merged per row by log-sum-exp: O(N * blocks per row * (block + D)) time and memory,
no N x N tensor and no scores kept for backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, default_scale, mean_keys
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.block_attend import attend_blocks
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.topk import select_topk, topk_mask
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


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
        "fast path: the rows that attend each key block run through PyTorch's CPU flash kernel against it "
        "(groups of similar length batched into one call), merged per row by log-sum-exp; backward by the "
        "kernel's backward from the merged log-sum-exp: never N x N",
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

    def keys_per_query(self, n: int, causal: bool) -> float:
        """``topk`` blocks of keys per row; causal: its own block up to itself and ``topk - 1``
        earlier ones (all when fewer)."""
        block, topk = self.config.block, self.config.topk
        if not causal:
            return float(min(topk * block, n))
        i = torch.arange(n)
        return mean_keys(i % block + 1 + block * (i // block).clamp(max=topk - 1))

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
