"""Performer: FAVOR+ positive orthogonal random features (Choromanski et al. 2020,
https://arxiv.org/abs/2009.14794), an unbiased estimate of ``exp(q . k / sqrt(D))``.

A ``RandomFeatureAttention`` (``kernel_features.py``: the seeded projection, redraws) whose
feature maps are ``favor_query`` and ``favor_keys``: ``exp(w^T x - |x|^2 / 2) / sqrt(m)`` with
per-row stabilisers that keep the estimate finite in float32 and causal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnzoo.mechanisms._ops import feature_floor, floored_exp_
from attnzoo.mechanisms.kernel import KeyFeatures
from attnzoo.mechanisms.kernel_features import (
    DRAWS_NOTE,
    FEATURES_NOTE,
    RANDOM_FEATURES_COST,
    RandomFeatureAttention,
    RandomFeatureConfig,
)
from attnzoo.mechanisms.kernel_linear import register_kernel


def favor_exponent(x: Tensor, w: Tensor) -> Tensor:
    """``w^T x - |x|^2 / 2``, the log of the unstabilised FAVOR+ feature ``sqrt(m) phi(x)``:
    ``(B, H, N, D), (m, D) -> (B, H, N, m)``. (The fast path computes it shifted, in place.)"""
    return x @ w.T - x.pow(2).sum(-1, keepdim=True) / 2


class _MaxExponent(torch.autograd.Function):
    """``max_j x . w_j`` over the m features, ``(B, H, N)``, with its gradient ``w_{j*}`` (the
    max is piecewise linear in ``x``). The value is read from ``xw`` in one pass; nothing of
    ``xw`` is saved (the callers exponentiate it in place).

    ``lazy=False`` (queries: every row's maximum gets a gradient) takes the arg-max in forward.
    ``lazy=True`` (keys: only the rows that set a block's or a running maximum get one) takes a
    plain ``amax`` in forward, about 6x cheaper on CPU than max with indices, and finds the
    arg-max in backward for the rows with a nonzero gradient only, from ``x`` (saved by the
    caller's matmul anyway)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, xw: Tensor, w: Tensor, lazy: bool) -> Tensor:  # type: ignore[override]
        ctx.lazy = lazy
        if not ctx.needs_input_grad[0] or lazy:
            if ctx.needs_input_grad[0]:
                ctx.save_for_backward(x, w)
            return xw.detach().amax(-1)
        values, index = xw.detach().max(-1)
        ctx.save_for_backward(index, w)
        return values

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if not ctx.lazy:
            index, w = ctx.saved_tensors
            return grad[..., None] * w.to(grad.dtype)[index], None, None, None
        x, w = ctx.saved_tensors
        w = w.to(x.dtype)
        if torch.compiler.is_compiling():
            # No data-dependent row count in a graph: the arg-max of every row (dense, exact).
            return grad[..., None].to(x.dtype) * w[(x @ w.T).argmax(-1)], None, None, None
        rows = grad.nonzero(as_tuple=True)  # few: the rows that won a maximum
        winners = w[(x[rows] @ w.T).argmax(-1)]  # [rows, D]
        grad_x = torch.zeros_like(x)
        grad_x[rows] = grad[rows][:, None].to(x.dtype) * winners
        return grad_x, None, None, None


def _max_exponent(x: Tensor, xw: Tensor, w: Tensor, *, lazy: bool = False) -> Tensor:
    """``max_j x . w_j`` on the autograd graph of ``x`` (see ``_MaxExponent``)."""
    return _MaxExponent.apply(x, xw, w, lazy)


def favor_query(q: Tensor, w: Tensor) -> Tensor:
    """FAVOR+ features of (already ``D^-1/4``-scaled) queries, ``(B, H, N, D) -> (B, H, N, m)``.

    Notes:
        Stabiliser: each query row subtracts its own maximum exponent over the m features (its
        largest feature is ``1/sqrt(m)``). A per-row constant cancels in the row's ratio
        ``phi(q)^T S / (phi(q)^T z + eps)`` only up to ``eps``, so the stabiliser stays on the
        autograd graph (not detached): the gradient is exact for the function computed, also
        where ``eps`` is not negligible against the denominator. It takes the place of the row's
        ``|q|^2 / 2``, which is never computed.
    """
    qw = q @ w.T  # [B, H, N, m]
    shift = _max_exponent(q, qw, w)[..., None] + math.log(w.shape[0]) / 2
    # In place: matmul does not save its output for backward. add_ of a negated shift, not
    # sub_: sub_'s backward negates the whole (B, H, N, m) gradient to reduce it to the shift's.
    # A feature below eps^2 of the row's largest is 0 (``_ops.feature_floor``): large queries
    # spread their exponents far below it, where exp and the products after it slow down.
    return floored_exp_(qw.add_(-shift), feature_floor(qw.dtype))


def favor_keys(k: Tensor, w: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None) -> KeyFeatures:
    """FAVOR+ features of (``D^-1/4``-scaled) keys with a stabiliser that keeps causality.

    Args:
        k: ``(B, H, N, D)``; w: ``(m, D)``; real: bool ``(B, 1, N)`` (True = a real key) or None.
        causal: False: one offset per (batch, head), the maximum exponent over the real keys
            given (returned as ``c (B, H, 1)``, -inf if there are none). True: a running
            maximum ``c_t`` over the real keys ``<= t``.
        c0: ``(B, H)`` running maximum of earlier keys (decoding); None or -inf for none.

    Returns:
        ``KeyFeatures``: ``phi (B, H, N, m)``; causal: ``log_decay`` ``a_t = c_{t-1} - c_t <= 0``
        and the last ``c (B, H)``.

    Notes:
        Causal key ``t`` is stored as ``exp(raw_t - c_t) / sqrt(m)`` and the running sums are
        rescaled by ``exp(a_t)``, so every key in row ``i``'s sums carries the same factor
        ``exp(-c_i)``, which cancels exactly; ``c_t`` depends on keys ``<= t`` only, so a future
        key can neither change nor underflow a past output. It cancels only up to the ``eps`` of
        the denominator, so like the query's it stays on the autograd graph (see
        ``favor_query``). Padded keys are zeroed before the projection, left out of the maxima,
        and shifted by +inf: their features are exactly 0 and they get no gradient, however
        large they were.
    """
    if real is not None:
        k = torch.where(real[..., None], k, 0.0)
    kw = k @ w.T  # [B, H, N, m]
    half_norm = k.pow(2).sum(-1) / 2  # [B, H, N]: per key, so it does not cancel (keeps its gradient)
    row_max = _max_exponent(k, kw, w, lazy=True) - half_norm
    if real is not None:
        row_max = row_max.masked_fill(~real, -math.inf)
    if causal:
        prev0 = row_max.new_full(row_max.shape[:2], -math.inf) if c0 is None else c0.to(row_max.dtype)
        c = torch.maximum(torch.cummax(row_max, dim=-1).values, prev0[..., None])
        prev = torch.cat([prev0[..., None], c[..., :-1]], dim=-1)
        # Before the first real key the sums are empty, so any decay will do; 0 avoids -inf - -inf.
        log_decay, out_c = torch.where(torch.isfinite(prev), prev - c, 0.0), c[..., -1]
    else:
        c = row_max.amax(-1, keepdim=True)
        log_decay, out_c = None, c
    shift = half_norm + torch.where(torch.isfinite(c), c, 0.0) + math.log(w.shape[0]) / 2
    if real is not None:
        shift = torch.where(real, shift, math.inf)
    exponents, floor = kw.add_(-shift[..., None]), feature_floor(kw.dtype)
    sparse = causal and _states_may_vanish(exponents, log_decay, floor)
    return KeyFeatures(floored_exp_(exponents, floor), log_decay, out_c, sparse=sparse)  # see favor_query


def _states_may_vanish(exponents: Tensor, log_decay: Tensor, floor: float) -> bool:
    """``KeyFeatures.sparse`` for causal FAVOR+ keys on the CPU: the running maximum rose by more
    than ``-floor`` over the call (the states' decays multiply to below ``eps^2``) and some
    feature is flushed to 0 (an exponent below ``floor``). Only then can a state's entry that
    no key adds to decay through the denormal range; unit-variance inputs at 4K rarely pass the
    first test, and there the flush would cost ~5% of the step for nothing."""
    if exponents.device.type != "cpu" or torch.compiler.is_compiling() or not exponents.numel():
        return False
    rise = log_decay.detach().sum(-1).amin()  # the most negative total log decay of a (batch, head)
    return bool(rise < floor) and bool(exponents.detach().amin() < floor)


@dataclass(frozen=True, kw_only=True)
class PerformerConfig(RandomFeatureConfig):
    """Config of ``performer``.

    Args:
        features: m, the number of random features; default None for m = 2 D (128 at D = 64),
            fixed when D is known (see ``RandomFeatureConfig`` for why).
        head_dim: D to draw the projection for at construction (a layer's ``attnzoo.Shape``
            sets it); default None draws it on the first forward (see ``RandomFeatureAttention``).
        seed: seed of the projection; None (default) draws one per module from torch's global
            RNG at construction, so every layer differs (kept in the state dict as the buffer
            ``projection_seed``). An int gives every module built with it the same projection.
        redraw_every: in training mode, redraw the projection after this many training forward
            passes (Performer's periodic redrawing); None (default) never redraws by itself.
        chunk: causal chunk length; None (default): ``kernel.causal_chunk``.
        eps: added to the denominator ``phi(q)^T z``. Default 1e-6.
    """


@register_kernel(
    "performer",
    PerformerConfig,
    "Performer (FAVOR+): positive orthogonal random features estimating softmax attention.",
    "Choromanski et al. 2020, Rethinking Attention with Performers, https://arxiv.org/abs/2009.14794",
    RANDOM_FEATURES_COST,
    (
        "swapped in untrained: random features (seed 0): an unbiased estimate of softmax attention",
        DRAWS_NOTE,
        FEATURES_NOTE,
        "q and k are scaled by D^-1/4, so phi(q).phi(k) estimates exp(q.k / sqrt(D))",
        "stabilisers: per query row max; keys: max over real keys (causal: running max, carried in the state)",
        "a feature below eps^2 of its stabiliser's maximum (exponent < -31.8 in float32) is 0 on the CPU: "
        "it moves a row's denominator by less than 2 N eps^2, below the eps it adds; exp and the products after it "
        "stay fast (no denormals) for large q, k",
    ),
    causal=True,
)
class PerformerAttention(RandomFeatureAttention):
    """FAVOR+: ``phi(x) = exp(w^T x - |x|^2/2 - stabiliser) / sqrt(m)`` on ``x = D^-1/4 q``
    (resp. k), ``w`` orthogonal random features; stabilisers in ``favor_query`` / ``favor_keys``.

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``.
    """

    config: PerformerConfig

    def query_features(self, q: Tensor) -> Tensor:
        # w D^-1/4 applies the D^-1/4 scaling of q (favor_query never needs |q|^2)
        return favor_query(q, self.projection_for(q) * q.shape[-1] ** -0.25)

    def key_features(
        self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None, heads: slice | None = None
    ) -> KeyFeatures:
        return favor_keys(k * k.shape[-1] ** -0.25, self.projection_for(k), real, causal=causal, c0=c0)

    def num_features(self, head_dim: int) -> int:
        return self.config.features_for(head_dim)
