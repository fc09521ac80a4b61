"""Softmax attention over a few listed keys per query row, as sparse CSR products: the blocked
backend's gathered path (``random(r)``: ``gathered.py``) and the selected-keys attention of
``topk`` and ``dsa`` (``mechanisms/selected.py``).

Each query row lists up to ``k`` keys in slots ``idx, valid (M, k)``. ``sparse_rows`` turns the
kept slots into a CSR structure (``SparseRows``: row by row with keys ascending, and the same
pairs key by key). ``SparseRowsAttention`` then computes, per (batch, head): the scores of the
listed pairs only (``torch.sparse.sampled_addmm``), plus an additive bias at them if given
(``pair_bias``), the softmax over each row's slots, and the
output as CSR @ V; backward is the same sparse products (``dP`` sampled from ``dO V^T``,
``dQ = dS K``, and ``dK = dS^T Q``, ``dV = P^T dO`` through the transposed structure). Time and
memory O(M k D); nothing is M x N. One (batch, head) at a time: the 2-D sparse kernels ran twice
as fast as their batched forms on CPU. float32 and float64 (the sparse kernels' types).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.mechanisms._ops import flush_small_weights_
from attnzoo.score_mods import Bias


class SparseRows(NamedTuple):
    """One (batch, head)'s listed pairs. ``crow (M + 1)``, ``col (nnz)``: row by row, keys
    ascending; ``rows (nnz)``: each pair's row; ``slots (nnz)``: its place in the ``(M, k)``
    slot layout it came from; ``perm (nnz)``: row order -> key order; ``crow_t (N + 1)``,
    ``col_t (nnz)``: the pairs key by key; ``full``: every row keeps all ``k`` slots (then the
    values in row order are already an ``(M, k)`` block, rows intact). The four CSR index
    tensors are int32 where they fit (``csr_index_dtype``), the rest int64."""

    crow: Tensor
    col: Tensor
    rows: Tensor
    slots: Tensor
    perm: Tensor
    crow_t: Tensor
    col_t: Tensor
    full: bool
    shape: tuple[int, int, int]  # (M, N, k)


def csr_index_dtype(m: int, n: int, nnz: int) -> torch.dtype:
    """The CSR structures' index type: int32 where every index and count fits, as MKL's sparse
    kernels take them; given int64, ``addmm`` converts the column indices to int32 on each call (a
    pass over them per product: 1.52 -> 1.42 ms for 262K pairs at 4K, timed alone on the Xeon with
    AMX tiles) and ``sampled_addmm`` copies them twice more (4.68 -> 4.36 ms there)."""
    return torch.int32 if max(m, n, nnz) < 2**31 else torch.int64


def _narrow(r: SparseRows) -> SparseRows:
    """``r`` with its CSR index tensors in ``csr_index_dtype``."""
    m, n, _ = r.shape
    dtype = csr_index_dtype(m, n, r.col.numel())
    return r._replace(crow=r.crow.to(dtype), col=r.col.to(dtype), crow_t=r.crow_t.to(dtype), col_t=r.col_t.to(dtype))


def sparse_rows(idx: Tensor, valid: Tensor, n: int) -> SparseRows:
    """``SparseRows`` of the slots ``idx, valid (M, k)`` (``idx`` distinct within a row where
    valid) over ``n`` keys."""
    return sparse_rows_of_many(idx[None], valid[None], n)[0]


def sparse_rows_of_many(idx: Tensor, valid: Tensor, n: int) -> list[SparseRows]:
    """``sparse_rows`` of each of ``G`` slot tables ``idx, valid (G, M, k)``. Where every slot is
    kept (``topk`` without padding or a causal cut) the G structures are built by a few batched
    calls instead of a dozen small ones each (``topk`` at N = 1024: 84 -> 79 ms fwd+bwd in one
    process)."""
    g, m, k = idx.shape
    # kept keys ascending, unused slots last; in int32 where it holds them (a quarter faster at 4K)
    narrow = torch.int32 if n < 2**31 else idx.dtype
    keys, order = idx.masked_fill(~valid, n).to(narrow).sort(-1)
    keys, kept = keys.long(), keys < n
    arange_m = torch.arange(m, device=idx.device)
    if bool(kept.all()):
        col = keys.reshape(g, m * k)
        perm = key_order(col, n)
        rows = arange_m.repeat_interleave(k)
        slots = (arange_m[:, None] * k + order).reshape(g, m * k)
        offsets = torch.arange(g, device=idx.device)[:, None] * n
        crow_t = torch.bincount((col + offsets).flatten(), minlength=g * n).view(g, n).cumsum(-1)
        crow_t, crow = F.pad(crow_t, (1, 0)), torch.arange(0, m * k + 1, k, device=idx.device)
        return [
            _narrow(SparseRows(crow, col[i], rows, slots[i], perm[i], crow_t[i], rows[perm[i]], True, (m, n, k)))
            for i in range(g)
        ]
    structures = []
    for keys_i, order_i, kept_i in zip(keys, order, kept):
        counts = kept_i.sum(-1)
        col = keys_i[kept_i]
        rows = arange_m.repeat_interleave(counts)
        slots = (arange_m[:, None] * k + order_i)[kept_i]
        perm = key_order(col[None], n)[0]
        crow_t = F.pad(torch.bincount(col, minlength=n).cumsum(0), (1, 0))
        crow = F.pad(counts.cumsum(0), (1, 0))
        structures.append(_narrow(SparseRows(crow, col, rows, slots, perm, crow_t, rows[perm], False, (m, n, k))))
    return structures


def key_order(col: Tensor, n: int) -> Tensor:
    """``(G, nnz)`` -> each row's entries in key order, ties (rows of one key) kept in row order:
    ``torch.sort(col, stable=True)``'s indices. Done as one stable sort of a flat int32 tensor
    ``col + g n``, where torch sorts by radix: 4.9 -> 1.4 ms for ``topk``'s 8 heads at 512 (k =
    32), 39 -> 16 at 4K, against the row-wise int64 sort; ``topk`` fwd+bwd 3-7% faster, ``dsa``
    6-11% at 512-4K, within noise at 16K (``benchmarks/ab-key-order-cpu.txt``). Below 2^15
    entries torch does not take its radix path, and the row-wise sort was as fast (0.24 against
    0.29 ms for 8K entries)."""
    g, nnz = col.shape
    if g * n >= 2**31 or g * nnz < 2**15:
        return torch.sort(col, dim=-1, stable=True).indices
    offsets = torch.arange(g, device=col.device)[:, None]
    flat = (col + offsets * n).to(torch.int32).flatten()
    return torch.sort(flat, stable=True).indices.view(g, nnz) - offsets * nnz


def csr(r: SparseRows, values: Tensor, transposed: bool = False) -> Tensor:
    """The pairs with ``values`` as a CSR matrix ``(M, N)``: values in row order, or in key order
    with ``transposed`` (then ``(N, M)``)."""
    m, n, _ = r.shape
    if transposed:
        return torch.sparse_csr_tensor(r.crow_t, r.col_t, values, (n, m), check_invariants=False)
    return torch.sparse_csr_tensor(r.crow, r.col, values, (m, n), check_invariants=False)


def _sampled(r: SparseRows, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``alpha * a @ b^T`` at the pairs only: values ``(nnz,)`` in row order."""
    pattern = csr(r, a.new_zeros(r.col.numel()))
    return torch.sparse.sampled_addmm(pattern, a, b.t(), beta=0.0, alpha=alpha).values()


def _row_softmax(r: SparseRows, scores: Tensor, visible: Tensor | None) -> Tensor:
    """Softmax of each row's pair scores ``(nnz,)`` over its visible pairs (``visible (nnz,)``,
    None: all), in row order; 0 for the rest, and for every pair of a row with none visible."""
    m, _, k = r.shape
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    if r.full:  # the row-order values are an (M, k) block already
        block = scores.view(m, k)
    else:
        block = scores.new_full((m * k,), -math.inf).index_copy_(0, r.slots, scores).view(m, k)
    # torch.softmax, not logsumexp and exp: those leave their vector path on -inf and on
    # exponents below -87 (``_ops.exp_floor``): causal ``random`` fwd+bwd at 2K 25.4 -> 21.4 ms,
    # ``logsparse`` 12.1 -> 10.7 (``benchmarks/ab-row-softmax-cpu.txt``).
    weights = torch.softmax(block, -1)
    empty = block.amax(-1, keepdim=True) == -math.inf  # softmax over nothing: NaN, made 0 (a NaN score stays)
    if bool(empty.any()):
        weights.masked_fill_(empty, 0.0)
    weights = weights.flatten()
    return weights if r.full else weights[r.slots]


def slot_weights(r: SparseRows, weights: Tensor) -> Tensor:
    """Row-order pair weights ``(nnz,)`` -> the ``(M, k)`` slot layout (0 in unused slots)."""
    m, _, k = r.shape
    return weights.new_zeros(m * k).index_copy_(0, r.slots, weights).view(m, k)


def per_pair(x: Tensor, r: SparseRows) -> Tensor:
    """A value per row ``(M,)`` -> per pair ``(nnz,)`` in row order: repeated k times where every
    row keeps k slots, else gathered by the pairs' rows (10x the time of the repeat at 4K)."""
    return x.repeat_interleave(r.shape[2]) if r.full else x.index_select(0, r.rows)


def by_key(values: Tensor, r: SparseRows) -> Tensor:
    """Row-order pair values ``(nnz,)`` in key order (for the transposed structure): ``take``,
    which ran faster here than indexing or ``index_select`` (0.24 against 0.34 ms at 4K, r = 64)."""
    return values.take(r.perm)


#: ``(b, h)`` -> the structure of batch row b, query head h.
StructureOf = Callable[[int, int], SparseRows]
#: ``(structure, b)`` -> which of its pairs have a real key in batch row b ``(nnz,)``, or None (all).
VisibleOf = Callable[[SparseRows, int], "Tensor | None"]
#: ``(structure, b, h)`` -> an additive bias on its pairs' scores in batch row b, head h ``(nnz,)``.
BiasOf = Callable[[SparseRows, int, int], Tensor]


def pair_bias(bias: Bias, r: SparseRows, b: int, h: int, offset: int, dtype: torch.dtype) -> Tensor:
    """``bias`` (``score_mods.plain_bias``: ALiBi) at the pairs of ``r`` in row order ``(nnz,)``,
    for batch row ``b``, head ``h``; queries end-aligned to the keys (``q_idx = row + offset``,
    ``offset = N_kv - N_q``), as ``spec``'s index convention has them."""
    at = torch.tensor([b, h], device=r.col.device)
    return bias(at[0], at[1], r.rows + offset, r.col).to(dtype).expand(r.col.shape)


class SparseRowsAttention(torch.autograd.Function):
    """``q (B, H, M, D)``, ``k (B, H_kv, N, D)``, ``v (B, H_kv, N, D_v)`` (``H_kv`` dividing ``H``),
    ``structure_of``, ``visible_of``, ``scale``, ``bias_of`` (None: no bias) -> ``(out (B, H, M,
    D_v), *weights)``: one weights tensor ``(nnz,)`` per (b, h) in ``b * H + h`` order, in its
    structure's row order, without gradient. A bias is a constant of the scores (no gradient
    reaches it); with one, weights below ``eps^4`` are 0 (``_ops.flush_small_weights_``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        structure_of: StructureOf,
        visible_of: VisibleOf,
        scale: float,
        bias_of: BiasOf | None = None,
    ):
        (batch, heads, m), groups = q.shape[:3], q.shape[1] // k.shape[1]
        out, weights = v.new_empty(batch, heads, m, v.shape[-1]), []
        with warnings.catch_warnings():  # torch's one-time notice that its CSR support is beta
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            for b in range(batch):
                seen: tuple[SparseRows | None, Tensor | None] = (None, None)
                for h in range(heads):
                    r = structure_of(b, h)
                    if r is not seen[0]:  # heads sharing a structure share its padding verdict
                        seen = (r, visible_of(r, b))
                    scores = _sampled(r, q[b, h], k[b, h // groups], scale)
                    if bias_of is None:
                        w = _row_softmax(r, scores, seen[1])
                    else:
                        w = _row_softmax(r, scores.add_(bias_of(r, b, h)), seen[1])
                        flush_small_weights_(w)
                    out[b, h].addmm_(csr(r, w), v[b, h // groups], beta=0.0)  # beta 0: its garbage ignored
                    weights.append(w)
        ctx.save_for_backward(q, k, v, out, *weights)
        ctx.structure_of, ctx.scale = structure_of, scale
        ctx.mark_non_differentiable(*weights)
        return (out, *weights)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, *weights = ctx.saved_tensors
        (batch, heads), groups, scale = q.shape[:2], q.shape[1] // k.shape[1], ctx.scale
        delta = (grad * out).sum(-1)  # (B, H, M): rowsum(dO * O)
        d_q, d_k, d_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            for b in range(batch):
                for h in range(heads):
                    r, p, g = ctx.structure_of(b, h), weights[b * heads + h], grad[b, h].contiguous()
                    d_scores = p * (_sampled(r, g, v[b, h // groups]) - per_pair(delta[b, h], r))
                    # In place, the scale as alpha: no product, copy or sum in a pass of its own
                    d_q[b, h].addmm_(csr(r, d_scores), k[b, h // groups], beta=0.0, alpha=scale)
                    d_k[b, h // groups].addmm_(csr(r, by_key(d_scores, r), transposed=True), q[b, h], alpha=scale)
                    d_v[b, h // groups].addmm_(csr(r, by_key(p, r), transposed=True), g)
        return d_q, d_k, d_v, None, None, None, None
