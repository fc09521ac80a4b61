"""Exact attention: ``O = softmax(s * Q K^T + mask) V`` (Vaswani et al. 2017).

The fast path hands the plain case (softmax normaliser, no ``score_mod``) to
``torch.nn.functional.scaled_dot_product_attention``, and an additive bias (ALiBi,
``score_mods.bias_mod``) to ``score_chunks.softmax_chunks`` (chunks of query rows, forward and
backward by hand; SDPA takes no bias it could use fast); everything else runs
``reference_attention``. All compute the same function, tested against each other and against
the double-loop oracle in ``tests/oracles.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.backends.reference import reference_attention, visible_pairs
from attnzoo.mechanisms._ops import compute_dtype, default_scale, dense_dropout
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted
from attnzoo.mechanisms.cache import KVCacheDecode
from attnzoo.mechanisms.score_chunks import softmax_chunks
from attnzoo.registry import Config, bounded, register
from attnzoo.score_mods import plain_bias
from attnzoo.spec import Capabilities, Complexity, ScoreMod


@dataclass(frozen=True, kw_only=True)
class SoftmaxConfig(Config):
    """Config of ``softmax``.

    Args:
        normalizer: ``"softmax"`` (default) or ``"relu"``: ReLU scores divided by their row sum
            over visible keys (rows whose ReLU scores sum to 0 give zeros).
        scale: score scale; default None means ``1 / sqrt(D)``.
    """

    normalizer: Literal["softmax", "relu"] = "softmax"
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")


@register(
    "softmax",
    config=SoftmaxConfig,
    family="exact",
    summary="Exact scaled dot-product attention (SDPA fast path; chunks for a bias; dense reference otherwise).",
    paper="Vaswani et al. 2017, Attention Is All You Need, https://arxiv.org/abs/1706.03762",
    capabilities=Capabilities(
        causal=True,
        key_mask=True,
        decode_step=True,
        cross_attention=True,
        score_mod=True,
        gqa=True,
        dropout=True,
        attn_mask=True,
        scale=True,
        backends=("sdpa", "reference"),
    ),
    complexity=Complexity(time="O(N^2 D)", memory="O(N D) SDPA, O(N D + 1M scores) bias chunks, O(N^2) reference"),
    notes=(
        "causal aligns queries to the end of the keys: query i sees keys j <= i + N_kv - N_q",
        "a query with no visible key returns zeros and passes zero gradient",
        "bf16/fp16 inputs are accumulated in float32",
        "an additive bias (score_mods.bias_mod: ALiBi) runs in chunks of query rows with a hand-written backward "
        "(no N x N tensor, no second derivative); another score_mod, or a bias that needs a gradient, the reference",
        "grouped-query K/V (H_kv dividing H) go to SDPA as they are (enable_gqa), never repeated",
        "dropout_p > 0 runs the dense path (O(N^2) memory): the mask is a seeded function of (b, h, i, j) "
        "that the reference reproduces, which SDPA's internal dropout is not",
        "decode step: a KV cache (preallocated to the final length when known, else grown by doubling; "
        "grouped K/V kept at H_kv heads), the new rows attended over it: O(t) per token",
    ),
)
class SoftmaxAttention(KVCacheDecode, Attention):
    """Exact attention. The plain case runs SDPA; ``normalizer="relu"`` or a ``score_mod``
    runs the dense reference. ``uses_fast_path(...)`` says which one a call takes."""

    config: SoftmaxConfig

    def uses_fast_path(self, *, score_mod: ScoreMod | None = None, dropout: bool = False) -> bool:
        return self.config.normalizer == "softmax" and score_mod is None and not dropout

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        if not self.uses_fast_path(score_mod=args.score_mod, dropout=args.dropout is not None):
            k, v = self._kv_heads(q, k, v, native=False)  # the dense reference and the chunks take H K/V heads
            chunked = self._bias_chunks(q, k, v, args)
            return chunked if chunked is not None else self._reference(q, k, v, args, return_weights=False)
        if args.attn_mask is not None:
            return sdpa_with_attn_mask(q, k, v, args, scale=self.config.scale)
        return sdpa_attention(q, k, v, causal=args.causal, key_mask=args.key_mask, scale=self.config.scale)

    def _bias_chunks(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor | None:
        """``softmax_chunks`` for a ``score_mod`` that adds a bias needing no gradient (ALiBi), with
        the softmax normaliser and no dropout or ``attn_mask``; None where the call needs the
        reference (ALiBi at 2K ran 14x slower than SDPA on the reference, whose scores are N x N)."""
        bias = plain_bias(args.score_mod, q.device)
        plain = self.config.normalizer == "softmax" and args.dropout is None and args.attn_mask is None
        if bias is None or not plain:
            return None
        dtype, scale = compute_dtype(q), default_scale(self.config.scale, q.shape[-1])
        qc, kc, vc = (x.to(dtype) for x in (q, k, v))
        out = softmax_chunks(qc, kc, vc, scale=scale, causal=args.causal, key_mask=args.key_mask, bias=bias)
        return out.to(q.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        options = {"causal": args.causal, "key_mask": args.key_mask, "score_mod": args.score_mod}
        options |= {"scale": self.config.scale, "normalizer": self.config.normalizer}
        if args.attn_mask is not None:
            options |= attn_mask_mods(args.attn_mask, args.score_mod)
        if args.dropout is None:
            return reference_attention(q, k, v, return_weights=return_weights, **options)
        # Dropout on the probabilities (Vaswani et al. 2017, 5.4): the seeded mask, rescaled.
        weights = reference_attention(q, k, v, return_weights=True, **options)[1]
        weights = dense_dropout(weights, args.dropout.seed, args.dropout.p)
        out = weights.to(v.dtype) @ v
        return (out, weights) if return_weights else out


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None, scale: float | None
) -> Tensor:
    """Exact softmax attention through ``F.scaled_dot_product_attention``.

    SDPA's own ``is_causal`` aligns queries to the start of the keys; attnzoo aligns them to
    the end, so for ``N_q != N_kv`` (and whenever padding is combined with causal) the mask is
    passed explicitly. A row with no visible key comes back as zeros (checked by tests).
    """
    n_q, n_kv = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]  # grouped K/V heads: SDPA indexes them, nothing is repeated
    if key_mask is None and (not causal or n_q == n_kv):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    mask = visible_pairs(
        q.shape[0],
        q.shape[1],
        n_q,
        n_kv,
        causal=causal,
        key_mask=key_mask,
        mask_mod=None,
        device=q.device,
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def attn_mask_mods(attn_mask: Tensor, score_mod: ScoreMod | None) -> dict[str, object]:
    """A general ``attn_mask`` as the reference's ``mask_mod`` (which pairs are visible: True,
    or a finite bias) and, for an additive mask, a ``score_mod`` adding its finite values to the
    scores (after ``score_mod``'s own bias, if any)."""

    def at(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        b = b if attn_mask.shape[0] > 1 else torch.zeros_like(b)
        h = h if attn_mask.shape[1] > 1 else torch.zeros_like(h)
        return attn_mask[b, h, q_idx, kv_idx]

    if attn_mask.dtype == torch.bool:
        return {"mask_mod": at}

    def bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        score = score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)
        added = at(b, h, q_idx, kv_idx).to(score.dtype)
        return score + torch.where(torch.isfinite(added), added, 0.0)

    return {"mask_mod": lambda b, h, i, j: at(b, h, i, j) > -math.inf, "score_mod": bias}


def sdpa_with_attn_mask(q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, *, scale: float | None) -> Tensor:
    """SDPA with a general ``attn_mask`` combined with ``causal`` and ``key_mask`` (one bool or
    additive mask); a row that sees nothing gets zeros, not SDPA's NaN."""
    b, h, n_q, n_kv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    visible = visible_pairs(b, h, n_q, n_kv, causal=args.causal, key_mask=args.key_mask, mask_mod=None, device=q.device)
    mask = args.attn_mask
    if mask.dtype == torch.bool:
        mask = mask if visible is None else mask & visible
        seen = mask.any(-1, keepdim=True)
    else:
        mask = mask.to(q.dtype)
        mask = mask if visible is None else mask.masked_fill(~visible, -math.inf)
        seen = (mask > -math.inf).any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != h)
    return torch.where(seen, out, 0.0)
