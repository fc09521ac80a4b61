"""A/B of the tile plan's gathers and scatters of whole blocks as flattened rows
(``blocked._take``: one ``index_select`` of ``block * D`` values per block, in the kernel's
order; ``blocked._scatter``: one ``index_add_`` of them) against the old ones (advanced indexing
of the ``(B, H, blocks, block, D)`` view and a permuted copy; ``index_add_`` along dim 2 of that
view), in one process (issue 12).

The old functions are swapped in per call; each pair is timed forward+backward interleaved
with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage:
``python scripts/ab_block_rows.py N CAUSAL(0|1) bigbird[,block2d] [REPEATS]``.
"""

from __future__ import annotations

import torch
from ab_timing import ab_main
from torch import Tensor

from attnzoo.backends import blocked


def old_take(x: Tensor, piece: blocked.Piece, blocks: Tensor, block: int) -> Tensor:
    x = x[:, piece.heads] if piece.heads.numel() != x.shape[1] else x
    xb = x.view(x.shape[0], x.shape[1], -1, block, x.shape[-1])[:, :, blocks]  # [B, Hg, Q', (c,) block, D]
    xb = xb.flatten(3, -2) if blocks.ndim == 2 else xb
    return xb.permute(2, 0, 1, 3, 4).flatten(1, 2)


def old_scatter(target: Tensor, grad: Tensor, piece: blocked.Piece, blocks: Tensor, block: int) -> None:
    hg, dim, batch = piece.heads.numel(), grad.shape[-1], target.shape[0]
    grad = grad.reshape(grad.shape[0], batch, hg, -1, block, dim)  # [Q', B, Hg, c, block, D]
    grad = grad.permute(1, 2, 0, 3, 4, 5).reshape(batch, hg, -1, block, dim)
    view = target.view(batch, target.shape[1], -1, block, dim)
    flat = blocks.flatten().to(target.device)
    if hg == target.shape[1]:
        view.index_add_(2, flat, grad.to(target.dtype))
    else:
        sub = torch.zeros(batch, hg, view.shape[2], block, dim, dtype=target.dtype, device=target.device)
        sub.index_add_(2, flat, grad.to(target.dtype))
        view[:, piece.heads] += sub


if __name__ == "__main__":
    rules = {"old": (old_take, old_scatter), "new": (blocked._take, blocked._scatter)}

    def use(rule: str) -> None:
        blocked._take, blocked._scatter = rules[rule]

    ab_main(use)
