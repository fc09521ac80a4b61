"""A/B of the non-causal kernel path's blocks taken with ``split``, in one process (issue 12).

``kernel._blocked`` runs blocks of positions; it took them as slices (``k[:, :, i : i + rows]``),
each of whose backward zero-fills a gradient of the whole input and adds it; now ``split``, whose
backward is one concatenation. ``sliced_blocked`` below is the code before. Both are swapped in per
call; each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median
of the repeats). Usage: ``python scripts/ab_kernel_split.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

import torch
from ab_timing import swap_main
from torch import Tensor

from attnzoo.backends.grouped import fold_rows, unfold_rows
from attnzoo.mechanisms import kernel


def sliced_blocked(q: Tensor, k: Tensor, v: Tensor, real: Tensor | None, maps: kernel.FeatureMaps):  # noqa: ANN201
    """``kernel._blocked`` before: the blocks as slices."""
    groups = q.shape[1] // k.shape[1]
    q = fold_rows(q, groups)
    rows = max(1, kernel.BLOCK_ROWS // (q.shape[0] * q.shape[1]))
    s1 = c = None
    for i in range(0, k.shape[2], rows):
        part = None if real is None else real[..., i : i + rows]
        f = maps.key_features(k[:, :, i : i + rows], part, causal=False, c0=None)
        phi = f.phi if part is None else torch.where(part[..., None], f.phi, 0.0)
        vb = v[:, :, i : i + rows]
        s1, c = kernel._merge(s1, c, phi.transpose(-1, -2) @ torch.cat([vb, torch.ones_like(vb[..., :1])], -1), f.c)
    if maps.normalizer == "keys":
        z = s1[..., -1:]
        s1 = torch.cat([s1[..., :-1] / torch.where(z > 0, z, 1.0), z], dim=-1)
    outs = [maps.query_features(q[:, :, i : i + rows]) @ s1 for i in range(0, q.shape[2], rows)]
    out1 = unfold_rows(torch.cat(outs, dim=2), groups)
    state = kernel.KernelState(s1[..., :-1], s1[..., -1], c)
    return kernel.normalise(out1[..., :-1], out1[..., -1], maps.normalizer, maps.eps), state


def main() -> None:
    swap_main(kernel, "_blocked", sliced_blocked, causal=False)


if __name__ == "__main__":
    main()
