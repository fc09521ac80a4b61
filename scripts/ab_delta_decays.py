"""A/B of the gated delta rule's chunk decays with the ``eps^4`` floor, in one process (issue 12).

``delta_chunks._intra`` and ``_back_intra`` took ``exp(g)`` and ``exp(g_L - g)`` of the in-chunk
cumulative log decays as they were; with strong decays those reach the denormal range, and the
products they enter slow down (``_ops.decay_floor``). Now ``_decays`` floors them as the kernel
family's ``_factors`` does. The old pair is loaded from git ``c42e0c5`` and swapped in per call;
each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the
repeats), for ``gated_deltanet`` as built and fed ``10 q``, ``10 k`` (``-x10``). Usage: ``python
scripts/ab_delta_decays.py N [REPEATS]`` (causal).
"""

from __future__ import annotations

import sys

from ab_floored_exp import LargeInputs
from ab_timing import fwd_bwd_ab, module_at

import attnzoo
from attnzoo.mechanisms import delta_chunks

OLD = module_at("c42e0c5", "src/attnzoo/mechanisms/delta_chunks.py")
NAMES = ("_intra", "_back_intra")
RULES = {rule: {name: getattr(m, name) for name in NAMES} for rule, m in (("old", OLD), ("new", delta_chunks))}


def use(rule: str) -> None:
    for name, fn in RULES[rule].items():
        setattr(delta_chunks, name, fn)


if __name__ == "__main__":
    n, repeats = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 7
    built = {"gated_deltanet-x10": LargeInputs(attnzoo.build("gated_deltanet"))}
    fwd_bwd_ab(n, True, ["gated_deltanet"], repeats, use, built)
