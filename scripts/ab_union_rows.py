"""A/B of a window union with few global tokens, in one process (issue 12).

``windowed._UnionAttention`` now writes the union into one output buffer that the columns'
product accumulates into and the global tokens' rows are copied into, with a backward that adds
every term into the window part's gradients; before, the columns' product, the window's scaled
output and their sum were three ``(N, D)`` tensors, and the rows ran outside through autograd
(``index_copy`` and its backward, a gather's zero-filled gradient, one addition per input).
``OldUnion`` below is the code before. Both are swapped in per call (``windowed._run_part``);
each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the
repeats). Usage: ``python scripts/ab_union_rows.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from typing import Any

import torch
from ab_timing import swap_main
from torch import Tensor

from attnzoo.backends import windowed as W
from attnzoo.backends.grouped import grouped_matmul, grouped_outer
from attnzoo.backends.window_parts import finite, part_backward, part_forward, part_lse


class OldUnion(torch.autograd.Function):
    """``_UnionAttention`` before: window part + global columns, no rows."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, part: Any, opts: Any) -> Tensor:  # type: ignore[override]
        index = part.tokens.to(q.device)
        scores = W._column_scores(part, q, k[:, :, index].to(W.compute_dtype(q)), opts)
        lse = torch.logsumexp(scores, dim=-1)
        saved, out_w = None, None
        if part.windows is not None:
            out_w, saved = part_forward(part.windows, q, k, v, opts)
            lse_w = part_lse(part.windows, saved, q.shape[2], q.shape[1]).to(lse.dtype)
            lse = torch.logaddexp(lse, lse_w)
        probs = torch.exp(scores - finite(lse, 0.0)[..., None])
        out = grouped_matmul(probs, v[:, :, index].to(probs.dtype))
        if out_w is not None:
            out = out + out_w.to(out.dtype) * torch.exp(lse_w - finite(lse, 0.0))[..., None]
        out = out.to(q.dtype)
        W._save(ctx, saved, q, k, v, out, lse, probs)
        ctx.part, ctx.scale = part, opts.scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        part, scale = ctx.part, ctx.scale
        (q, k, v, out, lse, probs), saved = W._load(ctx, part.windows, 6)
        if saved is not None:
            lse_k = finite(lse, float("inf")).to(saved.lse.dtype)
            dq, dk, dv = (x.to(probs.dtype) for x in part_backward(part.windows, saved, grad, scale, out, lse_k))
        else:
            dq, dk, dv = (torch.zeros(x.shape, dtype=probs.dtype, device=x.device) for x in (q, k, v))
        index = part.tokens.to(q.device)
        g = grad.to(probs.dtype)
        delta = (g * out.to(probs.dtype)).sum(-1, keepdim=True)
        d_scores = probs * (grouped_matmul(g, v[:, :, index].to(probs.dtype).transpose(-1, -2)) - delta) * scale
        dq.add_(grouped_matmul(d_scores, k[:, :, index].to(probs.dtype)))
        dk.index_add_(2, index, grouped_outer(d_scores, q.to(probs.dtype), k.shape[1]))
        dv.index_add_(2, index, grouped_outer(probs, g, k.shape[1]))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def old_run_part(part: Any, q: Tensor, k: Tensor, v: Tensor, opts: Any) -> Tensor:
    """``windowed._run_part`` before (for unions below ``KERNEL_COLUMNS`` global keys)."""
    if not isinstance(part, W.WithGlobals) or part.tokens.numel() >= W.KERNEL_COLUMNS:
        return NEW_RUN_PART(part, q, k, v, opts)
    out = OldUnion.apply(q, k, v, part, opts)
    if not part.rows:
        return out
    return out.index_copy(2, part.tokens.to(q.device), W._global_rows(part, q, k, v, opts))


NEW_RUN_PART = W._run_part


def main() -> None:
    swap_main(W, "_run_part", old_run_part)


if __name__ == "__main__":
    main()
