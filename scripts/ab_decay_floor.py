"""A/B of the chunkwise cores' decay floor at ``eps^4`` instead of float32's smallest normal, in one
process (issue 12).

``kernel_chunks._factors`` flushes decay factors below a floor to 0. At float32's smallest normal
(e^-87) a kept factor of 1e-37 still turned the products it entered (``v * to_end``, ``grad *
rise``, ``d_weights * pair``) into denormals, and matrix products over denormals run 75x slower on
this CPU; at ``decay_floor`` (``eps^4``, e^-63.7) they stay normal, and no causal sum can feel the
difference (each holds its row's own key at factor 1). The old floor is written out below and
swapped in per call; each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats), for the mechanisms as built and fed ``10 q``, ``10 k``
(``-x10``: ``rfa``'s gate logits grow tenfold, its decays with them). Usage: ``python
scripts/ab_decay_floor.py N [REPEATS]`` (causal).
"""

from __future__ import annotations

import sys

import torch
from ab_floored_exp import LargeInputs
from ab_timing import fwd_bwd_ab
from torch import Tensor

import attnzoo
from attnzoo.mechanisms import kernel_chunks
from attnzoo.mechanisms._ops import exp_floor, flushed_exp_

NEW = kernel_chunks._factors


def old_factors(log_decay: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``_factors`` with its floor at ``exp_floor`` (float32's smallest normal)."""
    floor = exp_floor(dtype)
    cum = log_decay.double().cumsum(-1)
    pair = flushed_exp_((cum[..., :, None] - cum[..., None, :]).to(dtype).clamp_(max=0.0), floor).tril_()
    to_end = flushed_exp_((cum[..., -1:] - cum).to(dtype), floor)
    rise, gates = (flushed_exp_(x.clone(), floor).to(dtype) for x in (cum, cum[..., -1, None, None]))
    return pair, to_end, rise, gates


def use(rule: str) -> None:
    kernel_chunks._factors = old_factors if rule == "old" else NEW


if __name__ == "__main__":
    n, repeats = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 7
    names = ["rfa", "ssd", "retnet"]
    built = {f"{name}-x10": LargeInputs(attnzoo.build(name)) for name in names}
    fwd_bwd_ab(n, True, names, repeats, use, built)
