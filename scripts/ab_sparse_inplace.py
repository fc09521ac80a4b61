"""A/B of ``SparseRowsAttention``'s CSR products written in place (``addmm_`` into the output and
gradient slices, the scale as ``alpha``) against the old ones (a product, then a copy into the
slice, a multiplication by the scale and an addition in passes of their own), in one process.

The old ``forward``/``backward`` are swapped in per call; each pair is timed forward+backward
interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_sparse_inplace.py N CAUSAL(0|1) random[,logsparse,topk] [REPEATS]``.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from ab_timing import fwd_bwd_ab, split_names
from torch import Tensor

from attnzoo.backends import gathered
from attnzoo.backends import sparse_rows as S
from attnzoo.mechanisms import selected


class Old(S.SparseRowsAttention):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, structure_of: Any, visible_of: Any, scale: float):  # type: ignore[override]
        (batch, heads, m), groups = q.shape[:3], q.shape[1] // k.shape[1]
        out, weights = v.new_empty(batch, heads, m, v.shape[-1]), []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            for b in range(batch):
                seen: tuple[Any, Any] = (None, None)
                for h in range(heads):
                    r = structure_of(b, h)
                    if r is not seen[0]:
                        seen = (r, visible_of(r, b))
                    w = S._row_softmax(r, S._sampled(r, q[b, h], k[b, h // groups], scale), seen[1])
                    out[b, h] = S.csr(r, w) @ v[b, h // groups]
                    weights.append(w)
        ctx.save_for_backward(q, k, v, out, *weights)
        ctx.structure_of, ctx.scale = structure_of, scale
        ctx.mark_non_differentiable(*weights)
        return (out, *weights)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, *weights = ctx.saved_tensors
        (batch, heads), groups, scale = q.shape[:2], q.shape[1] // k.shape[1], ctx.scale
        delta = (grad * out).sum(-1)
        d_q, d_k, d_v = q.new_empty(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            for b in range(batch):
                for h in range(heads):
                    r, p, g = ctx.structure_of(b, h), weights[b * heads + h], grad[b, h].contiguous()
                    d_scores = p * (S._sampled(r, g, v[b, h // groups]) - delta[b, h][r.rows])
                    d_q[b, h] = (S.csr(r, d_scores) @ k[b, h // groups]) * scale
                    d_k[b, h // groups] += (S.csr(r, d_scores[r.perm], transposed=True) @ q[b, h]) * scale
                    d_v[b, h // groups] += S.csr(r, p[r.perm], transposed=True) @ g
        return d_q, d_k, d_v, None, None, None


if __name__ == "__main__":
    args = sys.argv[1:]
    rules = {"old": Old, "new": S.SparseRowsAttention}

    def use(rule: str) -> None:  # where the class is used: the gathered path and topk's / dsa's
        gathered.SparseRowsAttention = selected.SparseRowsAttention = rules[rule]

    fwd_bwd_ab(int(args[0]), args[1] == "1", split_names(args[2]), int(args[3]) if len(args) > 3 else 7, use)
