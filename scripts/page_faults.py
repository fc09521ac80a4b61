"""Minor page faults and time of one causal forward+backward, under a malloc setting (issue 12).

``bench``: the thresholds ``attnzoo bench speed`` runs under (``monitor.release_mmap_threshold``:
glibc's dynamic maxima, as a long-running process reaches them); ``nommap``: no mmap at all
and the heap never trimmed (``M_MMAP_MAX = 0``, ``M_TRIM_THRESHOLD = 1 GiB``), so every
temporary reuses resident memory. The gap between the two is what fresh pages cost the
mechanism. Dense SDPA is timed alongside. Usage: ``python scripts/page_faults.py NAME
bench|nommap N [causal|full]`` (default causal; one process per setting: mallopt is process-wide).
"""

from __future__ import annotations

import ctypes
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench.monitor import release_mmap_threshold


def per_call(fn, repeats: int = 5) -> tuple[float, float]:
    """Median seconds and mean minor faults per call of ``fn``."""
    times, before = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / repeats


def main() -> None:
    name, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    causal = len(sys.argv) < 5 or sys.argv[4] == "causal"
    if mode == "bench":
        release_mmap_threshold()
    elif mode == "nommap":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    else:
        raise SystemExit("mode: bench or nommap")
    attn = attnzoo.build(name)
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, n, 64)
    mechanism = lambda: attn(q, k, v, causal=causal).backward(grad)  # noqa: E731
    dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)  # noqa: E731
    for _ in range(2):
        mechanism()
        dense()
    (t_m, f_m), (t_d, f_d) = per_call(mechanism), per_call(dense)
    print(f"{name} N={n} {'causal' if causal else 'full'} {mode}: {t_m * 1e3:.1f} ms, {f_m:.0f} faults/call;", end=" ")
    print(f"SDPA {t_d * 1e3:.1f} ms, {f_d:.0f} faults/call")


if __name__ == "__main__":
    main()
