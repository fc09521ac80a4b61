"""Feature maps of the kernel family beyond ``linear``: ``performer``, ``efficient``, ``rfa``.

Each plugs its feature maps into the shared core of ``kernel.py``:

- ``performer``: FAVOR+ positive orthogonal random features (Choromanski et al. 2020,
  https://arxiv.org/abs/2009.14794), an unbiased estimate of ``exp(q . k / sqrt(D))``.
- ``efficient``: softmax feature maps (Shen et al. 2018/2021, https://arxiv.org/abs/1812.01243).
- ``rfa``: random Fourier features with a learned gate (Peng et al. 2021,
  https://arxiv.org/abs/2103.02143).

The random projection ``w (m, D)`` of the random-feature members is a buffer drawn by
``orthogonal_gaussian`` from the module's ``projection_seed``: ``config.seed`` when given (two
builds with one config are then the same module), else a seed drawn from torch's global RNG at
construction, so every layer has its own projection. ``redraw()`` draws the next one;
``redraw_every`` makes a module redraw itself periodically in training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.mechanisms.base import AttendArgs
from attnzoo.mechanisms.kernel import _CAUSAL, _NOTES, KernelAttention, KeyFeatures, Normalizer
from attnzoo.registry import Config, bounded, quarter, register
from attnzoo.spec import Capabilities, Complexity

#: Seed of draw ``t`` (``redraw`` count) of a module with ``seed``: ``seed + _STRIDE * t``.
_STRIDE = 1_000_003
_DRAWS = (
    "the projection is drawn per module (its own seed from the global RNG unless config.seed is set; "
    "kept in the state dict); redraw() on demand, or by itself every redraw_every training forwards",
)


def orthogonal_gaussian(m: int, d: int, *, generator: torch.Generator) -> Tensor:
    """``(m, d)`` float64 random projection: orthogonal random features (Yu et al. 2016).

    Notes:
        Rows come in blocks of ``d`` mutually orthogonal directions (QR of a Gaussian matrix,
        signs fixed so the directions are Haar-distributed); each row is then scaled by the norm
        of an independent ``d``-dim Gaussian (chi distribution), so every row is marginally
        ``N(0, I_d)`` as the unbiased estimators need.
    """
    blocks = []
    for _ in range(math.ceil(m / d)):
        q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # rows orthonormal
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1)
    return torch.cat(blocks)[:m] * norms[:, None]


def favor_exponent(x: Tensor, w: Tensor) -> Tensor:
    """``w^T x - |x|^2 / 2``, the log of the unstabilised FAVOR+ feature ``sqrt(m) phi(x)``:
    ``(B, H, N, D), (m, D) -> (B, H, N, m)``. (The fast path computes it shifted, in place.)"""
    return x @ w.T - x.pow(2).sum(-1, keepdim=True) / 2


class _MaxExponent(torch.autograd.Function):
    """``max_j x . w_j`` over the m features, ``(B, H, N)``, with its gradient ``w_{j*}`` (the
    max is piecewise linear in ``x``). The value is read from ``xw`` in one pass; nothing of
    ``xw`` is saved (the callers exponentiate it in place).

    ``lazy=False`` (queries: every row's maximum gets a gradient) takes the arg-max in forward.
    ``lazy=True`` (keys: only the rows that set a block's or a running maximum get one) takes a
    plain ``amax`` in forward, about 6x cheaper on CPU than max with indices, and finds the
    arg-max in backward for the rows with a nonzero gradient only, from ``x`` (saved by the
    caller's matmul anyway)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, xw: Tensor, w: Tensor, lazy: bool) -> Tensor:  # type: ignore[override]
        ctx.lazy = lazy
        if not ctx.needs_input_grad[0] or lazy:
            if ctx.needs_input_grad[0]:
                ctx.save_for_backward(x, w)
            return xw.detach().amax(-1)
        values, index = xw.detach().max(-1)
        ctx.save_for_backward(index, w)
        return values

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if not ctx.lazy:
            index, w = ctx.saved_tensors
            return grad[..., None] * w.to(grad.dtype)[index], None, None, None
        x, w = ctx.saved_tensors
        rows = grad.nonzero(as_tuple=True)  # few: the rows that won a maximum
        w = w.to(x.dtype)
        winners = w[(x[rows] @ w.T).argmax(-1)]  # [rows, D]
        grad_x = torch.zeros_like(x)
        grad_x[rows] = grad[rows][:, None].to(x.dtype) * winners
        return grad_x, None, None, None


def _max_exponent(x: Tensor, xw: Tensor, w: Tensor, *, lazy: bool = False) -> Tensor:
    """``max_j x . w_j`` on the autograd graph of ``x`` (see ``_MaxExponent``)."""
    return _MaxExponent.apply(x, xw, w, lazy)


def favor_query(q: Tensor, w: Tensor) -> Tensor:
    """FAVOR+ features of (already ``D^-1/4``-scaled) queries, ``(B, H, N, D) -> (B, H, N, m)``.

    Notes:
        Stabiliser: each query row subtracts its own maximum exponent over the m features (its
        largest feature is ``1/sqrt(m)``). A per-row constant cancels in the row's ratio
        ``phi(q)^T S / (phi(q)^T z + eps)`` only up to ``eps``, so the stabiliser stays on the
        autograd graph (not detached): the gradient is exact for the function computed, also
        where ``eps`` is not negligible against the denominator. It takes the place of the row's
        ``|q|^2 / 2``, which is never computed.
    """
    qw = q @ w.T  # [B, H, N, m]
    shift = _max_exponent(q, qw, w)[..., None] + math.log(w.shape[0]) / 2
    # In place: matmul does not save its output for backward. add_ of a negated shift, not
    # sub_: sub_'s backward negates the whole (B, H, N, m) gradient to reduce it to the shift's.
    return qw.add_(-shift).exp_()


def favor_keys(k: Tensor, w: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None) -> KeyFeatures:
    """FAVOR+ features of (``D^-1/4``-scaled) keys with a stabiliser that keeps causality.

    Args:
        k: ``(B, H, N, D)``; w: ``(m, D)``; real: bool ``(B, 1, N)`` (True = a real key) or None.
        causal: False: one offset per (batch, head), the maximum exponent over the real keys
            given (returned as ``c (B, H, 1)``, -inf if there are none). True: a running
            maximum ``c_t`` over the real keys ``<= t``.
        c0: ``(B, H)`` running maximum of earlier keys (decoding); None or -inf for none.

    Returns:
        ``KeyFeatures``: ``phi (B, H, N, m)``; causal: ``log_decay`` ``a_t = c_{t-1} - c_t <= 0``
        and the last ``c (B, H)``.

    Notes:
        Causal key ``t`` is stored as ``exp(raw_t - c_t) / sqrt(m)`` and the running sums are
        rescaled by ``exp(a_t)``, so every key in row ``i``'s sums carries the same factor
        ``exp(-c_i)``, which cancels exactly; ``c_t`` depends on keys ``<= t`` only, so a future
        key can neither change nor underflow a past output. It cancels only up to the ``eps`` of
        the denominator, so like the query's it stays on the autograd graph (see
        ``favor_query``). Padded keys are zeroed before the projection, left out of the maxima,
        and shifted by +inf: their features are exactly 0 and they get no gradient, however
        large they were.
    """
    if real is not None:
        k = torch.where(real[..., None], k, 0.0)
    kw = k @ w.T  # [B, H, N, m]
    half_norm = k.pow(2).sum(-1) / 2  # [B, H, N]: per key, so it does not cancel (keeps its gradient)
    row_max = _max_exponent(k, kw, w, lazy=True) - half_norm
    if real is not None:
        row_max = row_max.masked_fill(~real, -math.inf)
    if causal:
        prev0 = row_max.new_full(row_max.shape[:2], -math.inf) if c0 is None else c0.to(row_max.dtype)
        c = torch.maximum(torch.cummax(row_max, dim=-1).values, prev0[..., None])
        prev = torch.cat([prev0[..., None], c[..., :-1]], dim=-1)
        # Before the first real key the sums are empty, so any decay will do; 0 avoids -inf - -inf.
        log_decay, out_c = torch.where(torch.isfinite(prev), prev - c, 0.0), c[..., -1]
    else:
        c = row_max.amax(-1, keepdim=True)
        log_decay, out_c = None, c
    shift = half_norm + torch.where(torch.isfinite(c), c, 0.0) + math.log(w.shape[0]) / 2
    if real is not None:
        shift = torch.where(real, shift, math.inf)
    return KeyFeatures(kw.add_(-shift[..., None]).exp_(), log_decay, out_c)  # add_: see favor_query


def fourier_features(x: Tensor, w: Tensor, sigma: float) -> Tensor:
    """RFA's random Fourier features of unit-normalised ``x``: ``(B, H, N, D) -> (B, H, N, 2m)``.

    ``phi(x) = sqrt(1/m) [sin(w^T x^ / sigma), cos(w^T x^ / sigma)]`` with ``x^ = x / |x|`` and
    rows of ``w (m, D)`` marginally ``N(0, I)``, so ``E[phi(x) . phi(y)] = exp(-|x^ - y^|^2 /
    (2 sigma^2)) = exp((x^ . y^ - 1) / sigma^2)``: softmax weights with temperature ``sigma^2``
    on unit vectors. The features, and so the estimated weights, can be negative.
    """
    u = F.normalize(x, dim=-1) @ w.T / sigma
    return torch.cat([torch.sin(u), torch.cos(u)], dim=-1) / math.sqrt(w.shape[0])


class RandomFeatureAttention(KernelAttention):
    """A ``KernelAttention`` that owns a random projection buffer ``projection (m, D)``.

    Notes:
        The seed is the buffer ``projection_seed``: ``config.seed``, or with ``seed=None`` one
        drawn from torch's global RNG at construction (layers built from one config differ;
        reproducible after ``torch.manual_seed``). Draw ``t`` (``t`` = the buffer ``draws``,
        redraws so far) uses the seed ``projection_seed + 1000003 t``, so ``redraw()``
        sequences are reproducible. Both buffers travel with the state dict, so a reloaded
        module is the same module, before and after its first forward.

        The projection is drawn at construction when ``config.head_dim`` is set, which a layer
        does through its ``attnzoo.Shape``: its state dict is then complete before the first
        forward. Built without it (``attnzoo.build("performer")`` applied to bare ``(B, H, N, D)``
        tensors, where nothing but the input says D) the projection is drawn on the first forward
        / ``init_state`` for the D seen then (a later call with another D raises). Such a module
        has no ``projection`` to load into before it has run: build it with ``head_dim`` (or a
        ``Shape``) to load a checkpoint.

        ``config.redraw_every = n``: in training mode a forward pass that comes after ``n``
        training forward passes on the current projection first calls ``redraw()`` (the buffer
        ``forwards`` counts them; ``redraw()`` resets it). Eval mode and ``step()`` neither
        count nor redraw. The check reads the counter on the host once per training forward.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        seed = int(torch.randint(0, 2**62, ())) if config.seed is None else config.seed
        self.register_buffer("projection_seed", torch.tensor(seed, dtype=torch.long))
        self.register_buffer("draws", torch.tensor(0, dtype=torch.long))
        self.register_buffer("forwards", torch.tensor(0, dtype=torch.long))
        self.register_buffer("projection", None)
        if config.head_dim is not None:
            self.projection = self._draw(config.head_dim)

    def _draw(self, d: int) -> Tensor:
        g = torch.Generator().manual_seed(int(self.projection_seed) + _STRIDE * int(self.draws))
        return orthogonal_gaussian(self.config.features, d, generator=g).float()

    def projection_for(self, x: Tensor) -> Tensor:
        """The projection for inputs ``x (..., D)``, in ``x``'s dtype; drawn on first use."""
        d = x.shape[-1]
        if self.projection is None:
            self.projection = self._draw(d).to(x.device)
        elif self.projection.shape[1] != d:
            raise ValueError(
                f"{self.spec.name} was built for head_dim={self.projection.shape[1]} but got inputs "
                f"with D={d}; build it with head_dim={d}"
            )
        return self.projection.to(x.dtype)

    @torch.no_grad()
    def redraw(self) -> None:
        """Draw a new projection (the next seed of this module's sequence)."""
        self.draws += 1
        self.forwards.zero_()
        if self.projection is not None:
            # A new tensor, not an in-place copy: a graph not yet backpropagated keeps the old one.
            self.projection = self._draw(self.projection.shape[1]).to(self.projection)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        every = self.config.redraw_every
        if self.training and every is not None:
            if int(self.forwards) >= every:
                self.redraw()
            self.forwards += 1
        return super()._attend(q, k, v, args)

    def prepare(self, heads: int, head_dim: int, device: Any, dtype: torch.dtype) -> None:
        self.projection_for(torch.empty(0, head_dim, device=device, dtype=dtype))


@dataclass(frozen=True, kw_only=True)
class _RandomFeatureConfig(Config):
    """The fields every ``RandomFeatureAttention`` reads (projection size and seed, redrawing,
    causal chunk, denominator eps), declared once so performer and rfa cannot drift apart;
    each config documents them and overrides the defaults that differ."""

    features: int = bounded(256, ge=1)
    head_dim: int | None = bounded(None, ge=1, none="drawn on the first forward; a layer's Shape sets it")
    seed: int | None = bounded(None, ge=0, none="one seed per module from torch's global RNG")
    redraw_every: int | None = bounded(None, ge=1, none="never redraw")
    chunk: int = bounded(64, ge=1)
    eps: float = bounded(1e-6, gt=0)

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A quarter as many features (random frequencies for rfa) as keys."""
        return dict(features=quarter(n))


@dataclass(frozen=True, kw_only=True)
class PerformerConfig(_RandomFeatureConfig):
    """Config of ``performer``.

    Args:
        features: m, the number of random features. Default 256.
        head_dim: D to draw the projection for at construction (a layer's ``attnzoo.Shape``
            sets it); default None draws it on the first forward (see ``RandomFeatureAttention``).
        seed: seed of the projection; None (default) draws one per module from torch's global
            RNG at construction, so every layer differs (kept in the state dict as the buffer
            ``projection_seed``). An int gives every module built with it the same projection.
        redraw_every: in training mode, redraw the projection after this many training forward
            passes (Performer's periodic redrawing); None (default) never redraws by itself.
        chunk: causal chunk length. Default 64.
        eps: added to the denominator ``phi(q)^T z``. Default 1e-6.
    """


@register(
    "performer",
    config=PerformerConfig,
    family="kernel",
    summary="Performer (FAVOR+): positive orthogonal random features estimating softmax attention.",
    paper="Choromanski et al. 2020, Rethinking Attention with Performers, https://arxiv.org/abs/2009.14794",
    capabilities=_CAUSAL,
    complexity=Complexity(time="O(N D m)", memory="O(N (D + m)) (+ (N/chunk) m D_v causal)", subquadratic_memory=True),
    notes=_NOTES
    + ("swapped in untrained: random features (seed 0): an unbiased estimate of softmax attention",)
    + _DRAWS
    + (
        "q and k are scaled by D^-1/4, so phi(q).phi(k) estimates exp(q.k / sqrt(D))",
        "stabilisers: per query row max; keys: max over real keys (causal: running max, carried in the state)",
    ),
)
class PerformerAttention(RandomFeatureAttention):
    """FAVOR+: ``phi(x) = exp(w^T x - |x|^2/2 - stabiliser) / sqrt(m)`` on ``x = D^-1/4 q``
    (resp. k), ``w`` orthogonal random features; stabilisers in ``favor_query`` / ``favor_keys``.

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``.
    """

    config: PerformerConfig

    def query_features(self, q: Tensor) -> Tensor:
        # w D^-1/4 applies the D^-1/4 scaling of q (favor_query never needs |q|^2)
        return favor_query(q, self.projection_for(q) * q.shape[-1] ** -0.25)

    def key_features(self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None) -> KeyFeatures:
        return favor_keys(k * k.shape[-1] ** -0.25, self.projection_for(k), real, causal=causal, c0=c0)

    def num_features(self, head_dim: int) -> int:
        return self.config.features


@dataclass(frozen=True, kw_only=True)
class RFAConfig(_RandomFeatureConfig):
    """Config of ``rfa``.

    Args:
        features: m, the number of random frequencies (``phi`` has 2m features). Default 128.
        sigma: kernel width: the features estimate ``exp((q^ . k^ - 1) / sigma^2)``. Default 1.
        heads, head_dim: H and D of the gate parameters ``(H, D)``, ``(H,)`` (and D of the
            projection) to create them at construction (a layer's ``attnzoo.Shape`` sets both);
            default None creates them on the first causal forward / ``init_state`` (then make
            the optimizer after a first forward; see ``RandomFeatureAttention``).
        seed: seed of the projection and of the gate's initial weights; None (default) draws one
            per module from torch's global RNG at construction (see ``PerformerConfig``).
        redraw_every: in training mode, redraw the projection after this many training forward
            passes; None (default) never redraws by itself. The gate is a parameter: not redrawn.
        chunk: causal chunk length. Default 64.
        eps: the denominator is kept at ``|phi(q)^T z| >= eps`` with its sign. Default 1e-6.
    """

    features: int = bounded(128, ge=1)
    head_dim: int | None = bounded(None, ge=1, none="created on the first forward; a layer's Shape sets it")
    sigma: float = bounded(1.0, gt=0)
    heads: int | None = bounded(None, ge=1, none="created on the first forward; a layer's Shape sets it")


@register(
    "rfa",
    config=RFAConfig,
    family="kernel",
    summary="Random Feature Attention: random Fourier features, gated recurrence when causal.",
    paper="Peng et al. 2021, Random Feature Attention, https://arxiv.org/abs/2103.02143",
    capabilities=_CAUSAL,
    complexity=Complexity(time="O(N D m)", memory="O(N (D + m)) (+ (N/chunk) m D_v causal)", subquadratic_memory=True),
    notes=_NOTES
    + ("swapped in untrained: random Fourier features on unit-normalised q, k: not softmax attention",)
    + _DRAWS
    + (
        "q, k unit-normalised; phi = [sin, cos](w^T x / sigma) / sqrt(m) can be negative: "
        "|denominator| >= eps, sign kept",
        "causal: S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T, z likewise, g_t = sigmoid(w_g . k_t + b_g) per head",
        "non-causal: plain random-feature attention, no gate",
    ),
)
class RFAAttention(RandomFeatureAttention):
    """RFA: ``phi`` = ``fourier_features``; causal adds the learned per-head gate.

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``.

    Notes:
        Gate parameters ``gate_weight (H, D)`` (initially ``N(0, 1/D)`` from the module's seed) and
        ``gate_bias (H,)`` (initially 2, so ``g ~ 0.88``). The chunked form uses in-chunk
        cumulative sums of ``log g`` (``logsigmoid``), equal to the recurrence.
    """

    config: RFAConfig
    normalizer: Normalizer = "signed"

    def __init__(self, config: RFAConfig) -> None:
        super().__init__(config)
        self.register_parameter("gate_weight", None)
        self.register_parameter("gate_bias", None)
        if config.heads is not None and config.head_dim is not None:
            self.prepare(config.heads, config.head_dim, None, torch.float32)

    def prepare(self, heads: int, head_dim: int, device: Any, dtype: torch.dtype) -> None:
        super().prepare(heads, head_dim, device, dtype)
        if self.gate_weight is None:
            g = torch.Generator().manual_seed(int(self.projection_seed) + 1)
            weight = torch.randn(heads, head_dim, generator=g, dtype=torch.float64) / math.sqrt(head_dim)
            self.gate_weight = nn.Parameter(weight.to(device=device, dtype=dtype))
            self.gate_bias = nn.Parameter(torch.full((heads,), 2.0, device=device, dtype=dtype))
        elif tuple(self.gate_weight.shape) != (heads, head_dim):
            raise ValueError(
                f"rfa's gate was made for (heads, head_dim) = {tuple(self.gate_weight.shape)}, got "
                f"inputs with ({heads}, {head_dim}); build it with heads={heads}, head_dim={head_dim}"
            )

    def query_features(self, q: Tensor) -> Tensor:
        return fourier_features(q, self.projection_for(q), self.config.sigma)

    def key_features(self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None) -> KeyFeatures:
        phi = fourier_features(k, self.projection_for(k), self.config.sigma)
        if not causal:
            return KeyFeatures(phi)
        self.prepare(k.shape[1], k.shape[3], k.device, k.dtype)
        logit = torch.einsum("bhnd,hd->bhn", k, self.gate_weight.to(k.dtype)) + self.gate_bias.to(k.dtype)[:, None]
        # (1 - g_t) phi(k_t) and log g_t, through logsigmoid (stable for large logits)
        return KeyFeatures(phi * F.logsigmoid(-logit).exp()[..., None], F.logsigmoid(logit))

    def num_features(self, head_dim: int) -> int:
        return 2 * self.config.features


@dataclass(frozen=True, kw_only=True)
class EfficientConfig(Config):
    """Config of ``efficient`` (no options)."""


@register(
    "efficient",
    config=EfficientConfig,
    family="kernel",
    summary="Efficient attention: softmax(Q over features) (softmax(K over positions)^T V).",
    paper="Shen et al. 2018/2021, Efficient Attention, https://arxiv.org/abs/1812.01243",
    capabilities=Capabilities(causal=False, key_padding=True, cross_attention=True),
    complexity=Complexity(time="O(N D D_v)", memory="O(N D + D D_v)", subquadratic_memory=True),
    notes=(
        "swapped in untrained: softmax over q's channels and k's positions: not an approximation of softmax attention",
        "not causal: the softmax of K runs over all positions",
        "rows are normalised by construction (no denominator); padded keys get weight 0",
    ),
)
class EfficientAttention(KernelAttention):
    """Efficient Attention (Shen et al., https://arxiv.org/abs/1812.01243):
    ``O = rho_q(Q) (rho_k(K)^T V)``, ``rho_q`` a softmax of each query over its D features,
    ``rho_k`` a softmax of each key feature over the real positions.

    Notes:
        The rows of ``rho_q rho_k^T`` sum to 1 by construction, so there is no denominator
        (normalizer ``"keys"``). ``key_features`` returns ``exp(k - max)`` per block with the
        per-feature max as its offset; the core divides by the sum over all real keys. A batch
        row with no real key gets output 0. Not causal.
    """

    config: EfficientConfig
    normalizer: Normalizer = "keys"

    def query_features(self, q: Tensor) -> Tensor:
        return q.softmax(dim=-1)

    def key_features(self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None) -> KeyFeatures:
        logits = k if real is None else k.masked_fill(~real[..., None], -math.inf)
        c = logits.detach().amax(2)  # [B, H, D]: per-feature max over the real keys
        return KeyFeatures((logits - torch.where(torch.isfinite(c), c, 0.0)[:, :, None]).exp(), None, c)
