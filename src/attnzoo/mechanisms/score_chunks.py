"""Exact softmax attention with a change to the scores the flash kernel cannot take: an additive
bias (ALiBi, ``score_mods.bias_mod``) and Gemma 2's soft cap, ``cap * tanh(x / cap)``, in chunks
of query rows with a forward and backward written by hand. The ``softmax`` mechanism runs it for
a bias, ``softcap`` (``softmax_variants``) for its cap with or without one; both beside the dense
reference they are tested against.

Per chunk of rows, with ``x = scale Q K^T + bias``::

    T = tanh(x / cap),  P = softmax(cap T + mask),  O = P V      (no cap: P = softmax(x + mask))
    backward:  dV += P^T dO,  dX = P (dO V^T - rowsum(dO O)) (1 - T^2  with a cap),
               dQ = scale dX K,  dK += scale dX^T Q

Backward recomputes each chunk's scores (one GEMM, the bias, ``tanh``, ``softmax``) instead of
saving them: memory stays O(N D + one chunk's scores), never N x N. The bias gets no gradient
(``bias_mod``: a learned one takes the general path). Before, ``softcap`` ran the reference per
chunk, checkpointed, and ``softmax`` with ALiBi the dense reference. Fwd+bwd against dense SDPA,
B = 1, H = 8, D = 64, on a 2-core Xeon (``benchmarks/ab-softcap-chunks-cpu.txt``, one process):
``softcap`` 1K 0.31x -> 0.56x (0.32x -> 0.60x rerun), 2K 0.33x -> 0.59x (0.31x -> 0.50x), 4K
0.31x -> 0.48x; causal 0.23x -> 0.57x, 0.25x -> 0.50x, 0.22x -> 0.44x. ``softmax`` with ALiBi
(``benchmarks/ab-bias-chunks-cpu.txt``): 1K 0.13x -> 0.50x, 2K 0.11x -> 0.45x, 4K 0.08x -> 0.38x;
causal 0.09x -> 0.55x, 0.07x -> 0.47x, 0.04x -> 0.35x. About 1x is out of reach
this way: the seven products per chunk (two forward, five backward, as the flash kernel's) run
at the BLAS rate and alone take ~1.3x SDPA's whole time at 2K, where the flash kernel keeps its
tiles in cache. (Nor does the flash kernel with the bias as a float mask help: ALiBi's far pairs
put exponents below -87, where its backward's ``exp`` leaves its vector path, 6x slower.) No
second derivative (``once_differentiable``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnzoo.mechanisms._ops import exp_floor, flush_small_weights_
from attnzoo.score_mods import Bias

#: Scores (batch x head x row x key) of one chunk: 1M float32 (4 MiB). 0.25M took 19-52% longer
#: at 1K-4K, 4M 17-72% longer at 1K-2K and the same at 4K (``benchmarks/ab-softcap-chunks-cpu.txt``).
CHUNK_SCORES = 1 << 20


class _Scores(NamedTuple):
    """What makes a chunk's scores: ``scale`` on ``Q K^T``, then ``bias``, then the ``cap``."""

    scale: float
    cap: float | None
    bias: Bias | None
    causal: bool
    rows: int


def softmax_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    causal: bool,
    key_mask: Tensor | None,
    cap: float | None = None,
    bias: Bias | None = None,
) -> Tensor:
    """Softmax attention over ``cap * tanh((scale Q K^T + bias) / cap)`` (module docstring), in
    ``q``'s dtype.

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)`` (K/V heads as
            many as query heads). scale: on ``Q K^T``. cap: > 0, or None for none.
        bias: ``bias(b, h, q_idx, kv_idx)`` on ``pair_indices``-shaped index tensors (``q_idx``
            end-aligned), broadcastable to the scores; no gradient reaches it. None: none.
        causal: query ``i`` sees keys ``j <= i + N_kv - N_q`` (end-aligned, as a KV cache).
        key_mask: bool ``(B, N_kv)``, True = a real key; None: all real.

    Returns:
        ``(B, H, N_q, D_v)``; a row that sees no key is 0 (and passes no gradient).
    """
    rows = max(16, CHUNK_SCORES // max(1, q.shape[0] * q.shape[1] * k.shape[2]))
    return _SoftmaxChunks.apply(q, k, v, key_mask, _Scores(scale, cap, bias, causal, rows))


def _chunks(n_q: int, n_kv: int, rows: int, causal: bool) -> list[tuple[int, int, int]]:
    """``(start, stop, end)`` per chunk of query rows: keys ``[0, end)`` are the ones it reads
    (causal: up to its last row's last visible key)."""
    offset = n_kv - n_q
    return [
        (start, min(start + rows, n_q), max(0, min(n_kv, min(start + rows, n_q) + offset)) if causal else n_kv)
        for start in range(0, n_q, rows)
    ]


def _chunk_bias(cfg: _Scores, shape: torch.Size, start: int, offset: int, device: torch.device) -> Tensor:
    """``cfg.bias`` at the chunk's pairs: rows ``start ...`` (end-aligned) by keys ``[0, end)``."""
    batch, heads, rows, end = shape
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q_idx = torch.arange(start + offset, start + offset + rows, device=device).view(1, 1, -1, 1)
    kv_idx = torch.arange(end, device=device).view(1, 1, 1, -1)
    return cfg.bias(b, h, q_idx, kv_idx)  # type: ignore[misc]


def _weights(
    qc: Tensor, kc: Tensor, key_mask: Tensor | None, cfg: _Scores, start: int, offset: int
) -> tuple[Tensor | None, Tensor]:
    """One chunk's ``T = tanh(x / cap)`` (None without a cap) and weights ``P`` (0 on rows that
    see no key), ``(B, H, rows, end)``."""
    if cfg.bias is None and cfg.cap is not None:  # scale / cap on the (rows, D) queries, not the scores
        t = torch.matmul(qc * (cfg.scale / cfg.cap), kc.mT).tanh_()
    else:
        x = torch.matmul(qc * cfg.scale, kc.mT)
        if cfg.bias is not None:
            x.add_(_chunk_bias(cfg, x.shape, start, offset, x.device))
        t = None if cfg.cap is None else x.div_(cfg.cap).tanh_()
    scores = x if t is None else t * cfg.cap
    if cfg.causal:  # row r (query start + r) sees keys j <= start + r + offset
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(start + offset + 1)
        scores.masked_fill_(future, -math.inf)
    if key_mask is not None:
        scores.masked_fill_(~key_mask[:, None, None, : kc.shape[2]], -math.inf)
    weights = torch.softmax(scores, -1)
    if key_mask is not None or (cfg.causal and start + offset < 0):  # a row may see nothing: 0, not NaN
        weights.masked_fill_(scores.amax(-1, keepdim=True) == -math.inf, 0.0)
    if cfg.bias is not None or (cfg.cap is not None and 2 * cfg.cap > -exp_floor(weights.dtype)):
        # Scores that spread wider than exp's normal range (ALiBi's far pairs: -1000) leave weights
        # so small that the products after them run over denormals (P V 7.5x slower at 2K); a
        # weight below eps^4 is 0 (_ops.flush_small_weights_), far under the rounding of the row.
        flush_small_weights_(weights)
    return t, weights


def _flat(x: Tensor) -> Tensor:
    """``(B, H, n, e)`` -> ``(B H, n, e)``: a view (every tensor here has contiguous heads)."""
    return x.flatten(0, 1)


class _SoftmaxChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, cfg: _Scores) -> Tensor:  # type: ignore[override]
        n_q, n_kv, offset = q.shape[2], k.shape[2], k.shape[2] - q.shape[2]
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        for start, stop, end in _chunks(n_q, n_kv, cfg.rows, cfg.causal):
            if end == 0:  # causal rows before the first key: they see nothing
                continue
            _, weights = _weights(q[:, :, start:stop], k[:, :, :end], key_mask, cfg, start, offset)
            torch.matmul(weights, v[:, :, :end], out=out[:, :, start:stop])
        ctx.save_for_backward(q, k, v, out, key_mask)
        ctx.cfg = cfg
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, key_mask = ctx.saved_tensors
        cfg: _Scores = ctx.cfg
        offset, grad = k.shape[2] - q.shape[2], grad.contiguous()
        # contiguous whatever the inputs' strides (a layer's heads are often a transposed view):
        # the products below write into them through flattened views
        dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        delta = (grad * out).sum(-1, keepdim=True)  # rowsum(dO O): the softmax's backward
        for start, stop, end in _chunks(q.shape[2], k.shape[2], cfg.rows, cfg.causal):
            if end == 0:
                continue
            qc, kc, vc, gc = q[:, :, start:stop], k[:, :, :end], v[:, :, :end], grad[:, :, start:stop]
            t, weights = _weights(qc, kc, key_mask, cfg, start, offset)
            # baddbmm_: each chunk's share added inside the product, not in a pass of its own
            _flat(dv)[:, :end].baddbmm_(_flat(weights).mT, _flat(gc))
            # dX = (dO V^T - rowsum(dO O)) P (1 - T^2), with P (1 - T^2) in one pass; the scale
            # goes on the (rows, D) and (N, D) products, not on the scores
            d_scores = torch.matmul(gc, vc.mT).sub_(delta[:, :, start:stop])
            d_scores.mul_(weights if t is None else torch.addcmul(weights, weights, t.square_(), value=-1.0))
            torch.matmul(d_scores, kc, out=dq[:, :, start:stop]).mul_(cfg.scale)
            _flat(dk)[:, :end].baddbmm_(_flat(d_scores).mT, _flat(qc), alpha=cfg.scale)
        return dq, dk, dv, None, None
