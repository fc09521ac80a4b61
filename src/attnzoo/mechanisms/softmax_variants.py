"""Cheap variants of exact softmax attention from recent LLMs: each changes one thing about
``softmax(s Q K^T) V`` and keeps everything else (decoding with a KV cache included).

* ``softcap`` (Gemma 2): scores soft-capped, ``cap * tanh(s / cap)``, before the softmax.
* ``learned_sinks`` (gpt-oss): one learned logit per head joins every softmax denominator.
* ``differential`` (Diff Transformer) and ``gated`` (gated attention, Qwen3-Next): in
  ``diff_gated.py`` (file size), their plain functions re-exported here.

Each has a plain function with the signature of the interface the oracles share
(``tests/oracles_modern.py``): ``softcap_attention``, ``sink_softmax_attention``,
``differential_attention``, ``gated_attention``; the registered modules make their extra inputs
(lambda, sink logits, gate logits) from their own parameters and call them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from attnzoo import patterns as P
from attnzoo._compat import flash_attention_cpu, flash_attention_cpu_backward
from attnzoo.backends.blocked import blocked_attention
from attnzoo.backends.call import Call, resolve_pattern
from attnzoo.backends.plan import plan_for
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms._ops import compute_dtype, default_scale, same_width
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted
from attnzoo.mechanisms.cache import KVCacheDecode
from attnzoo.mechanisms.diff_gated import (
    CACHE_CAPS,
    KV_DECODE,
    PerHead,
    diff_lambda,
    differential_attention,
    gated_attention,
    gated_output,
    lambda_init,
)
from attnzoo.mechanisms.score_chunks import softmax_chunks
from attnzoo.mechanisms.softmax import sdpa_attention
from attnzoo.registry import Config, bounded, register
from attnzoo.score_mods import chain, plain_bias, softcap, softcap_scores
from attnzoo.spec import Capabilities, Complexity, ScoreMod

__all__ = [
    "differential_attention",
    "diff_lambda",
    "gated_attention",
    "gated_output",
    "lambda_init",
    "sink_softmax_attention",
    "softcap_attention",
    "softcap_scores",
]

#: Elements of one query chunk's score matrix in ``chunked_attention`` (as the blocked backend's).
SCORE_BUDGET = 1 << 22


def chunked_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None, score_mod: ScoreMod | None, scale: float
) -> Tensor:
    """Exact softmax attention with a ``score_mod``, one chunk of query rows at a time, each
    chunk recomputed in backward (``torch.utils.checkpoint``): at most ``SCORE_BUDGET`` scores
    (and at least 16 rows) live at once, never ``N_q x N_kv``. A causal chunk reads only the
    keys its last row can see. What SDPA cannot do (it takes no ``score_mod``) at dense speed."""
    n_q, n_kv = q.shape[2], k.shape[2]
    rows = max(16, SCORE_BUDGET // max(1, q.shape[0] * q.shape[1] * n_kv))
    if rows >= n_q:
        return reference_attention(q, k, v, causal=causal, key_mask=key_mask, score_mod=score_mod, scale=scale)
    outs = []
    for start in range(0, n_q, rows):
        stop = min(start + rows, n_q)
        # Causal: the chunk, end-aligned to keys [0, end), gets its own positions; otherwise
        # reference_attention aligns it to the end of all keys and the score_mod's q_idx shifts.
        end = stop + n_kv - n_q if causal else n_kv
        shift = 0 if causal else stop - n_q
        mask = None if key_mask is None else key_mask[:, :end]
        mod = score_mod if shift == 0 or score_mod is None else _shifted(score_mod, shift)

        def run(qc: Tensor, kc: Tensor, vc: Tensor, mask: Tensor | None = mask, mod: ScoreMod | None = mod) -> Tensor:
            return reference_attention(qc, kc, vc, causal=causal, key_mask=mask, score_mod=mod, scale=scale)

        chunk = q[:, :, start:stop], k[:, :, :end], v[:, :, :end]
        outs.append(checkpoint(run, *chunk, use_reentrant=False, preserve_rng_state=False))
    return torch.cat(outs, dim=2)


def _shifted(score_mod: ScoreMod, shift: int) -> ScoreMod:
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_idx + shift, kv_idx)


def softcap_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cap: float,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_mask: Tensor | None = None,
    score_mod: ScoreMod | None = None,
) -> Tensor:
    """Gemma 2 attention (Gemma Team 2024, https://arxiv.org/abs/2408.00118, Sec. 2):
    ``softmax(cap * tanh(s / cap)) V`` with ``s = scale * Q K^T`` (+ ``score_mod``'s bias, added
    before the cap), masked after the cap. No ``N x N`` tensor: ``score_chunks.softmax_chunks``
    (forward and backward by hand) without a ``score_mod`` or with an additive bias
    (``score_mods.bias_mod``, e.g. ALiBi), ``chunked_attention`` with any other."""
    scale = default_scale(scale, q.shape[-1])
    bias = plain_bias(score_mod, q.device)
    if score_mod is None or bias is not None:
        dtype = compute_dtype(q)
        qc, kc, vc = (x.to(dtype) for x in (q, k, v))
        out = softmax_chunks(qc, kc, vc, scale=scale, causal=causal, key_mask=key_mask, cap=cap, bias=bias)
        return out.to(q.dtype)
    mod = chain(score_mod, softcap(cap))
    return chunked_attention(q, k, v, causal=causal, key_mask=key_mask, score_mod=mod, scale=scale)


@dataclass(frozen=True, kw_only=True)
class SoftcapConfig(Config):
    """Config of ``softcap``.

    Args:
        cap: the soft cap on the scaled scores (Gemma 2: 50.0). scale: default ``1 / sqrt(D)``.
    """

    cap: float = bounded(50.0, gt=0)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")


@register(
    "softcap",
    config=SoftcapConfig,
    family="exact",
    summary="Softmax attention with soft-capped scores, cap * tanh(s / cap) (Gemma 2).",
    paper="Gemma Team 2024, Gemma 2, https://arxiv.org/abs/2408.00118",
    capabilities=Capabilities(**CACHE_CAPS, score_mod=True, backends=("chunked", "reference")),
    complexity=Complexity(time="O(N^2 D)", memory="O(N D + 1M-4M scores per chunk)", subquadratic_memory=True),
    notes=(
        "a score_mod (a position bias) is added before the cap: attnzoo.score_mods.chain(bias, softcap(cap))",
        "fast path (SDPA takes no score_mod): query chunks of at most 1M scores, forward and backward written "
        "out, each chunk's scores recomputed in backward, also with an additive bias (score_mods.bias_mod: ALiBi); "
        "with another score_mod: the reference in chunks of at most 4M scores, checkpointed; no second derivative "
        "on the fast path (a double backward raises)",
        KV_DECODE,
    ),
)
class SoftcapAttention(KVCacheDecode, Attention):
    """Gemma 2's soft-capped softmax attention; ``attnzoo.score_mods.softcap`` is the same cap
    for any mechanism that takes a ``score_mod``."""

    config: SoftcapConfig

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        options = dict(causal=args.causal, key_mask=args.key_mask, score_mod=args.score_mod, scale=self.config.scale)
        return softcap_attention(q, k, v, self.config.cap, **options)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        mod = chain(args.score_mod, softcap(self.config.cap))
        options = dict(causal=args.causal, key_mask=args.key_mask, score_mod=mod, scale=self.config.scale)
        return reference_attention(q, k, v, return_weights=return_weights, **options)


def sink_softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sink_logits: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_mask: Tensor | None = None,
    left: int | None = None,
    right: int | None = None,
) -> Tensor:
    """gpt-oss attention sinks (OpenAI 2025, https://arxiv.org/abs/2508.10925): a learned logit
    per head joins the softmax denominator and carries no value,
    ``o_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))``.

    That is plain attention times ``1 / (1 + exp(sink_h - lse_i))`` (``lse_i`` the log-sum-exp
    of row i's scores), so it runs as one attention that also returns the lse: PyTorch's CPU
    flash kernel (``SinkFlash``), or with a window (``left``/``right`` keys each side, None =
    unbounded) the blocked backend's tile plan. Neither makes an ``N x N`` tensor. Off the CPU
    (no such kernel there) the sink is one more key of zero value through SDPA
    (``sink_key_attention``); a window is CPU only.

    Shapes: q, k ``(B, H, N_q | N_kv, D)``, v ``(B, H, N_kv, D_v)``, sink_logits ``(H,)``.
    """
    windowed = left is not None or right is not None
    if q.device.type != "cpu" and windowed:
        raise ValueError(
            f"sink_softmax_attention with a window runs the blocked backend, CPU only; inputs are on {q.device.type}"
        )
    scale = default_scale(scale, q.shape[-1])
    cd = compute_dtype(q)
    if q.device.type != "cpu":
        out = sink_key_attention(q.to(cd), k.to(cd), v.to(cd), sink_logits.to(cd), causal, key_mask, scale)
        return out.to(v.dtype)
    sink = sink_logits.to(cd).view(1, -1, 1)
    if left is None and right is None:
        out = SinkFlash.apply(*same_width(q.to(cd), k.to(cd), v.to(cd)), sink, causal, key_mask, scale)
        return out[..., : v.shape[-1]].to(v.dtype)
    n_kv = k.shape[2]
    band = P.sliding_window(n_kv if left is None else left, n_kv if right is None else right)
    call = Call(q, k, v, resolve_pattern(band, q.shape[1], causal), key_mask, None, scale, 128)
    out, lse = blocked_attention(call, plan_for(call), return_lse=True)
    return (out.to(cd) * torch.sigmoid(lse.to(cd) - sink)[..., None]).to(q.dtype)


def sink_key_attention(
    q: Tensor, k: Tensor, v: Tensor, sink_logits: Tensor, causal: bool, key_mask: Tensor | None, scale: float
) -> Tensor:
    """Attention sinks off the CPU (no CPU flash kernel there): the sink as one more key, first
    in every row, with a zero value. ``q' = [q * scale, 1]``, ``k' = [k, 0]`` and the sink key
    ``[0, sink_h]`` give ``q' . k'_j = scale * q . k_j`` and ``q' . sink = sink_h``; SDPA with
    scale 1 takes them (zero columns pad q, k, v to one width, as its fused kernels want). With
    the key first, end-aligned causal rows see it and their own keys, nothing later."""
    (b, h, _, d), d_v = q.shape, v.shape[-1]
    sink_key = F.pad(sink_logits.view(1, h, 1, 1).expand(b, h, 1, 1), (d, 0))  # [B, H, 1, D + 1]: [0, sink_h]
    qs = torch.cat([q * scale, torch.ones_like(q[..., :1])], dim=-1)
    ks = torch.cat([sink_key, F.pad(k, (0, 1))], dim=2)
    qs, ks, vs = same_width(qs, ks, F.pad(v, (0, 0, 1, 0)))  # a zero value row for the sink
    if causal and key_mask is None:  # end-aligned causal without a materialised mask
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(qs.shape[2], ks.shape[2]), scale=1.0
        )
    else:
        mask = None if key_mask is None else F.pad(key_mask, (1, 0), value=True)
        out = sdpa_attention(qs, ks, vs, causal=causal, key_mask=mask, scale=1.0)
    return out[..., :d_v]


class SinkFlash(torch.autograd.Function):
    """Attention with a value-less sink logit per head through the CPU flash kernel.

    The sink is one more key in every row's softmax, so with ``lse' = logaddexp(lse, sink)``
    (the log of the whole denominator) the kernel's backward, given the final output and
    ``lse'``, recomputes the sink-inclusive probabilities and is exact as it stands; the sink's
    own gradient is ``-sum_i p_sink,i (dO_i . o_i)``."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sink: Tensor, causal: bool, key_mask, scale: float):  # noqa: ANN001, ANN205
        square, mask, seen = _flash_mask(q, k.shape[2], causal, key_mask)
        out, lse = flash_attention_cpu(q, k, v, 0.0, square, attn_mask=mask, scale=scale)[:2]
        # The kernel reports lse = 0 for a row that sees no key: make it -inf (weight 0).
        lse = lse if seen is None else lse.masked_fill(~seen, -math.inf)
        total = torch.logaddexp(lse, sink)
        out = out * torch.exp(lse - total)[..., None]
        ctx.save_for_backward(q, k, v, out, total, sink, mask)
        ctx.square, ctx.scale = square, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # noqa: ANN205
        q, k, v, out, total, sink, mask = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = flash_attention_cpu_backward(
            grad, q, k, v, out, total, 0.0, ctx.square, attn_mask=mask, scale=ctx.scale
        )
        delta = (grad * out).sum(-1)  # (B, H, N_q)
        d_sink = -(torch.exp(sink - total) * delta).sum((0, 2)).view_as(sink)
        return dq, dk, dv, d_sink, None, None, None


def _flash_mask(
    q: Tensor, n_kv: int, causal: bool, key_mask: Tensor | None
) -> tuple[bool, Tensor | None, Tensor | None]:
    """What the flash kernel takes for this call: ``is_causal`` (square causal: the kernel's own
    triangle), the additive mask (None, ``(B, 1, 1, N_kv)`` for padding, ``(B | 1, 1, N_q, N_kv)``
    for an end-aligned causal band when ``N_q < N_kv``: a decode step's few rows), and which rows
    see any key (``(B, 1, N_q | 1)`` bool; None when all do)."""
    n_q = q.shape[2]
    square = causal and n_q == n_kv
    allowed = None if key_mask is None else key_mask[:, None, None, :]
    if causal and not square:
        band = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril(n_kv - n_q)
        allowed = band[None, None] if allowed is None else allowed & band
    if allowed is None:
        return square, None, None
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, -math.inf)
    if key_mask is None:
        return square, mask, None
    # A row sees a key iff a real key sits at or before its aligned position (causal), or anywhere.
    seen = (key_mask.cumsum(-1) > 0)[:, n_kv - n_q :] if causal else key_mask.any(-1, keepdim=True)
    return square, mask, seen[:, None]


@dataclass(frozen=True, kw_only=True)
class LearnedSinksConfig(Config):
    """Config of ``learned_sinks``.

    Args:
        heads: H, one sink logit each (layer geometry; 8).
        left, right: a sliding window, keys ``i - left .. i + right`` (None: unbounded on that
            side; both None, the default: full attention). gpt-oss's banded layers are
            ``left=127`` (128 keys with the query's own) under causal.
        scale: default ``1 / sqrt(D)``.
    """

    heads: int = bounded(8, ge=1)
    left: int | None = bounded(None, ge=0, none="unbounded")
    right: int | None = bounded(None, ge=0, none="unbounded")
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")


@register(
    "learned_sinks",
    config=LearnedSinksConfig,
    family="exact",
    summary="Softmax attention with a learned per-head sink logit in the denominator (gpt-oss).",
    paper="OpenAI 2025, gpt-oss-120b & gpt-oss-20b model card, https://arxiv.org/abs/2508.10925",
    capabilities=Capabilities(**CACHE_CAPS, backends=("flash-cpu", "blocked", "reference")),
    complexity=Complexity(time="O(N^2 D) (O(N w D) windowed)", memory="O(N D)", subquadratic_memory=True),
    notes=(
        "sink logits start at 0 (each row's denominator gets one extra exp(0)); learned",
        "fast path: the CPU flash kernel's output and log-sum-exp, rescaled by 1 / (1 + exp(sink - lse)); "
        "with a window the blocked backend's tile plan (CPU only); off the CPU, without a window, SDPA with "
        "the sink as one more key of zero value ([q * scale, 1] . [0, sink_h])",
        KV_DECODE + " (also with a window: the cache is not trimmed to it)",
    ),
)
class LearnedSinksAttention(KVCacheDecode, PerHead):
    """gpt-oss attention: ``sink_softmax_attention`` with the module's ``sinks (H,)``."""

    config: LearnedSinksConfig

    def __init__(self, config: LearnedSinksConfig) -> None:
        super().__init__(config)
        self.sinks = nn.Parameter(torch.zeros(config.heads))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        self._check_geometry(q, v)
        cfg = self.config
        window = dict(left=cfg.left, right=cfg.right)
        return sink_softmax_attention(
            q, k, v, self.sinks, causal=args.causal, scale=cfg.scale, key_mask=args.key_mask, **window
        )

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """The paper's form: the sink is one more logit in every row's softmax, its weight dropped."""
        self._check_geometry(q, v)
        cd, cfg, n_q, n_kv = compute_dtype(q), self.config, q.shape[2], k.shape[2]
        scores = torch.einsum("bhid,bhjd->bhij", q.to(cd), k.to(cd)) * default_scale(cfg.scale, q.shape[-1])
        i = torch.arange(n_q, device=q.device)[:, None] + (n_kv - n_q)
        j = torch.arange(n_kv, device=q.device)[None, :]
        visible = torch.ones_like(scores, dtype=torch.bool)
        visible = visible & ((j <= i) if args.causal else True)
        visible = visible & ((j >= i - cfg.left) if cfg.left is not None else True)
        visible = visible & ((j <= i + cfg.right) if cfg.right is not None else True)
        if args.key_mask is not None:
            visible = visible & args.key_mask[:, None, None, :]
        sink = self.sinks.to(cd).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat([scores.masked_fill(~visible, -math.inf), sink], dim=-1)
        weights = torch.softmax(logits, dim=-1)[..., :-1]  # the sink takes its share and gives nothing
        out = (weights @ v.to(cd)).to(q.dtype)
        return (out, weights) if return_weights else out
