"""Softmax attention of each query over its own selected keys, in query chunks, as dense GEMMs
(``SelectedSoftmax``): the fast path of ``topk`` (each head's k largest scores) and of ``dsa``
(keys picked by the lightning indexer, shared by the heads).

Per chunk of query rows the scores against every key the chunk can reach (causal: up to its last
row) are one GEMM, ``(B, H, c, N')``; ``select`` picks each row's slots from them, the selected
scores are gathered and softmaxed, and the weights are scattered back into the score tile for a
second GEMM with v. The backward redoes the GEMMs chunk by chunk from the saved weights. So the
time is O(N^2 D H), as in dense attention (both mechanisms score every pair by definition), and
memory is O(B H chunk N) working plus O(B H N k) kept for backward; no N x N tensor exists.

Why GEMMs with a scattered tile and not a gather of each query's k keys and values,
``(B, H, c, k, D)``: on CPU the gather, its scatter-add backward and the batched mat-vecs over it
ran 4-8x slower than the two GEMMs at N = 4096, k = 256 (``dsa``), and about 2x slower at
N = 1024, k = 32 (``topk``), at H = 8, D = 64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from attnzoo.backends.reference import normalize_scores

#: ``select(start, stop, reach, scores)`` -> ``(idx, valid)``, each ``(B, H or 1, c, k)``, for query
#: rows ``start:stop`` given their ``(B, H, c, reach)`` scores (no gradient); k is the same for
#: every chunk (unused slots invalid).
Select = Callable[[int, int, int, Tensor], tuple[Tensor, Tensor]]


def row_chunks(m: int, n: int, chunk: int, causal: bool) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, reach)`` per chunk of ``m`` query rows end-aligned to ``n`` keys: the chunk
    can see keys ``:reach`` (causal: up to its last row; else all)."""
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        yield start, stop, (stop + n - m if causal else n)


def scattered(w: Tensor, idx: Tensor, reach: int, out: Tensor | None = None) -> Tensor:
    """Slot values ``w (B, H, c, k)`` at their key positions ``idx``, ``(B, H, c, reach)``, zero
    elsewhere (into ``out`` when given); added, so an invalid slot (idx 0, value 0) cannot
    overwrite key 0's value."""
    base = w.new_zeros(*w.shape[:-1], reach) if out is None else out.zero_()
    return base.scatter_add_(-1, idx, w)


class SelectedSoftmax(torch.autograd.Function):
    """``q (B, H, M, D)`` already scaled (the last M of N positions), ``k (B, H, N, D)``, ``v (B,
    H, N, D_v)``, ``select`` (see ``Select``), ``chunk``, ``causal`` -> ``(out (B, H, M, D_v),
    weights (B, H, M, k))``; the weights carry no gradient (``dsa``'s indexer loss reads them as
    its target). A row with no valid slot gets zeros and passes zero gradient; a NaN row stays NaN."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, select: Select, chunk: int, causal: bool):  # type: ignore[override]
        heads, (m, n) = q.shape[1], (q.shape[2], k.shape[2])
        outs, weights, slots = [], [], []
        for start, stop, reach in row_chunks(m, n, chunk, causal):
            tile = torch.matmul(q[:, :, start:stop], k[:, :, :reach].transpose(-1, -2))  # (B, H, c, reach)
            idx, ok = select(start, stop, reach, tile)
            idx = idx.masked_fill(~ok, 0)  # an unused slot may point past the chunk's reach
            idx_h, ok_h = (x.expand(-1, heads, -1, -1) for x in (idx, ok))
            w = normalize_scores(tile.gather(-1, idx_h), ok_h, "softmax")  # (B, H, c, k)
            outs.append(torch.matmul(scattered(w, idx_h, reach, out=tile), v[:, :, :reach]))
            weights.append(w)
            slots.append(idx)
        if not outs:  # no query rows
            return q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_zeros(*q.shape[:-1], 0)
        weights_all = torch.cat(weights, 2)
        ctx.save_for_backward(q, k, v, torch.cat(slots, 2), weights_all)
        ctx.chunk, ctx.causal = chunk, causal
        ctx.mark_non_differentiable(weights_all)
        return torch.cat(outs, 2), weights_all

    @staticmethod
    def backward(ctx, grad: Tensor, _: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, idx, weights = ctx.saved_tensors
        heads, (m, n) = q.shape[1], (q.shape[2], k.shape[2])
        d_q, d_k, d_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for start, stop, reach in row_chunks(m, n, ctx.chunk, ctx.causal):
            w, g, q_c = weights[:, :, start:stop], grad[:, :, start:stop], q[:, :, start:stop]
            idx_h = idx[:, :, start:stop].expand(-1, heads, -1, -1)
            tile = torch.matmul(g, v[:, :, :reach].transpose(-1, -2))  # (B, H, c, reach): d weights
            d_w = tile.gather(-1, idx_h)
            d_v[:, :, :reach] += torch.matmul(scattered(w, idx_h, reach, out=tile).transpose(-1, -2), g)
            d_logits = scattered(w * (d_w - (d_w * w).sum(-1, keepdim=True)), idx_h, reach, out=tile)
            d_q[:, :, start:stop] = torch.matmul(d_logits, k[:, :, :reach])
            d_k[:, :, :reach] += torch.matmul(d_logits.transpose(-1, -2), q_c)
        return d_q, d_k, d_v, None, None, None
