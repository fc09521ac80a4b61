"""Position-based sparse attention (MECHANISMS.md §B): exact softmax attention restricted to a
pattern from ``attnzoo.patterns``, computed by ``attnzoo.attend`` on the configured backend.

Every mechanism here is one config class whose ``make_pattern()`` builds its pattern; the module is
shared. ``backend`` picks how to compute it (``"auto"``, ``"blocked"``, ``"flex"``,
``"reference"``); the reference is dense and exists to test the others. Each config's
``length_values`` says how the pattern is sized for a sequence of ``n`` tokens
(``Config.for_length``): what the benchmarks, the gallery and the backend tests build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from attnzoo import patterns as P
from attnzoo.backends.dispatch import attend
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms import pattern_decode
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.registry import Config, bounded, eighth, quarter, register
from attnzoo.spec import Capabilities, Complexity

Backend = Literal["auto", "blocked", "flex", "reference"]


@dataclass(frozen=True, kw_only=True)
class SparseConfig(Config):
    """Fields every sparse mechanism shares.

    Args:
        backend: how to compute (see ``attnzoo.attend``). Default ``"auto"``.
        block: tile size of the blocked tile plan and of flex (the structured path picks its own). Default 128.
        scale: score scale; default ``1 / sqrt(D)``.
    """

    backend: Backend = "auto"
    block: int = bounded(128, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    def make_pattern(self) -> P.Pattern:
        raise NotImplementedError

    def validate(self) -> None:
        self.make_pattern()  # the pattern factory checks its own arguments


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


class PatternAttention(Attention):
    """Exact attention over ``config.pattern()``; see the module docstring."""

    def __init__(self, config: SparseConfig) -> None:
        super().__init__(config)
        self.pattern = config.make_pattern()

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        cfg = self.config
        return attend(
            q,
            k,
            v,
            pattern=self.pattern,
            causal=args.causal,
            key_padding_mask=args.key_padding_mask,
            score_mod=args.score_mod,
            scale=cfg.scale,
            backend=cfg.backend,
            block=cfg.block,
        )

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """Dense softmax over the pattern's mask (the ``reference`` backend, whatever
        ``config.backend`` says)."""
        pattern = self.pattern.resolve_heads(q.shape[1])
        pattern = pattern & P.causal() if args.causal else pattern
        return reference_attention(
            q,
            k,
            v,
            key_padding_mask=args.key_padding_mask,
            score_mod=args.score_mod,
            scale=self.config.scale,
            mask_mod=pattern.mask_mod_for(q.shape[2], k.shape[2]),
            return_weights=return_weights,
        )

    def _init_state(self, spec: StateSpec) -> Any:
        """The cache the pattern needs (``pattern_decode``): the keys a later row can still see
        for a band with a left end (with key columns: ``sinks``), else every key."""
        return pattern_decode.init_state(self, spec)

    def _step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, Any]:
        """The new tokens' rows of the causal forward (``pattern_decode.step``); ``score_mod``
        sees absolute positions, as in the full forward."""
        return pattern_decode.step(self, state, q, k, v, args)


SELF_ONLY = "defined on a fixed number of positions: self-attention only"


def _register(
    name: str,
    config: type,
    summary: str,
    paper: str,
    *,
    cross: bool = True,
    no_decode: str | None = None,
    notes: tuple[str, ...] = (),
) -> None:
    """Register a pattern mechanism. It decodes (``init_state`` / ``step``) unless ``no_decode``
    says why not: the step needs row t of the causal pattern to be the same whatever the final
    length, which random draws over N, grids of a fixed size and graphs are not."""
    notes = notes or ("causal=True intersects the pattern with j <= i",)
    if no_decode:
        notes = (*notes, f"no decode step: {no_decode}")
    register(
        name,
        config=config,
        family="sparse",
        summary=summary,
        paper=paper,
        capabilities=Capabilities(
            causal=True,
            key_padding=True,
            decode_step=no_decode is None,
            cross_attention=cross,
            score_mod=True,
            backends=("blocked", "flex", "reference"),
        ),
        complexity=Complexity(time="O(N k D), k keys per row", memory="O(N k)", subquadratic_memory=True),
        notes=notes,
    )(PatternAttention)


@dataclass(frozen=True, kw_only=True)
class LocalConfig(SparseConfig):
    """``sliding_window(left, right)``: ``i - left <= j <= i + right``. Defaults 64, 64."""

    left: int = 64
    right: int = 64

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A quarter of the keys on each side."""
        q = quarter(n)
        return dict(left=q, right=q)

    def make_pattern(self) -> P.Pattern:
        return P.sliding_window(self.left, self.right)


@dataclass(frozen=True, kw_only=True)
class DilatedConfig(SparseConfig):
    """``dilated(left, right, dilation)``: ``j = i + dilation * t``, ``t in [-left, right]``."""

    left: int = 32
    right: int = 32
    dilation: int = 2

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """An eighth on each side, every 2nd key: a quarter of the keys spread twice as far."""
        q = quarter(n)
        return dict(left=q // 2, right=q // 2, dilation=2)

    def make_pattern(self) -> P.Pattern:
        return P.dilated(self.left, self.right, self.dilation)


@dataclass(frozen=True, kw_only=True)
class StridedConfig(SparseConfig):
    """``strided(stride)``: ``(i - j) mod stride == 0``."""

    stride: int = 64

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Every 4th key."""
        return dict(stride=4)

    def make_pattern(self) -> P.Pattern:
        return P.strided(self.stride)


@dataclass(frozen=True, kw_only=True)
class GlobalConfig(SparseConfig):
    """``global_tokens(indices)``: the tokens' rows and columns."""

    indices: tuple[int, ...] = (0,)

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """The first token global."""
        return dict(indices=(0,))

    def make_pattern(self) -> P.Pattern:
        return P.global_tokens(self.indices)


@dataclass(frozen=True, kw_only=True)
class RandomConfig(SparseConfig):
    """``random(r, seed)``: ``r`` keys per query row, without replacement."""

    r: int = 64
    seed: int = 0

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A quarter of the keys per query."""
        return dict(r=quarter(n))

    def make_pattern(self) -> P.Pattern:
        return P.random(self.r, self.seed)


@dataclass(frozen=True, kw_only=True)
class BlockLocalConfig(SparseConfig):
    """``block_local(size)``: ``i // size == j // size``."""

    size: int = 128

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Blocks of a quarter of the sequence."""
        return dict(size=quarter(n))

    def make_pattern(self) -> P.Pattern:
        return P.block_local(self.size)


@dataclass(frozen=True, kw_only=True)
class LongformerConfig(SparseConfig):
    """``longformer(window, global_indices, dilation)``; a tuple of dilations gives one head
    group per dilation."""

    window: int = 64
    global_indices: tuple[int, ...] = (0,)
    dilation: int | tuple[int, ...] = 1

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A window of a quarter of the keys and a global first token."""
        return dict(window=quarter(n), global_indices=(0,))

    def make_pattern(self) -> P.Pattern:
        return P.longformer(self.window, self.global_indices, self.dilation)


@dataclass(frozen=True, kw_only=True)
class BigBirdConfig(SparseConfig):
    """``bigbird(block, window_blocks, global_blocks, random_blocks, seed)``; the kernel tile is
    the BigBird block, so every tile is full."""

    block: int = bounded(64, ge=1)
    window_blocks: int = 3
    global_blocks: int = 2
    random_blocks: int = 3
    seed: int = 0

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Blocks of an eighth: three window blocks, one global, one random."""
        return dict(block=eighth(n), window_blocks=3, global_blocks=1, random_blocks=1)

    def make_pattern(self) -> P.Pattern:
        return P.bigbird(self.block, self.window_blocks, self.global_blocks, self.random_blocks, self.seed)


@dataclass(frozen=True, kw_only=True)
class StarConfig(SparseConfig):
    """``star(relay)``: neighbours within 1 (no wrap-around) and one relay token."""

    relay: int = 0

    def make_pattern(self) -> P.Pattern:
        return P.star(self.relay)


@dataclass(frozen=True, kw_only=True)
class ETCConfig(SparseConfig):
    """``etc(window, n_global)``: the first ``n_global`` positions are global."""

    window: int = 64
    n_global: int = 1

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A window of a quarter of the keys and one global token."""
        return dict(window=quarter(n), n_global=1)

    def make_pattern(self) -> P.Pattern:
        return P.etc(self.window, self.n_global)


@dataclass(frozen=True, kw_only=True)
class SinksConfig(SparseConfig):
    """``sinks(sinks, left, right)``: a sliding window plus the first ``sinks`` keys for every
    query (StreamingLLM keeps 4). Causal use (the paper's) cuts ``right`` to 0."""

    sinks: int = bounded(4, ge=1)
    left: int = 64
    right: int = 64

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A quarter of the keys on each side and the first 4 keys (fewer when n is short)."""
        q = quarter(n)
        return dict(sinks=min(4, n), left=q, right=q)

    def make_pattern(self) -> P.Pattern:
        return P.sinks(self.sinks, self.left, self.right)


@dataclass(frozen=True, kw_only=True)
class SparseTransformerStridedConfig(SparseConfig):
    """``sparse_transformer_strided(l)``: half the heads local, half strided (causal)."""

    l: int = 128  # noqa: E741

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Blocks (and stride) of an eighth of the sequence."""
        return dict(l=eighth(n))

    def make_pattern(self) -> P.Pattern:
        return P.sparse_transformer_strided(self.l)


@dataclass(frozen=True, kw_only=True)
class SparseTransformerFixedConfig(SparseConfig):
    """``sparse_transformer_fixed(l, c)``: half the heads block-local, half the summary columns."""

    l: int = 128  # noqa: E741
    c: int = 8

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Blocks of a quarter, up to 4 summary columns each (``c <= l``)."""
        q = quarter(n)
        return dict(l=q, c=min(4, q))  # c <= l

    def make_pattern(self) -> P.Pattern:
        return P.sparse_transformer_fixed(self.l, self.c)


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


@dataclass(frozen=True, kw_only=True)
class GraphConfig(SparseConfig):
    """``graph(edges, n, self_loops)``: ``edges`` as (query, key) pairs on ``n`` nodes."""

    edges: tuple[tuple[int, int], ...] = ((0, 1), (1, 0))
    n: int = 2
    self_loops: bool = True

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A ring with chords on ``n`` nodes (``ring_with_chords``)."""
        return dict(edges=ring_with_chords(n), n=n)

    def make_pattern(self) -> P.Pattern:

        edge_index = torch.tensor(self.edges, dtype=torch.long).reshape(-1, 2).t()
        return P.graph(edge_index, self.n, self.self_loops)


@dataclass(frozen=True, kw_only=True)
class PatternConfig(SparseConfig):
    """Any ``attnzoo.patterns.Pattern``, e.g. ``per_head([...])`` for different head groups."""

    pattern: P.Pattern = P.full()

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Half the heads local, half strided, both at an eighth of the sequence."""
        e = eighth(n)
        return dict(pattern=P.per_head([P.local(e), P.strided(e)]))

    def make_pattern(self) -> P.Pattern:
        return self.pattern


ARXIV = "https://arxiv.org/abs/"
_WINDOW_DECODE = (
    "causal=True intersects the pattern with j <= i",
    "decode step: only the last left (x dilation) keys are kept, O(window) memory and time per token at any position",
)
_RANDOM_OVER_N = "row t's random keys are drawn over the final length N, which a step does not know"
_GRID = "defined on an h x w grid of a fixed size: a prefix of the sequence is not a grid"
_register(
    "local",
    LocalConfig,
    "Sliding-window (local / truncated) attention.",
    "Beltagy et al. 2020 (Longformer), " + ARXIV + "2004.05150",
    notes=_WINDOW_DECODE,
)
_register(
    "dilated",
    DilatedConfig,
    "Dilated sliding window.",
    "Beltagy et al. 2020 (Longformer), " + ARXIV + "2004.05150",
    notes=_WINDOW_DECODE,
)
_register(
    "strided",
    StridedConfig,
    "Every stride-th position.",
    "Child et al. 2019 (Sparse Transformer), " + ARXIV + "1904.10509",
)
_register(
    "global",
    GlobalConfig,
    "Internal global tokens attend to and from all.",
    "Beltagy et al. 2020 (Longformer), " + ARXIV + "2004.05150",
)
_register(
    "random",
    RandomConfig,
    "Random keys per query (fixed per seed and length).",
    "Zaheer et al. 2020 (BigBird), " + ARXIV + "2007.14062",
    no_decode=_RANDOM_OVER_N,
)
_register(
    "block_local",
    BlockLocalConfig,
    "Attention inside non-overlapping blocks.",
    "Qiu et al. 2019 (BlockBERT), " + ARXIV + "1911.02972",
)
_register(
    "longformer",
    LongformerConfig,
    "Sliding window + global tokens (+ dilation per head).",
    "Beltagy et al. 2020, " + ARXIV + "2004.05150",
    notes=(
        "causal=True intersects the pattern with j <= i",
        "one set of projections for every pair: the paper's separate global projections (Q_g, K_g, V_g "
        "for the scores to and from global tokens) are not implemented",
    ),
)
_register(
    "bigbird",
    BigBirdConfig,
    "Block window + global blocks + random blocks.",
    "Zaheer et al. 2020, " + ARXIV + "2007.14062",
    no_decode=_RANDOM_OVER_N,
)
_register(
    "star",
    StarConfig,
    "Neighbours within 1 (a band, no wrap) + one relay token.",
    "Guo et al. 2019 (Star-Transformer), " + ARXIV + "1902.09113",
    notes=(
        "causal=True intersects the pattern with j <= i",
        "satellites see |i - j| <= 1 without wrap-around: the first and last satellites are not linked, "
        "so the paper's ring of satellites is a band here; the relay links everything",
    ),
)
_register(
    "etc", ETCConfig, "External global tokens + sliding window.", "Ainslie et al. 2020 (ETC), " + ARXIV + "2004.08483"
)
_register(
    "sinks",
    SinksConfig,
    "Attention sinks: the first keys for every query + a sliding window.",
    "Xiao et al. 2023 (StreamingLLM), " + ARXIV + "2309.17453",
    notes=(
        "causal=True intersects the pattern with j <= i (the paper's setting)",
        "decode step: only the first sinks keys and the last left keys are kept (O(window + sinks) at any "
        "position); their positions stay absolute, where StreamingLLM re-indexes positions inside its rolling "
        "cache (for RoPE), so the step equals the causal forward exactly",
        "gpt-oss's learned per-head sink logits are not implemented",
    ),
)
_register(
    "sparse_transformer_strided",
    SparseTransformerStridedConfig,
    "Local heads + strided heads.",
    "Child et al. 2019, " + ARXIV + "1904.10509",
    notes=("heads split in two groups; H must be even",),
)
_register(
    "sparse_transformer_fixed",
    SparseTransformerFixedConfig,
    "Block-local heads + summary-column heads.",
    "Child et al. 2019, " + ARXIV + "1904.10509",
    notes=("heads split in two groups; H must be even",),
)
_register(
    "block2d",
    Block2DConfig,
    "Image Transformer 2-D block-local attention.",
    "Parmar et al. 2018, " + ARXIV + "1802.05751",
    cross=False,
    notes=(
        "not a drop-in for pretrained attention: needs an h x w image grid (N = h * w); "
        "text is 1-D and of varying length",
        SELF_ONLY,
        "causal=True is j <= i in raster (row-major) order, not the paper's block-raster "
        "generation order: with 2 x 2 query blocks and a margin, pixel (1, 0) sees (0, 2), "
        "which block-raster order generates later",
    ),
    no_decode=_GRID,
)
_register(
    "axial",
    AxialConfig,
    "Same row or same column of a 2-D grid under one softmax (criss-cross-like).",
    "Huang et al. 2019 (CCNet criss-cross attention), " + ARXIV + "1811.11721",
    cross=False,
    notes=(
        "not a drop-in for pretrained attention: needs an h x w image grid (N = h * w); "
        "text is 1-D and of varying length",
        SELF_ONLY,
        "one softmax over the union of the row and the column (h + w - 1 keys), the criss-cross "
        "pattern; not Ho et al. 2019's axial attention (" + ARXIV + "1912.12180), which is a row pass then "
        "a column pass, each with its own softmax and projections: that is attnzoo.nn.AxialAttention",
        "causal=True intersects the pattern with j <= i",
    ),
    no_decode=_GRID,
)
_register(
    "graph",
    GraphConfig,
    "Attention along the edges of a graph.",
    "Velickovic et al. 2018 (GAT), " + ARXIV + "1710.10903",
    cross=False,
    notes=(
        "not a drop-in for pretrained attention: needs a graph (edge list) as input",
        SELF_ONLY,
    ),
    no_decode="the edge list is given for a fixed number of nodes",
)
_register(
    "pattern",
    PatternConfig,
    "Any attnzoo.patterns.Pattern (per_head for mixed heads).",
    "see attnzoo.patterns",
    notes=(
        "causal=True intersects the pattern with j <= i",
        "not a drop-in for pretrained attention: needs a Pattern object; the named patterns cover it",
    ),
    no_decode="an arbitrary Pattern may depend on the final length (use a named mechanism to decode)",
)
