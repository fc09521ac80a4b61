"""Two softmax variants that change what is done with the weights, split from
``softmax_variants`` (which re-exports their plain functions, the interface's module):

* ``differential`` (Diff Transformer): the difference of two softmax maps, then a per-head norm.
* ``gated`` (gated attention, Qwen3-Next): the output times an elementwise sigmoid gate.

Also the pieces the variants share: ``PerHead`` (parameters sized by the layer geometry) and the
capabilities of a variant that decodes with a KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms._ops import compute_dtype, default_scale, same_width
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted
from attnzoo.mechanisms.cache import KVCacheDecode
from attnzoo.mechanisms.softmax import sdpa_attention
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity

KV_DECODE = "decode step: a KV cache, the new rows attended over it: O(t) memory and time per token"
#: What every variant that decodes through ``KVCacheDecode`` declares (its steps are N_q < N_kv calls).
CACHE_CAPS = dict(causal=True, key_mask=True, decode_step=True, cross_attention=True)
#: ``differential`` and ``gated``: SDPA then a per-head map of its output (norm, gate), so the
#: output is not weights @ v; grouped K/V go to SDPA as they are.
_SDPA_THEN_MAP = Capabilities(**CACHE_CAPS, gqa=True, weights_apply_to_v=False, backends=("sdpa", "reference"))


class PerHead(Attention):
    """A variant with parameters sized by the layer geometry (config ``heads``, ``head_dim``,
    ``value_dim``): checks that the inputs have that geometry."""

    def _check_geometry(self, q: Tensor, v: Tensor | None) -> None:
        """Refuse inputs of another geometry than the parameters were made for; ``v=None``
        skips D_v (``_values_transformed`` says why)."""
        cfg = self.config
        value_dim = getattr(cfg, "value_dim", None) or getattr(cfg, "head_dim", None)
        sizes = {
            "heads": (q.shape[1], getattr(cfg, "heads", None)),
            "head_dim": (q.shape[-1], getattr(cfg, "head_dim", None)),
        }
        sizes["value_dim"] = (value_dim if v is None else v.shape[-1], value_dim)
        for name, (got, built) in sizes.items():
            if built is not None and got != built:
                raise ValueError(
                    f"{self.spec.name!r} was built for {name}={built} but got {got}: build it with "
                    f"shape=attnzoo.Shape(heads=..., head_dim=..., value_dim=...) of the layer"
                )

    def _values_transformed(self, q: Tensor, v: Tensor, return_weights: bool) -> bool:
        """Whether ``_reference`` applies the per-channel output transform (norm, gate) to
        ``weights @ v``: always, except for the weights alone (``implied_attention``), whose dummy
        v has one column, not D_v; there the output is the untransformed ``weights @ v``."""
        self._check_geometry(q, None if return_weights else v)
        return v.shape[-1] == (getattr(self.config, "value_dim", None) or self.config.head_dim)


def lambda_init(layer_index: int) -> float:
    """Diff Transformer's ``lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))`` for layer ``l`` (from 1)."""
    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 1:
        raise ValueError(f"layer_index counts layers from 1, got {layer_index!r}")
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_index - 1))


def diff_lambda(lq1: Tensor, lk1: Tensor, lq2: Tensor, lk2: Tensor, lambda_init: float) -> Tensor:
    """Diff Transformer's re-parametrised lambda, eq. (2): ``exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init``."""
    return torch.exp((lq1 * lk1).sum(-1)) - torch.exp((lq2 * lk2).sum(-1)) + lambda_init


def differential_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor | float,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_mask: Tensor | None = None,
) -> Tensor:
    """Diff Transformer (Ye et al. 2024, https://arxiv.org/abs/2410.05258), eq. (1), before the
    per-head norm: ``(softmax(s Q1 K1^T) - lam softmax(s Q2 K2^T)) V`` with ``Q1, Q2`` (``K1,
    K2``) the halves of q (k) along D and ``s`` the half width's scale (default ``1 / sqrt(D /
    2)``). Two SDPA calls. ``lam``: a scalar or ``(H,)``."""
    if q.shape[-1] % 2:
        raise ValueError(f"differential attention splits q and k in halves: D must be even, got {q.shape[-1]}")
    half = q.shape[-1] // 2
    scale = default_scale(scale, half)
    parts = (slice(None, half), slice(half, None))
    one, two = (
        sdpa_attention(*same_width(q[..., part], k[..., part], v), causal=causal, key_mask=key_mask, scale=scale)
        for part in parts
    )
    one, two = one[..., : v.shape[-1]], two[..., : v.shape[-1]]
    return one - _per_head(lam, one) * two


def _per_head(lam: Tensor | float, like: Tensor) -> Tensor:
    """``lam`` (scalar or ``(H,)``) shaped to scale ``(B, H, N, D_v)``."""
    lam = torch.as_tensor(lam, dtype=like.dtype, device=like.device)
    return lam.view(-1, 1, 1) if lam.dim() == 1 else lam


@dataclass(frozen=True, kw_only=True)
class DifferentialConfig(Config):
    """Config of ``differential``.

    Args:
        head_dim: D of q and k (layer geometry; 64; must be even to run): the lambda vectors have D / 2 entries.
        value_dim: D_v, the width of the per-head norm (None: head_dim).
        layer_index: l, from 1, of the layer: ``lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))`` (1).
        scale: of the half-width scores; default ``1 / sqrt(D / 2)``.
        seed: of the lambda vectors' N(0, 0.1^2) init (0).
    """

    head_dim: int = bounded(64, ge=2)
    value_dim: int | None = bounded(None, ge=1, none="head_dim")
    layer_index: int = bounded(1, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D/2)")
    seed: int = bounded(0, ge=0)


@register(
    "differential",
    config=DifferentialConfig,
    family="exact",
    summary="Differential attention: the difference of two softmax maps, then a per-head RMSNorm.",
    paper="Ye et al. 2024, Differential Transformer, https://arxiv.org/abs/2410.05258",
    capabilities=_SDPA_THEN_MAP,
    complexity=Complexity(time="O(N^2 D)", memory="O(N D) (SDPA, twice)"),
    notes=(
        "swapped in untrained: the difference of two half-width softmax maps, weighted by a lambda from random "
        "vectors, then a per-head RMSNorm: a different function from the model's attention until trained",
        "a head's q and k are split in halves along D (Q1, Q2, K1, K2 of width D / 2) and v is used whole: the "
        "paper's head of width d with values of width 2d is an attnzoo head with D = 2d and D_v = 2d",
        "lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, one per layer (shared by the heads), "
        "lambda_init from layer_index",
        "the per-head RMSNorm (eps 1e-5, a learned weight of D_v) and the (1 - lambda_init) factor are part of the "
        "mechanism: the output is not weights @ v; reference weights are the difference map",
        KV_DECODE,
    ),
)
class DifferentialAttention(KVCacheDecode, PerHead):
    """Diff Transformer attention: ``(1 - lambda_init) RMSNorm(differential_attention(q, k, v, lambda))``."""

    config: DifferentialConfig
    eps = 1e-5

    def __init__(self, config: DifferentialConfig) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(config.seed)
        half = config.head_dim // 2
        vectors = torch.randn(4, half, generator=g) * 0.1
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (nn.Parameter(x) for x in vectors)
        self.norm_weight = nn.Parameter(torch.ones(config.value_dim or config.head_dim))
        self.lambda_init = lambda_init(config.layer_index)

    def lam(self) -> Tensor:
        """The current lambda (a 0-dim tensor)."""
        return diff_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)

    def _normed(self, out: Tensor) -> Tensor:
        """Per-head RMSNorm over D_v, then ``(1 - lambda_init)`` (Ye et al. 2024, eq. (3))."""
        normed = F.rms_norm(out, out.shape[-1:], self.norm_weight.to(out.dtype), eps=self.eps)
        return normed * (1 - self.lambda_init)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        self._check_geometry(q, v)
        cd = compute_dtype(q)
        out = differential_attention(
            *(x.to(cd) for x in (q, k, v)),
            self.lam(),
            causal=args.causal,
            scale=self.config.scale,
            key_mask=args.key_mask,
        )
        return self._normed(out).to(q.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """The two maps written out; the weights returned are their difference ``A1 - lambda A2``."""
        transformed = self._values_transformed(q, v, return_weights)
        if q.shape[-1] % 2:
            raise ValueError(f"differential attention splits q and k in halves: D must be even, got {q.shape[-1]}")
        half, cd = q.shape[-1] // 2, compute_dtype(q)
        options = dict(causal=args.causal, key_mask=args.key_mask, scale=default_scale(self.config.scale, half))
        _, a1 = reference_attention(q[..., :half], k[..., :half], v, return_weights=True, **options)
        _, a2 = reference_attention(q[..., half:], k[..., half:], v, return_weights=True, **options)
        weights = a1 - self.lam().to(cd) * a2
        out = weights @ v.to(cd)
        out = (self._normed(out) if transformed else out).to(q.dtype)
        return (out, weights) if return_weights else out


def gated_output(o: Tensor, gate_logits: Tensor) -> Tensor:
    """Qiu et al. 2025's output gate (position G1, elementwise): ``o * sigmoid(gate_logits)``."""
    return o * torch.sigmoid(gate_logits)


def gated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate_logits: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_mask: Tensor | None = None,
) -> Tensor:
    """Gated attention (Qiu et al. 2025, https://arxiv.org/abs/2505.06708): SDPA's output times
    ``sigmoid(gate_logits)``, elementwise; ``gate_logits (B, H, N_q, D_v)``."""
    return gated_output(sdpa_attention(q, k, v, causal=causal, key_mask=key_mask, scale=scale), gate_logits)


@dataclass(frozen=True, kw_only=True)
class GatedConfig(Config):
    """Config of ``gated``.

    Args:
        heads, head_dim, value_dim: layer geometry (8, 64, None = head_dim): the gate map is
            ``(H, D, D_v)`` plus a bias ``(H, D_v)``.
        scale: default ``1 / sqrt(D)``. seed: of the gate map's N(0, 1/D) init (0).
    """

    heads: int = bounded(8, ge=1)
    head_dim: int = bounded(64, ge=1)
    value_dim: int | None = bounded(None, ge=1, none="head_dim")
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")
    seed: int = bounded(0, ge=0)


@register(
    "gated",
    config=GatedConfig,
    family="exact",
    summary="Softmax attention times an elementwise sigmoid gate per head (gated attention, Qwen3-Next).",
    paper="Qiu et al. 2025, Gated Attention for Large Language Models, https://arxiv.org/abs/2505.06708",
    capabilities=_SDPA_THEN_MAP,
    complexity=Complexity(time="O(N^2 D + N D D_v)", memory="O(N D) (SDPA)"),
    notes=(
        "swapped in untrained: the gate's weights are random at init: each output channel is scaled by the "
        "sigmoid of a random linear map of q (about 0.5 on average)",
        "the paper computes the gate from the layer's hidden state (X W_theta); a mechanism sees q only, so the "
        "gate logits are a learned per-head linear map of q_i (D -> D_v, plus bias): the same place (after SDPA, "
        "elementwise, head-specific), a different input",
        "the output is not weights @ v (the gate scales each value channel); reference weights are the softmax's",
        KV_DECODE,
    ),
)
class GatedAttention(KVCacheDecode, PerHead):
    """Gated attention: ``gated_attention`` with gate logits ``q W_h + b_h``."""

    config: GatedConfig

    def __init__(self, config: GatedConfig) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(config.seed)
        d, d_v = config.head_dim, config.value_dim or config.head_dim
        self.gate_weight = nn.Parameter(torch.randn(config.heads, d, d_v, generator=g) * d**-0.5)
        self.gate_bias = nn.Parameter(torch.zeros(config.heads, d_v))

    def gate_logits(self, q: Tensor) -> Tensor:
        """``(B, H, N_q, D_v)``: ``q_i W_h + b_h``."""
        w, b = self.gate_weight.to(q.dtype), self.gate_bias.to(q.dtype)
        return torch.einsum("bhnd,hde->bhne", q, w) + b[:, None, :]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        self._check_geometry(q, v)
        cd = compute_dtype(q)
        qc, kc, vc = (x.to(cd) for x in (q, k, v))
        out = gated_attention(
            qc, kc, vc, self.gate_logits(qc), causal=args.causal, scale=self.config.scale, key_mask=args.key_mask
        )
        return out.to(q.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        transformed = self._values_transformed(q, v, return_weights)
        options = dict(causal=args.causal, key_mask=args.key_mask, scale=self.config.scale)
        out, weights = reference_attention(q, k, v, return_weights=True, **options)
        out = gated_output(out, self.gate_logits(q.to(out.dtype))) if transformed else out
        return (out, weights) if return_weights else out
