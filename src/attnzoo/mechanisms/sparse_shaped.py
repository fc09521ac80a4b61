"""The sparse mechanisms defined on one shape of input (MECHANISMS.md §B): an ``h x w`` image
grid (``block2d``, ``axial``) or a graph on ``n`` nodes (``graph``). Like those in ``sparse.py``
they run as ``PatternAttention``; unlike them they are self-attention only and do not decode (a
prefix of the sequence is not a grid, nor the graph). Their ``length_values`` fit the shape to a
sequence of ``n`` tokens (``square_grid``, ``ring_with_chords``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attnzoo import patterns as P
from attnzoo.mechanisms.pattern_attention import CAUSAL_NOTE, SparseConfig, register_pattern


def square_grid(n: int) -> tuple[int, int]:
    """The most square ``h x w = n``: the grid a 2-D pattern is fitted to at length ``n``."""
    h = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return h, n // h


def ring_with_chords(n: int) -> tuple[tuple[int, int], ...]:
    """Edges of a graph on ``n`` nodes for graph mechanisms at length ``n``: a ring both ways
    (each node sees its neighbours) plus a chord from every 8th node to the opposite one (so
    information also travels across), about 2 edges per node."""
    ring = tuple((i, (i + s) % n) for i in range(n) for s in (1, -1))
    return ring + tuple((i, (i + n // 2) % n) for i in range(0, n, 8))


@dataclass(frozen=True, kw_only=True)
class EdgeList:
    """The fields of a mechanism on a graph (``graph`` here, ``graph_attention``): ``edges`` as
    ``(query, key)`` pairs, node ``query`` attending to node ``key``, on ``n`` nodes (inputs must
    have N = n), with ``(i, i)`` added for every node when ``self_loops``. Defaults: a 2-cycle on
    2 nodes, self-loops."""

    edges: tuple[tuple[int, int], ...] = ((0, 1), (1, 0))
    n: int = 2
    self_loops: bool = True

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A ring with chords on ``n`` nodes (``ring_with_chords``)."""
        return dict(edges=ring_with_chords(n), n=n)

    def graph(self) -> P.Graph:
        edge_index = torch.tensor(self.edges, dtype=torch.long).reshape(-1, 2).t()
        return P.graph(edge_index, self.n, self.self_loops)


_GRID = "defined on an h x w grid of a fixed size: a prefix of the sequence is not a grid"
_GRID_INPUT = (
    "not a drop-in for pretrained attention: needs an h x w image grid (N = h * w); text is 1-D and of varying length"
)
_SELF_ONLY = "defined on a fixed number of positions: self-attention only"


@register_pattern(
    "block2d",
    "Image Transformer 2-D block-local attention.",
    "Parmar et al. 2018, https://arxiv.org/abs/1802.05751",
    cross=False,
    notes=(
        _GRID_INPUT,
        _SELF_ONLY,
        "causal=True is j <= i in raster (row-major) order, not the paper's block-raster "
        "generation order: with 2 x 2 query blocks and a margin, pixel (1, 0) sees (0, 2), "
        "which block-raster order generates later",
    ),
    no_decode=_GRID,
)
@dataclass(frozen=True, kw_only=True)
class Block2DConfig(SparseConfig):
    """``block2d(h, w, query_block, memory_margin)`` on a row-major ``h x w`` image."""

    h: int = 32
    w: int = 32
    query_block: tuple[int, int] = (8, 8)
    memory_margin: tuple[int, int] = (4, 4)

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """The most square grid of ``n`` cells, query blocks of half its sides."""
        h, w = square_grid(n)
        return dict(h=h, w=w, query_block=(max(1, h // 2), max(1, w // 2)), memory_margin=(1, 1))

    def make_pattern(self) -> P.Pattern:
        return P.block2d(self.h, self.w, self.query_block, self.memory_margin)


@register_pattern(
    "axial",
    "Same row or same column of a 2-D grid under one softmax (criss-cross-like).",
    "Huang et al. 2019 (CCNet criss-cross attention), https://arxiv.org/abs/1811.11721",
    cross=False,
    notes=(
        _GRID_INPUT,
        _SELF_ONLY,
        "one softmax over the union of the row and the column (h + w - 1 keys), the criss-cross "
        "pattern; not Ho et al. 2019's axial attention (https://arxiv.org/abs/1912.12180), which is a row "
        "pass then a column pass, each with its own softmax and projections: that is attnzoo.nn.AxialAttention",
        CAUSAL_NOTE,
    ),
    no_decode=_GRID,
)
@dataclass(frozen=True, kw_only=True)
class AxialConfig(SparseConfig):
    """``axial(h, w)``: same row or column of a row-major ``h x w`` grid, one softmax over both
    (criss-cross); Ho et al.'s two-pass axial attention is ``attnzoo.nn.AxialAttention``."""

    h: int = 32
    w: int = 32

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """The most square grid of ``n`` cells."""
        h, w = square_grid(n)
        return dict(h=h, w=w)

    def make_pattern(self) -> P.Pattern:
        return P.axial(self.h, self.w)


@register_pattern(
    "graph",
    "Attention along the edges of a graph.",
    "Velickovic et al. 2018 (GAT), https://arxiv.org/abs/1710.10903",
    cross=False,
    notes=("not a drop-in for pretrained attention: needs a graph (edge list) as input", _SELF_ONLY),
    no_decode="the edge list is given for a fixed number of nodes",
)
@dataclass(frozen=True, kw_only=True)
class GraphConfig(EdgeList, SparseConfig):
    """``graph(edges, n, self_loops)``: ``edges`` as (query, key) pairs on ``n`` nodes."""

    def make_pattern(self) -> P.Pattern:
        return self.graph()
