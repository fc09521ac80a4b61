"""The named position-based sparse mechanisms (MECHANISMS.md §B): one config per pattern of
``attnzoo.patterns``, registered by ``register_pattern`` just above it; every one of them runs as
``PatternAttention`` (``pattern_attention.py``), on the backend its ``backend`` field picks.

Each config's ``length_values`` says how the pattern is sized for a sequence of ``n`` tokens
(``Config.for_length``): what the benchmarks, the gallery and the backend tests build. The
mechanisms defined on one shape of input (a grid, a graph) are in ``sparse_shaped.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnzoo import patterns as P
from attnzoo.mechanisms.pattern_attention import CAUSAL_NOTE, GLOBAL_DECODE, SparseConfig, register_pattern
from attnzoo.registry import bounded, eighth, quarter

_LONGFORMER = "Beltagy et al. 2020 (Longformer), https://arxiv.org/abs/2004.05150"
_CHILD = "Child et al. 2019, https://arxiv.org/abs/1904.10509"
_WINDOW_DECODE = (
    CAUSAL_NOTE,
    "decode step: only the last left (x dilation) keys are kept, O(window) memory and time per token at any position",
)
_TWO_GROUPS = ("heads split in two groups; H must be even",)
_RANDOM_OVER_N = "row t's random keys are drawn over the final length N, which a step does not know"


@register_pattern("local", "Sliding-window (local / truncated) attention.", _LONGFORMER, notes=_WINDOW_DECODE)
@dataclass(frozen=True, kw_only=True)
class LocalConfig(SparseConfig):
    """``sliding_window(left, right)``: ``i - left <= j <= i + right``. Defaults 64, 64."""

    left: int = bounded(64, for_length=quarter)
    right: int = bounded(64, for_length=quarter)

    def make_pattern(self) -> P.Pattern:
        return P.sliding_window(self.left, self.right)


@register_pattern("dilated", "Dilated sliding window.", _LONGFORMER, notes=_WINDOW_DECODE)
@dataclass(frozen=True, kw_only=True)
class DilatedConfig(SparseConfig):
    """``dilated(left, right, dilation)``: ``j = i + dilation * t``, ``t in [-left, right]``."""

    # for_length: an eighth on each side, every 2nd key: a quarter of the keys spread twice as far.
    left: int = bounded(32, for_length=lambda n: quarter(n) // 2)
    right: int = bounded(32, for_length=lambda n: quarter(n) // 2)
    dilation: int = bounded(2, for_length=2)

    def make_pattern(self) -> P.Pattern:
        return P.dilated(self.left, self.right, self.dilation)


@register_pattern(
    "logsparse",
    "LogSparse: each position and the positions at distances 1, 2, 4, ... (causal in the paper).",
    "Li et al. 2019 (LogSparse Transformer), https://arxiv.org/abs/1907.00235",
    notes=(CAUSAL_NOTE, "non-causal: the distances go both ways (the paper's setting is causal)"),
)
@dataclass(frozen=True, kw_only=True)
class LogSparseConfig(SparseConfig):
    """``logsparse(levels)``: ``|i - j|`` in ``{0, 1, 2, 4, ..., 2^(levels - 1)}``. Default 12:
    distances up to 2048, the paper's pattern up to N = 4096."""

    # for_length: every power of two below n, the paper's pattern at that length.
    levels: int = bounded(12, ge=1, for_length=lambda n: max(1, (n - 1).bit_length()))

    def make_pattern(self) -> P.Pattern:
        return P.logsparse(self.levels)


@register_pattern(
    "strided", "Every stride-th position.", "Child et al. 2019 (Sparse Transformer), https://arxiv.org/abs/1904.10509"
)
@dataclass(frozen=True, kw_only=True)
class StridedConfig(SparseConfig):
    """``strided(stride)``: ``(i - j) mod stride == 0``."""

    stride: int = bounded(64, for_length=4)

    def make_pattern(self) -> P.Pattern:
        return P.strided(self.stride)


@register_pattern("global", "Internal global tokens attend to and from all.", _LONGFORMER)
@dataclass(frozen=True, kw_only=True)
class GlobalConfig(SparseConfig):
    """``global_tokens(indices)``: the tokens' rows and columns."""

    indices: tuple[int, ...] = (0,)

    def make_pattern(self) -> P.Pattern:
        return P.global_tokens(self.indices)


@register_pattern(
    "random",
    "Random keys per query (fixed per seed and length).",
    "Zaheer et al. 2020 (BigBird), https://arxiv.org/abs/2007.14062",
    no_decode=_RANDOM_OVER_N,
)
@dataclass(frozen=True, kw_only=True)
class RandomConfig(SparseConfig):
    """``random(r, seed)``: ``r`` keys per query row, without replacement."""

    r: int = bounded(64, for_length=quarter)
    seed: int = 0

    def make_pattern(self) -> P.Pattern:
        return P.random(self.r, self.seed)


@register_pattern(
    "block_local",
    "Attention inside non-overlapping blocks.",
    "Qiu et al. 2019 (BlockBERT), https://arxiv.org/abs/1911.02972",
)
@dataclass(frozen=True, kw_only=True)
class BlockLocalConfig(SparseConfig):
    """``block_local(block)``: ``i // block == j // block``."""

    renamed = {"size": "block"}

    block: int = bounded(128, for_length=quarter)

    def make_pattern(self) -> P.Pattern:
        return P.block_local(self.block)


@register_pattern(
    "longformer",
    "Sliding window + global tokens (+ dilation per head).",
    "Beltagy et al. 2020, https://arxiv.org/abs/2004.05150",
    decode=GLOBAL_DECODE + " (one dilation; per-head dilations keep a KV cache, O(t) per token)",
    notes=(
        CAUSAL_NOTE,
        "one set of projections for every pair: the paper's separate global projections (Q_g, K_g, V_g "
        "for the scores to and from global tokens) are not implemented",
    ),
)
@dataclass(frozen=True, kw_only=True)
class LongformerConfig(SparseConfig):
    """``dilated(left, right, dilation) | global_tokens(global_indices)`` (``longformer(w)`` is
    ``left = right = w``); a tuple of dilations gives one head group per dilation."""

    renamed = {"window": "left and right (keys on each side; window=w was left=w, right=w)"}

    left: int = bounded(64, for_length=quarter)
    right: int = bounded(64, for_length=quarter)
    global_indices: tuple[int, ...] = (0,)
    dilation: int | tuple[int, ...] = 1

    def make_pattern(self) -> P.Pattern:
        glob = P.global_tokens(self.global_indices) if self.global_indices else None
        dilations = (self.dilation,) if isinstance(self.dilation, int) else self.dilation
        bands = [
            P.sliding_window(self.left, self.right) if d == 1 else P.dilated(self.left, self.right, d)
            for d in dilations
        ]
        groups = [band if glob is None else band | glob for band in bands]
        return groups[0] if isinstance(self.dilation, int) else P.per_head(groups)


@register_pattern(
    "bigbird",
    "Block window + global blocks + random blocks.",
    "Zaheer et al. 2020, https://arxiv.org/abs/2007.14062",
    no_decode=_RANDOM_OVER_N,
)
@dataclass(frozen=True, kw_only=True)
class BigBirdConfig(SparseConfig):
    """``bigbird(block, window_blocks, global_blocks, random_blocks, seed)``; the kernel tile is
    the BigBird block unless ``tile`` is set, so every tile is full."""

    block: int = bounded(64, ge=1, for_length=eighth)
    tile: int | None = bounded(None, ge=1, none="the BigBird block")
    window_blocks: int = 3
    global_blocks: int = bounded(2, for_length=1)
    random_blocks: int = bounded(3, for_length=1)
    seed: int = 0

    def make_pattern(self) -> P.Pattern:
        return P.bigbird(self.block, self.window_blocks, self.global_blocks, self.random_blocks, self.seed)

    def backend_tile(self) -> int:
        return self.block if self.tile is None else self.tile


@register_pattern(
    "star",
    "Neighbours within 1 (a band, no wrap) + one relay token.",
    "Guo et al. 2019 (Star-Transformer), https://arxiv.org/abs/1902.09113",
    decode=GLOBAL_DECODE,
    notes=(
        CAUSAL_NOTE,
        "satellites see |i - j| <= 1 without wrap-around: the first and last satellites are not linked, "
        "so the paper's ring of satellites is a band here; the relay links everything",
    ),
)
@dataclass(frozen=True, kw_only=True)
class StarConfig(SparseConfig):
    """``star(relay)``: neighbours within 1 (no wrap-around) and one relay token."""

    relay: int = 0

    def make_pattern(self) -> P.Pattern:
        return P.star(self.relay)


@register_pattern(
    "etc",
    "External global tokens + sliding window.",
    "Ainslie et al. 2020 (ETC), https://arxiv.org/abs/2004.08483",
    decode=GLOBAL_DECODE,
)
@dataclass(frozen=True, kw_only=True)
class ETCConfig(SparseConfig):
    """``global_tokens(range(n_global)) | sliding_window(left, right)`` (``etc(w, n_global)`` is
    ``left = right = w``): the first ``n_global`` positions are global."""

    renamed = LongformerConfig.renamed

    left: int = bounded(64, for_length=quarter)
    right: int = bounded(64, for_length=quarter)
    n_global: int = bounded(1, ge=1)

    def make_pattern(self) -> P.Pattern:
        return P.global_tokens(range(self.n_global)) | P.sliding_window(self.left, self.right)


@register_pattern(
    "sinks",
    "Attention sinks: the first keys for every query + a sliding window.",
    "Xiao et al. 2023 (StreamingLLM), https://arxiv.org/abs/2309.17453",
    notes=(
        "causal=True intersects the pattern with j <= i (the paper's setting)",
        "decode step: only the first sinks keys and the last left keys are kept (O(window + sinks) at any "
        "position); their positions stay absolute, where StreamingLLM re-indexes positions inside its rolling "
        "cache (for RoPE), so the step equals the causal forward exactly",
        "gpt-oss's learned per-head sink logits are not implemented",
    ),
)
@dataclass(frozen=True, kw_only=True)
class SinksConfig(SparseConfig):
    """``sinks(sinks, left, right)``: a sliding window plus the first ``sinks`` keys for every
    query (StreamingLLM keeps 4). Causal use (the paper's) cuts ``right`` to 0."""

    sinks: int = bounded(4, ge=1, for_length=lambda n: min(4, n))
    left: int = bounded(64, for_length=quarter)
    right: int = bounded(64, for_length=quarter)

    def make_pattern(self) -> P.Pattern:
        return P.sinks(self.sinks, self.left, self.right)


@register_pattern("sparse_transformer_strided", "Local heads + strided heads.", _CHILD, notes=_TWO_GROUPS)
@dataclass(frozen=True, kw_only=True)
class SparseTransformerStridedConfig(SparseConfig):
    """``sparse_transformer_strided(l)``: half the heads local, half strided (causal)."""

    l: int = bounded(128, for_length=eighth)  # noqa: E741

    def make_pattern(self) -> P.Pattern:
        return P.sparse_transformer_strided(self.l)


@register_pattern("sparse_transformer_fixed", "Block-local heads + summary-column heads.", _CHILD, notes=_TWO_GROUPS)
@dataclass(frozen=True, kw_only=True)
class SparseTransformerFixedConfig(SparseConfig):
    """``sparse_transformer_fixed(l, c)``: half the heads block-local, half the summary columns."""

    l: int = bounded(128, for_length=quarter)  # noqa: E741
    c: int = bounded(8, for_length=lambda n: min(4, quarter(n)))  # c <= l

    def make_pattern(self) -> P.Pattern:
        return P.sparse_transformer_fixed(self.l, self.c)


def _local_and_strided_heads(n: int) -> P.Pattern:
    """``pattern`` on ``n`` tokens: half the heads local, half strided, both at an eighth of the sequence."""
    return P.per_head([P.local(eighth(n)), P.strided(eighth(n))])


@register_pattern(
    "pattern",
    "Any attnzoo.patterns.Pattern (per_head for mixed heads).",
    "see attnzoo.patterns",
    notes=(CAUSAL_NOTE, "not a drop-in for pretrained attention: needs a Pattern object; the named patterns cover it"),
    no_decode="an arbitrary Pattern may depend on the final length (use a named mechanism to decode)",
)
@dataclass(frozen=True, kw_only=True)
class PatternConfig(SparseConfig):
    """Any ``attnzoo.patterns.Pattern``, e.g. ``per_head([...])`` for different head groups."""

    pattern: P.Pattern = bounded(P.full(), for_length=_local_and_strided_heads)

    def make_pattern(self) -> P.Pattern:
        return self.pattern
