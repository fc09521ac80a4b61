"""``attnzoo bench decode``: time of one decoding step at given positions. A mechanism with a
recurrent state (``linear``) should cost the same at every position; a KV cache (``softmax``)
grows with it. The state is filled by one prefill step of ``position`` tokens, then single-token
steps are timed (median)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

import attnzoo
from attnzoo.bench.speed import machine


def step_times(
    name: str, config: dict[str, Any], position: int, *, heads: int = 8, dim: int = 64, steps: int = 32
) -> list[float]:
    """Seconds per single-token step after ``position`` tokens (B = 1)."""
    module = attnzoo.build(name, **config).eval()
    g = torch.Generator().manual_seed(0)
    prefill = torch.randn(3, 1, heads, position, dim, generator=g)
    tokens = torch.randn(3, 1, heads, steps + 1, dim, generator=g)
    times = []
    with torch.no_grad():
        state = module.init_state(1, heads, dim, dim, dtype=prefill.dtype, capacity=position + steps + 1)
        _, state = module.step(state, *prefill.unbind(0))
        for t in range(steps + 1):
            q, k, v = (x[:, :, t : t + 1] for x in tokens.unbind(0))
            start = time.perf_counter()
            _, state = module.step(state, q, k, v)
            if t:  # the first step is a warm-up
                times.append(time.perf_counter() - start)
    return times


def run(
    mechanisms: tuple[tuple[str, dict[str, Any]], ...],
    positions: tuple[int, ...],
    command: str,
    heads: int = 8,
    dim: int = 64,
) -> Iterator[dict[str, Any]]:
    from attnzoo.bench.train import git_revision  # as speed.run: train imports the models

    yield {"kind": "meta", **machine(), "git": git_revision(), "command": command}
    for name, config in mechanisms:
        if not attnzoo.describe(name).capabilities.decode_step:
            yield {"kind": "decode", "mechanism": name, "error": f"{name!r} has no decode step"}
            continue
        for position in positions:
            median = statistics.median(step_times(name, config, position, heads=heads, dim=dim))
            yield {
                "kind": "decode",
                "mechanism": name,
                "config": config,
                "position": position,
                "heads": heads,
                "dim": dim,
                "step_s": median,
                "steps_per_s": 1 / median,
            }
