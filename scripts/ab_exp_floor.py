"""A/B of the decay matrices' ``exp`` kept on its vector path, in one process (issue 12).

torch's elementwise ``exp`` on CPU leaves its vector path for every value outside about [-87, 88]
in float32 (``_ops.exp_floor``): -inf costs 1.1 ns a value, an underflow 21 ns, against 0.15 in
range. The chunkwise cores built their ``(L, L)`` decay matrices as ``masked_fill(-inf)`` then
``exp`` (half the entries -inf, and strong decays underflowing), and their per-position factors
by ``exp`` of exponents down to any depth. Now the exponents are clamped to ``[floor, 0]`` and
the upper triangle zeroed after ``exp`` (``_ops.lower_decay_exp_``), the factors clamped to the
floor. The old ``kernel_chunks._factors`` (``rfa``, ``performer``, ``retnet``, ``ssd``, ...) and
``delta_chunks._intra`` (``gated_deltanet``) are loaded from git ``c2eb477`` and swapped in per
call; each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median
of the repeats). Usage: ``python scripts/ab_exp_floor.py N CAUSAL(0|1) NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import ab_main, module_at

from attnzoo.mechanisms import delta_chunks, kernel_chunks

SWAPS = (
    (kernel_chunks, "_factors", "src/attnzoo/mechanisms/kernel_chunks.py"),
    (delta_chunks, "_intra", "src/attnzoo/mechanisms/delta_chunks.py"),
)
RULES = {
    (module, name): {"old": getattr(module_at("c2eb477", path), name), "new": getattr(module, name)}
    for module, name, path in SWAPS
}


def use(rule: str) -> None:
    for (module, name), rules in RULES.items():
        setattr(module, name, rules[rule])


if __name__ == "__main__":
    ab_main(use)
