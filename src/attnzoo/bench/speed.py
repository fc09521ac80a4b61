"""``attnzoo bench speed``: forward and forward+backward time, peak memory and useful GFLOP/s of
registered mechanisms, each against dense ``scaled_dot_product_attention`` measured in the same
run (this machine is shared and noisy, so only same-run ratios are meaningful).

Every ratio comes from the mechanism and SDPA timed *interleaved* (SDPA, mechanism, SDPA, ...)
after both are warmed up: the median of the pairwise ratios, with its spread. Rows carry the
pattern's ``density`` (pairs attended / pairs SDPA computes) and the ``density_bound`` 1/density,
and each fit line the ``crossover_n`` (smallest N from which the mechanism beats SDPA).

Before timing, each mechanism is checked against its reference at the benchmark's N (up to
1024; at 300 above that, or at N for a mechanism defined on one length); a mechanism that fails
the check is reported as failed and gets no speed-up figure. A default config that is not
defined at N (``axial``'s 32 x 32 grid) is sized for N (``Config.length_values``), and the row
says so (``sized_for``); a config given on the command line is never changed.
"""

from __future__ import annotations

import ast
import datetime
import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench.monitor import PeakMemory, release_mmap_threshold
from attnzoo.mechanisms.base import Attention
from attnzoo.registry import check_values, config_fields

CHECK_N = 300
CHECK_MAX_N = 1024


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One benchmark configuration (``attnzoo bench speed`` flags)."""

    mechanisms: tuple[tuple[str, dict[str, Any]], ...]
    backends: tuple[str, ...] = ("auto",)
    sizes: tuple[int, ...] = (1024, 4096, 16384)
    batch: int = 1
    heads: int = 8
    dim: int = 64
    #: run every size non-causal, causal, or both: ``(False,)``, ``(True,)``, ``(False, True)``.
    causal_modes: tuple[bool, ...] = (False,)
    repeats: int = 5
    backward: bool = True
    sdpa_max_n: int = 16384
    #: where inputs and modules live: "cpu" or "cuda" (timings then synchronize the device).
    device: str = "cpu"
    #: q and k are unit-variance Gaussians times this (SDPA's and the mechanism's alike; v stays
    #: unit variance): a trained model's are often several times larger, and peaky scores slow
    #: some kernels down (denormal weights, features or sums; torch's CPU flash backward).
    input_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.input_scale, int | float) and math.isfinite(self.input_scale) and self.input_scale > 0):
            raise ValueError(f"input_scale (--input-scale) must be a finite number > 0, got {self.input_scale!r}")
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: no CUDA device is available here; use --device cpu")


def parse_mechanism(text: str, settings: tuple[str, ...] | list[str] = ()) -> tuple[str, dict[str, Any]]:
    """``"local:left=256,right=256"`` -> ``("local", {"left": 256, "right": 256})``; values are
    Python literals (numbers, tuples, strings). ``settings`` (``--set KEY=VALUE`` items) are
    merged over the ones after the colon. Unknown keys and values of the wrong type raise a
    ``ValueError`` naming them."""
    name, _, rest = text.partition(":")
    attnzoo.describe(name)
    config = parse_settings(rest, where=text)
    for item in settings:
        config.update(parse_settings(item, where=f"--set {item}"))
    config = {key: _read_pattern(name, key, value) for key, value in config.items()}
    check_values(name, config)
    return name, config


def _read_pattern(name: str, key: str, value: Any) -> Any:
    """A text value of a field typed ``Pattern`` read as one (``attnzoo.patterns.parse``)."""
    field_type = config_fields(name).get(key, ("", None))[0]
    return attnzoo.patterns.parse(value) if isinstance(value, str) and field_type == "Pattern" else value


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside every (), [] and {} pair."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"settings {text!r} have unbalanced brackets; close every (, [ and {{ in a value")
    return [*parts, text[start:]]


def parse_settings(text: str, *, where: str = "") -> dict[str, Any]:
    """``"left=256,indices=(0, 5)"`` -> ``{"left": 256, "indices": (0, 5)}``: comma-separated
    ``key=value`` pairs (commas inside brackets of any kind belong to the value, so
    ``pattern=per_head[local(8), strided(8)]`` is one pair); a value that is not a Python literal
    stays a string."""
    config: dict[str, Any] = {}
    for item in filter(None, _top_level_split(text)):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"settings are key=value pairs, got {item!r} in {where or text!r}")
        try:
            config[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            config[key.strip()] = value.strip()
    return config


def machine(device: str = "cpu") -> dict[str, Any]:
    """Where a benchmark ran: the CPU, and the accelerator for ``device="cuda"``."""
    gpu = {"device": torch.cuda.get_device_name(device)} if torch.device(device).type == "cuda" else {}
    return {
        **gpu,
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        **_cpu_flags(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


#: The CPU features that change which kernels torch runs (and so the speed figures): two machines
#: may share a processor name (a cloud VM's "Intel(R) Xeon(R) Processor") and not these.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve", "sve2")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_model() -> str:
    match = re.search(r"model name\s*:\s*(.+)", _cpuinfo())
    return match.group(1).strip() if match else "unknown"


def _cpu_flags() -> dict[str, Any]:
    """``cpu_flags``: which of ``CPU_FLAGS`` the CPU has (from /proc/cpuinfo's flags, or features on
    ARM), and ``cpu_capability``: the vector ISA torch's CPU kernels were dispatched to; each left
    out where it cannot be read."""
    found = {}
    match = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", _cpuinfo(), re.MULTILINE)
    if match:
        have = set(match.group(1).split())
        found["cpu_flags"] = [flag for flag in CPU_FLAGS if flag in have]
    capability = getattr(torch.backends.cpu, "get_cpu_capability", None)
    if capability is not None:
        found["cpu_capability"] = capability()
    return found


def peak_memory(fn: Callable[[], Any], device: str = "cpu") -> int | None:
    """Bytes the call adds to the peak: the process's resident set on the CPU, the allocator's
    peak on CUDA (``monitor.PeakMemory``); None where that is not available."""
    memory = PeakMemory(torch.device(device))
    if memory.base is None:
        return None
    result = fn()
    del result
    peak = memory.peak()
    if memory.device.type == "cpu":
        release_mmap_threshold()  # the probe's pinned threshold would make every later timing page-fault
    return peak


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (and compilation, for flex)
    return statistics.median(_clock(fn) for _ in range(repeats))


def _synchronize() -> None:
    if torch.cuda.is_initialized():  # GPU work is queued: wait for it (a no-op on CPU-only runs)
        torch.cuda.synchronize()


def _clock(fn: Callable[[], Any]) -> float:
    _synchronize()
    start = time.perf_counter()
    fn()
    _synchronize()
    return time.perf_counter() - start


def interleaved(reference: Callable[[], Any], fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Time ``reference`` and ``fn`` alternately (A, B, A, B, ...) after warming both up twice,
    so both see the same machine state; the ratio is the median of the pairwise ratios
    ``reference / fn`` (> 1: ``fn`` is faster), with its spread (min, max)."""
    for _ in range(2):
        reference()
        fn()
    pairs = [(_clock(reference), _clock(fn)) for _ in range(repeats)]
    ratios = sorted(a / b for a, b in pairs)
    return {
        "reference_s": statistics.median(a for a, _ in pairs),
        "s": statistics.median(b for _, b in pairs),
        "ratio": statistics.median(ratios),
        "spread": [ratios[0], ratios[-1]],
    }


def matmul_gflops(n: int = 2048, repeats: int = 3, device: str = "cpu") -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / median_time(lambda: a @ b, repeats) / 1e9


def _inputs(setting: Setting, n: int, requires_grad: bool) -> tuple[torch.Tensor, ...]:
    """``(q, k, v)``, each ``(B, H, n, D)``: unit-variance Gaussians, q and k times ``input_scale``."""
    shape = (setting.batch, setting.heads, n, setting.dim)
    scales = (setting.input_scale, setting.input_scale, 1.0)
    return tuple((torch.randn(shape, device=setting.device) * s).requires_grad_(requires_grad) for s in scales)


def _build(name: str, config: dict[str, Any], backend: str, device: str = "cpu") -> torch.nn.Module:
    if backend != "auto" and "backend" in config_fields(name):
        config = {**config, "backend": backend}
    return attnzoo.build(name, **config).to(device)


def _fwd_bwd(
    module: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> None:
    for x in (q, k, v):
        x.grad = None
    out = module(q, k, v, causal=causal)
    # A dense gradient, as a loss downstream gives: ``out.sum().backward()`` would hand the
    # backward an expanded (stride-0) tensor, which sends CPU batched matmuls down a slow path.
    out.backward(torch.ones_like(out))


def check(
    name: str, config: dict[str, Any], backend: str, setting: Setting, causal: bool, n: int = CHECK_N
) -> tuple[float, str]:
    """Max abs difference at ``n`` against the mechanism's reference, and how it was
    checked: the ``reference`` backend where the mechanism has a backend switch, else its
    ``implied_attention(q, k) @ v`` (the matrix its reference computes), or its ``reference``
    where the output is not ``weights @ v`` (``Capabilities.weights_apply_to_v``)."""
    fast = _build(name, config, backend, setting.device).eval()
    small = Setting(
        mechanisms=(),
        batch=1,
        heads=setting.heads,
        dim=setting.dim,
        device=setting.device,
        input_scale=setting.input_scale,
    )
    q, k, v = _inputs(small, n, False)
    with torch.no_grad():
        out = fast(q, k, v, causal=causal)
        if "backend" in config_fields(name):
            want = _build(name, config, "reference", setting.device)(q, k, v, causal=causal)
            how = "reference backend"
        elif isinstance(fast, Attention) and fast.spec.capabilities.weights_apply_to_v:
            want, how = fast.implied_attention(q, k, causal=causal) @ v, "implied_attention @ v"
        elif isinstance(fast, Attention):  # a gate, norm or latent around the weights: the whole reference
            want, how = fast.reference(q, k, v, causal=causal), "reference"
        else:
            return float("nan"), "unchecked"
    return float((out - want).abs().max()), how


def useful_pairs(module: torch.nn.Module, n: int, causal: bool) -> float | None:
    """Pairs per (batch, head) the mechanism attends: the pattern's pairs, all pairs for exact
    attention, its budget where it declares one (``Attention.keys_per_query``: ``topk``, ``sac``,
    ``hierarchical``, ``moba``, ``nsa``, ``dsa``), None where the pairs depend on the data (no
    density bound or GFLOP/s is reported then)."""
    pattern = getattr(module, "pattern", None)
    if pattern is None:
        if module.spec.family == "exact":
            return n * (n + 1) / 2 if causal else float(n * n)
        keys = module.keys_per_query(n, causal) if isinstance(module, Attention) else None
        return None if keys is None else keys * n
    if causal:
        pattern = pattern & attnzoo.patterns.causal()
    return pattern.density(n, block=128) * n * n


def density(pairs: float | None, n: int, causal: bool) -> float | None:
    """Pairs attended over the pairs dense SDPA computes at the same causality (its causal
    kernel skips the upper triangle): ``1 / density`` is the speed-up bound."""
    if pairs is None:
        return None
    return pairs / (n * (n + 1) / 2 if causal else float(n * n))


def run_one(name: str, config: dict[str, Any], backend: str, n: int, setting: Setting, causal: bool) -> dict[str, Any]:
    """Time one mechanism at one size against dense SDPA, interleaved (see ``interleaved``)."""
    row: dict[str, Any] = {
        "kind": "speed",
        "mechanism": name,
        "config": config,
        "backend": backend,
        "n": n,
        "batch": setting.batch,
        "heads": setting.heads,
        "dim": setting.dim,
        "causal": causal,
    }
    if setting.input_scale != 1:
        row["input_scale"] = setting.input_scale
    if attnzoo.describe(name).capabilities.kind == "mixer":
        return _run_mixer(row, name, config, n, setting, causal)
    module = _build(name, config, backend, setting.device).eval()
    # Checked at the benchmark's own N up to CHECK_MAX_N, else at CHECK_N; a mechanism defined on
    # one length only (a 32 x 32 grid) refuses CHECK_N and is checked at its own.
    try:
        error = check(name, config, backend, setting, causal, n if n <= CHECK_MAX_N else CHECK_N)
    except ValueError:
        error = check(name, config, backend, setting, causal, n)
    row["max_abs_error_vs_reference"], row["checked_by"] = error
    row["correct"] = row["max_abs_error_vs_reference"] < 1e-3
    q, k, v = _inputs(setting, n, False)
    forward = lambda: module(q, k, v, causal=causal)  # noqa: E731
    with torch.no_grad():
        timed = interleaved(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), forward, setting.repeats)
        row["forward_s"], row["sdpa_forward_s"] = timed["s"], timed["reference_s"]
        row["peak_forward_bytes"] = peak_memory(forward, setting.device)
    choice = attnzoo.last_choice() if hasattr(module, "pattern") else None
    row["backend_ran"] = name if choice is None else choice.backend + (f" ({choice.path})" if choice.path else "")
    if choice is not None and choice.skipped:  # why auto passed over the backends before it
        row["backends_skipped"] = choice.skipped
    pairs = useful_pairs(module, n, causal)
    row["density"] = density(pairs, n, causal)
    if row["density"]:
        row["density_bound"] = 1 / row["density"]
    if pairs is not None:
        row["useful_gflops"] = 4 * pairs * setting.dim * setting.batch * setting.heads / row["forward_s"] / 1e9
    if row["correct"]:
        row["speedup_forward_vs_sdpa"], row["speedup_forward_spread"] = timed["ratio"], timed["spread"]
    if setting.backward and (backend != "flex" or setting.device != "cpu"):  # flex has no CPU backward
        qg, kg, vg = _inputs(setting, n, True)
        timed = interleaved(
            lambda: _fwd_bwd(_sdpa, qg, kg, vg, causal), lambda: _fwd_bwd(module, qg, kg, vg, causal), setting.repeats
        )
        row["forward_backward_s"], row["sdpa_forward_backward_s"] = timed["s"], timed["reference_s"]
        if row["correct"]:
            row["speedup_forward_backward_vs_sdpa"] = timed["ratio"]
            row["speedup_forward_backward_spread"] = timed["spread"]
    blocks_ms = _blocks_ms(module, n)
    if blocks_ms is not None:
        row["blocks_ms"] = blocks_ms
    return row


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _run_mixer(
    row: dict[str, Any], name: str, config: dict[str, Any], n: int, setting: Setting, causal: bool
) -> dict[str, Any]:
    """Token mixers take the layer input ``x (B, N, H * D)``: time that. There is no reference
    to check against, so no speed-up is claimed (``correct`` is None)."""
    width = setting.heads * setting.dim
    module = attnzoo.build(name, shape=attnzoo.Shape(max_len=max(n, 512)), **{"dim": width, **config})
    module = module.to(setting.device).eval()
    x = torch.randn(setting.batch, n, width, device=setting.device)
    with torch.no_grad():
        row["forward_s"] = median_time(lambda: module(x, causal=causal), setting.repeats)
        row["peak_forward_bytes"] = peak_memory(lambda: module(x, causal=causal), setting.device)
    row.update(backend_ran=name, correct=None, checked_by="unchecked (token mixer: no reference)")
    return row


def _blocks_ms(module: torch.nn.Module, n: int) -> float | None:
    pattern, config = getattr(module, "pattern", None), getattr(module, "config", None)
    if pattern is None or not hasattr(config, "backend_tile"):
        return None
    block = config.backend_tile()
    from attnzoo.patterns.atomic import sample_without_replacement

    sample_without_replacement.cache_clear()  # time a cold call, random tables included
    start = time.perf_counter()
    pattern.resolve_heads(2 * getattr(pattern, "n_groups", 1)).blocks(n, n, block)
    return (time.perf_counter() - start) * 1e3


def sdpa_row(n: int, setting: Setting, causal: bool) -> dict[str, Any]:
    """Dense SDPA's own times at ``n`` (warmed up twice), for plots; the ratios in the
    mechanism rows come from their own interleaved pairs, not from this row."""
    q, k, v = _inputs(setting, n, False)
    with torch.no_grad():
        _sdpa(q, k, v, causal)
        row = {
            "kind": "sdpa",
            "n": n,
            "causal": causal,
            **({"input_scale": setting.input_scale} if setting.input_scale != 1 else {}),
            "forward_s": median_time(lambda: _sdpa(q, k, v, causal), setting.repeats),
            "peak_forward_bytes": peak_memory(lambda: _sdpa(q, k, v, causal), setting.device),
        }
    if setting.backward:
        qg, kg, vg = _inputs(setting, n, True)
        _fwd_bwd(_sdpa, qg, kg, vg, causal)
        row["forward_backward_s"] = median_time(lambda: _fwd_bwd(_sdpa, qg, kg, vg, causal), setting.repeats)
    return row


def run(setting: Setting) -> Iterator[dict[str, Any]]:
    """Yield the meta line, then per causality and size one SDPA line and one line per
    mechanism and backend, then the fits. Failures are lines with an ``error`` field."""
    from attnzoo.bench.train import git_revision

    meta = {"kind": "meta", **machine(setting.device), "git": git_revision()}
    yield {**meta, "matmul_2048_gflops": matmul_gflops(device=setting.device), **setting.extra}
    done: list[dict[str, Any]] = []
    for causal in setting.causal_modes:
        for n in setting.sizes:
            if n <= setting.sdpa_max_n:
                yield sdpa_row(n, setting, causal)
            for name, config in setting.mechanisms:
                if not causal and not attnzoo.describe(name).capabilities.bidirectional:
                    continue  # defined causally only (nsa): no non-causal row to measure
                for backend in setting.backends:
                    row = _run_or_size(name, config, backend, n, setting, causal)
                    if "error" not in row:
                        done.append(row)
                    yield row
    yield from fits(done)


def _run_or_size(name: str, config: dict[str, Any], backend: str, n: int, setting: Setting, causal: bool) -> dict:
    """``run_one``'s row, or one with an ``error``. A default config that is not defined at
    ``n`` (``axial``'s 32 x 32 grid) is sized for ``n`` (``Config.length_values``) and the row
    says so (``sized_for``, ``default_error``); a config the user chose is never changed."""
    try:
        return run_one(name, config, backend, n, setting, causal)
    except (ValueError, TypeError, RuntimeError) as error:
        failed = {"kind": "speed", "mechanism": name, "config": config, "backend": backend, "n": n, "causal": causal}
        failed["error"] = f"{type(error).__name__}: {error}"
        if config or not isinstance(error, ValueError):
            return failed
        sized = attnzoo.describe(name).config.length_values(n)
        if not sized:
            return failed
        note = {"sized_for": n, "default_error": str(error)}
        try:
            row = run_one(name, sized, backend, n, setting, causal)
        except (ValueError, TypeError, RuntimeError) as again:
            return {**failed, "config": summary(sized), **note, "error": f"{type(again).__name__}: {again}"}
        return {**row, "config": summary(sized), **note}


def summary(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` for a result row: a long sequence (a sized graph's edge list) as its length."""
    return {k: f"<{len(v)} items>" if isinstance(v, (tuple, list)) and len(v) > 16 else v for k, v in config.items()}


def fitted_exponent(sizes: list[int], values: list[float]) -> float | None:
    """Slope of log(value) against log(N): 1 is linear, 2 quadratic. None with < 2 points."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values) if v and v > 0]
    if len(points) < 2:
        return None
    xs, ys = zip(*points)
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)


def fits(rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One line per (mechanism, config, backend) measured at two or more sizes. A default sized
    for each N (``sized_for``) counts as the default: its sizes fit together."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        config = {} if "sized_for" in row else row["config"]
        key = [row["mechanism"], config, row["backend"], row.get("causal", False)]
        groups.setdefault(json.dumps(key, default=str), []).append(row)
    for group in groups.values():
        if len(group) < 2:
            continue
        sizes = [r["n"] for r in group]
        yield {
            "kind": "fit",
            "mechanism": group[0]["mechanism"],
            "config": {} if "sized_for" in group[0] else group[0]["config"],
            "backend": group[0]["backend"],
            "causal": group[0].get("causal", False),
            "sizes": sizes,
            "crossover_n": crossover(group),
            "time_exponent": fitted_exponent(sizes, [r["forward_s"] for r in group]),
            "memory_exponent": fitted_exponent(sizes, [r.get("peak_forward_bytes") for r in group]),
        }


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """The smallest N in the sweep from which the mechanism beats SDPA (forward+backward where
    measured, else forward) at that N and every larger N measured; None if it never does."""
    metric = (
        "speedup_forward_backward_vs_sdpa"
        if any("speedup_forward_backward_vs_sdpa" in r for r in rows)
        else "speedup_forward_vs_sdpa"
    )
    best = None
    for row in sorted(rows, key=lambda r: r["n"], reverse=True):
        if (row.get(metric) or 0) < 1:
            break
        best = row["n"]
    return best


def write_lines(rows: Iterator[dict[str, Any]], out: Path | None, echo: Callable[[dict], None]) -> list[dict]:
    collected = []
    handle = out.open("w") if out else None
    try:
        for row in rows:
            collected.append(row)
            echo(row)
            if handle:
                handle.write(json.dumps(row, default=str) + "\n")
                handle.flush()
    finally:
        if handle:
            handle.close()
    return collected
