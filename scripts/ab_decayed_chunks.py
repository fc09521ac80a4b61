"""A/B of the decayed causal chunks, in one process (issue 12).

``kernel._causal_sums`` with a decay (``rfa``'s gates, ``performer``'s causal stabiliser,
``retnet``'s decay) now runs ``kernel_chunks.decayed_chunks``, forward and backward written by
hand; before, the same sums were a chain of autograd operations (``autograd_chunks`` below, the
code it replaced). Both are swapped in per call; each pair is timed forward+backward, causal,
interleaved with dense SDPA's causal forward+backward (B=1, H=8, D=64, median of the repeats).
Usage: ``python scripts/ab_decayed_chunks.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import math

import torch
from ab_timing import swap_main
from torch import Tensor

from attnzoo.mechanisms import kernel
from attnzoo.mechanisms._ops import gated_scan


def autograd_chunks(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, s0: Tensor) -> tuple[Tensor, Tensor]:
    """``decayed_chunks`` as autograd operations (the code before; same shapes)."""
    size, groups = k.shape[-2], q.shape[-2] // k.shape[-2]
    tril = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    scores = q @ k.transpose(-1, -2)
    cum = log_decay.double().cumsum(-1)
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~tril, -math.inf).to(q.dtype).exp()
    to_end = (cum[..., -1:] - cum).to(q.dtype).exp()
    chunk_sums = k.transpose(-1, -2) @ (v * to_end[..., None])
    starts, final = gated_scan(chunk_sums, cum[..., -1].to(q.dtype).exp()[..., None, None], s0)
    within = (scores.unflatten(-2, (groups, size)) * pair_decay[:, :, :, None]).flatten(-3, -2)
    across = (q @ starts).unflatten(-2, (groups, size)) * cum.to(q.dtype).exp()[:, :, :, None, :, None]
    return within @ v + across.flatten(-3, -2), final


def main() -> None:
    swap_main(kernel, "decayed_chunks", autograd_chunks, causal=True)


if __name__ == "__main__":
    main()
