"""The functions of the ``recurrent`` family (``decay.py`` re-exports them): the fast paths
``retention``, ``ssd`` and ``gla`` of issue 19's interface, each chunkwise-parallel (quadratic
inside a chunk, states carried across chunks) and returning the output and the final state; the
token-by-token recurrences ``naive_*`` as the papers write them; and ``decay_weights``, the dense
parallel form the mechanisms' references use. Scalar decays (RetNet, Mamba-2 SSD) run on the kernel family's
chunkwise core (``kernel._causal_sums``); per-channel decays (GLA, Yang et al. 2023,
https://arxiv.org/abs/2312.06635) need more than it has: ``gla_chunks`` below.

GLA's recurrence ``S_t = diag(alpha_t) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` unrolls to
``o_i = sum_{j <= i} sum_d q_id k_jd exp(c_id - c_jd) v_j`` with ``c`` the cumulative log
decays. Factoring ``exp(c_i - c_j) = exp(c_i) / exp(c_j)`` would divide by a product that
underflows after a few hundred strong decays, so no exponent here is ever positive:

* across chunks of ``L`` positions, states are carried: a query sees the state at its chunk's
  start through ``exp(c_i - c_start) <= 1``; a key reaches its chunk's end through
  ``exp(c_end - c_j) <= 1``;
* inside a chunk, the pairs ``j <= i`` are split in halves recursively (the secondary chunks of
  the GLA paper, taken all the way down): in each block of ``2h`` positions the queries of the
  upper half see the keys of the lower half through the block's middle ``r``,
  ``exp(c_i - c_j) = exp(c_i - c_r) exp(c_r - c_j)``, both factors <= 1, an ``(h, h)`` matmul;
  the pairs ``i = j`` have decay 1. ``log2(L)`` levels cover every pair once: ``log2(L)``
  scaled copies of q and k, the chunk's ``(L, L)`` weights, one matmul with v, and never an
  ``(L, L, D)`` tensor.

Cumulative log decays are summed in float64 (only their differences are cast back before
``exp``): in float32, ``c_i - c_j`` of two sums near -1000 keeps only about 1e-4 of its value,
which strong decays followed by weak ones turn into 1e-4 relative errors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.mechanisms._ops import dense_gradient, gated_scan
from attnzoo.mechanisms.kernel import _causal_sums

#: Inside a chunk, blocks of up to this many positions are multiplied out elementwise.
SMALL_BLOCK = 8


def retention(
    q: Tensor, k: Tensor, v: Tensor, log_gamma: Tensor, *, initial_state: Tensor | None = None, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """Retention without the group norm: ``S_t = gamma_h S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``.

    Args:
        q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)``: as given (no scaling here).
        log_gamma: ``(H,)``, < 0. initial_state: ``(B, H, D, Dv)`` replacing ``S_0 = 0``.
        chunk: positions per chunk of the chunkwise form (64).

    Returns:
        ``(o (B, H, N, Dv), S_N (B, H, D, Dv))``. ``ssd`` with the same decay at every token.
    """
    _check_decay("log_gamma", log_gamma, (q.shape[1],))
    return ssd(q, k, v, log_gamma[:, None].expand(q.shape[:3]), initial_state=initial_state, chunk=chunk)


def ssd(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor, *, initial_state: Tensor | None = None, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """Mamba-2 SSD in attention form: ``S_t = a_t S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``.

    Args:
        q (C), k (B) ``(B, H, N, D)``, v (dt x) ``(B, H, N, Dv)``; log_a ``(B, H, N)``, <= 0
            (``dt_t A_h`` in Mamba-2); initial_state, chunk: as ``retention``.

    Returns:
        ``(o, S_N)``. The chunkwise core is the kernel family's (``kernel._causal_sums``): inside a
        chunk ``(q_i . k_j) exp(c_i - c_j)``, across chunks the states, decays as differences of
        cumulative log decays only (nothing overflows).
    """
    _check_decay("log_a", log_a, q.shape[:3])
    s0 = _initial(k, v, initial_state)
    if q.shape[2] == 1 and s0 is not None:
        return _one_token(q, k, v, log_a[..., None], s0)
    out, state = _causal_sums(q, k, v, log_a, s0, chunk)
    return dense_gradient(out), state


def gla(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, *, initial_state: Tensor | None = None, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """GLA: ``S_t = diag(alpha_t) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``, per key channel.

    Args:
        q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)``; log_alpha ``(B, H, N, D)``, <= 0;
        initial_state as ``retention``; chunk: a power of two (64).

    Returns:
        ``(o, S_N)`` through ``gla_chunks`` (secondary chunks by halves: no
        exponent > 0, no division by a cumulative product).
    """
    _check_decay("log_alpha", log_alpha, k.shape)
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"gla: chunk must be a power of two, got {chunk}")
    s0 = _initial(k, v, initial_state)
    if q.shape[2] == 1 and s0 is not None:
        return _one_token(q, k, v, log_alpha, s0)
    out, state = gla_chunks(q, k, v, log_alpha, s0, chunk)
    return dense_gradient(out), state


def _check_decay(name: str, log_decay: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(log_decay.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(log_decay.shape)}")


def _initial(k: Tensor, v: Tensor, state: Tensor | None) -> Tensor | None:
    want = (*k.shape[:2], k.shape[3], v.shape[3])
    if state is not None and tuple(state.shape) != want:
        raise ValueError(f"initial_state must have shape (B, H, D, Dv) = {want}, got {tuple(state.shape)}")
    return state


def _one_token(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, s0: Tensor) -> tuple[Tensor, Tensor]:
    """A decode step (N = 1) on a carried state, without the chunk layout: ``log_decay``
    ``(B, H, 1, D | 1)`` decays the state's key channels."""
    s1 = log_decay.exp().transpose(-1, -2) * s0 + k.transpose(-1, -2) @ v
    return q @ s1, s1


def _recurrence(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, s0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The papers' recurrent form, one token at a time: ``S_t = exp(log_decay_t) S_{t-1} +
    k_t^T v_t`` (``log_decay (B, H, N, D | 1)`` per key channel), ``o_t = q_t S_t``."""
    s = k.new_zeros(*k.shape[:2], k.shape[3], v.shape[3]) if s0 is None else s0
    outs = []
    for t in range(q.shape[2]):
        s = log_decay[:, :, t, :, None].exp() * s + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(q[:, :, t, None, :] @ s)
    return torch.cat(outs, dim=2), s


def naive_retention(
    q: Tensor, k: Tensor, v: Tensor, log_gamma: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``retention`` token by token (RetNet's recurrent representation, eq. 6)."""
    return _recurrence(q, k, v, log_gamma[:, None, None].expand(*q.shape[:3], 1), initial_state)


def naive_gla(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``gla`` token by token (GLA's recurrent form, Sec. 4.1)."""
    return _recurrence(q, k, v, log_alpha, initial_state)


def naive_ssd(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``ssd`` token by token (Mamba-2's linear/recurrent mode with ``A_t = a_t I``)."""
    return _recurrence(q, k, v, log_a[..., None], initial_state)


def decay_weights(q: Tensor, k: Tensor, log_decay: Tensor) -> Tensor:
    """The dense parallel form's weights ``(B, H, N, N)``: ``W_ij = sum_d q_id k_jd
    exp(c_id - c_jd)`` for ``j <= i`` (0 above), ``c`` the cumulative log decays
    ``(B, H, N)`` (scalar: ``(Q K^T) * D`` with RetNet's / Mamba-2's decay matrix ``D``) or
    ``(B, H, N, D)`` (per channel: GLA). ``O = W V``. O(N^2 D) memory for GLA: small N only."""
    n = q.shape[2]
    below = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    cum = log_decay.cumsum(2)
    if log_decay.dim() == 3:
        gap = cum[..., :, None] - cum[..., None, :]  # sum of the decays of j < t <= i
        return (q @ k.transpose(-1, -2)) * gap.masked_fill(~below, -math.inf).exp()
    gap = (cum[:, :, :, None] - cum[:, :, None]).masked_fill(~below[..., None], -math.inf)  # [B, H, N, N, D]
    return (q[:, :, :, None] * k[:, :, None] * gap.exp()).sum(-1)


def gla_chunks(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, s0: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor]:
    """Chunkwise GLA: ``(o (B, H, N, Dv), state after the last token (B, H, D, Dv))``.

    Args:
        q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)``; log_alpha ``(B, H, N, D)``, <= 0.
        s0: the state before the first token ``(B, H, D, Dv)``, or None for zeros.
        chunk: L, a power of two (cut to the next power of two >= N on short inputs).

    Notes:
        O(N (L D + D Dv) + N D log L) time, O(N (L + D log L) + (N / L) D Dv) memory. The
        positions padded up to a whole chunk have zero k, v and log decay: they change nothing.
    """
    n = k.shape[2]
    size = min(chunk, 1 << (n - 1).bit_length())
    pad = -n % size
    q, k, v, log_alpha = (
        rearrange(F.pad(x, (0, 0, 0, pad)) if pad else x, "b h (c l) e -> b h c l e", l=size)
        for x in (q, k, v, log_alpha)
    )
    # float64 sums (see the module docstring): differences of sums near -1000 keep their digits
    cum = log_alpha.double().cumsum(3)  # [B, H, C, L, D]: non-increasing along L
    last = cum[:, :, :, -1]  # [B, H, C, D]: a chunk's whole decay
    chunk_sums = (k * _exp(last[:, :, :, None] - cum, k)).transpose(-1, -2) @ v  # [B, H, C, D, Dv]
    starts, final = gated_scan(chunk_sums, _exp(last, k)[..., None], s0)  # a gate per state row
    out = _within_chunks(q, k, v, cum) + (q * _exp(cum, q)) @ starts
    return rearrange(out, "b h c l e -> b h (c l) e")[:, :, :n], final


def _within_chunks(q: Tensor, k: Tensor, v: Tensor, cum: Tensor) -> Tensor:
    """``sum_{j <= i in i's chunk} sum_d q_id k_jd exp(c_id - c_jd) v_j`` for ``(B, H, C, L, .)``
    inputs: the chunk's ``(L, L)`` weights built by halves (see the module docstring), then one
    matmul with v. Level ``h`` joins pairs of ``(h, h)`` diagonal blocks into a ``(2h, 2h)``
    one, the upper half's queries against the lower half's keys filling its lower-left quarter."""
    size = q.shape[3]
    blocks = (q * k).sum(-1)[..., None, None]  # [B, H, C, L, 1, 1]: i = j, decay 1
    h = 1
    while h < size:
        pairs = size // (2 * h)
        cb = cum.unflatten(3, (pairs, 2 * h))  # [B, H, C, pairs, 2h, D]
        # exp(c_i - c_mid) for the upper half, exp(c_mid - c_j) for the lower: both <= 1
        side = torch.cat([cum.new_full((h, 1), -1.0), cum.new_ones(h, 1)])
        w = _exp(((cb - cb[:, :, :, :, h - 1 : h]) * side).flatten(3, 4), q)
        q_up = (q * w).unflatten(3, (pairs, 2, h))[:, :, :, :, 1]  # [B, H, C, pairs, h, D]
        k_low = (k * w).unflatten(3, (pairs, 2, h))[:, :, :, :, 0]
        if h < SMALL_BLOCK:  # many tiny matmuls are slower than the products written out
            corner = (q_up[..., :, None, :] * k_low[..., None, :, :]).sum(-1)
        else:
            corner = q_up @ k_low.transpose(-1, -2)  # [B, H, C, pairs, h, h]
        low, high = blocks[:, :, :, 0::2], blocks[:, :, :, 1::2]
        top = torch.cat([low, torch.zeros_like(low)], dim=-1)
        blocks = torch.cat([top, torch.cat([corner, high], dim=-1)], dim=-2)  # [B, H, C, pairs, 2h, 2h]
        h *= 2
    return blocks[:, :, :, 0] @ v


def _exp(log: Tensor, like: Tensor) -> Tensor:
    """``exp(log)`` in ``like``'s dtype (the differences are taken in float64, the rest is not)."""
    return log.to(like.dtype).exp()
