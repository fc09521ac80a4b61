"""What a run shows and measures as it goes: a rich progress bar with loss and throughput, and
peak memory (of a training loop here, of one call in ``bench speed``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _rss(field_name: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field_name}:\s+(\d+) kB", text).group(1)) * 1024


def _libc(function: str, *args: int) -> None:
    import ctypes
    import ctypes.util

    try:
        getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), function)(*args)
    except (OSError, AttributeError):
        pass


def _mallopt(option: int, value: int) -> None:
    _libc("mallopt", option, value)


def _pin_mmap_threshold() -> None:
    """glibc raises its mmap threshold after large blocks are freed, then serves big tensors
    from heap memory that is already resident, hiding them from the RSS peak. A fixed threshold
    (set once) makes every large allocation map fresh pages and unmap them on free; trimming
    first returns free heap memory (left by earlier work) to the system, so what the measured
    call reuses of it is paged in again and counted."""
    _mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    _libc("malloc_trim", 0)


def release_mmap_threshold() -> None:
    """Undo ``_pin_mmap_threshold`` for timing: the threshold and trim limit a long-running
    process reaches on its own (glibc's dynamic maxima, 32 MiB and 64 MiB on 64-bit), so
    temporaries reuse resident heap memory instead of page-faulting on every allocation — as
    in a user's training loop, and for SDPA and every mechanism alike."""
    _mallopt(-3, 32 * 1024 * 1024)  # M_MMAP_THRESHOLD
    _mallopt(-1, 64 * 1024 * 1024)  # M_TRIM_THRESHOLD


class Reporter:
    """A progress bar over training steps (only where ``enabled``: the main process, not --quiet)."""

    def __init__(self, *, enabled: bool, total: int, start: int, title: str, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[speed]} steps/s  {task.fields[note]}"),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task(title, total=total, completed=start, loss="-", speed="-", note="")

    def __enter__(self) -> Reporter:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def step(self, step: int, loss: float, steps_per_s: float) -> None:
        self._progress.update(self._task, completed=step, loss=f"{loss:.3f}", speed=f"{steps_per_s:.1f}")

    def note(self, text: str) -> None:
        self._progress.update(self._task, note=text)


class PeakMemory:
    """Peak memory the training loop adds: CUDA's allocator peak on GPU; on Linux CPUs the growth
    of the resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs) over the
    resident size when measuring started. None where neither is available."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base: int | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            return
        _pin_mmap_threshold()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _rss("VmRSS")
        except OSError:
            self.base = None

    def peak(self) -> int | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return max(_rss("VmHWM") - self.base, 0)
