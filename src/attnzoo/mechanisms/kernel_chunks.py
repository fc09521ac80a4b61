"""The causal chunkwise core with a per-position decay, forward and backward written by hand:
``kernel._causal_sums`` runs RFA's gates, Performer's causal stabiliser and the scalar decays of
RetNet and Mamba-2's SSD (``decay_functions``) on it.

Per chunk of ``L`` positions, with ``cum`` the in-chunk cumulative sum of the log decays ``a``::

    W = (Q K^T) * D,            D_ij = exp(cum_i - cum_j) for j <= i, else 0
    U = K^T (V * e),            e_j = exp(cum_L - cum_j)      (decay from key j to the chunk's end)
    S_{c+1} = g_c S_c + U_c,    g_c = exp(cum_L)              (``_ops.scan_states``)
    O = W V + r * (Q S_c),      r_i = exp(cum_i)

Autograd ran this as a dozen nodes: each of ``dQ`` and ``dK`` came as two products added in a
separate pass over ``(N, m)`` (``m`` = 256 features for RFA), ``dK`` through a transposed copy,
and the decay factors through float64 ``(L, L)`` backward passes. Here each gradient is one
buffer that the second product accumulates into (``baddbmm_``), and the log decays' gradient is
written out (``_log_decay_grad``). In one process (``benchmarks/ab-decayed-chunks-cpu.txt``,
causal fwd+bwd at N = 4096): ``rfa`` 324 -> 279 ms, ``performer`` 153 -> 147, ``ssd`` 74 -> 67,
``retnet`` 57 -> 56 (at 2K: 162 -> 159, 91 -> 88, 43 -> 39, 35 -> 38: within this machine's noise).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnzoo.mechanisms._ops import (
    decay_floor,
    flush_tiny_,
    flushed_exp_,
    lower_decay_exp_,
    scan_grads,
    scan_states,
)


def decayed_chunks(
    q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, s0: Tensor, *, flush: bool = False
) -> tuple[Tensor, Tensor]:
    """The decayed chunkwise sums (module docstring) and the state after the last chunk. ``flush``:
    the states' entries below ``tiny / eps^3`` are 0 (``_ops.flush_tiny_``), for features that
    can be exactly 0 (Performer's large inputs), where an entry no chunk adds to decays through
    the denormal range.

    Shapes:
        q ``(B, H, C, G L, m)`` (the ``G`` query heads of a K/V head as rows of its chunks),
        k ``(B, H, C, L, m)``, v ``(B, H, C, L, E)``, log_decay ``(B, H, C, L)`` (each <= 0),
        s0 ``(B, H, m, E)`` -> out ``(B, H, C, G L, E)``, final ``(B, H, m, E)``.
    """
    return _DecayedChunks.apply(q, k, v, log_decay, s0, flush)


def _factors(log_decay: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``D (B, H, C, L, L)``, ``e``, ``r (B, H, C, L)`` and ``g (B, H, C, 1, 1)`` of the module
    docstring. The cumulative sums are float64: a difference of two sums near -1000 keeps its
    digits (float32 loses 1e-4); every exponent is <= 0, and a factor below ``decay_floor`` is 0
    (``exp``'s slow path, denormal products): staged, these factors took 6.7 ms of causal ``rfa``'s
    ~145 at 4K with ``masked_fill(-inf)`` before ``exp``, 3.0 now (end to end within this
    machine's noise: ``benchmarks/ab-exp-floor-cpu.txt``)."""
    cum = log_decay.double().cumsum(-1)
    pair = lower_decay_exp_((cum[..., :, None] - cum[..., None, :]).to(dtype))
    floor = decay_floor(dtype)
    to_end = flushed_exp_((cum[..., -1:] - cum).to(dtype), floor)
    # In float64 (``cum`` itself, not a difference, carries the digits), floored for the dtype
    # it is cast to; on copies: ``cum`` is still read.
    rise, gates = (flushed_exp_(x.clone(), floor).to(dtype) for x in (cum, cum[..., -1, None, None]))
    return pair, to_end, rise, gates


def _flat(x: Tensor) -> Tensor:
    """The leading dimensions as one batch dimension, for ``baddbmm_``'s operands (a view
    where the layout allows, transposed last dimensions included)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _into(x: Tensor) -> Tensor:
    """``_flat`` of a ``baddbmm_`` target: a view or an error, never a copy that the product
    would land in instead of ``x``."""
    return x.view(-1, x.shape[-2], x.shape[-1])


def _by_group(x: Tensor, size: int) -> Tensor:
    """``(..., G L, e) -> (..., G, L, e)``: a chunk's rows as its query heads' rows."""
    return x.unflatten(-2, (x.shape[-2] // size, size))


class _DecayedChunks(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, s0: Tensor, flush: bool
    ) -> tuple[Tensor, Tensor]:
        size = k.shape[-2]
        pair, to_end, rise, gates = _factors(log_decay, q.dtype)
        weights = (_by_group(q @ k.mT, size) * pair[:, :, :, None]).flatten(-3, -2)  # [B, H, C, G L, L]
        v_end = v * to_end[..., None]
        states, final = scan_states(k.mT @ v_end, gates, s0)  # [B, H, C, m, E]
        if flush:
            flush_tiny_(states)
        across = q @ states  # [B, H, C, G L, E]
        out = (_by_group(across, size) * rise[:, :, :, None, :, None]).flatten(-3, -2)
        _into(out).baddbmm_(_flat(weights), _flat(v))
        ctx.save_for_backward(q, k, v, v_end, pair, to_end, rise, gates, weights, states, across)
        return out, final

    @staticmethod
    def backward(ctx: Any, grad: Tensor, grad_final: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        q, k, v, v_end, pair, to_end, rise, gates, weights, states, across = ctx.saved_tensors
        size, grad = k.shape[-2], grad.contiguous()
        d_weights = _by_group(grad @ v.mT, size)  # [B, H, C, G, L, L]
        d_pair = (d_weights * _by_group(weights, size)).sum(3)  # dD_ij D_ij = dW_ij A_ij D_ij
        d_scores = (d_weights * pair[:, :, :, None]).flatten(-3, -2)
        d_rise = (_by_group(grad, size) * _by_group(across, size)).sum((-1, 3))
        d_across = (_by_group(grad, size) * rise[:, :, :, None, :, None]).flatten(-3, -2)
        dq = d_across @ states.mT
        _into(dq).baddbmm_(_flat(d_scores), _flat(k))
        d_sums, d_gates, d_s0 = scan_grads(q.mT @ d_across, grad_final, gates, states)
        dk = v_end @ d_sums.mT
        _into(dk).baddbmm_(_flat(d_scores.mT), _flat(q))
        d_v_end = k @ d_sums  # [B, H, C, L, E]
        dv = d_v_end * to_end[..., None]
        _into(dv).baddbmm_(_flat(weights.mT), _flat(grad))
        d_log = _log_decay_grad(d_pair, (d_v_end * v_end).sum(-1), d_rise * rise, d_gates * gates)
        return dq, dk, dv, d_log, d_s0, None


def _log_decay_grad(d_pair: Tensor, d_end: Tensor, d_rise: Tensor, d_gate: Tensor) -> Tensor:
    """The log decays' gradient from those of ``D``, ``e``, ``r`` and ``g``, each already times
    its factor (``d exp(x) = exp(x) dx``): ``D_ij`` moves with ``cum_i - cum_j``, ``e_j`` with
    ``cum_L - cum_j``, ``r_i`` with ``cum_i`` and ``g`` with ``cum_L``; then ``a_t`` enters every
    ``cum_i`` with ``i >= t`` (a reversed cumulative sum)."""
    d_cum = d_pair.sum(-1) - d_pair.sum(-2) - d_end + d_rise
    d_cum[..., -1] += d_end.sum(-1) + d_gate[..., 0, 0]
    return d_cum.sum(-1, keepdim=True) - d_cum.cumsum(-1) + d_cum
