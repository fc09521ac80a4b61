"""Native Sparse Attention (``nsa``; Yuan et al. 2025, https://arxiv.org/abs/2502.11089).

Three branches per query, mixed by gates: attention over compressed blocks (one key and value
per block of ``block`` tokens), attention over the raw keys of the blocks the compressed branch
attends to most (``n_select`` of them, the own block and block 0 always), and a sliding window.
Here compression block = stride = selection block = ``block``. The selected branch runs on
``block_attend.attend_blocks`` (flash-kernel calls per key block, never N x N), the window on the
sparse backends (``attnzoo.attend`` with ``sliding_window(window - 1, 0)``, a few heads per call
so that its key-window buffers stay small: see ``WINDOW_CHUNK_BYTES``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from attnzoo.backends.dispatch import attend
from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, default_scale, mean_keys, visible_counts
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.block_attend import attend_blocks
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.topk import select_topk, topk_mask
from attnzoo.patterns import sliding_window
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


def _check(block: int, n_select: int, window: int) -> None:
    for name, value, low in (("block", block, 1), ("n_select", n_select, 2), ("window", window, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            hint = " (the own block and block 0 are always selected)" if name == "n_select" else ""
            raise ValueError(f"{name} must be an int >= {low}{hint}, got {value!r}")


def _complete_real(real: Tensor | None, n_cmp: int, block: int) -> Tensor | None:
    """``(B, C)`` bool: the complete blocks that hold a real key (None: all real)."""
    if real is None:
        return None
    return rearrange(real[:, : n_cmp * block], "b (c j) -> b c j", j=block).any(-1)


def compressed_visible(positions: Tensor, n_cmp: int, block: int, cmp_real: Tensor | None) -> Tensor:
    """``(B | 1, 1, R, C)`` bool: compressed block c is visible to the query at position i when
    it is complete by then, ``(c + 1) block - 1 <= i``, and holds a real key."""
    ends = (torch.arange(n_cmp, device=positions.device) + 1) * block - 1
    visible = (ends <= positions[:, None])[None, None]
    return visible if cmp_real is None else visible & cmp_real[:, None, None, :]


def nsa_selection(
    importance: Tensor, visible: Tensor, positions: Tensor, n_blocks: int, block: int, n_select: int
) -> Tensor:
    """NSA's selected blocks, bool ``(B, H, R, n_blocks)``: the own block (``position // block``),
    block 0, and the ``n_select - 2`` visible blocks in between of highest ``importance (B, H, R,
    C)`` (the compressed branch's probabilities; ties to the lower index)."""
    blocks = torch.arange(n_blocks, device=importance.device)
    own = torch.div(positions, block, rounding_mode="floor")[:, None]  # (R, 1)
    keep = ((blocks == own) | (blocks == 0)).expand(importance.shape[:3] + (n_blocks,))
    between = (blocks[: importance.shape[-1]] > 0) & (blocks[: importance.shape[-1]] < own) & visible
    if n_select > 2 and importance.shape[-1] > 0:
        idx, valid = select_topk(importance, between, min(n_select - 2, importance.shape[-1]))
        chosen = torch.zeros(keep.shape, dtype=torch.long, device=keep.device).scatter_add_(-1, idx, valid.long())
        keep = keep | (chosen > 0)
    return keep


#: The window branch runs on at most this many bytes of q at a time (heads split into calls):
#: the sparse backend's backward holds ~5x its q in overlapping key windows, and allocations
#: above glibc's 32 MiB mmap threshold are fresh memory (page faults) on every call.
WINDOW_CHUNK_BYTES = 4 << 20


def _window(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float, real: Tensor | None) -> Tensor:
    """Rows end-aligned to the keys see keys ``i - window + 1 .. i`` (only the last ``window +
    R - 1`` keys can be seen: the rest are not passed on). Heads run in chunks of at most
    ``WINDOW_CHUNK_BYTES`` of q."""
    first = max(0, k.shape[2] - q.shape[2] - window + 1)
    mask = None if real is None else real[:, first:]
    pattern = sliding_window(window - 1, 0)
    heads = max(1, WINDOW_CHUNK_BYTES // max(1, q[:, :1].numel() * q.element_size()))
    parts = [
        attend(qh, kh, vh, pattern=pattern, causal=True, key_mask=mask, scale=scale)
        for qh, kh, vh in zip(q.split(heads, 1), k[:, :, first:].split(heads, 1), v[:, :, first:].split(heads, 1))
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _compressed_probs(q: Tensor, k_cmp: Tensor, visible: Tensor, scale: float) -> Tensor:
    """``normalize_scores(q k_cmp^T scale, visible, "softmax")`` in fewer passes: an additive
    ``-inf`` bias instead of two masked fills (rows with no visible block: bias 0, weights 0)."""
    has_key = visible.any(-1, keepdim=True)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible & has_key, -math.inf)
    return torch.softmax(torch.einsum("bhrd,bhcd->bhrc", q, k_cmp) * scale + bias, -1) * has_key


def nsa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cmp: Tensor,
    v_cmp: Tensor,
    gates: Tensor,
    *,
    block: int,
    n_select: int,
    window: int,
    scale: float,
    key_mask: Tensor | None = None,
) -> Tensor:
    """NSA, the fast path (causal only; rows may be the last R of the N keys, as in decoding).

    Args:
        q: ``(B, H, R, D)``; k, v: ``(B, H, N, D)``, ``(B, H, N, D_v)``, R <= N, rows end-aligned.
        k_cmp, v_cmp: ``(B, H, N // block, D | D_v)``: the compressed key and value of each complete block.
        gates: ``(B, H, R, 3)`` in (0, 1): (compressed, selected, window).
        block: compression = selection block. n_select: selected blocks per query (>= 2).
        window: keys per query of the window branch. scale: score scale of all three branches.
        key_mask: ``(B, N)`` bool, True = real, or None: padded keys are never attended; a
            compressed block with no real key is invisible (so never selected by importance).

    Returns:
        ``(B, H, R, D_v)`` in the dtype of q.
    """
    _check(block, n_select, window)
    dtype = compute_dtype(q)
    qc, kc, vc, kcc, vcc, g = (x.to(dtype) for x in (q, k, v, k_cmp, v_cmp, gates))
    positions = torch.arange(q.shape[2], device=q.device) + (k.shape[2] - q.shape[2])
    visible = compressed_visible(positions, k_cmp.shape[2], block, _complete_real(key_mask, k_cmp.shape[2], block))
    p_cmp = _compressed_probs(qc, kcc, visible, scale)
    with torch.no_grad():
        keep = nsa_selection(p_cmp, visible, positions, -(-k.shape[2] // block), block, n_select)
    o_sel = attend_blocks(qc, kc, vc, keep, block=block, scale=scale, causal=True, real=key_mask)
    o_win = _window(qc, kc, vc, window, scale, key_mask)
    out = g[..., 0:1] * (p_cmp @ vcc) + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
    return out.to(q.dtype)


def compress(x: Tensor, real: Tensor | None, position_weight: Tensor, block: int) -> Tensor:
    """The compressed key (or value) of each complete block: the mean of its real tokens, each
    weighted by ``1 + position_weight[h, j]`` for its place j in the block.

    Shapes:
        x ``(B, H, N, D)``, real ``(B, N)`` or None, position_weight ``(H, block)`` -> ``(B, H, N // block, D)``.
    """
    n_cmp = x.shape[2] // block
    blocks = rearrange(x[:, :, : n_cmp * block], "b h (c j) d -> b h c j d", j=block)
    if real is None:  # every block holds `block` real tokens
        return torch.einsum("bhcjd,hj->bhcd", blocks, (1 + position_weight.to(x.dtype)) / block)
    weight = rearrange(real[:, : n_cmp * block], "b (c j) -> b c j", j=block).to(x.dtype)
    count = weight.sum(-1).clamp(min=1)[:, None, :, None]  # (B, 1, C, 1)
    return torch.einsum("bhcjd,bcj,hj->bhcd", blocks, weight, 1 + position_weight.to(x.dtype)) / count


def pooling_matrix(real: Tensor | None, position_weight: Tensor, shape: tuple[int, int], block: int) -> Tensor:
    """``compress`` as a matrix ``(B, H, C, N)`` for ``shape = (B, N)``: ``compress(x) = P @ x``
    (the compression of the identity)."""
    (batch, n), heads = shape, position_weight.shape[0]
    eye = torch.eye(n, dtype=position_weight.dtype, device=position_weight.device).expand(batch, heads, n, n)
    return compress(eye, real, position_weight, block)


def reference_nsa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pooling: tuple[Tensor, Tensor],
    gates: Tensor,
    *,
    block: int,
    n_select: int,
    window: int,
    scale: float,
    key_mask: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Dense NSA (Yuan et al. 2025, https://arxiv.org/abs/2502.11089), as the paper writes it:
    ``o_i = g_cmp o_cmp + g_slc o_slc + g_win o_win`` where

    * compressed: ``K_cmp = P_k K``, ``V_cmp = P_v V`` (``pooling = (P_k, P_v)``, ``(B | 1, H, C, N)``),
      ``p_cmp = softmax(s q K_cmp^T)`` over the blocks complete by i that hold a real key;
    * selected: blocks ranked by ``p_cmp`` (``topk_mask``, ties to the lower index), the own
      block and block 0 always, ``n_select`` in all; softmax over their keys ``j <= i``;
    * window: softmax over keys ``i - window + 1 .. i``.

    Returns:
        ``(out (B, H, N, D_v), weights (B, H, N, N))``: the compressed branch's weights on the raw
        values are ``p_cmp P_v``. Allocates N x N by design.
    """
    dtype = compute_dtype(q)
    qc, kc, vc, g = (x.to(dtype) for x in (q, k, v, gates))
    n, (p_k, p_v) = k.shape[2], pooling
    pos, n_cmp = torch.arange(n, device=q.device), p_k.shape[2]
    visible = compressed_visible(pos, n_cmp, block, _complete_real(key_mask, n_cmp, block))
    p_cmp = normalize_scores(torch.einsum("bhid,bhcd->bhic", qc, p_k @ kc) * scale, visible, "softmax")
    blocks, own = torch.arange(-(-n // block), device=q.device), (pos // block)[:, None]
    forced = (blocks == own) | (blocks == 0)
    selected = forced.expand(p_cmp.shape[:3] + forced.shape[-1:])
    if n_select > 2 and n_cmp > 0:
        ranked = topk_mask(p_cmp.detach(), visible & (blocks[:n_cmp] > 0) & (blocks[:n_cmp] < own), n_select - 2)
        selected = selected | torch.nn.functional.pad(ranked, (0, len(blocks) - n_cmp))
    real = torch.ones(n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask[:, None, None, :]
    causal = pos[None, :] <= pos[:, None]
    scores = torch.einsum("bhid,bhjd->bhij", qc, kc) * scale
    w_sel = normalize_scores(scores, selected[..., pos // block] & causal & real, "softmax")
    w_win = normalize_scores(scores, causal & (pos[None, :] > pos[:, None] - window) & real, "softmax")
    weights = g[..., 0:1] * (p_cmp @ p_v) + g[..., 1:2] * w_sel + g[..., 2:3] * w_win
    return (weights @ vc).to(q.dtype), weights


@dataclass(frozen=True, kw_only=True)
class NSAConfig(Config):
    """Config of ``nsa``.

    Args:
        block: tokens per compressed block, also the selection block. Default 64.
        n_select: blocks per query in the selected branch, the own block and block 0 included. Default 16.
        window: keys per query of the window branch (``i - window + 1 .. i``). Default 512.
        heads: H, for the per-head compression and gate parameters. Default 8.
        head_dim: D, for the gate projection ``(H, D, 3)``. Default 64.
        scale: score scale of all three branches; default None means ``1 / sqrt(D)``.
    """

    block: int = bounded(64, ge=1)
    n_select: int = bounded(16, ge=2)
    window: int = bounded(512, ge=1)
    heads: int = bounded(8, ge=1)
    head_dim: int = bounded(64, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Blocks of about n / 64 tokens (at least 2), about an eighth of the keys selected, a window of n / 16."""
        block = max(2, n // 64)
        return dict(block=block, n_select=max(2, n // (8 * block)), window=max(2, n // 16))


@dataclass(frozen=True)
class NSAState:
    """``nsa``'s decode state: every key and value (``cache``) and the compressed key and value
    of every block completed so far, ``(B, H, C, D | D_v)``."""

    cache: KVCache
    k_cmp: Tensor
    v_cmp: Tensor


@register(
    "nsa",
    config=NSAConfig,
    family="content",
    summary="Native Sparse Attention: gated compressed, selected-block and sliding-window branches (causal).",
    paper="Yuan et al. 2025, Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse Attention, "
    "https://arxiv.org/abs/2502.11089",
    capabilities=Capabilities(causal=True, bidirectional=False, key_mask=True, decode_step=True),
    complexity=Complexity(
        time="O(N^2 D / block) compressed + O(N n_select block D) selected + O(N window D) window",
        memory="O(N^2 / block) compressed scores, O(N n_select (block + D)) selected, O(N window) window",
        subquadratic_memory=True,
    ),
    notes=(
        "causal only: causal=False is refused (the selection is defined by the causal compressed branch)",
        "compression block = stride = selection block = block (the paper uses blocks of 32 with stride 16 "
        "for compression and 64 for selection)",
        "departure: the paper compresses each block with an MLP over its keys plus an intra-block position "
        "encoding; here the compressed key (value) of a block is the mean of its real keys (values), each "
        "weighted by 1 + w[h, j], a learned weight per head and place j in the block (0 at init: mean pooling)",
        "departure: gates from the query, sigmoid(q W_h + b_h) with W (H, D, 3), b (H, 3) learned; the paper "
        "computes them from the layer input (hidden state)",
        "selected branch: the own block and block 0 always, the rest ranked by the compressed branch's "
        "attention probability (ties to the lower block index), n_select in all; the ranking passes no gradient",
        "key_mask: padded keys are never attended and never pooled; a block with no real key is invisible "
        "to the compressed branch and never ranked",
        "fast path: the compressed branch's probabilities computed once, for its output and for the ranking; "
        "the selected branch on MoBA's block kernel (rows grouped per key block through PyTorch's CPU flash "
        "kernel, merged by log-sum-exp); the window on the sparse backends, a few heads per call; never N x N",
        "decode step: a KV cache and the compressed key and value of each block as it completes; per token "
        "O(t D / block) compressed, O(n_select block D) selected, O(window D) window",
    ),
)
class NSAAttention(Attention):
    """NSA. ``k_position``, ``v_position`` ``(H, block)``: the compression's per-place weights;
    ``gate_weight (H, D, 3)``, ``gate_bias (H, 3)``: the branch gates."""

    config: NSAConfig

    def __init__(self, config: NSAConfig) -> None:
        super().__init__(config)
        self.k_position = nn.Parameter(torch.zeros(config.heads, config.block))
        self.v_position = nn.Parameter(torch.zeros(config.heads, config.block))
        self.gate_weight = nn.Parameter(torch.randn(config.heads, config.head_dim, 3) * config.head_dim**-0.5)
        self.gate_bias = nn.Parameter(torch.zeros(config.heads, 3))

    def _options(self, q: Tensor, args: AttendArgs) -> dict[str, Any]:
        cfg = self.config
        if q.shape[1] != cfg.heads or q.shape[3] != cfg.head_dim:
            raise ValueError(
                f"nsa was built with heads={cfg.heads}, head_dim={cfg.head_dim} but q has H={q.shape[1]}, "
                f"D={q.shape[3]}; build it with heads={q.shape[1]}, head_dim={q.shape[3]}"
            )
        scale = default_scale(cfg.scale, q.shape[-1])
        return dict(block=cfg.block, n_select=cfg.n_select, window=cfg.window, scale=scale, key_mask=args.key_mask)

    def gates(self, q: Tensor) -> Tensor:
        """``(B, H, N, 3)``: ``sigmoid(q W_h + b_h)``, the (compressed, selected, window) gates."""
        weight, bias = self.gate_weight.to(q.dtype), self.gate_bias.to(q.dtype)
        return torch.sigmoid(torch.einsum("bhnd,hdg->bhng", q, weight) + bias[:, None, :])

    def keys_per_query(self, n: int, causal: bool) -> float:
        """The three branches' keys per row (each its own softmax, so overlaps count twice): the
        window, the selected blocks (the own one up to the row, block 0 and ``n_select - 2``
        earlier ones) and one compressed key per complete block."""
        cfg, i = self.config, torch.arange(n)
        own = i // cfg.block
        selected = i % cfg.block + 1 + cfg.block * ((own > 0).long() + (own - 1).clamp(min=0, max=cfg.n_select - 2))
        return mean_keys(visible_counts(n, True).clamp(max=cfg.window) + selected + (i + 1) // cfg.block)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        options, block = self._options(q, args), self.config.block
        k_cmp = compress(k, args.key_mask, self.k_position, block)
        v_cmp = compress(v, args.key_mask, self.v_position, block)
        return nsa(q, k, v, k_cmp, v_cmp, self.gates(q), **options)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        options, shape = self._options(q, args), (k.shape[0], k.shape[2])
        pooling = tuple(
            pooling_matrix(args.key_mask, w.to(compute_dtype(q)), shape, self.config.block)
            for w in (self.k_position, self.v_position)
        )
        out, weights = reference_nsa(q, k, v, pooling, self.gates(q), **options)
        return (out, weights) if return_weights else out

    def _init_state(self, spec: StateSpec) -> NSAState:
        """An empty cache and no compressed blocks."""
        empty = torch.zeros(spec.batch, spec.kv_heads, 0, 1, device=spec.device, dtype=spec.dtype)
        return NSAState(
            KVCache.for_state(spec), empty.expand(-1, -1, -1, spec.head_dim), empty.expand(-1, -1, -1, spec.value_dim)
        )

    def _step(self, state: NSAState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, NSAState]:
        """The new rows of the causal forward: the blocks the new tokens complete are compressed
        and appended, then ``nsa`` runs the new rows over the cache."""
        cfg = self.config
        options = self._options(q, AttendArgs(causal=True, key_mask=None, score_mod=None))
        cache = state.cache.append(k, v, args.key_mask)
        done, complete = state.k_cmp.shape[2], cache.length // cfg.block
        k_cmp, v_cmp = state.k_cmp, state.v_cmp
        if complete > done:
            span = slice(done * cfg.block, complete * cfg.block)
            real = None if cache.key_mask is None else cache.key_mask[:, span]
            k_new = compress(cache.k[:, :, span], real, self.k_position, cfg.block)
            v_new = compress(cache.v[:, :, span], real, self.v_position, cfg.block)
            k_cmp, v_cmp = torch.cat([k_cmp, k_new.to(k_cmp.dtype)], 2), torch.cat([v_cmp, v_new.to(v_cmp.dtype)], 2)
        options["key_mask"] = cache.key_mask
        out = nsa(q, cache.k, cache.v, k_cmp, v_cmp, self.gates(q), **options)
        return nan_rows_of_non_finite_queries(out, q), NSAState(cache, k_cmp, v_cmp)
