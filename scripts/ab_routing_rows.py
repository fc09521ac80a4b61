"""A/B of routing's unpicked queries (non-causal) as extra rows of their cluster's call, against
tiles of their own, in one process (issue 12).

A query no cluster picks attends to the picked keys of its nearest centroid. It ran in tiles of
128 queries, each tile with its own gathered copy of the cluster's w keys and values (at 4K, 112
tiles of 1024 keys: two 29 MiB copies forward and two gradients of that size, fresh pages each
call, backward). ``routing_tiles.SPARE`` now lets them join their cluster's call as extra rows,
over the keys it already gathered; ``SPARE = 0`` is the old rule. Each pair is timed
forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage:
``python scripts/ab_routing_rows.py N NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import swap_main

from attnzoo.mechanisms import routing_tiles

if __name__ == "__main__":
    swap_main(routing_tiles, "SPARE", 0.0, causal=False)
