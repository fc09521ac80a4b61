"""A/B of the window parts' backward in chunks of query blocks, in one process (issue 12).

A window part's backward ran the CPU flash kernel over every query block at once: its key
gradients come out per window, ``width / block`` times the keys' size (168 MiB per tensor at 16K
for a (256, 256) window), zero-filled by the kernel and added back. Now it runs in chunks of
query blocks whose window gradients stay under ``window_parts.BACKWARD_BYTES``, each added into
the keys' gradient right away. ``old_part_backward`` below is the code before (git 66bc57b),
swapped in per call; each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_backward_chunks.py N CAUSAL(0|1)
NAME[,NAME...] [REPEATS]`` (a NAME may carry config values: ``local:left=256,right=256``).
The old code knows window parts only: dense parts on views (``window_parts._deal``, later) need
the current ``part_backward``, so time window mechanisms with it (or run it at 66bc57b).
"""

from __future__ import annotations

from ab_timing import swap_main
from torch import Tensor

from attnzoo._compat import flash_attention_cpu_backward
from attnzoo.backends import window_parts as wp
from attnzoo.backends import windowed
from attnzoo.backends.call import from_subsequences
from attnzoo.backends.grouped import blocks_to_rows, unfold_rows


def _overlap_add(windows: Tensor, w, n: int) -> Tensor:
    bh, blocks, width, dim = windows.shape
    front, per = max(0, -w.start), width // w.block
    first = (front + w.start) // w.block
    total = max(first + blocks - 1 + per, -(-(front + n) // w.block))
    out = windows.new_empty(bh, total, w.block, dim)
    parts = windows.view(bh, blocks, per, w.block, dim)
    out[:, :first].zero_()
    out[:, first + blocks :].zero_()
    out[:, first : first + blocks] = parts[:, :, 0]
    for s in range(1, per):
        out[:, first + s : first + s + blocks] += parts[:, :, s]
    return out.view(bh, total * w.block, dim)[:, front : front + n]


def old_part_backward(w, saved, grad: Tensor, scale: float, out=None, lse=None) -> tuple[Tensor, Tensor, Tensor]:
    n, sub, heads = grad.shape[2], -(-grad.shape[2] // w.stride), grad.shape[1]
    g = wp._to_kernel(grad, w, saved).contiguous()
    kernel_out = saved.out if out is None else wp._to_kernel(out, w, saved).contiguous()
    kernel_lse = saved.lse if lse is None else wp._to_kernel(lse[..., None], w, saved)[..., 0].contiguous()
    dq, dk, dv = flash_attention_cpu_backward(
        g, saved.q, saved.k, saved.v, kernel_out, kernel_lse, 0.0, saved.is_causal, attn_mask=saved.mask, scale=scale
    )
    if w.width == 0:
        dq = unfold_rows(dq, saved.q.shape[2] // saved.k.shape[2])
        return tuple(from_subsequences(x, w.stride, n) for x in (dq, dk, dv))
    groups = saved.q.shape[2] // w.block
    bb = dq.shape[0] * groups // heads
    dq = blocks_to_rows(dq, heads, groups, sub)
    dk, dv = (_overlap_add(x, w, sub).view(bb, heads // groups, sub, -1) for x in (dk, dv))
    return from_subsequences(dq, w.stride, n), from_subsequences(dk, w.stride, n), from_subsequences(dv, w.stride, n)


if __name__ == "__main__":
    swap_main(windowed, "part_backward", old_part_backward)
