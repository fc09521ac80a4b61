"""Linear attention with decay (family ``recurrent``): a state ``S (D, D_v)`` per head that
forgets, ``S_t = decay_t * S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` (no softmax, no denominator).
The members differ in the decay:

- ``retnet``: retention (Sun et al. 2023, https://arxiv.org/abs/2307.08621), a fixed gamma per head;
- ``gla``: gated linear attention (Yang et al. 2023, https://arxiv.org/abs/2312.06635), a decay
  per token and key channel from a low-rank projection;
- ``ssd``: Mamba-2's state space duality (Dao & Gu 2024, https://arxiv.org/abs/2405.21060), a
  scalar decay per token and head, ``exp(dt_t A_h)``;
- ``lightning``: Lightning attention (Qin et al. 2024, https://arxiv.org/abs/2401.04658), retention
  with ALiBi-slope decays that weaken with depth, on ``silu(q)``, ``silu(k)``.

The plain functions ``retention``, ``gla`` and ``ssd`` (the interface of issue 19, shared with
``tests/oracles_modern.py``; defined in ``decay_functions.py``) are the fast paths: chunkwise
(quadratic inside a chunk, states carried across chunks, every exponent <= 0), returning the
output and the final state. ``naive_*`` are the token-by-token recurrences as the papers write
them; ``decay_weights`` the dense ``(Q K^T) * D`` form with its explicit decay matrix, which the
mechanisms' references use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.mechanisms._ops import compute_dtype, default_scale
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.mechanisms.decay_functions import decay_weights, gla, naive_gla, naive_retention, naive_ssd, retention, ssd
from attnzoo.positional import alibi_slopes
from attnzoo.registry import LAZY_GEOMETRY, Config, bounded, register
from attnzoo.spec import Capabilities, Complexity

__all__ = ["retention", "gla", "ssd", "naive_retention", "naive_gla", "naive_ssd", "decay_weights"]


class Gated(NamedTuple):
    """What a member makes from ``(q, k)`` and its parameters: the query and key its function
    takes, the log decays (``(B, H, N)`` scalar or ``(B, H, N, D)`` per channel), and, for SSD,
    the per-token value scale ``dt (B, H, N)`` and the skip weight ``D_h (H,)``."""

    q: Tensor
    k: Tensor
    log_decay: Tensor
    v_scale: Tensor | None = None
    skip: Tensor | None = None


class DecayAttention(Attention):
    """Base of the family: a member supplies ``gates`` (its ``Gated`` inputs from ``q, k``) and
    ``fast`` (its chunkwise function); this class runs the fast path, the dense reference, and
    ``init_state`` / ``step`` on the state ``S (B, H, D, D_v)``.

    Notes:
        Causal only (the state holds the past; there is no non-causal form): ``causal=False``
        raises. A padded token (``key_mask`` False) is skipped: its k and v are zero, so it adds
        nothing to the state, and its log decay is set to 0, so it does not decay it either; a
        left-padded prompt leaves the state the unpadded one would. Gates come from q and k only
        (never v), so ``implied_attention`` (which has no v) sees the same weights.
        float16/bfloat16 inputs are computed in float32 and cast back.
    """

    fast: ClassVar[Callable[..., tuple[Tensor, Tensor]]]

    def gates(self, q: Tensor, k: Tensor) -> Gated:
        raise NotImplementedError

    def _gated(self, q: Tensor, k: Tensor, args: AttendArgs) -> Gated:
        ct = compute_dtype(q)
        g = self.gates(q.to(ct), k.to(ct))
        if args.key_mask is None:
            return g
        real = args.key_mask[:, None] if g.log_decay.dim() == 3 else args.key_mask[:, None, :, None]
        return g._replace(log_decay=torch.where(real, g.log_decay, 0.0))

    def _run(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, state: Tensor | None) -> tuple[Tensor, Tensor]:
        g = self._gated(q, k, args)
        vc = v.to(g.q.dtype)
        values = vc if g.v_scale is None else vc * g.v_scale[..., None]
        s0 = None if state is None else state.to(vc.dtype)
        out, state = type(self).fast(g.q, g.k, values, g.log_decay, initial_state=s0, chunk=self.config.chunk)
        if g.skip is not None:
            out = out + g.skip[:, None, None] * vc
        return out.to(q.dtype), state

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return self._run(q, k, v, args, None)[0]

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """The parallel form: ``O = ((Q K^T) * D) V`` with the decay matrix written out
        (``decay_weights``); SSD's ``dt`` scales the key columns and its skip adds ``D_h I``."""
        g = self._gated(q, k, args)
        weights = decay_weights(g.q, g.k, g.log_decay)
        if g.v_scale is not None:
            weights = weights * g.v_scale[:, :, None, :]
        if g.skip is not None:
            real = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
            real = real if args.key_mask is None else args.key_mask
            weights = weights + torch.diag_embed(real[:, None] * g.skip[:, None])
        out = weights @ v.to(weights.dtype)
        return (out, weights) if return_weights else out

    def _init_state(self, spec: StateSpec) -> Tensor:
        """``S = 0 (B, H, D, D_v)``, float64 for float64, else float32: fixed size."""
        dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32
        return torch.zeros(spec.batch, spec.heads, spec.head_dim, spec.value_dim, device=spec.device, dtype=dtype)

    def _step(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, Tensor]:
        """The recurrence over the ``T`` new tokens (O(D D_v) per token)."""
        return self._run(q, k, v, args, state)


_NOTES = (
    "causal only: causal=False raises (the recurrence has no non-causal form)",
    "padded tokens are skipped: zero k and v, and log decay 0, so they neither enter nor decay the state",
    "causal: chunkwise (quadratic inside a chunk of `chunk` positions, states carried across chunks); "
    "scalar decays (not gla's per-channel ones): a decay factor below eps^4 (e^-64 in float32) counts "
    "as 0, beside the row's own key at factor 1",
    "decode step: the recurrence on S (B, H, D, D_v), O(D D_v) per token, fixed size",
)
_COST = Complexity(
    time="O(N (chunk D + D D_v))", memory="O(N (chunk + D) + (N / chunk) D D_v)", subquadratic_memory=True
)


def _register(name: str, config: type, summary: str, paper: str, notes: tuple[str, ...]) -> Callable[[type], type]:
    caps = Capabilities(causal=True, bidirectional=False, key_mask=True, decode_step=True)
    about = dict(family="recurrent", summary=summary, paper=paper, notes=_NOTES + notes)
    return register(name, config=config, capabilities=caps, complexity=_COST, **about)


@dataclass(frozen=True, kw_only=True)
class RetNetConfig(Config):
    """Config of ``retnet``.

    Args:
        scale: q is multiplied by it; None (default) for 1/sqrt(D) (the paper scales K by it).
        chunk: positions per chunk of the chunkwise form. Default 64.
    """

    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")
    chunk: int = bounded(64, ge=1)


@_register(
    "retnet",
    RetNetConfig,
    "Retention: linear attention with a fixed decay gamma_h per head, S_t = gamma_h S_{t-1} + k_t^T v_t.",
    "Sun et al. 2023, Retentive Network: A Successor to Transformer, https://arxiv.org/abs/2307.08621",
    (
        "gamma_h = 1 - 2^(-5 - h) for head h = 0 .. H-1 (the paper's choice), fixed, no parameters",
        "without the paper's per-head GroupNorm (and the D / QK^T normalisations it makes harmless): "
        "the layer applies it; the output stays linear in v, so implied_attention is exact",
        "the paper's xPos rotation of q and k is the layer's positional encoding (rope), not done here",
    ),
)
class RetNetAttention(DecayAttention):
    """Retention: ``O = ((Q K^T) * D) V``, ``D_ij = gamma_h^(i - j)`` for ``j <= i``."""

    config: RetNetConfig
    fast = staticmethod(ssd)

    def gates(self, q: Tensor, k: Tensor) -> Gated:
        heads = torch.arange(q.shape[1], device=q.device, dtype=q.dtype)
        log_gamma = torch.log1p(-torch.exp2(-5.0 - heads))  # [H]
        scale = default_scale(self.config.scale, q.shape[-1])
        return Gated(q * scale, k, log_gamma[:, None].expand(q.shape[:3]))


@dataclass(frozen=True, kw_only=True)
class LightningConfig(Config):
    """Config of ``lightning``.

    Args:
        layer_index, layers: this layer's index l (from 0) among L layers: head h decays by
            ``exp(-s_h (1 - l / (L - 1) + 1e-5))`` per token (one layer: ``exp(-s_h (1 + 1e-5))``),
            so deeper layers remember longer. Defaults 0 and 1.
        chunk: positions per chunk. Default 64.
    """

    layer_index: int = bounded(0, ge=0)
    layers: int = bounded(1, ge=1)
    chunk: int = bounded(64, ge=1)

    def validate(self) -> None:
        if self.layer_index >= self.layers:
            raise ValueError(f"LightningConfig: layer_index ({self.layer_index}) must be < layers ({self.layers})")


@_register(
    "lightning",
    LightningConfig,
    "Lightning attention: retention with ALiBi-slope decays that weaken with depth, on silu(q), silu(k).",
    "Qin et al. 2024, Lightning Attention-2 (TransNormerLLM, MiniMax-01), https://arxiv.org/abs/2401.04658",
    (
        "decay exp(-s_h (1 - l / (L - 1) + 1e-5)) per token, s_h the ALiBi slopes 2^(-8 (h + 1) / H), "
        "l = layer_index of L = layers (as MiniMax-01's slope_rate); fixed, no parameters",
        "q and k pass silu (the feature map), unscaled; the models' silu on v, output RMSNorm ('NormAttention') "
        "and sigmoid output gate are the layer's, so the output stays linear in v",
    ),
)
class LightningAttention(DecayAttention):
    """Lightning attention: ``O = ((silu(Q) silu(K)^T) * M) V``, ``M_ij = lambda_h^(i - j)``."""

    config: LightningConfig
    fast = staticmethod(ssd)

    def gates(self, q: Tensor, k: Tensor) -> Gated:
        c = self.config
        depth = 1 - c.layer_index / (c.layers - 1) if c.layers > 1 else 1.0
        rate = alibi_slopes(q.shape[1]).to(q) * (depth + 1e-5)  # [H]
        return Gated(F.silu(q), F.silu(k), -rate[:, None].expand(q.shape[:3]))


class LearnedDecay(DecayAttention):
    """A member whose gates have parameters, the first of them ``(H, D, ...)``: made at
    construction when ``config.heads`` and ``config.head_dim`` are set (a layer's ``Shape`` sets
    them), else on the first forward / ``init_state`` (then make the optimizer after it)."""

    parameter_names: ClassVar[tuple[str, ...]]

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        for name in self.parameter_names:
            self.register_parameter(name, None)
        if config.heads is not None and config.head_dim is not None:
            self.prepare(config.heads, config.head_dim, None)

    def initial_parameters(self, heads: int, head_dim: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def prepare(self, heads: int, head_dim: int, device: Any) -> None:
        first = getattr(self, self.parameter_names[0])
        if first is None:
            for name, value in self.initial_parameters(heads, head_dim).items():
                setattr(self, name, nn.Parameter(value.to(device)))
        elif tuple(first.shape[:2]) != (heads, head_dim):
            raise ValueError(
                f"{self.spec.name} was made for (heads, head_dim) = {tuple(first.shape[:2])}, got inputs with "
                f"({heads}, {head_dim}); build it with heads={heads}, head_dim={head_dim}"
            )

    def parameter(self, name: str, like: Tensor) -> Tensor:
        self.prepare(like.shape[1], like.shape[3], like.device)
        return getattr(self, name).to(like.dtype)

    def _init_state(self, spec: StateSpec) -> Tensor:
        self.prepare(spec.heads, spec.head_dim, spec.device)
        return super()._init_state(spec)


@dataclass(frozen=True, kw_only=True)
class GLAConfig(Config):
    """Config of ``gla``.

    Args:
        heads, head_dim: H and D of the gate's parameters (a layer's ``Shape`` sets them); None
            (default) creates them on the first forward.
        rank: of the gate's low-rank projection ``D -> rank -> D`` (16, the paper's).
        temperature: tau in ``log alpha = logsigmoid(x) / tau`` (16, the paper's).
        scale: q is multiplied by it; None (default) for 1/sqrt(D).
        chunk: positions per chunk, a power of two. Default 64.
    """

    heads: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)
    head_dim: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)
    rank: int = bounded(16, ge=1)
    temperature: float = bounded(16.0, gt=0)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")
    chunk: int = bounded(64, ge=1)

    def validate(self) -> None:
        if self.chunk & (self.chunk - 1):
            raise ValueError(f"GLAConfig: chunk must be a power of two (the halving inside a chunk), got {self.chunk}")


@_register(
    "gla",
    GLAConfig,
    "Gated linear attention: a decay per token and key channel, S_t = diag(alpha_t) S_{t-1} + k_t^T v_t.",
    "Yang et al. 2023, Gated Linear Attention Transformers with Hardware-Efficient Training, "
    "https://arxiv.org/abs/2312.06635",
    (
        "alpha_t = sigmoid(k_t W_1 W_2 + b)^(1/16) per head (rank 16, temperature 16): the paper projects the "
        "layer input x_t; here the gate reads k_t, the only per-token input the mechanism sees besides q and v",
        "the paper's output GroupNorm and swish output gate are the layer's, not done here",
        "chunks: secondary chunks by halves inside a chunk, every exponent <= 0 (no division by a decay product)",
    ),
)
class GLAAttention(LearnedDecay):
    """GLA with its gate ``log alpha_t = logsigmoid(k_t W_down W_up + b) / tau`` per head.

    Notes:
        Parameters ``gate_down (H, D, rank)``, ``gate_up (H, rank, D)`` (``nn.Linear``'s uniform
        init), ``gate_bias (H, D)`` (0: alpha about 0.96 at the start).
    """

    config: GLAConfig
    fast = staticmethod(gla)
    parameter_names = ("gate_down", "gate_up", "gate_bias")

    def initial_parameters(self, heads: int, head_dim: int) -> dict[str, Tensor]:
        rank = self.config.rank
        return dict(
            gate_down=(torch.rand(heads, head_dim, rank) * 2 - 1) / math.sqrt(head_dim),
            gate_up=(torch.rand(heads, rank, head_dim) * 2 - 1) / math.sqrt(rank),
            gate_bias=torch.zeros(heads, head_dim),
        )

    def gates(self, q: Tensor, k: Tensor) -> Gated:
        low = torch.einsum("bhnd,hdr->bhnr", k, self.parameter("gate_down", k))
        logits = torch.einsum("bhnr,hre->bhne", low, self.parameter("gate_up", k))
        log_alpha = F.logsigmoid(logits + self.parameter("gate_bias", k)[:, None]) / self.config.temperature
        return Gated(q * default_scale(self.config.scale, q.shape[-1]), k, log_alpha)


@dataclass(frozen=True, kw_only=True)
class SSDConfig(Config):
    """Config of ``ssd``.

    Args:
        heads, head_dim: H and D of the parameters (a layer's ``Shape`` sets them); None
            (default) creates them on the first forward.
        dt_min, dt_max: the initial ``dt = softplus(dt_bias)`` is drawn log-uniform in this
            range, one per head (Mamba-2's 0.001, 0.1).
        chunk: positions per chunk. Default 64.
    """

    heads: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)
    head_dim: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)
    dt_min: float = bounded(0.001, gt=0)
    dt_max: float = bounded(0.1, gt=0)
    chunk: int = bounded(64, ge=1)

    def validate(self) -> None:
        if self.dt_min > self.dt_max:
            raise ValueError(f"SSDConfig: dt_min ({self.dt_min}) must be <= dt_max ({self.dt_max})")


@_register(
    "ssd",
    SSDConfig,
    "Mamba-2 SSD: a scalar decay exp(dt_t A_h) per token and head, values scaled by dt_t, plus a skip D_h v_t.",
    "Dao & Gu 2024, Transformers are SSMs (Mamba-2), https://arxiv.org/abs/2405.21060",
    (
        "q plays C, k plays B, v plays x: o_t = q_t S_t + D_h v_t, S_t = exp(dt_t A_h) S_{t-1} + dt_t k_t^T v_t",
        "dt_t = softplus(k_t . w_h + dt_bias_h): Mamba-2 projects dt from the layer input; here from k_t "
        "(never v, so implied_attention sees it); A_h = -exp(A_log_h) learned, A_log = log U(1, 16), D_h = 1",
        "no scaling of q (C . B as in Mamba-2); the convolution and output norm/gate are the layer's",
    ),
)
class SSDAttention(LearnedDecay):
    """SSD's parameters per head: ``dt_weight (H, D)`` (``nn.Linear``'s uniform init),
    ``dt_bias (H,)`` (inverse softplus of a log-uniform dt), ``a_log (H,)``, ``d_skip (H,)``."""

    config: SSDConfig
    fast = staticmethod(ssd)
    parameter_names = ("dt_weight", "dt_bias", "a_log", "d_skip")

    def initial_parameters(self, heads: int, head_dim: int) -> dict[str, Tensor]:
        low, high = math.log(self.config.dt_min), math.log(self.config.dt_max)
        dt = (torch.rand(heads) * (high - low) + low).exp().clamp(min=1e-4)
        return dict(
            dt_weight=(torch.rand(heads, head_dim) * 2 - 1) / math.sqrt(head_dim),
            dt_bias=dt + torch.log(-torch.expm1(-dt)),  # softplus(dt_bias) = dt
            a_log=torch.empty(heads).uniform_(1, 16).log(),
            d_skip=torch.ones(heads),
        )

    def gates(self, q: Tensor, k: Tensor) -> Gated:
        logits = torch.einsum("bhnd,hd->bhn", k, self.parameter("dt_weight", k))
        dt = F.softplus(logits + self.parameter("dt_bias", k)[:, None])  # [B, H, N]
        a = -self.parameter("a_log", k).exp()  # [H], < 0
        return Gated(q, k, dt * a[:, None], v_scale=dt, skip=self.parameter("d_skip", k))
