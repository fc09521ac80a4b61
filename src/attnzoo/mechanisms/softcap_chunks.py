"""Gemma 2's soft-capped attention, ``softmax(cap * tanh(s / cap)) V`` with ``s = scale * Q K^T``,
in chunks of query rows with a forward and backward written by hand (``softcap`` registers it
in ``softmax_variants``, beside the dense reference it is tested against).

SDPA takes no score modifier, so the cap cannot run in the flash kernel. Per chunk of rows::

    T = tanh(s / cap),  P = softmax(cap T + mask),  O = P V
    backward:  dV += P^T dO,  dS = P (dO V^T - rowsum(dO O)) (1 - T^2),
               dQ = scale dS K,  dK += scale dS^T Q

Backward recomputes each chunk's ``T`` and ``P`` (one GEMM, ``tanh``, ``softmax``) instead of
saving them: memory stays O(N D + one chunk's scores), never N x N. The generic path it replaces
(``chunked_attention``: the reference with the cap as a ``score_mod``, each chunk checkpointed)
ran its forward twice and autograd's dozen nodes per chunk. Fwd+bwd against dense SDPA, B = 1,
H = 8, D = 64, on a 2-core Xeon (``benchmarks/ab-softcap-chunks-cpu.txt``, one process): 1K
0.31x -> 0.56x (0.32x -> 0.60x rerun), 2K 0.33x -> 0.59x (0.31x -> 0.50x), 4K 0.31x -> 0.48x;
causal 0.23x -> 0.57x, 0.25x -> 0.50x, 0.22x -> 0.44x. About 1x is out of reach this way: the
seven products per chunk (two forward, five backward, as the flash kernel's) run at the BLAS
rate and alone take ~1.3x SDPA's whole time at 2K, where the flash kernel keeps its tiles in
cache. A user's ``score_mod`` (a bias before the cap) still takes the generic path: its
derivative is not known here. No second derivative (``once_differentiable``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

#: Scores (batch x head x row x key) of one chunk: 1M float32 (4 MiB). 0.25M took 19-52% longer
#: at 1K-4K, 4M 17-72% longer at 1K-2K and the same at 4K (``benchmarks/ab-softcap-chunks-cpu.txt``).
CHUNK_SCORES = 1 << 20


def softcap_chunks(
    q: Tensor, k: Tensor, v: Tensor, cap: float, *, causal: bool, key_mask: Tensor | None, scale: float
) -> Tensor:
    """Soft-capped attention (module docstring), computed in ``q``'s dtype.

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)`` (K/V heads as
            many as query heads). cap: > 0. scale: on ``Q K^T``, before the cap.
        causal: query ``i`` sees keys ``j <= i + N_kv - N_q`` (end-aligned, as a KV cache).
        key_mask: bool ``(B, N_kv)``, True = a real key; None: all real.

    Returns:
        ``(B, H, N_q, D_v)``; a row that sees no key is 0 (and passes no gradient).
    """
    rows = max(16, CHUNK_SCORES // max(1, q.shape[0] * q.shape[1] * k.shape[2]))
    return _SoftcapChunks.apply(q, k, v, key_mask, (cap, scale, causal, rows))


def _chunks(n_q: int, n_kv: int, rows: int, causal: bool) -> list[tuple[int, int, int]]:
    """``(start, stop, end)`` per chunk of query rows: keys ``[0, end)`` are the ones it reads
    (causal: up to its last row's last visible key)."""
    offset = n_kv - n_q
    return [
        (start, min(start + rows, n_q), max(0, min(n_kv, min(start + rows, n_q) + offset)) if causal else n_kv)
        for start in range(0, n_q, rows)
    ]


def _capped_weights(
    qc: Tensor, kc: Tensor, key_mask: Tensor | None, cfg: tuple, start: int, offset: int
) -> tuple[Tensor, Tensor]:
    """One chunk's ``T = tanh(s / cap)`` and weights ``P`` (0 on rows that see no key), both
    ``(B, H, rows, end)``."""
    cap, scale, causal, _ = cfg
    t = torch.matmul(qc * (scale / cap), kc.mT).tanh_()  # the factor on the (rows, D) queries, not the scores
    capped = t * cap
    if causal:  # row r (query start + r) sees keys j <= start + r + offset
        future = torch.ones(capped.shape[-2:], dtype=torch.bool, device=capped.device).triu_(start + offset + 1)
        capped.masked_fill_(future, -math.inf)
    if key_mask is not None:
        capped.masked_fill_(~key_mask[:, None, None, : kc.shape[2]], -math.inf)
    weights = torch.softmax(capped, -1)
    if key_mask is not None or (causal and start + offset < 0):  # a row may see nothing: 0, not NaN
        weights.masked_fill_(capped.amax(-1, keepdim=True) == -math.inf, 0.0)
    return t, weights


def _flat(x: Tensor) -> Tensor:
    """``(B, H, n, e)`` -> ``(B H, n, e)``: a view (every tensor here has contiguous heads)."""
    return x.flatten(0, 1)


class _SoftcapChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, cfg: tuple) -> Tensor:  # type: ignore[override]
        n_q, n_kv, offset = q.shape[2], k.shape[2], k.shape[2] - q.shape[2]
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        for start, stop, end in _chunks(n_q, n_kv, cfg[3], cfg[2]):
            if end == 0:  # causal rows before the first key: they see nothing
                continue
            _, weights = _capped_weights(q[:, :, start:stop], k[:, :, :end], key_mask, cfg, start, offset)
            torch.matmul(weights, v[:, :, :end], out=out[:, :, start:stop])
        ctx.save_for_backward(q, k, v, out, key_mask)
        ctx.cfg = cfg
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, key_mask = ctx.saved_tensors
        cap, scale, causal, rows = cfg = ctx.cfg
        offset, grad = k.shape[2] - q.shape[2], grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad * out).sum(-1, keepdim=True)  # rowsum(dO O): the softmax's backward
        for start, stop, end in _chunks(q.shape[2], k.shape[2], rows, causal):
            if end == 0:
                continue
            qc, kc, vc, gc = q[:, :, start:stop], k[:, :, :end], v[:, :, :end], grad[:, :, start:stop]
            t, weights = _capped_weights(qc, kc, key_mask, cfg, start, offset)
            # baddbmm_: each chunk's share added inside the product, not in a pass of its own
            _flat(dv)[:, :end].baddbmm_(_flat(weights).mT, _flat(gc))
            # dS = (dO V^T - rowsum(dO O)) P (1 - T^2), with P (1 - T^2) in one pass; the scale
            # goes on the (rows, D) and (N, D) products, not on the scores
            d_scores = torch.matmul(gc, vc.mT).sub_(delta[:, :, start:stop])
            d_scores.mul_(torch.addcmul(weights, weights, t.square_(), value=-1.0))
            torch.matmul(d_scores, kc, out=dq[:, :, start:stop]).mul_(scale)
            _flat(dk)[:, :end].baddbmm_(_flat(d_scores).mT, _flat(qc), alpha=scale)
        return dq, dk, dv, None, None
