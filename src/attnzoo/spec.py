"""What a mechanism declares about itself, as data: capabilities, complexity, and the two
callable signatures that carry pattern and score semantics, and the ``Shape`` a layer hands the
mechanism it builds.

Index convention (used by ``causal``, ``MaskMod`` and ``ScoreMod`` everywhere in attnzoo):
queries are aligned to the *end* of the key sequence. Query row ``i`` of ``N_q`` sits at
position ``i + (N_kv - N_q)`` of the key sequence, and that aligned position is the ``q_idx``
a mask or score function receives. For self-attention (``N_q == N_kv``) this is plain ``i``,
exactly FlexAttention's convention; for a decode step (one query against a cache of ``t + 1``
keys) it is ``t``, so causal masks and position biases need no special case when decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``: True where the pair is computed.
#: Arguments are broadcastable integer tensors (FlexAttention's signature, vectorised).
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
#: Where a ``mask_mod``'s lookup tables live (``None``: the CPU). A compiled FlexAttention mask
#: must not move tensors between devices, so ``Pattern.mask_mod_for`` places them up front.
Device = torch.device | str | None

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``: edits the scaled score of each pair
#: (e.g. adds an ALiBi or relative-position bias). Same broadcasting as ``MaskMod``.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

Kind = Literal["attention", "mixer"]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a mechanism can honour. Anything declared False raises when asked for.

    Attributes:
        causal: honours ``causal=True`` in the strong sense (output i depends on inputs <= i).
        bidirectional: honours ``causal=False``. False for mechanisms defined only causally
            (``nsa``): they refuse a non-causal call instead of inventing a meaning for it.
        key_mask: honours ``key_mask`` (which keys are real: True = attend).
        decode_step: has ``init_state`` / ``step`` for O(state) autoregressive decoding.
        cross_attention: accepts ``N_q != N_kv`` (keys/values from another sequence).
        score_mod: accepts a ``score_mod`` (position biases such as ALiBi, Shaw relative).
        attn_mask: honours a general ``attn_mask (B | 1, H | 1, N_q, N_kv)``, bool or additive.
        dropout: honours ``dropout_p`` (attention-probability dropout with a seeded mask that
            the reference reproduces).
        scale: honours a per-call ``scale`` on the dot products (default ``1 / sqrt(D)``): its
            scores are ``scale * q . k``, so the base class rescales q (exact) and the mechanism
            needs nothing else. False where q enters otherwise (feature maps, gates, routing).
        gqa: attends K/V with fewer heads than q (``H_kv`` dividing ``H``, grouped-query
            attention) without repeating them. Every mechanism accepts such K/V; one without
            this flag gets them repeated to ``H`` heads first (``Attention.forward``).
        backends: the attention backends it can run on (empty for mechanisms with their own
            computation).
        kind: ``"attention"`` mechanisms take ``(q, k, v)``; ``"mixer"`` token mixers take the
            layer input ``x`` of shape ``(B, N, dim)``.
        weights_apply_to_v: the output is ``reference``'s weights applied to v (``weights @ v``),
            so ``implied_attention`` is the whole story. False where values are transformed after
            the weighting (an output gate, a per-head norm) or the keys are made from the values
            (``mla``'s shared latent, whose ``implied_attention`` is refused).
        independent_queries: output row i depends on query i alone among the queries (and on
            the keys and values). False where the definition pools or routes the queries
            together (shared-QK hashing, landmarks averaged from queries, clusters of a fixed
            size, a short convolution over the queries): one query can then change other rows,
            and a NaN query can reach them.
    """

    causal: bool
    key_mask: bool
    bidirectional: bool = True
    decode_step: bool = False
    cross_attention: bool = False
    score_mod: bool = False
    gqa: bool = False
    dropout: bool = False
    attn_mask: bool = False
    scale: bool = False
    backends: tuple[str, ...] = ()
    kind: Kind = "attention"
    independent_queries: bool = True
    weights_apply_to_v: bool = True


@dataclass(frozen=True, kw_only=True)
class Complexity:
    """Asymptotic cost of the fast path in N (sequence), D (head dim) and the mechanism's own
    parameters, as human-readable strings, e.g. ``time="O(N^2 D)"``, ``memory="O(N D)"``."""

    time: str
    memory: str
    #: True when the fast path never materialises an N x N tensor (checked by tests).
    subquadratic_memory: bool = False


@dataclass(frozen=True, kw_only=True)
class Spec:
    """Everything ``attnzoo.describe(name)`` reports about one registered mechanism."""

    name: str
    family: str
    summary: str
    paper: str
    config: type
    module: type
    capabilities: Capabilities
    complexity: Complexity
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def decoding(self) -> str | None:
        """How a causal mechanism decodes, from its notes: the one starting ``"decode step: "``
        (the state it keeps, the cost per token) or ``"no decode step: "`` (why a step is not
        defined); None for a mechanism that cannot be causal."""
        prefixes = ("decode step: ", "no decode step: ")
        found = [note for note in self.notes if note.startswith(prefixes)]
        return found[0] if found else None


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The geometry a layer knows about the mechanism it builds: ``attnzoo.build(name, shape=...)``.

    A mechanism with per-head or per-position parameters (Synthesizer, Linformer, Sinkhorn,
    SAC, the random features of Performer/RFA, Routing's centroids, gMLP's spatial weight)
    needs this geometry to create them at construction, so that a layer's state dict is complete
    before its first forward. The layer (``MultiHeadAttention``, ``TransformerEncoderLayer``,
    the benchmark models, ``attnzoo.hf``) says what it knows once, here, instead of asking
    which config fields a mechanism has; ``build`` fills each config field named like one of
    these (``heads``, ``head_dim``, ``value_dim``, ``max_len``) that the config has and the
    caller did not set. None means "not known here": that field keeps its default.

    Attributes:
        heads: H, the heads the mechanism receives.
        head_dim: D of the queries and keys.
        value_dim: D_v of the values (no config reads it today; carried for those that will).
        max_len: the longest sequence the layer will see.
    """

    heads: int | None = None
    head_dim: int | None = None
    value_dim: int | None = None
    max_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("heads", "head_dim", "value_dim", "max_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Shape: {name} must be an int >= 1 or None, got {value!r}")

    def known(self) -> dict[str, int]:
        """The fields that are set, by name."""
        return {
            name: value
            for name, value in (
                ("heads", self.heads),
                ("head_dim", self.head_dim),
                ("value_dim", self.value_dim),
                ("max_len", self.max_len),
            )
            if value is not None
        }
