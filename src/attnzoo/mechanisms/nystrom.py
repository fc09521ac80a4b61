"""Nyströmformer (Xiong et al. 2021, https://arxiv.org/abs/2102.03902): m landmarks, the means of
m contiguous segments of queries and keys, and the N x N softmax rebuilt from three small ones
through a pseudo-inverse, ``S^ = softmax(Q K~^T s) A^+ softmax(Q~ K^T s)``. ``nystrom_attention``
is the fast path (two SDPA calls around the m x m pseudo-inverse), ``nystrom_weights`` the dense
reference (``S^`` itself)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, real_tokens
from attnzoo.mechanisms.base import AttendArgs
from attnzoo.mechanisms.low_rank import LowRankAttention
from attnzoo.registry import Config, bounded, eighth, register
from attnzoo.spec import Capabilities, Complexity


def iterative_pinv(a: Tensor, iters: int) -> Tensor:
    """Moore-Penrose pseudo-inverse of ``a (..., m, m)`` by Nyströmformer's iteration (eq. 16):
    ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4`` from ``Z_0 = A^T / (||A||_1 ||A||_inf)``,
    norms per matrix (the official code takes the max over the whole batch, so one sequence's
    result depends on the others). An all-zero matrix gives zeros."""
    norm = a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1)  # (...,)
    z = a.transpose(-1, -2) / torch.where(norm > 0, norm, 1.0)[..., None, None]
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def landmark_segments(n: int, landmarks: int, device: torch.device) -> tuple[Tensor, int]:
    """Segment of each position ``(N,)`` and the count ``m = min(landmarks, N)``: position j is in
    segment ``floor(j m / N)``: contiguous, in order, floor(N/m) or ceil(N/m) positions each
    (equal when m divides N, the paper's case)."""
    m = min(landmarks, n)
    return torch.div(torch.arange(n, device=device) * m, n, rounding_mode="floor"), m


def _segment_means(x: Tensor, seg: Tensor, m: int, real: Tensor) -> tuple[Tensor, Tensor]:
    """Means of ``x (B, H, N, D)`` over each segment's real positions -> ``(B, H, m, D)`` (zeros for
    a segment with none), and ``(B, m)``: True where a segment holds a real position."""
    w = real.to(x.dtype)
    sums = x.new_zeros(x.shape[0], x.shape[1], m, x.shape[3]).index_add_(2, seg, x * w[:, None, :, None])
    counts = w.new_zeros(w.shape[0], m).index_add_(1, seg, w)
    return sums / counts.clamp(min=1)[:, None, :, None], counts > 0


def nystrom_attention(
    q: Tensor, k: Tensor, v: Tensor, *, landmarks: int, pinv_iters: int, key_mask: Tensor | None = None
) -> Tensor:
    """Nyströmformer, fast: ``F (Z (B V))`` by two SDPA calls (args as ``nystrom_weights``; v
    ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``)."""
    ct, (b, _, n, dim) = compute_dtype(q), q.shape
    scale = dim**-0.5
    qc, kc, vc = (t.to(ct) for t in (q, k, v))
    seg, m = landmark_segments(n, landmarks, q.device)
    real = real_tokens(key_mask, b, n, q.device)
    (q_l, ok), (k_l, _) = _segment_means(qc, seg, m, real), _segment_means(kc, seg, m, real)  # (B, H, m, D)
    a = normalize_scores(q_l @ k_l.transpose(-1, -2) * scale, ok[:, None, :, None] & ok[:, None, None, :], "softmax")
    padded = key_mask is not None
    bv = F.scaled_dot_product_attention(  # softmax(Q~ K^T) V: (B, H, m, D_v)
        q_l, kc, vc, attn_mask=(ok[:, None, :, None] & real[:, None, None, :]) if padded else None, scale=scale
    )
    w = iterative_pinv(a, pinv_iters) @ bv
    f_mask = ok[:, None, None, :] if padded else None
    return F.scaled_dot_product_attention(qc, k_l, w, attn_mask=f_mask, scale=scale).to(q.dtype)


def nystrom_weights(
    q: Tensor, k: Tensor, *, landmarks: int, pinv_iters: int | None, key_mask: Tensor | None = None
) -> Tensor:
    """Nyströmformer, dense (eq. 15): ``S^ = softmax(Q K~^T s) A^+ softmax(Q~ K^T s)``,
    ``A = softmax(Q~ K~^T s)``; the output is ``S^ V``.

    Args:
        q, k: ``(B, H, N, D)``.
        landmarks: segments (``landmark_segments``); ``Q~, K~ = (m, N) averaging matrix @ Q, K``.
        pinv_iters: steps of ``iterative_pinv``; None: ``torch.linalg.pinv`` in float64, the exact
            pseudo-inverse (its gradient is not meant for rank-deficient A).
        key_mask: padded positions are left out of the means and masked in the third
            softmax; a segment of padding only is an invalid landmark, masked everywhere (A is then
            block-diagonal with a zero block, whose pseudo-inverse is zero there).

    Returns:
        ``S^ (B, H, N, N)`` in the compute dtype.
    """
    ct, (b, _, n, dim) = compute_dtype(q), q.shape
    scale = dim**-0.5
    qc, kc = q.to(ct), k.to(ct)
    seg, m = landmark_segments(n, landmarks, q.device)
    real = real_tokens(key_mask, b, n, q.device)
    member = (seg == torch.arange(m, device=q.device)[:, None]) & real[:, None, :]  # (B, m, N)
    counts = member.sum(-1, keepdim=True)
    average = (member.to(ct) / counts.clamp(min=1).to(ct))[:, None]  # (B, 1, m, N)
    q_l, k_l, ok = average @ qc, average @ kc, (counts[..., 0] > 0)[:, None]  # ok (B, 1, m)
    kernel_f = normalize_scores(qc @ k_l.transpose(-1, -2) * scale, ok[..., None, :], "softmax")  # (B, H, N, m)
    kernel_a = normalize_scores(q_l @ k_l.transpose(-1, -2) * scale, ok[..., :, None] & ok[..., None, :], "softmax")
    kernel_b = normalize_scores(
        q_l @ kc.transpose(-1, -2) * scale, ok[..., :, None] & real[:, None, None, :], "softmax"
    )
    if pinv_iters is None:
        a_pinv = torch.linalg.pinv(kernel_a.double()).to(ct)
    else:
        a_pinv = iterative_pinv(kernel_a, pinv_iters)
    return kernel_f @ a_pinv @ kernel_b


@dataclass(frozen=True, kw_only=True)
class NystromConfig(Config):
    """Config of ``nystrom``.

    Args:
        landmarks: number of landmarks m (segments); N < m uses m = N. Default 64.
        pinv_iters: steps of the pseudo-inverse iteration (0: its initial guess). Default 6.
    """

    landmarks: int = bounded(64, ge=1, for_length=eighth)  # segments of 8 tokens
    pinv_iters: int = bounded(6, ge=0)


@register(
    "nystrom",
    config=NystromConfig,
    family="low_rank",
    summary="Nyströmformer: softmax attention rebuilt from segment-mean landmarks and a pseudo-inverse.",
    paper="Xiong et al. 2021, Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention, "
    "https://arxiv.org/abs/2102.03902",
    capabilities=Capabilities(causal=False, key_mask=True, cross_attention=False, independent_queries=False),
    complexity=Complexity(time="O(N m D + iters m^3)", memory="O(N m + m^2)", subquadratic_memory=True),
    notes=(
        "representative keys: m landmarks, means of m contiguous segments of floor(N/m) or ceil(N/m) keys "
        "(queries likewise); padded positions are left out of the means",
        "iterative pseudo-inverse (pinv_iters steps, Z0 = A^T / (|A|_1 |A|_inf) per matrix); with m = N "
        "and enough steps it is exact attention; rows of the implied matrix need not be >= 0 or sum to 1",
        "not causal: landmarks average future keys; self-attention only (queries and keys share segments)",
        "the paper's depthwise convolution skip on V belongs to the layer and is not included",
    ),
)
class NystromAttention(LowRankAttention):
    """Nyströmformer attention: ``nystrom_attention``, with ``nystrom_weights`` as its dense twin."""

    config: NystromConfig

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        cfg, mask = self.config, args.key_mask
        return nystrom_attention(q, k, v, landmarks=cfg.landmarks, pinv_iters=cfg.pinv_iters, key_mask=mask)

    def _weights(self, q: Tensor, k: Tensor, args: AttendArgs) -> Tensor:
        cfg, mask = self.config, args.key_mask
        return nystrom_weights(q, k, landmarks=cfg.landmarks, pinv_iters=cfg.pinv_iters, key_mask=mask)
