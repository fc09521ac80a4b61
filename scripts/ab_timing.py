"""The timing loop of the one-process A/B scripts (``ab_pad_rows.py``, ``ab_forward_blocks.py``):
dense SDPA, then each mechanism under the old and the new rule, round after round, the rules'
order alternating per round; medians after the first round (a warm-up), and each median as a
ratio to SDPA's."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def interleaved(
    mechanisms: dict[str, Any],
    use: Callable[[str], None],
    dense: Callable[[], Any],
    timed: Callable[[Callable[[], Any]], float],
    repeats: int,
    title: str,
) -> None:
    """Print ``title`` with SDPA's median, then each mechanism's median under ``use("old")`` and
    ``use("new")``; ``timed(fn)`` times one call of ``fn`` (forward, or forward and backward)."""
    times: dict[tuple[str, str], list[float]] = {(name, r): [] for name in mechanisms for r in ("old", "new")}
    dense_times = []
    for i in range(repeats + 1):
        dense_times.append(timed(dense))
        for name, attn in mechanisms.items():
            for rule in ("old", "new") if i % 2 == 0 else ("new", "old"):
                use(rule)
                times[(name, rule)].append(timed(attn))
    sdpa = statistics.median(dense_times[1:])  # the first round warms up
    print(f"{title} SDPA {sdpa * 1e3:.1f} ms")
    for (name, rule), ts in times.items():
        median = statistics.median(ts[1:])
        print(f"{name:28s} {rule}: {median * 1e3:7.2f} ms  {sdpa / median:5.2f}x SDPA")
