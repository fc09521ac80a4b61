"""Softmax attention of each query over its own selected keys (``SelectedSoftmax``): the fast
path of ``topk`` (each head's k largest scores, picked by ``select_in_chunks``) and of ``dsa``
(keys picked by the lightning indexer, shared by the heads).

The selected (row, key) pairs of one (batch, head) are the structure of a sparse CSR matrix
(``_Rows``): the scores are a sampled dense-dense product on it (``torch.sparse.sampled_addmm``:
only the selected pairs), the softmax runs over each row's slots ``(M, k)``, and the output is a
sparse-times-dense product with v. The backward is the same few products (``dP`` sampled from
``dO v^T``, ``dQ = dS K``, and ``dK = dS^T Q``, ``dV = P^T dO`` through the transposed structure,
a stable sort of the keys). So attention over the selection costs O(N k D) forward and backward;
``topk``'s selection itself scores every pair (one GEMM per query chunk, by definition), ``dsa``'s
comes from its indexer. Memory: O(B H N k) kept for backward, O(B H chunk N) for ``topk``'s
selection; no N x N tensor exists.

This replaced a scatter of the selected weights into each chunk's dense score tile for GEMMs with
v, K and Q (forward and backward O(N^2 D), as dense attention): see the README's speed section.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

#: ``select(start, stop, reach, scores)`` -> ``(idx, valid)``, each ``(B, H, c, k)``, for query rows
#: ``start:stop`` given their ``(B, H, c, reach)`` scores (no gradient); k is the same for every
#: chunk (unused slots invalid).
Select = Callable[[int, int, int, Tensor], tuple[Tensor, Tensor]]


def row_chunks(m: int, n: int, chunk: int, causal: bool) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, reach)`` per chunk of ``m`` query rows end-aligned to ``n`` keys: the chunk
    can see keys ``:reach`` (causal: up to its last row; else all)."""
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        yield start, stop, (stop + n - m if causal else n)


@torch.no_grad()
def select_in_chunks(q: Tensor, k: Tensor, select: Select, chunk: int, causal: bool) -> tuple[Tensor, Tensor]:
    """``select`` applied to every chunk's scores ``q k^T`` (one GEMM per chunk of query rows,
    causal: only the keys the chunk can reach): ``(idx, valid)``, each ``(B, H, M, k)``."""
    parts = [
        select(start, stop, reach, torch.matmul(q[:, :, start:stop], k[:, :, :reach].transpose(-1, -2)))
        for start, stop, reach in row_chunks(q.shape[2], k.shape[2], chunk, causal)
    ]
    return torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)


class _Rows(NamedTuple):
    """One (batch, head)'s selected pairs. ``crow (M + 1)``, ``col (nnz)``: row by row, keys
    ascending; ``rows (nnz)``: each pair's row; ``slots (nnz)``: its place in the ``(M, k)`` slot
    layout (``idx``'s order); ``perm (nnz)``: row order -> key order; ``crow_t (N + 1)``,
    ``col_t (nnz)``: the pairs key by key."""

    crow: Tensor
    col: Tensor
    rows: Tensor
    slots: Tensor
    perm: Tensor
    crow_t: Tensor
    col_t: Tensor


def _rows(idx: Tensor, valid: Tensor, n: int) -> _Rows:
    """``_Rows`` of one (batch, head)'s slots ``idx, valid (M, k)`` over ``n`` keys."""
    m, k = idx.shape
    keys, order = idx.masked_fill(~valid, n).sort(-1)  # invalid slots last in every row
    kept = keys < n
    counts = kept.sum(-1)
    col = keys[kept]
    rows = torch.arange(m, device=idx.device).repeat_interleave(counts)
    slots = (torch.arange(m, device=idx.device)[:, None] * k + order)[kept]
    perm = torch.sort(col, stable=True).indices  # rows stay ascending within a key
    crow_t = F.pad(torch.bincount(col, minlength=n).cumsum(0), (1, 0))
    return _Rows(F.pad(counts.cumsum(0), (1, 0)), col, rows, slots, perm, crow_t, rows[perm])


def _csr(r: _Rows, values: Tensor, shape: tuple[int, int], transposed: bool = False) -> Tensor:
    """The pairs with ``values`` (row order; key order when ``transposed``, shape ``(N, M)``)."""
    if transposed:
        return torch.sparse_csr_tensor(r.crow_t, r.col_t, values, shape[::-1], check_invariants=False)
    return torch.sparse_csr_tensor(r.crow, r.col, values, shape, check_invariants=False)


def _sampled(r: _Rows, a: Tensor, b: Tensor, shape: tuple[int, int]) -> Tensor:
    """``a @ b^T`` at the pairs only: values ``(nnz,)`` in row order."""
    pattern = _csr(r, a.new_zeros(r.col.numel()), shape)
    return torch.sparse.sampled_addmm(pattern, a, b.t(), beta=0.0).values()


class SelectedSoftmax(torch.autograd.Function):
    """``q (B, H, M, D)`` already scaled (the last M of N positions), ``k (B, H, N, D)``, ``v (B,
    H, N, D_v)``, the selected keys ``idx``, ``valid`` ``(B, H | 1, M, k)`` (1: shared by the heads)
    -> ``(out (B, H, M, D_v), weights (B, H, M, k))``, the weights in ``idx``'s slot order and
    without gradient (``dsa``'s indexer loss reads them as its target). A row with no valid slot
    gets zeros and passes zero gradient; a NaN row stays NaN. float32 and float64 (the sparse
    kernels' types)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor):  # type: ignore[override]
        (batch, heads, m), slots, n = q.shape[:3], idx.shape[3], k.shape[2]
        out, weights = v.new_empty(batch, heads, m, v.shape[-1]), q.new_zeros(batch, heads, m * slots)
        structures = []
        with warnings.catch_warnings():  # torch's one-time notice that its CSR support is beta
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            for b in range(batch):
                for h in range(heads):
                    if h < idx.shape[1]:
                        structures.append(_rows(idx[b, h], valid[b, h], n))
                    r = structures[-1]
                    block = torch.full((m * slots,), -math.inf, dtype=q.dtype, device=q.device)
                    block = block.index_copy_(0, r.slots, _sampled(r, q[b, h], k[b, h], (m, n))).view(m, slots)
                    lse = torch.logsumexp(block, -1, keepdim=True)
                    weights[b, h] = torch.exp(block - torch.where(lse == -math.inf, math.inf, lse)).flatten()
                    out[b, h] = _csr(r, weights[b, h][r.slots], (m, n)) @ v[b, h]
        ctx.save_for_backward(q, k, v, out, weights)
        ctx.structures, ctx.shared = structures, idx.shape[1] == 1
        weights = weights.view(batch, heads, m, slots)
        ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, weights = ctx.saved_tensors
        (batch, heads, m), n = q.shape[:3], k.shape[2]
        delta = (grad * out).sum(-1)  # (B, H, M): rowsum(dO * O)
        d_q, d_k, d_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            for b in range(batch):
                for h in range(heads):
                    r = ctx.structures[b if ctx.shared else b * heads + h]
                    g, w = grad[b, h].contiguous(), weights[b, h][r.slots]
                    d_logits = w * (_sampled(r, g, v[b, h], (m, n)) - delta[b, h][r.rows])
                    d_q[b, h] = _csr(r, d_logits, (m, n)) @ k[b, h]
                    d_k[b, h] = _csr(r, d_logits[r.perm], (m, n), transposed=True) @ q[b, h]
                    d_v[b, h] = _csr(r, w[r.perm], (m, n), transposed=True) @ g
        return d_q, d_k, d_v, None, None
