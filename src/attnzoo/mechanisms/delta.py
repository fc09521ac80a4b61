"""The recurrent family: linear attention whose state is overwritten, not only added to, by the
delta rule. ``deltanet`` (Schlag et al. 2021, https://arxiv.org/abs/2102.11174, parallelised
by Yang et al. 2024, https://arxiv.org/abs/2406.06484) and ``gated_deltanet`` (Yang, Kautz &
Hatamizadeh 2024, https://arxiv.org/abs/2412.06464)::

    S_t = alpha_t (S_{t-1} - beta_t k_t^T (k_t S_{t-1})) + beta_t k_t^T v_t,    o_t = q_t S_t

The plain functions (``delta_rule``, ``gated_delta_rule``: chunkwise; ``naive_*``: token by
token; ``delta_weights``: dense) live in ``delta_chunks.py`` and are re-exported here. The
mechanisms make their extra inputs from q, k and their own per-head parameters:

- q and k are L2-normalised per head (the papers do this for stability: with ``|k_t| = 1`` and
  ``beta_t`` in (0, 1), ``I - beta_t k_t^T k_t`` is a contraction, so the state cannot blow up),
  then q is scaled by ``scale`` (1/sqrt(D), as flash-linear-attention's kernels).
- ``beta_t = sigmoid(k_t . w_h + b_h)``: the papers project the hidden state ``x_t``; a mechanism
  sees only q, k, v, so beta is a learned per-head projection of the key before normalisation
  (``k_t = x_t W_k``, so this is ``x_t`` projected through ``W_k w_h``: a rank-restricted form
  of the paper's ``x_t W_beta``).
- ``gated_deltanet``: ``log alpha_t = -exp(A_log_h) * softplus(k_t . w'_h + dt_bias_h)``, Mamba-2's
  parametrisation as Gated DeltaNet uses it, again projected from the key; ``A_log`` and
  ``dt_bias`` initialised as Mamba-2 (``A ~ U(1, 16)``, ``dt ~ logU(0.001, 0.1)``).
- padded tokens (``key_mask`` False) do not touch the state: beta = 0 (no write) and alpha = 1
  (no decay) there, so padding anywhere (left-padded prompts) leaves S as it was.
- the short convolution (``short_conv`` = 4, the papers' width): q and k pass through a causal
  depthwise convolution along the sequence and a SiLU before they are normalised, so a token's
  key can carry its predecessors (what associative recall needs: a value is stored under the key
  token before it). The papers convolve v as well; here v is left alone, so the output stays
  ``weights @ v`` (``implied_attention`` holds). Padded tokens enter the convolution as zeros, and
  the decode state keeps the last ``short_conv - 1`` inputs beside S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.mechanisms._ops import compute_dtype, default_scale, unit
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.mechanisms.delta_chunks import (
    CHUNK,
    delta_rule,
    delta_weights,
    gated_delta_rule,
    naive_delta_rule,
    naive_gated_delta_rule,
)
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity

__all__ = [
    "DeltaNet",
    "DeltaState",
    "GatedDeltaNet",
    "delta_rule",
    "delta_weights",
    "gated_delta_rule",
    "naive_delta_rule",
    "naive_gated_delta_rule",
    "short_conv",
]

#: L2 normalisation's guard: a zero (padded) q or k stays zero instead of dividing by 0.
NORM_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class DeltaConfig(Config):
    """Config of ``deltanet``.

    Args:
        heads, head_dim: the geometry the per-head parameters are sized for (8, 64; a layer's
            ``Shape`` fills them). chunk: tokens per chunk of the fast path (32: the plain functions'
            ``CHUNK``, fastest fwd+bwd on CPU at N = 4096 against 16, 24 and 64).
        scale: multiplies the normalised q; None (default) for 1/sqrt(D). seed: of the init (0).
        short_conv: width of the causal depthwise convolution (+ SiLU) over q and k before the
            rule (4, as the papers; 0 for none: the rule on the projected q and k).
    """

    heads: int = bounded(8, ge=1)
    head_dim: int = bounded(64, ge=1)
    chunk: int = bounded(CHUNK, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")
    seed: int = bounded(0, ge=0)
    short_conv: int = bounded(4, ge=0)


@dataclass(frozen=True, kw_only=True)
class GatedDeltaConfig(DeltaConfig):
    """Config of ``gated_deltanet``: the fields of ``DeltaConfig``."""


_NOTES = (
    "q and k L2-normalised per head (the papers' choice, for stability), then q scaled by `scale`",
    "beta_t = sigmoid(k_t . w_h + b_h): a learned per-head projection of the key before normalisation "
    "(the papers project the hidden state, which a mechanism does not see)",
    "short convolution (width `short_conv`, 4) + SiLU on q and k before normalisation, as the papers; "
    "the papers convolve v too, here v is left alone so that the output stays weights @ v",
    "causal only: causal=False is refused (the papers define no non-causal form)",
    "padded tokens do not touch the state (beta = 0, no decay); a padded query's row is 0",
    "chunkwise (Yang et al. 2024): a unit-triangular inverse per chunk of `chunk` tokens, the state carried across",
    "decode step: the state S (D x D_v per head) and the last short_conv - 1 inputs of q and k, O(D D_v) per token",
)
_COMPLEXITY = Complexity(
    time="O(N C (C + D + D_v) + N D D_v)",  # C^3 per chunk: the unit-triangular inverse
    memory="O(N (C + D + D_v) + (N / C) D D_v)",
    subquadratic_memory=True,
)
# The short convolution mixes each query with the 3 before it: rows are not independent of other queries.
_CAPS = Capabilities(causal=True, bidirectional=False, key_mask=True, decode_step=True, independent_queries=False)


@register(
    "deltanet",
    config=DeltaConfig,
    family="recurrent",
    summary="DeltaNet: linear attention whose state is corrected by the delta rule, S += beta k^T (v - k S).",
    paper="Yang et al. 2024, Parallelizing Linear Transformers with the Delta Rule over Sequence Length, "
    "https://arxiv.org/abs/2406.06484 (Schlag et al. 2021, https://arxiv.org/abs/2102.11174)",
    capabilities=_CAPS,
    complexity=_COMPLEXITY,
    notes=_NOTES,
)
class DeltaNet(Attention):
    """DeltaNet (module docstring). Parameters: ``beta_proj (H, D)`` (seeded, std 1/sqrt(D)),
    ``beta_bias (H,)`` (0: beta starts near 1/2) and, with ``short_conv`` W > 0, ``conv_qk (H, W,
    2 D)`` (q's channels, then k's; uniform in +-1/sqrt(W), torch's Conv1d init).

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``; H and D as configured.
    """

    config: DeltaConfig

    def __init__(self, config: DeltaConfig) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(config.seed)
        self.beta_proj = nn.Parameter(_projection(config, g))
        self.beta_bias = nn.Parameter(torch.zeros(config.heads))
        self._init_gate(g)
        width = config.short_conv  # drawn last: the other parameters' init does not depend on it
        shape = (config.heads, width, 2 * config.head_dim)
        self.conv_qk = nn.Parameter((2 * torch.rand(shape, generator=g) - 1) * width**-0.5) if width else None

    def _init_gate(self, g: torch.Generator) -> None:
        """Create the decay gate's parameters, drawing from ``g`` after beta's (none here)."""

    def log_alpha(self, k: Tensor) -> Tensor | None:
        """``(B, H, N)`` log decays from the raw keys; None: no decay (DeltaNet)."""
        return None

    def _inputs(self, q: Tensor, k: Tensor, key_mask: Tensor | None, tail: Tensor | None = None) -> tuple[Tensor, ...]:
        """``(q, k, beta, log_alpha, tail)`` as the rule takes them, in the compute dtype: q and k
        convolved and normalised (q scaled), beta and log_alpha projected from the raw keys and
        neutral (0, 0) at padded tokens; ``tail`` the convolution's inputs to carry (``tail`` in:
        those before q and k, None for the sequence's start)."""
        c = self.config
        if q.shape[1] != c.heads or q.shape[-1] != c.head_dim:
            raise ValueError(
                f"{self.spec.name} was built for heads={c.heads}, head_dim={c.head_dim} but q has "
                f"H={q.shape[1]}, D={q.shape[-1]}; build it with heads={q.shape[1]}, head_dim={q.shape[-1]}"
            )
        ct = compute_dtype(q)
        q, k = q.to(ct), k.to(ct)
        beta = torch.sigmoid(torch.einsum("bhnd,hd->bhn", k, self.beta_proj.to(ct)) + self.beta_bias.to(ct)[:, None])
        log_alpha = self.log_alpha(k)
        if key_mask is not None:
            real = key_mask[:, None]  # [B, 1, N]
            beta = torch.where(real, beta, 0.0)
            log_alpha = None if log_alpha is None else torch.where(real, log_alpha, 0.0)
        q, k, tail = self._convolve(q, k, key_mask, tail)
        scale = default_scale(c.scale, q.shape[-1])
        return unit(q, NORM_EPS) * scale, unit(k, NORM_EPS), beta, log_alpha, tail

    def _convolve(self, q: Tensor, k: Tensor, key_mask: Tensor | None, tail: Tensor | None) -> tuple[Tensor, ...]:
        """q and k through the short convolution; ``(q, k, tail)``. Padded tokens enter as zeros:
        ``zero_padded`` has zeroed their q and k before ``_attend``, ``_reference`` and ``_step``."""
        if tail is None:
            tail = q.new_zeros(*q.shape[:2], max(self.config.short_conv - 1, 0), 2 * q.shape[-1])
        if self.conv_qk is None:
            return q, k, tail
        qk = torch.cat([q, k], dim=-1)  # [B, H, N, 2D]
        qk, tail = short_conv(qk, self.conv_qk.to(qk.dtype), tail.to(qk.dtype))
        if key_mask is not None:  # a padded position's output row stays 0 (its q would hold its neighbours')
            qk = torch.where(key_mask[:, None, :, None], qk, 0.0)
        return *qk.chunk(2, dim=-1), tail

    def _rule(
        self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, state: DeltaState | None = None
    ) -> tuple[Tensor, DeltaState]:
        """The chunkwise rule on the mechanism's inputs: ``(output in q's dtype, final state)``."""
        s0, tail = (None, None) if state is None else state
        qn, kn, beta, log_alpha, tail = self._inputs(q, k, args.key_mask, tail)
        vc, chunk = v.to(qn.dtype), self.config.chunk
        if log_alpha is None:
            out, s = delta_rule(qn, kn, vc, beta, initial_state=s0, chunk=chunk)
        else:
            out, s = gated_delta_rule(qn, kn, vc, beta, log_alpha, initial_state=s0, chunk=chunk)
        return out.to(q.dtype), DeltaState(s, tail)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return self._rule(q, k, v, args)[0]

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """The dense form (``delta_weights``): ``O = (Q K^T * Dec * M) (I + tril(diag(beta) (K K^T
        * Dec), -1))^-1 diag(beta) V`` on the normalised q, k."""
        qn, kn, beta, log_alpha, _ = self._inputs(q, k, args.key_mask)
        weights = delta_weights(qn, kn, beta, log_alpha, causal=args.causal)
        out = (weights @ v.to(weights.dtype)).to(q.dtype)
        return (out, weights) if return_weights else out

    def _init_state(self, spec: StateSpec) -> DeltaState:
        """The zero state: ``S (B, H, D, D_v)`` and the convolution's tail ``(B, H, W - 1, 2 D)``,
        float64 for float64, else float32."""
        dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32
        s = torch.zeros(spec.batch, spec.heads, spec.head_dim, spec.value_dim, device=spec.device, dtype=dtype)
        width = max(self.config.short_conv - 1, 0)
        return DeltaState(s, s.new_zeros(spec.batch, spec.heads, width, 2 * spec.head_dim))

    def _step(self, state: DeltaState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, DeltaState]:
        """The next T tokens: one token by the recurrence itself, a longer prefill chunkwise."""
        if q.shape[2] > 1:
            return self._rule(q, k, v, args, state)
        qn, kn, beta, log_alpha, tail = self._inputs(q, k, args.key_mask, state.tail)
        s0 = state.s.to(qn.dtype)
        out, s = naive_gated_delta_rule(qn, kn, v.to(qn.dtype), beta, log_alpha, initial_state=s0)
        return out.to(q.dtype), DeltaState(s, tail)


@register(
    "gated_deltanet",
    config=GatedDeltaConfig,
    family="recurrent",
    summary="Gated DeltaNet: the delta rule with a Mamba-2 decay gate, S = alpha (S - beta k^T k S) + beta k^T v.",
    paper="Yang, Kautz & Hatamizadeh 2024, Gated Delta Networks: Improving Mamba2 with Delta Rule, "
    "https://arxiv.org/abs/2412.06464",
    capabilities=_CAPS,
    complexity=_COMPLEXITY,
    notes=(
        *_NOTES[:2],
        "log alpha_t = -exp(A_log_h) softplus(k_t . w_h + dt_bias_h) (Mamba-2's gate, projected from the key)",
        "a decay factor below eps^4 (e^-64 in float32) counts as 0, beside the token's own update at factor 1",
        *_NOTES[2:],
    ),
)
class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet (module docstring). Adds ``gate_proj (H, D)`` (seeded, std 1/sqrt(D)),
    ``a_log (H,)`` (Mamba-2's ``A_log``: ``log U(1, 16)``) and ``dt_bias (H,)`` (the inverse
    softplus of ``dt ~ logU(0.001, 0.1)``)."""

    config: GatedDeltaConfig

    def _init_gate(self, g: torch.Generator) -> None:
        heads = self.config.heads
        self.gate_proj = nn.Parameter(_projection(self.config, g))
        self.a_log = nn.Parameter(torch.log(1 + 15 * torch.rand(heads, generator=g)))
        dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(heads, generator=g))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    def log_alpha(self, k: Tensor) -> Tensor:
        ct = k.dtype
        dt = F.softplus(torch.einsum("bhnd,hd->bhn", k, self.gate_proj.to(ct)) + self.dt_bias.to(ct)[:, None])
        return -self.a_log.to(ct).exp()[:, None] * dt


class DeltaState(NamedTuple):
    """The decode state: ``s (B, H, D, D_v)``, the rule's state; ``tail (B, H, W - 1, 2 D)``, the
    last ``short_conv - 1`` inputs of q and k (concatenated), which the next tokens' convolution
    reads (zeros before the first token, as the forward's left padding)."""

    s: Tensor
    tail: Tensor


def short_conv(x: Tensor, weight: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
    """Causal depthwise convolution along the sequence, then SiLU: ``x (B, H, N, C)``, ``weight
    (H, W, C)``, ``tail (B, H, W - 1, C)`` the inputs before ``x``. Returns the output ``(B, H, N, C)``
    and the new tail."""
    full = torch.cat([tail, x], dim=2)  # [B, H, W - 1 + N, C]
    return _ShortConv.apply(full, weight), full[:, :, full.shape[2] - (weight.shape[1] - 1) :]


#: Tokens per block of the short convolution: its W shifted multiply-adds run on a block that stays
#: in cache (at N = 8192 the whole-sequence passes are memory-bound and cost as much as the rule).
CONV_BLOCK = 512


def _pre_activation(full: Tensor, weight: Tensor, start: int, stop: int) -> Tensor:
    """The convolution's output for tokens ``start:stop`` (before SiLU), accumulated in place."""
    out = full[:, :, start:stop] * weight[:, None, 0]
    for j in range(1, weight.shape[1]):
        out.addcmul_(full[:, :, start + j : stop + j], weight[:, None, j])
    return out


class _ShortConv(torch.autograd.Function):
    """SiLU(depthwise causal conv) over blocks of ``CONV_BLOCK`` tokens, forward and backward (the
    backward recomputes each block's pre-activation); first-order gradients only."""

    @staticmethod
    def forward(ctx, full: Tensor, weight: Tensor) -> Tensor:  # noqa: ANN001
        n = full.shape[2] - weight.shape[1] + 1
        out = full.new_empty(*full.shape[:2], n, full.shape[3])
        for start in range(0, n, CONV_BLOCK):
            stop = min(start + CONV_BLOCK, n)
            out[:, :, start:stop] = F.silu(_pre_activation(full, weight, start, stop))
        ctx.save_for_backward(full, weight)
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor, Tensor]:  # noqa: ANN001
        full, weight = ctx.saved_tensors
        n, width = d_out.shape[2], weight.shape[1]
        d_full, d_weight = torch.zeros_like(full), torch.zeros_like(weight)
        for start in range(0, n, CONV_BLOCK):
            stop = min(start + CONV_BLOCK, n)
            pre = _pre_activation(full, weight, start, stop)
            sig = torch.sigmoid(pre)
            g = d_out[:, :, start:stop] * sig * (1 + pre * (1 - sig))  # SiLU' = sig (1 + x (1 - sig))
            for j in range(width):
                d_full[:, :, start + j : stop + j].addcmul_(g, weight[:, None, j])
                d_weight[:, j] += (g * full[:, :, start + j : stop + j]).sum((0, 2))
        return d_full, d_weight


def _projection(config: DeltaConfig, g: torch.Generator) -> Tensor:
    """A per-head projection ``(H, D)`` of the keys to one number, std 1/sqrt(D)."""
    return torch.randn(config.heads, config.head_dim, generator=g) * config.head_dim**-0.5
