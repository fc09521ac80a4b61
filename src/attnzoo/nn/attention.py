"""``MultiHeadAttention``: per-head q/k/v projections around any registered mechanism."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from attnzoo._checks import check_key_mask, check_module_input, check_positive_int, check_tensor, renamed_key_mask
from attnzoo.mechanisms.base import Attention
from attnzoo.positional import PositionalEncoding, RotaryEmbedding, build_positional
from attnzoo.registry import EXACT, build
from attnzoo.spec import Shape


@dataclass(frozen=True)
class MHAState:
    """Decode state of one attention layer: the mechanism's state and the next position."""

    mechanism: Any
    position: int


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, §3.2) over any registered mechanism.

    ``y = W_o concat_h(mechanism(W_q^h x, W_k^h c, W_v^h c))`` with ``c = x`` (self-attention)
    or ``c = context`` (cross-attention).

    Args:
        dim: model width of ``x``.
        heads: number of heads.
        mechanism: a registered name (``attnzoo.names()``) or a built ``Attention`` module.
            Default ``"softmax"``. Or a list of head groups ``[(mechanism, config, n_heads),
            ...]`` whose ``n_heads`` add up to ``heads``: each group runs its own mechanism on its
            slice of the heads ("different heads, different patterns"), outputs concatenated.
        kv_dim: width of ``context`` for cross-attention; default ``dim``.
        kv_heads: K/V heads for grouped-query (``1 < kv_heads < heads``) or multi-query
            (``kv_heads=1``) attention: each K/V head serves ``heads / kv_heads`` query heads
            (Ainslie et al. 2023); default ``heads``. Mechanisms that attend grouped K/V
            themselves (``Capabilities.gqa``: ``attnzoo.names(gqa=True)``) never repeat them; the others get
            them repeated per call. Head groups must each cover whole K/V groups.
        head_dim: width per head; default ``dim // heads`` (then ``dim % heads`` must be 0).
        positional: None, a name (``"sinusoidal"``, ``"rope"``, ``"alibi"``, ``"relative"``) or
            a ``attnzoo.positional.PositionalEncoding``. Absolute encodings given here are added
            to the query and key inputs (not the values).
        dropout: dropout on the output projection. Default 0.
        attn_dropout: attention-probability dropout in training mode (the mechanism's
            ``dropout_p``, for mechanisms with ``Capabilities.dropout``: ``softmax`` and the
            pattern mechanisms); default 0.
        bias: whether the projections have biases. Default True.
        max_len: the longest sequence the layer will see, if known; default None. With the
            heads and head width it makes the ``attnzoo.Shape`` the layer builds each mechanism
            with: it fills the config's ``heads`` / ``head_dim`` / ``value_dim`` / ``max_len``
            where ``mechanism_config`` leaves them out, so per-head and per-position parameters
            exist (and are in the state dict) before the first forward.
        **mechanism_config: the mechanism's config (only with a name); unknown keys raise.

    Shapes:
        ``x (B, N_q, dim)``, ``context (B, N_kv, kv_dim)``, ``key_mask (B, N_kv)`` bool
        (True = real token) -> ``(B, N_q, dim)``.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        mechanism: str | Attention = "softmax",
        *,
        kv_dim: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        positional: str | PositionalEncoding | None = None,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        bias: bool = True,
        max_len: int | None = None,
        **mechanism_config: Any,
    ) -> None:
        super().__init__()
        check_positive_int(dim, "dim")
        check_positive_int(heads, "heads")
        if head_dim is None and dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}), or pass head_dim explicitly")
        self.dim, self.heads = dim, heads
        self.kv_heads = heads if kv_heads is None else kv_heads
        check_positive_int(self.kv_heads, "kv_heads")
        if heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({heads})")
        self.head_dim = dim // heads if head_dim is None else head_dim
        self.kv_dim = dim if kv_dim is None else kv_dim
        check_positive_int(self.head_dim, "head_dim")
        check_positive_int(self.kv_dim, "kv_dim")
        shape = Shape(heads=heads, head_dim=self.head_dim, value_dim=self.head_dim, max_len=max_len)
        groups = _resolve_groups(mechanism, mechanism_config, shape)
        self.mechanisms = nn.ModuleList(attn for attn, _ in groups)
        self.group_heads = tuple(n for _, n in groups)
        per_kv = heads // self.kv_heads
        if any(n % per_kv for n in self.group_heads):
            raise ValueError(
                f"head groups of {list(self.group_heads)} heads do not each cover whole K/V groups of {per_kv} query "
                f"heads (heads={heads}, kv_heads={self.kv_heads})"
            )
        self.positional = _fit_rope(
            build_positional(positional, dim=dim, heads=heads, head_dim=self.head_dim), positional, self.mechanisms
        )
        for attn in self.mechanisms:
            _check_positional(self.positional, attn)
            if attn_dropout:
                attn._dropout(attn_dropout)  # refuses a mechanism without dropout, and a bad value
        self.attn_dropout = float(attn_dropout)
        if len(groups) > 1 and self.positional is not None and self.positional.needs_weights:
            raise ValueError(
                "Shaw relative value embeddings need one dense mechanism for all heads; "
                "use RelativePositionalEncoding(head_dim, values=False) with mixed head groups"
            )
        inner, kv_inner = heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(dim, inner, bias=bias)
        self.k_proj = nn.Linear(self.kv_dim, kv_inner, bias=bias)
        self.v_proj = nn.Linear(self.kv_dim, kv_inner, bias=bias)
        self.out_proj = nn.Linear(inner, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    @property
    def attn(self) -> Attention:
        """The mechanism of a one-group layer (the first group's otherwise)."""
        return self.mechanisms[0]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        # Older layers registered the first mechanism twice, as ``attn.*`` and ``mechanisms.0.*``
        # (the same tensors): their checkpoints still load, the old alias read as the new key.
        old, new = prefix + "attn.", prefix + "mechanisms.0."
        for key in [k for k in state_dict if k.startswith(old)]:
            value = state_dict.pop(key)
            state_dict.setdefault(new + key[len(old) :], value)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @renamed_key_mask
    def forward(
        self, x: Tensor, context: Tensor | None = None, *, causal: bool = False, key_mask: Tensor | None = None
    ) -> Tensor:
        check_tensor(x, "x", 3, f"(B, N, dim={self.dim})")
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have last dimension dim={self.dim}, got shape {tuple(x.shape)}")
        check_module_input(self, x, "x")
        kv_in = x if context is None else context
        if context is not None:
            check_tensor(context, "context", 3, f"(B, N_kv, kv_dim={self.kv_dim})")
            check_module_input(self, context, "context")
            if context.shape[-1] != self.kv_dim or context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"context must have shape (B={x.shape[0]}, N_kv, kv_dim={self.kv_dim}), got {tuple(context.shape)}"
                )
        if key_mask is not None and context is None:
            # Self-attention: the mask marks the padded queries too. A mechanism zeroes padded keys
            # and values, but a cross-attention-capable one leaves q as given, and a NaN query row
            # poisons the backward of every key it met: padded tokens are zeroed here, before the
            # projections, so that they are inert whatever they hold.
            key_mask = check_key_mask(key_mask, x.shape[0], x.shape[1], x.device)
            x = kv_in = torch.where(key_mask[..., None], x, 0.0)
        q_pos = torch.arange(x.shape[1], device=x.device)
        k_pos = torch.arange(kv_in.shape[1], device=x.device)
        q, k, v = self._project(x, kv_in, q_pos, k_pos)
        out = self._attend(q, k, v, causal=causal, key_mask=key_mask)
        return self._merge(out)

    def init_state(self, batch: int, *, device: Any = None, dtype: Any = None, capacity: int = 0) -> MHAState:
        """Empty decode state (self-attention only); see ``step``. One state per head group.
        ``capacity``: the length decoding will reach, if known (KV caches preallocate it)."""
        per_kv = self.heads // self.kv_heads
        options = {"device": device, "dtype": dtype, "capacity": capacity}
        states = tuple(
            attn.init_state(batch, n, self.head_dim, self.head_dim, kv_heads=n // per_kv, **options)
            for attn, n in zip(self.mechanisms, self.group_heads)
        )
        return MHAState(states[0] if len(states) == 1 else states, 0)

    @renamed_key_mask
    def step(self, x: Tensor, state: MHAState, *, key_mask: Tensor | None = None) -> tuple[Tensor, MHAState]:
        """Causal self-attention for the next ``T`` tokens ``x (B, T, dim)`` given everything
        before them in ``state``; equals the matching rows of ``forward(..., causal=True,
        key_mask=...)``. ``key_mask (B, T)``: which new tokens are real (True);
        padded ones (a left-padded prompt) are never attended, now or later."""
        check_tensor(x, "x", 3, f"(B, T, dim={self.dim})")
        check_module_input(self, x, "x")
        mask = check_key_mask(key_mask, x.shape[0], x.shape[1], x.device)
        pos = torch.arange(x.shape[1], device=x.device) + state.position
        q, k, v = self._project(x, x, pos, pos)
        if self.positional is not None and self.positional.needs_weights:
            # Shaw value embeddings need the weights: keep the KV cache here and attend densely.
            cache = state.mechanism.append(k, v, mask)
            out = self._attend(q, cache.k, cache.v, causal=True, key_mask=cache.key_mask)
            mech_state = cache
        else:
            score_mod = self._score_mod(q, state.position + x.shape[1])
            states = (state.mechanism,) if len(self.mechanisms) == 1 else state.mechanism
            outs, new_states = [], []
            for (attn, heads, kv, group_mod), group_state in zip(self._groups(score_mod), states):
                out_g, state_g = attn.step(
                    group_state, q[:, heads], k[:, kv], v[:, kv], key_mask=mask, score_mod=group_mod
                )
                outs.append(out_g)
                new_states.append(state_g)
            out = torch.cat(outs, dim=1)
            mech_state = new_states[0] if len(new_states) == 1 else tuple(new_states)
        return self._merge(out), MHAState(mech_state, state.position + x.shape[1])

    def _project(self, x: Tensor, kv_in: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        pe = self.positional
        q_in = x if pe is None else pe.add_to_input(x, q_pos)
        k_in = kv_in if pe is None else pe.add_to_input(kv_in, k_pos)
        q = rearrange(self.q_proj(q_in), "b n (h d) -> b h n d", h=self.heads)
        k, v = (
            rearrange(proj(inp), "b n (h d) -> b h n d", h=self.kv_heads)
            for proj, inp in ((self.k_proj, k_in), (self.v_proj, kv_in))
        )
        if pe is not None:
            q, k = pe.rotate(q, q_pos), pe.rotate(k, k_pos)
        return q, k, v

    def _score_mod(self, q: Tensor, n_kv: int) -> Any:
        return None if self.positional is None else self.positional.score_mod(q, n_kv)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None) -> Tensor:
        score_mod = self._score_mod(q, k.shape[2])
        p = self.attn_dropout if self.training else 0.0
        if self.positional is not None and self.positional.needs_weights:
            # Exact attention's dense twin is the same function, with its weights (the value term).
            out, weights = self.attn.reference(
                q, k, v, causal=causal, key_mask=key_mask, score_mod=score_mod, return_weights=True, dropout_p=p
            )
            return out + self.positional.value_term(weights).to(out.dtype)
        if len(self.mechanisms) == 1:
            return self.attn(q, k, v, causal=causal, key_mask=key_mask, score_mod=score_mod, dropout_p=p)
        outs = [
            attn(
                q[:, heads],
                k[:, kv],
                v[:, kv],
                causal=causal,
                key_mask=key_mask,
                score_mod=group_mod,
                dropout_p=p,
            )
            for attn, heads, kv, group_mod in self._groups(score_mod)
        ]
        return torch.cat(outs, dim=1)

    def _groups(self, score_mod: Any) -> list[tuple[Attention, slice, slice, Any]]:
        """Each head group's mechanism, its slice of query heads and of K/V heads, and the
        layer's score_mod re-indexed so that the group's local head h is the layer's head
        ``start + h``."""
        groups, start, per_kv = [], 0, self.heads // self.kv_heads
        for attn, n in zip(self.mechanisms, self.group_heads):
            shifted = None if score_mod is None else _shift_heads(score_mod, start)
            kv = slice(start // per_kv, (start + n) // per_kv)
            groups.append((attn, slice(start, start + n), kv, shifted))
            start += n
        return groups

    def _merge(self, out: Tensor) -> Tensor:
        return self.dropout(self.out_proj(rearrange(out, "b h n d -> b n (h d)")))


def _shift_heads(score_mod: Any, offset: int) -> Any:
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h + offset, q_idx, kv_idx)


def _resolve_groups(mechanism: Any, config: dict[str, Any], shape: Shape) -> list[tuple[Attention, int]]:
    """``[(module, n_heads), ...]`` from one mechanism or a list of ``(mechanism, config, n_heads)``;
    each group's mechanism is built with the layer's shape narrowed to its own heads."""
    heads = shape.heads
    if not (isinstance(mechanism, (list, tuple)) and mechanism and isinstance(mechanism[0], (list, tuple))):
        return [(_resolve_mechanism(mechanism, config, shape), heads)]
    if config:
        raise ValueError(f"with head groups, give each group its config; got layer-level keys {sorted(config)}")
    groups = []
    for group in mechanism:
        if len(group) != 3 or not isinstance(group[1], dict) or not isinstance(group[2], int) or group[2] < 1:
            raise ValueError(f"each head group is (mechanism, config dict, n_heads >= 1), got {group!r}")
        group_shape = dataclasses.replace(shape, heads=group[2])
        groups.append((_resolve_mechanism(group[0], dict(group[1]), group_shape), group[2]))
    if sum(n for _, n in groups) != heads:
        raise ValueError(f"head groups have {sum(n for _, n in groups)} heads in all, but heads={heads}")
    return groups


def _resolve_mechanism(mechanism: str | Attention, config: dict[str, Any], shape: Shape) -> Attention:
    if isinstance(mechanism, str):
        # Mechanisms with per-head parameters (SAC, Sinkhorn, Synthesizer, Linformer, ...) take
        # their geometry from the layer's shape unless the config sets it (``attnzoo.build``).
        attn = build(mechanism, shape=shape, **config)
    elif isinstance(mechanism, Attention):
        if config:
            raise ValueError(
                f"mechanism is already built; pass its config to attnzoo.build instead of {sorted(config)}"
            )
        attn = mechanism
    else:
        raise TypeError(
            f"mechanism must be a registered name or an attnzoo Attention module, got {type(mechanism).__name__}"
        )
    if not isinstance(attn, Attention):
        raise ValueError(
            f"{mechanism!r} is a token mixer, not a (q, k, v) mechanism; use it through "
            f"attnzoo.nn.TransformerEncoderLayer(mechanism={mechanism!r})"
        )
    return attn


def _fit_rope(pe: PositionalEncoding | None, asked: Any, mechanisms: nn.ModuleList) -> PositionalEncoding | None:
    """``positional="rope"`` rotates the channels the mechanisms ask for (``rotary_channels``: all,
    or the last few, as ``mla``'s decoupled RoPE); a RoPE instance passed by the user is kept as is."""
    if asked != "rope" or not isinstance(pe, RotaryEmbedding):
        return pe
    asks = (getattr(m, "rotary_channels", None) for m in mechanisms)  # token mixers ask nothing
    wanted = {pe.head_dim if c is None else c for c in asks}
    if len(wanted) > 1:
        raise ValueError(
            f"the head groups' mechanisms want RoPE on different numbers of channels ({sorted(wanted)}); pass "
            "positional=attnzoo.positional.RotaryEmbedding(head_dim, channels=...) to choose one"
        )
    (channels,) = wanted
    return pe if channels == pe.head_dim else RotaryEmbedding(pe.head_dim, pe.base, channels=channels)


def _check_positional(pe: PositionalEncoding | None, attn: Attention) -> None:
    if pe is None:
        return
    if pe.biases_scores and not attn.spec.capabilities.score_mod:
        attn._refuse(f"{type(pe).__name__} (a score bias)", "score_mod")
    if pe.needs_weights and attn.spec.name != EXACT:
        raise ValueError(
            f"{type(pe).__name__} with value embeddings needs the attention weights, which "
            f"{attn.spec.name!r} does not expose; use mechanism='softmax', or "
            f"RelativePositionalEncoding(head_dim, values=False) for the key term alone"
        )
