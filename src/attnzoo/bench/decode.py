"""``attnzoo bench decode``: time of one decoding step, and the size of the decode state, at
given positions. A mechanism with a recurrent state (``linear``) or a window (``local``) should
cost the same at every position; a KV cache (``softmax``) grows with it. The state is filled by
one prefill step of ``position`` tokens, then single-token steps are timed (median).

By default every causal attention mechanism is run with its default config; one that cannot
decode gets a row with the reason. A default config that does not reach a position (a
synthesizer's ``max_len``, routing's window left to N, a 2-node default graph) is replaced by the
config sized for that length (``Config.length_values``), and the row says so (``sized_for``,
``default_error``); a (mechanism, position) that still fails (e.g. out of memory) gets a row with
the error, so one does not stop the run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

import attnzoo
from attnzoo.bench.speed import machine, summary


def state_bytes(state: Any) -> int:
    """Bytes held by the tensors of a decode state (dataclasses, tuples, lists, dicts walked;
    a storage shared by several tensors counted once). A preallocated cache counts its room."""
    seen: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (tuple, list)):
            for item in x:
                walk(item)
        elif isinstance(x, dict):
            for item in x.values():
                walk(item)

    walk(state)
    return sum(seen.values())


#: Single-token steps timed after the prefill (the first is a warm-up).
STEPS = 32


def step_times(
    name: str,
    config: dict[str, Any],
    position: int,
    *,
    heads: int = 8,
    dim: int = 64,
    steps: int = STEPS,
    max_len: int | None = None,
) -> tuple[list[float], int]:
    """Seconds per single-token step after ``position`` tokens (B = 1), and the state's bytes
    after the last step."""
    shape = attnzoo.Shape(heads=heads, head_dim=dim, value_dim=dim, max_len=max_len)
    module = attnzoo.build(name, shape=shape, **config).eval()
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
    return times, state_bytes(state)


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
        spec = attnzoo.describe(name)
        if not spec.capabilities.decode_step:
            yield {"kind": "decode", "mechanism": name, "error": spec.decoding or f"{name!r} has no decode step"}
            continue
        for position in positions:
            row = {"kind": "decode", "mechanism": name, "config": config, "position": position}
            row |= {"heads": heads, "dim": dim}
            try:
                times, size = step_times(name, config, position, heads=heads, dim=dim)
            except ValueError as error:
                if config:  # a config the user chose: report, do not change it
                    yield {**row, "error": f"ValueError: {error}"}
                    continue
                # A default that does not reach this length (a synthesizer's max_len, routing's
                # window left to N, a default graph of 2 nodes): the config sized for the length
                # the run reaches (and a Shape with that max_len), said so in the row.
                n = position + STEPS + 1
                sized = spec.config.length_values(n)
                row |= {"config": summary(sized), "sized_for": n, "default_error": str(error)}
                try:
                    times, size = step_times(name, sized, position, heads=heads, dim=dim, max_len=n)
                except (ValueError, RuntimeError, MemoryError) as again:
                    yield {**row, "error": f"{type(again).__name__}: {again}"}
                    continue
            except (RuntimeError, MemoryError) as error:  # e.g. out of memory
                yield {**row, "error": f"{type(error).__name__}: {error}"}
                continue
            median = statistics.median(times)
            yield {**row, "step_s": median, "steps_per_s": 1 / median, "state_bytes": size}


def default_mechanisms() -> tuple[tuple[str, dict[str, Any]], ...]:
    """Every causal attention mechanism, with its default config."""
    return tuple((name, {}) for name in attnzoo.names(kind="attention", causal=True))
