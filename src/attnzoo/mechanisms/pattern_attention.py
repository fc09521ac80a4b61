"""The one module behind every position-based sparse mechanism (MECHANISMS.md §B): exact softmax
attention restricted to a pattern from ``attnzoo.patterns``, computed on the configured backend.

A sparse mechanism is a config, a ``SparseConfig`` whose ``make_pattern()`` builds its pattern,
registered by ``register_pattern``; the module, ``PatternAttention``, is shared. ``backend``
picks how to compute it (``"auto"``, ``"blocked"``, ``"flex"``, ``"reference"``); the reference
is dense and exists to test the others. The named mechanisms are in ``sparse.py``, their decode
step in ``pattern_decode.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from attnzoo import patterns as P
from attnzoo.backends.call import Call, resolve_pattern
from attnzoo.backends.dispatch import attend_call
from attnzoo.backends.reference import reference_call
from attnzoo.mechanisms import pattern_decode
from attnzoo.mechanisms._ops import default_scale
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity

Backend = Literal["auto", "blocked", "flex", "reference"]


@dataclass(frozen=True, kw_only=True)
class SparseConfig(Config):
    """Fields every sparse mechanism shares.

    Args:
        backend: how to compute (see ``attnzoo.attend``). Default ``"auto"``.
        tile: tile size of the blocked tile plan and of flex (the structured path picks its own);
            a cost setting, never the pattern's meaning (a pattern's own blocks are ``block``). Default 128.
        scale: score scale; default ``1 / sqrt(D)``.
    """

    renamed = {"block": "tile (the backend's tile size; `block` is a pattern's own block where it has one)"}

    backend: Backend = "auto"
    tile: int = bounded(128, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    def make_pattern(self) -> P.Pattern:
        raise NotImplementedError

    def backend_tile(self) -> int:
        """The tile size the backends use: ``tile`` (a pattern with blocks of its own may default to them)."""
        return self.tile

    def validate(self) -> None:
        self.make_pattern()  # the pattern factory checks its own arguments


class PatternAttention(Attention):
    """Exact attention over ``config.make_pattern()``; see the module docstring."""

    def __init__(self, config: SparseConfig) -> None:
        super().__init__(config)
        self.pattern = config.make_pattern()

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return attend_call(self._call(q, k, v, args), self.config.backend)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """Dense softmax over the pattern's mask (the ``reference`` backend, whatever
        ``config.backend`` says)."""
        return reference_call(self._call(q, k, v, args), return_weights)

    def _call(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Call:
        """The backends' call, as ``attnzoo.attend`` builds it after the checks ``forward`` has
        already made: the pattern for H heads (and-ed with ``causal()``), the scale a number."""
        cfg = self.config
        pattern = resolve_pattern(self.pattern, q.shape[1], args.causal)
        scale = default_scale(cfg.scale, q.shape[-1])
        return Call(q, k, v, pattern, args.key_mask, args.score_mod, scale, cfg.backend_tile(), dropout=args.dropout)

    def _init_state(self, spec: StateSpec) -> Any:
        """The cache the pattern needs (``pattern_decode``): the keys a later row can still see
        for a band with a left end (with key columns: ``sinks``), else every key."""
        return pattern_decode.init_state(self, spec)

    def _step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, Any]:
        """The new tokens' rows of the causal forward (``pattern_decode.step``); ``score_mod``
        sees absolute positions, as in the full forward."""
        return pattern_decode.step(self, state, q, k, v, args)


CAUSAL_NOTE = "causal=True intersects the pattern with j <= i"
KV_CACHE_DECODE = "decode step: every key kept (a KV cache), the new rows of the pattern masked over it: O(t) per token"
GLOBAL_DECODE = (
    "decode step: the window and every key up to the last global token are kept (a global token's row "
    "sees all before it): O(window + globals) memory and time per token at any position"
)
DROPOUT_NOTE = (
    "dropout_p > 0 runs the blocked tile plan's explicit path (not the flash kernel): slower, same memory; "
    "the mask is a seeded function of (b, h, i, j) that the reference reproduces. flex cannot apply it "
    "(on CUDA, backend='auto' then runs the dense reference)"
)
GQA_NOTE = (
    "grouped-query K/V (H_kv dividing H): never repeated on flex (FlexAttention's enable_gqa) and on the "
    "blocked backend's structured plans (band windows: a group's query heads stacked as the rows of each block "
    "against one K/V window; global rows and columns as grouped products; dense sub-sequences as G n rows), "
    "except a causal dense sub-sequence part (strided causal); the blocked tile plan (bigbird, graph), its "
    "gathered path (random) and the reference repeat them per call; a decode cache keeps H_kv heads"
)
_COMPLEXITY = Complexity(time="O(N k D), k keys per row", memory="O(N k)", subquadratic_memory=True)


def register_pattern(
    name: str,
    summary: str,
    paper: str,
    *,
    cross: bool = True,
    no_decode: str = "",
    decode: str = KV_CACHE_DECODE,
    notes: tuple[str, ...] = (),
) -> Callable[[type[SparseConfig]], type[SparseConfig]]:
    """Class decorator on a ``SparseConfig``: register ``name`` as a ``PatternAttention`` built
    from it, with ``notes`` (default: what ``causal=True`` means) and ``DROPOUT_NOTE`` (every
    pattern takes ``dropout_p``: the blocked backend's tile plan applies it). It decodes (``init_state`` /
    ``step``) unless ``no_decode`` says why not: the step needs row t of the causal pattern to be
    the same whatever the final length, which random draws over N, grids of a fixed size and
    graphs are not; else ``decode`` (unless ``notes`` has one) says what its state keeps.
    ``cross=False`` for patterns defined on one sequence (grids, graphs)."""
    notes = (*(notes or (CAUSAL_NOTE,)), DROPOUT_NOTE, GQA_NOTE)
    if no_decode:
        notes = (*notes, f"no decode step: {no_decode}")
    elif not any(note.startswith("decode step: ") for note in notes):
        notes = (*notes, decode)
    capabilities = Capabilities(
        causal=True,
        key_mask=True,
        decode_step=not no_decode,
        cross_attention=cross,
        score_mod=True,
        dropout=True,
        scale=True,
        gqa=True,
        backends=("blocked", "flex", "reference"),
    )

    def decorate(config: type[SparseConfig]) -> type[SparseConfig]:
        register(
            name,
            config=config,
            family="sparse",
            summary=summary,
            paper=paper,
            capabilities=capabilities,
            complexity=_COMPLEXITY,
            notes=notes,
        )(PatternAttention)
        return config

    return decorate
