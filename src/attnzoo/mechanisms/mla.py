"""Multi-head latent attention (MLA, DeepSeek-AI 2024, DeepSeek-V2,
https://arxiv.org/abs/2405.04434, Sec. 2.1): keys and values of every head are made from one
shared latent ``c_kv`` of rank R per token, plus a small decoupled RoPE key shared by the heads,
so a decode cache holds R + D_r numbers per token instead of 2 H D.

``latent_attention`` is the core (the interface of ``tests/oracles_modern.py``); the registered
``mla`` module makes its inputs from the layer's q, k, v:

* q ``(B, H, N, D)`` is split along D into ``q_nope`` (the first ``D - rope_dim`` channels) and
  ``q_rope`` (the last ``rope_dim``);
* the latent is a learned down-projection of every head's ``k_nope`` and ``v`` together,
  ``c_kv = sum_h [k_nope_h, v_h] W_dkv[h]``, and ``k_h = c_kv W_uk[h]``, ``v_h = c_kv W_uv[h]``;
* the shared rope key is a learned weighted sum over heads of the last ``rope_dim`` channels of k,
  ``k_rope = sum_h a_h k_rope_h``.

Positions: the layer's positional encoding is applied to q and k before the mechanism sees them.
A per-head scalar mix commutes with RoPE (every head's key at a position is rotated by the same
angle), so ``q_rope . k_rope`` keeps exactly the layer's relative-position structure; the nope
channels pass through the latent, where (as in DeepSeek-V2) no rotation may sit between ``W_uk``
and the score for the absorbed decode to hold. A layer that rotates every channel still gets a
correct function (the decode equals the forward whatever q and k hold); the paper's arrangement
is RoPE on the last ``rope_dim`` channels only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor, nn

from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms._ops import compute_dtype, default_scale
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.softmax import sdpa_attention
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


def latent_attention(
    q_nope: Tensor,
    q_rope: Tensor,
    c_kv: Tensor,
    k_rope: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_mask: Tensor | None = None,
) -> Tensor:
    """MLA's attention from the latent: ``k_h = c_kv W_uk[h]``, ``v_h = c_kv W_uv[h]``,
    ``s = (q_nope . k_h + q_rope . k_rope) * scale``, softmax, ``o = p v_h`` (one SDPA call over
    the up-projected keys and values, as DeepSeek-V2 trains).

    Shapes:
        q_nope ``(B, H, N_q, D_n)``, q_rope ``(B, H, N_q, D_r)`` (already rotated), c_kv
        ``(B, N_kv, R)``, k_rope ``(B, N_kv, D_r)`` (already rotated, shared by the heads),
        w_uk ``(H, R, D_n)``, w_uv ``(H, R, D_v)`` -> ``(B, H, N_q, D_v)``. ``scale`` defaults
        to ``1 / sqrt(D_n + D_r)``.
    """
    q, k, v = _expanded(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv)
    scale = default_scale(scale, q.shape[-1])
    return sdpa_attention(q, k, v, causal=causal, key_mask=key_mask, scale=scale)


def _expanded(
    q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, w_uk: Tensor, w_uv: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The per-head ``q, k (B, H, N, D_n + D_r)`` and ``v (B, H, N, D_v)`` that the latent stands for."""
    k_nope = torch.einsum("bnr,hrd->bhnd", c_kv, w_uk)
    v = torch.einsum("bnr,hrd->bhnd", c_kv, w_uv)
    k_rope = rearrange(k_rope, "b n d -> b 1 n d").expand(-1, k_nope.shape[1], -1, -1)
    return torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1), v


def absorbed_attention(
    q_nope: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    *,
    causal: bool,
    key_mask: Tensor | None,
    scale: float,
) -> Tensor:
    """``latent_attention`` with ``W_uk`` absorbed into the query and ``W_uv`` applied after the
    weighted sum (DeepSeek-V2's inference form): every head attends the same ``(B, 1, T, R +
    D_r)`` keys ``latent = [c_kv, k_rope]`` with values ``c_kv``, so the per-head keys and values
    are never made. ``q_nope W_uk[h]^T . c_kv = q_nope . c_kv W_uk[h]``."""
    rank = w_uk.shape[1]
    q = torch.cat([torch.einsum("bhnd,hrd->bhnr", q_nope, w_uk), q_rope], -1)  # [B, H, T, R + D_r]
    keys = rearrange(latent, "b t r -> b 1 t r")
    mixed = sdpa_attention(q, keys, keys[..., :rank], causal=causal, key_mask=key_mask, scale=scale)
    return torch.einsum("bhnr,hrd->bhnd", mixed, w_uv)


@dataclass(frozen=True, kw_only=True)
class MLAConfig(Config):
    """Config of ``mla``.

    Args:
        heads, head_dim, value_dim: layer geometry (8, 64, None = head_dim): the projections
            are sized by them.
        latent: R, the rank of the shared latent (None: 4 * head_dim, DeepSeek-V2's d_c = 4 d_h).
        rope_dim: D_r, the last channels of q and k that carry positions (None: head_dim // 2,
            DeepSeek-V2's d_h^R = d_h / 2); ``0 <= rope_dim < head_dim``.
        scale: default ``1 / sqrt(head_dim)`` (= ``1 / sqrt(D_n + D_r)``).
        seed: of the projections' Gaussian init (0).
    """

    heads: int = bounded(8, ge=1)
    head_dim: int = bounded(64, ge=1)
    value_dim: int | None = bounded(None, ge=1, none="head_dim")
    latent: int | None = bounded(None, ge=1, none="4 * head_dim")
    rope_dim: int | None = bounded(None, ge=0, none="head_dim // 2")
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(head_dim)")
    seed: int = bounded(0, ge=0)

    def validate(self) -> None:
        if self.rope_dim is not None and self.rope_dim >= self.head_dim:
            raise ValueError(f"MLAConfig: rope_dim ({self.rope_dim}) must be < head_dim ({self.head_dim})")

    def sizes(self) -> tuple[int, int, int, int]:
        """``(D_n, D_r, D_v, R)``."""
        rope = self.head_dim // 2 if self.rope_dim is None else self.rope_dim
        latent = 4 * self.head_dim if self.latent is None else self.latent
        return self.head_dim - rope, rope, self.value_dim or self.head_dim, latent


@register(
    "mla",
    config=MLAConfig,
    family="low_rank",
    summary="Multi-head latent attention: K/V from one shared low-rank latent, cached as R + D_r per token.",
    paper="DeepSeek-AI 2024, DeepSeek-V2, https://arxiv.org/abs/2405.04434",
    capabilities=Capabilities(
        causal=True, key_mask=True, decode_step=True, cross_attention=True, weights_apply_to_v=False
    ),
    complexity=Complexity(time="O(N^2 H D + N H D R)", memory="O(N H D) (SDPA)"),
    notes=(
        "swapped in untrained: its latent down- and up-projections are random at init, so its keys and values "
        "are unrelated to the model's (a pretrained model's MLA layer needs converting or fine-tuning)",
        "the latent is a learned down-projection of the layer's k (first D - rope_dim channels) and v of every "
        "head; k_rope a learned per-head weighted sum of k's last rope_dim channels (commutes with RoPE)",
        "the layer's positional encoding acts on q and k before the mechanism; MultiHeadAttention(positional="
        "'rope') rotates only the last rope_dim channels (rotary_channels; the paper's decoupled RoPE); a RoPE "
        "that rotates every channel still gives a correct function but breaks the content match through the "
        "latent (MQAR quick: 24.6% that way)",
        "grouped K/V are repeated to H heads before the down-projection (the latent is shared anyway)",
        "the weights depend on v and the output is not weights @ v: keys and values are made from one latent of "
        "k and v (as DeepSeek-V2's are from the hidden state); implied_attention(q, k) is refused",
        "decode step: a cache of c_kv and k_rope only, R + D_r numbers per token (not 2 H D), attended in the "
        "absorbed form (W_uk folded into the query): O(t (R + D_r)) memory, O(t H (R + D_r)) time per token",
    ),
)
class MultiHeadLatentAttention(Attention):
    """DeepSeek-V2's MLA over the layer's q, k, v (see the module docstring)."""

    config: MLAConfig

    def __init__(self, config: MLAConfig) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(config.seed)
        heads = config.heads
        d_n, d_r, d_v, rank = config.sizes()

        def gaussian(*shape: int, fan_in: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * fan_in**-0.5)

        self.w_dkv = gaussian(heads, d_n + d_v, rank, fan_in=heads * (d_n + d_v))  # [H, D_n + D_v, R]
        self.w_uk = gaussian(heads, rank, d_n, fan_in=rank)
        self.w_uv = gaussian(heads, rank, d_v, fan_in=rank)
        self.w_kr = nn.Parameter(torch.full((heads,), 1.0 / heads))  # the rope key starts as the heads' mean

    @property
    def rotary_channels(self) -> int:
        """D_r: the layer's RoPE rotates only the last ``rope_dim`` channels (decoupled RoPE)."""
        return self.config.sizes()[1]

    def compress(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``c_kv (B, N, R)`` and ``k_rope (B, N, D_r)`` of the layer's ``k (B, H, N, D)``, ``v``."""
        d_n = self.config.sizes()[0]
        nope_v = torch.cat([k[..., :d_n], v], -1)
        c_kv = torch.einsum("bhnd,hdr->bnr", nope_v, self.w_dkv.to(k.dtype))
        return c_kv, torch.einsum("bhnd,h->bnd", k[..., d_n:], self.w_kr.to(k.dtype))

    def _check(self, q: Tensor, v: Tensor) -> None:
        cfg = self.config
        got = (q.shape[1], q.shape[-1], v.shape[-1])
        want = (cfg.heads, cfg.head_dim, cfg.sizes()[2])
        if got != want:
            raise ValueError(
                f"'mla' was built for heads, head_dim, value_dim = {want} but got {got}: build it with "
                "shape=attnzoo.Shape(heads=..., head_dim=..., value_dim=...) of the layer"
            )

    def _inputs(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        """``latent_attention``'s arguments, in the compute dtype."""
        cd, d_n = compute_dtype(q), self.config.sizes()[0]
        q, k, v = (x.to(cd) for x in (q, k, v))
        return (q[..., :d_n], q[..., d_n:], *self.compress(k, v), self.w_uk.to(cd), self.w_uv.to(cd))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        self._check(q, v)
        options = dict(causal=args.causal, key_mask=args.key_mask, scale=self.config.scale)
        return latent_attention(*self._inputs(q, k, v), **options).to(q.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """Per-head keys and values up-projected from the latent, dense softmax: eqs. (9)-(19)
        of the paper."""
        self._check(q, v)
        qx, kx, vx = _expanded(*self._inputs(q, k, v))
        options = dict(causal=args.causal, key_mask=args.key_mask, scale=default_scale(self.config.scale, q.shape[-1]))
        out, weights = reference_attention(qx, kx, vx, return_weights=True, **options)
        return (out.to(q.dtype), weights) if return_weights else out.to(q.dtype)

    def implied_attention(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_mask: Tensor | None = None
    ) -> Tensor:
        """Refused: MLA's keys come from a latent of k and v together, so its weights depend on v
        too; ``reference(q, k, v, return_weights=True)`` gives them for a given v."""
        raise ValueError(
            "'mla' has no implied_attention(q, k): its keys are made from a latent of k and v, so the weights "
            "depend on v; use reference(q, k, v, return_weights=True)"
        )

    def _init_state(self, spec: StateSpec) -> KVCache:
        """A cache of ``[c_kv, k_rope]`` per token, ``R + D_r`` numbers (``KVCache``'s keys, one
        head; its values have width 0: the values are the first R channels of the keys)."""
        _, d_r, _, rank = self.config.sizes()
        size = (spec.batch, 1, rank + d_r, 0)
        return KVCache.empty(*size, capacity=spec.capacity, device=spec.device, dtype=spec.dtype)

    def _step(self, state: KVCache, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, KVCache]:
        """Append the new tokens' latent and rope key, then attend in the absorbed form."""
        self._check(q, v)
        q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = self._inputs(q, k, v)
        latent = torch.cat([c_kv, k_rope], -1).to(state.k_buffer.dtype)
        state = state.append(latent[:, None], latent.new_zeros(*latent.shape[:2], 0)[:, None], args.key_mask)
        scale = default_scale(self.config.scale, q.shape[-1])
        cd = compute_dtype(q)
        out = absorbed_attention(
            q_nope, q_rope, state.k[:, 0].to(cd), w_uk, w_uv, causal=True, key_mask=state.key_mask, scale=scale
        )
        return out.to(q.dtype), state
