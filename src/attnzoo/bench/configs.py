"""Configs sized for a sequence length, for benchmarks on short sequences.

Most defaults are sized for long inputs (windows of 64, blocks of 64 or 128, 64 landmarks): on
the quick tasks (64–100 tokens) they cover the whole sequence, so `local` or `bigbird` would be
full attention and the comparison would say nothing. Each mechanism's config says how it is
sized for ``n`` tokens (``Config.length_values`` / ``Config.for_length``: roughly a quarter of
the keys per query, blocks of an eighth, a grid or graph fitted to ``n``), so this module keeps
no per-mechanism table: a new mechanism sizes itself.
"""

from __future__ import annotations

from typing import Any

from attnzoo.registry import describe


def sized(name: str, n: int) -> dict[str, Any]:
    """The config values for ``name`` at sequence length ``n``, as keyword arguments for
    ``attnzoo.build`` (only the values that follow the length; ``{}`` where none does).

    >>> sized("local", 64)
    {'left': 16, 'right': 16}
    """
    return describe(name).config.length_values(n)
