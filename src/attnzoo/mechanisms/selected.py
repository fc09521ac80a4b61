"""Softmax attention of each query over its own selected keys (``selected_softmax``): the fast
path of ``topk`` (each head's k largest scores, picked by ``select_in_chunks``) and of ``dsa``
(keys picked by the lightning indexer, shared by the heads).

The selected pairs of each (batch, head) are a sparse CSR structure and the attention runs as
sparse products over it (``backends.sparse_rows``: the pairs' scores by ``sampled_addmm``, a
softmax over each row's slots, CSR @ v, and a backward of the same products), so attention over
the selection costs O(N k D) forward and backward; ``topk``'s selection itself scores every
pair (one GEMM per query chunk, by definition), ``dsa``'s comes from its indexer. Memory:
O(B H N k) kept for backward, O(B H chunk N) for ``topk``'s selection; no N x N tensor exists.

This replaced a scatter of the selected weights into each chunk's dense score tile for GEMMs with
v, K and Q (forward and backward O(N^2 D), as dense attention): ``benchmarks/ab-selected-sparse-cpu.txt``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from attnzoo.backends.sparse_rows import SparseRows, SparseRowsAttention, VisibleOf, slot_weights, sparse_rows_of_many

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


def selected_softmax(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """``q (B, H, M, D)`` already scaled (the last M of N positions), ``k (B, H, N, D)``, ``v (B,
    H, N, D_v)``, the selected keys ``idx``, ``valid`` ``(B, H | 1, M, k)`` (1: shared by the heads)
    -> ``(out (B, H, M, D_v), weights (B, H, M, k))``, the weights in ``idx``'s slot order and
    without gradient (``dsa``'s indexer loss reads them as its target). A row with no valid slot
    gets zeros and passes zero gradient; a NaN row stays NaN."""
    (batch, heads), n, per_head, width = q.shape[:2], k.shape[2], idx.shape[1], idx.shape[-1]
    visible_of: VisibleOf = lambda r, b: None  # noqa: E731
    if per_head > 1 and not bool(valid.all()):
        # Unused slots point at ``width`` extra zero keys, one per slot, masked: every row then
        # keeps all its slots, the layout whose CSR structures are built in a few batched calls
        # instead of one by one (causal ``topk`` at 1K: ab-selected-slots-cpu.txt). With one
        # structure per batch row (``dsa``'s, shared by the heads) there is nothing to batch, and
        # the padded K/V copies cost more than they save.
        idx = torch.where(valid, idx, n + torch.arange(width, device=idx.device))
        valid = torch.ones_like(valid)
        k, v = (torch.nn.functional.pad(x, (0, 0, 0, width)) for x in (k, v))
        visible_of = lambda r, b: r.col < n  # noqa: E731
    structures = sparse_rows_of_many(idx.flatten(0, 1), valid.flatten(0, 1), k.shape[2])  # b * per_head + h

    def structure_of(b: int, h: int) -> SparseRows:
        return structures[b * per_head + (h if per_head > 1 else 0)]

    out, *weights = SparseRowsAttention.apply(q, k, v, structure_of, visible_of, 1.0)
    slots = [slot_weights(structure_of(b, h), weights[b * heads + h]) for b in range(batch) for h in range(heads)]
    return out, torch.stack(slots).view(*q.shape[:3], idx.shape[-1])
