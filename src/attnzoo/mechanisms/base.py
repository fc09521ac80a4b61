"""The base classes of every ``(q, k, v)`` attention mechanism (``Attention``) and of every
attention-free token mixer (``TokenMixer``).

The mechanism protocol. A mechanism implements two methods, both on inputs already checked:

* ``_attend(q, k, v, args)`` — the fast path, what ``forward`` runs;
* ``_reference(q, k, v, args, return_weights)`` — the same function computed densely, written
  to read like the paper, with ``return_weights=True`` also returning the ``(B, H, N_q, N_kv)``
  weights it applies.

``args`` is the checked ``AttendArgs(causal, key_mask, score_mod)``.

The base turns them into the public API: ``forward``, ``reference`` and ``implied_attention``
(defined once, from ``reference``). Decoding works the same way: the public ``init_state`` /
``step`` live here, check their inputs and refuse unless the mechanism declares ``decode_step``;
such a mechanism implements ``_init_state(spec: StateSpec)`` and ``_step(state, q, k, v,
args)`` (``args.causal`` is True, ``args.key_mask`` marks the new tokens). ``tests/test_contracts.py`` holds
every registered mechanism to this protocol by reading its capabilities: fast == reference
(forward and gradients), causal prefix invariance, padding invariance, no N x N allocation where
the spec promises sub-quadratic memory, and step == forward.

``Attention.forward`` (and ``reference``) validates inputs against the mechanism's declared
capabilities once, here, so each mechanism implements only ``_attend`` with inputs it knows it
can honour. A request it
cannot honour (causal, key padding, a score_mod, cross-attention, a decode step) raises a
``ValueError`` that says so and names the registered mechanisms of the same kind that can.
Empty inputs (B = 0, or no query or no position) never reach ``_attend``/``_mix``: they return
correctly shaped empty outputs here, after the same checks. Padded keys and values (and the
padded queries of a self-attention-only mechanism) reach ``_attend`` holding zeros
(``Attention.zero_padded``), so no mechanism can leak what they held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._checks import check_attn_mask, check_causal, check_key_mask, check_qkv, check_tensor, renamed_key_mask
from attnzoo.mechanisms._ops import compute_dtype, zero_padding
from attnzoo.registry import names, spec_of_config
from attnzoo.spec import ScoreMod, Spec

Weighted = Tensor | tuple[Tensor, Tensor]
"""What a ``reference`` returns: the output, or ``(output, weights)`` with ``return_weights``."""


@dataclass(frozen=True, slots=True)
class AttendArgs:
    """The checked call options ``Attention.forward`` and ``reference`` hand to ``_attend`` and
    ``_reference``: one argument instead of three keywords, so the protocol's signatures stay
    one line in every mechanism and a new option is added here, not in 30 signatures.

    ``causal``: normalised by ``check_causal``; ``key_mask``: ``(B, N_kv)`` bool, True =
    real, or None when nothing is padded; ``score_mod``: only ever set for mechanisms whose
    capabilities declare it."""

    causal: bool
    key_mask: Tensor | None
    score_mod: ScoreMod | None
    dropout: Dropout | None = None
    attn_mask: Tensor | None = None


@dataclass(frozen=True, slots=True)
class StateSpec:
    """The checked arguments of ``Attention.init_state``, handed to ``_init_state``: the
    geometry of the state (``kv_heads``: the K/V heads ``_step`` gets, H unless the mechanism
    attends grouped K/V itself), where it lives, and ``capacity`` (the final length; 0 if
    unknown)."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    device: Any
    dtype: Any
    capacity: int


@dataclass(frozen=True, slots=True)
class Dropout:
    """Attention-probability dropout for one call: drop each weight with probability ``p`` and
    scale the rest by ``1 / (1 - p)``; which weights drop is a function of ``seed`` and the
    weight's (b, h, i, j) (``_ops.dropout_keep``), so the fast path and the reference drop the
    same ones, and a backward recomputes them instead of storing a mask."""

    p: float
    seed: int


class Mechanism(nn.Module):
    """What every registered module shares: its frozen config and the ``Spec`` it was
    registered with."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    @property
    def spec(self) -> Spec:
        return spec_of_config(self.config)

    def extra_repr(self) -> str:
        return repr(self.config)


def nan_rows_of_non_finite_queries(out: Tensor, q: Tensor) -> Tensor:
    """``out (B, H, N_q, D_v)`` with the row of every query that holds NaN or +-inf made NaN.

    Kernels can hide such a query: torch's CPU flash kernel returns zeros for a NaN query that
    sees only a few keys (so does ``F.scaled_dot_product_attention`` on CPU), a top-k selection
    can drop all of its NaN scores, a feature map can send -inf to a finite limit. Adding
    ``0 * sum(q_i)`` makes the row NaN in all of these and changes nothing else. On CPU (eager)
    one sum over all of q decides first whether any query is non-finite, and when none is (the
    usual case) ``out`` is returned as it is: a reduction of N D numbers, about 1% of ``local``'s
    forward at N = 4096, where adding the rows to ``out`` cost 4%. Elsewhere (GPU, compiled) the
    rows are always added, so no host synchronisation or graph break is introduced. Detached:
    backward is untouched. The sums run in float32 at least, so large finite half-precision
    queries do not overflow them (an overflow would only take the row path, which is exact).
    """
    wide, q = compute_dtype(q), q.detach()
    if q.device.type == "cpu" and not torch.compiler.is_compiling() and bool(q.sum(dtype=wide).isfinite()):
        return out
    return out + q.sum(-1, keepdim=True, dtype=wide).mul_(0).to(out.dtype)


class Attention(Mechanism):
    """Base class: ``forward(q, k, v, *, causal=False, key_mask=None, score_mod=None)``.

    Shapes:
        q ``(B, H, N_q, D)``, k ``(B, H, N_kv, D)``, v ``(B, H, N_kv, D_v)`` -> ``(B, H, N_q, D_v)``.
    """

    @property
    def rotary_channels(self) -> int | None:
        """How many of the last channels of q and k a RoPE layer should rotate; None: all of them.
        ``MultiHeadAttention(positional="rope")`` reads it (``mla`` keeps positions out of its latent)."""
        return None

    def keys_per_query(self, n: int, causal: bool) -> float | None:
        """The keys a query attends at length ``n``, averaged over the rows: the budget the speed
        report turns into a density bound (``bench.speed``); None where it depends on the data.
        Pattern mechanisms and exact attention are counted by the report itself."""
        return None

    @renamed_key_mask
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_mask: Tensor | None = None,
        score_mod: ScoreMod | None = None,
        dropout_p: float = 0.0,
        attn_mask: Tensor | None = None,
        scale: float | None = None,
    ) -> Tensor:
        """``dropout_p``: attention-probability dropout for this call (applied whenever > 0, as
        SDPA's ``dropout_p``; layers pass it only in training), where the mechanism declares
        ``Capabilities.dropout``; its mask is drawn from a seed taken from torch's global RNG.
        ``attn_mask``: a general mask ``(B | 1, H | 1, N_q, N_kv)``, bool (True = may attend) or
        additive float (added to the scaled scores), on top of ``causal`` and ``key_mask``, where
        the mechanism declares ``Capabilities.attn_mask``; elsewhere refused. ``scale``: the
        factor on ``q . k`` (default ``1 / sqrt(D)``), where the mechanism declares
        ``Capabilities.scale``, as SDPA's ``scale``."""
        args = self._checked(q, k, v, causal, key_mask, score_mod, dropout_p, attn_mask)
        q = self._rescaled(q, scale)
        k, v = self._kv_heads(q, k, v, native=self.spec.capabilities.gqa)
        if q.shape[0] == 0 or q.shape[2] == 0:
            # (B, H, N_q, D_v) with nothing in it, still on the autograd graph of q, k and v.
            return (q @ k.transpose(-1, -2)) @ v
        q, k, v = self.zero_padded(args.key_mask, q, k, v)
        out = self._attend(q, k, v, args)
        return nan_rows_of_non_finite_queries(out, q)

    @renamed_key_mask
    def reference(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_mask: Tensor | None = None,
        score_mod: ScoreMod | None = None,
        return_weights: bool = False,
        dropout_p: float = 0.0,
        attn_mask: Tensor | None = None,
        scale: float | None = None,
    ) -> Weighted:
        """The dense twin of ``forward``: the same function, computed the plain way (the N x N
        weights built explicitly), with the same checks and the same zeroed padding. With
        ``return_weights``: ``(output, weights (B, H, N_q, N_kv))``, ``output == weights @ v``
        up to rounding for every mechanism whose output is linear in v. With ``dropout_p``, the
        same seed as a ``forward`` call (``torch.manual_seed`` before each) drops the same
        weights; the weights returned are those applied (dropped and rescaled)."""
        args = self._checked(q, k, v, causal, key_mask, score_mod, dropout_p, attn_mask)
        q = self._rescaled(q, scale)
        k, v = self._kv_heads(q, k, v, native=False)  # the paper's form: one K/V per query head
        if q.shape[0] == 0 or q.shape[2] == 0:
            weights = q @ k.transpose(-1, -2)  # empty, on the graph
            return (weights @ v, weights) if return_weights else weights @ v
        q, k, v = self.zero_padded(args.key_mask, q, k, v)
        return self._reference(q, k, v, args, return_weights)

    @renamed_key_mask
    def implied_attention(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_mask: Tensor | None = None
    ) -> Tensor:
        """The dense ``(B, H, N_q, N_kv)`` weights this mechanism applies to ``v`` (small N: for
        pictures and for checking): ``reference``'s weights, with a dummy one-column v."""
        v = k.new_zeros(k.shape[:3] + (1,))
        return self.reference(q, k, v, causal=causal, key_mask=key_mask, return_weights=True)[1]

    def _checked(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        key_mask: Tensor | None,
        score_mod: ScoreMod | None,
        dropout_p: float = 0.0,
        attn_mask: Tensor | None = None,
    ) -> AttendArgs:
        """Validate a call against the declared capabilities; return what ``_attend`` and
        ``_reference`` receive: the normalised ``causal`` and ``key_mask`` (None when
        nothing is padded is kept as given) and the ``score_mod``."""
        caps = self.spec.capabilities
        check_qkv(q, k, v, cross_attention=caps.cross_attention, allow_empty=True)
        causal = check_causal(causal, q.shape[2], k.shape[2])
        key_mask = check_key_mask(key_mask, q.shape[0], k.shape[2], q.device)
        if causal and not caps.causal:
            self._refuse("causal=True", "causal")
        if key_mask is not None and not caps.key_mask:
            self._refuse("key_mask", "key_mask")
        if score_mod is not None and not caps.score_mod:
            self._refuse("score_mod (position biases such as ALiBi or relative positions)", "score_mod")
        if attn_mask is not None:
            check_attn_mask(attn_mask, q, k)
            if not caps.attn_mask:
                self._refuse("a general attn_mask (only causal and key_mask)", "attn_mask")
        dropout = self._dropout(dropout_p)
        if not causal and not caps.bidirectional:
            self._refuse("causal=False (it is defined causally only)", "bidirectional")
        return AttendArgs(causal, key_mask, score_mod, dropout, attn_mask)

    def _rescaled(self, q: Tensor, scale: float | None) -> Tensor:
        """``q`` such that the mechanism's default ``1 / sqrt(D)`` applies ``scale`` instead."""
        if scale is None:
            return q
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a positive finite number (None = 1 / sqrt(D)), got {scale!r}")
        if not self.spec.capabilities.scale:
            self._refuse(f"a per-call scale (scale={scale})", "scale")
        if getattr(self.config, "scale", None) is not None:
            raise ValueError(
                f"{self.spec.name!r} was built with scale={self.config.scale}; a per-call scale={scale} would "
                "multiply it: set one of them"
            )
        return q * (scale * math.sqrt(q.shape[-1]))

    def _dropout(self, p: float) -> Dropout | None:
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
            raise ValueError(f"dropout_p must be a number in [0, 1), got {p!r}")
        if p == 0:
            return None
        if not self.spec.capabilities.dropout:
            self._refuse(f"attention dropout (dropout_p={p})", "dropout")
        return Dropout(float(p), int(torch.randint(0, 2**62, ())))

    @staticmethod
    def _kv_heads(q: Tensor, k: Tensor, v: Tensor, *, native: bool) -> tuple[Tensor, Tensor]:
        """``k, v`` as the mechanism takes them: as given where it attends grouped K/V itself
        (``native``; or when they have H heads already), else each K/V head repeated for the
        ``H / H_kv`` query heads it serves (grouped-query attention, SDPA's ``enable_gqa``)."""
        if native or k.shape[1] == q.shape[1]:
            return k, v
        groups = q.shape[1] // k.shape[1]
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    def zero_padded(self, key_mask: Tensor | None, q: Tensor, *kv: Tensor) -> tuple[Tensor, ...]:
        """``(q, *kv)`` as ``_attend`` receives them: the key-side tensors ``kv`` with padded
        positions zeroed (``zero_padding``), and ``q`` too if the mechanism is self-attention
        only, where the mask marks the padded queries as well. A cross-attention mechanism's
        query i need not be key i (even with N_q == N_kv): its q is left as given. Methods that
        take ``q, k`` beside ``forward`` call this too."""
        if key_mask is None:
            return (q, *kv)
        if not self.spec.capabilities.cross_attention:
            q = zero_padding(q, key_mask)
        return (q, *(zero_padding(x, key_mask) for x in kv))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _attend")

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        raise NotImplementedError(f"{type(self).__name__} must implement _reference")

    def init_state(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        value_dim: int,
        *,
        kv_heads: int | None = None,
        device: Any = None,
        dtype: Any = None,
        capacity: int = 0,
    ) -> Any:
        """Empty decode state for ``step``; refused unless the mechanism declares ``decode_step``.
        ``kv_heads``: the K/V heads ``step`` will get (grouped-query attention; default
        ``heads``). ``capacity`` (the final length, 0 if unknown) lets a growing cache
        preallocate, and is ignored by states of fixed size."""
        if not self.spec.capabilities.decode_step:
            self._refuse("a decode step", "decode_step")
        kv_heads = heads if kv_heads is None else kv_heads
        sizes = (
            ("batch", batch),
            ("heads", heads),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("value_dim", value_dim),
        )
        for name, value in sizes:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"init_state: {name} must be a positive int, got {value!r}")
        if heads % kv_heads:
            raise ValueError(f"init_state: kv_heads ({kv_heads}) must divide heads ({heads})")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"init_state: capacity must be an int >= 0 (0 = unknown), got {capacity!r}")
        # A mechanism that does not attend grouped K/V itself gets them repeated (step): H heads.
        kv_heads = kv_heads if self.spec.capabilities.gqa else heads
        return self._init_state(StateSpec(batch, heads, kv_heads, head_dim, value_dim, device, dtype, capacity))

    @renamed_key_mask
    def step(
        self,
        state: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        key_mask: Tensor | None = None,
        score_mod: ScoreMod | None = None,
        scale: float | None = None,
    ) -> tuple[Tensor, Any]:
        """Attend new queries ``q (B, H, T, D)`` (usually T = 1) to everything seen so far plus
        the new ``k, v`` (``(B, H, T, D)``, ``(B, H, T, D_v)``); return ``(output (B, H, T, D_v),
        new_state)``. Row t equals row t of the causal forward over the whole sequence.

        ``key_mask (B, T)`` marks which new tokens are real (True), as in ``forward``:
        a padded token (a left-padded prompt in a batch) is never attended, now or later; its
        own row is what the forward gives a padded query, zeros where it sees no real key.
        ``scale`` as in ``forward``."""
        if not self.spec.capabilities.decode_step:
            self._refuse("a decode step", "decode_step")
        if score_mod is not None and not self.spec.capabilities.score_mod:
            self._refuse("score_mod (position biases such as ALiBi or relative positions)", "score_mod")
        check_qkv(q, k, v, cross_attention=False)
        q = self._rescaled(q, scale)
        mask = check_key_mask(key_mask, q.shape[0], q.shape[2], q.device)
        if mask is not None and bool(mask.all()):
            mask = None  # nothing padded: the states' fast paths
        k, v = self._kv_heads(q, k, v, native=self.spec.capabilities.gqa)
        q, k, v = self.zero_padded(mask, q, k, v)
        return self._step(state, q, k, v, AttendArgs(causal=True, key_mask=mask, score_mod=score_mod))

    def _init_state(self, spec: StateSpec) -> Any:
        raise NotImplementedError(f"{type(self).__name__} declares decode_step and must implement _init_state")

    def _step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, Any]:
        raise NotImplementedError(f"{type(self).__name__} declares decode_step and must implement _step")

    def _refuse(self, what: str, capability: str) -> None:
        # Only (q, k, v) mechanisms can stand in: token mixers take the layer input, not q, k, v.
        able = names(kind="attention", **{capability: True})
        raise ValueError(
            f"{self.spec.name!r} does not support {what}; mechanisms that do: {', '.join(able) or '(none yet)'}"
        )


class TokenMixer(Mechanism):
    """Base class of attention-free token mixers (``Capabilities(kind="mixer")``):
    ``forward(x, *, causal=False, key_mask=None)``.

    A token mixer takes the layer input directly (no q/k/v projections, no heads). Its config
    has a ``dim`` field, the width it was built for. ``forward`` validates ``x``, ``causal`` and
    ``key_mask`` once, here, refuses what the mixer's capabilities do not declare (a
    ``ValueError`` naming the token mixers that can), and calls ``_mix``.

    Shapes:
        x ``(B, N, dim)``, key_mask ``(B, N)`` bool (True = real token) -> ``(B, N, dim)``.
    """

    @renamed_key_mask
    def forward(self, x: Tensor, *, causal: bool = False, key_mask: Tensor | None = None) -> Tensor:
        dim = getattr(self.config, "dim", None)
        check_tensor(x, "x", 3, f"(B, N, dim={dim})")
        if dim is not None and x.shape[-1] != dim:
            raise ValueError(f"x must have last dimension dim={dim}, got shape {tuple(x.shape)}")
        causal = check_causal(causal, x.shape[1], x.shape[1])
        key_mask = check_key_mask(key_mask, x.shape[0], x.shape[1], x.device)
        if causal and not self.spec.capabilities.causal:
            self._refuse("causal=True", "causal")
        if key_mask is not None and not self.spec.capabilities.key_mask:
            self._refuse("key_mask", "key_mask")
        if x.shape[0] == 0 or x.shape[1] == 0:
            return x * 0  # empty, shaped like x, on x's autograd graph
        return self._mix(x, causal=causal, key_mask=key_mask)

    def _mix(self, x: Tensor, *, causal: bool, key_mask: Tensor | None) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _mix")

    def _refuse(self, what: str, capability: str) -> None:
        mixers = names(kind="mixer", **{capability: True})
        attention = names(kind="attention", **{capability: True})
        raise ValueError(
            f"{self.spec.name!r} does not support {what}; token mixers that do: {', '.join(mixers) or '(none yet)'}; "
            f"attention mechanisms that do: {', '.join(attention) or '(none yet)'}"
        )
