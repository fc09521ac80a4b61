"""Random features for the kernel family: the seeded projection every random-feature member
owns (``RandomFeatureAttention``, ``RandomFeatureConfig``), and ``rfa``, random Fourier features
with a learned gate (Peng et al. 2021, https://arxiv.org/abs/2103.02143). ``performer`` (FAVOR+)
is built on the same base in ``kernel_performer.py``.

The random projection ``w (m, D)`` of the random-feature members is a buffer drawn by
``orthogonal_gaussian`` from the module's ``projection_seed``: ``config.seed`` when given (two
builds with one config are then the same module), else a seed drawn from torch's global RNG at
construction, so every layer has its own projection. ``redraw()`` draws the next one;
``redraw_every`` makes a module redraw itself periodically in training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.mechanisms._ops import unit
from attnzoo.mechanisms.base import AttendArgs, StateSpec
from attnzoo.mechanisms.kernel import KernelState, KeyFeatures, Normalizer
from attnzoo.mechanisms.kernel_linear import KernelAttention, KernelConfig, register_kernel
from attnzoo.registry import LAZY_GEOMETRY, bounded
from attnzoo.spec import Complexity

#: Seed of draw ``t`` (``redraw`` count) of a module with ``seed``: ``seed + _STRIDE * t``.
_STRIDE = 1_000_003
#: A note of every random-feature member's registration.
DRAWS_NOTE = (
    "the projection is drawn per module (its own seed from the global RNG unless config.seed is set; "
    "kept in the state dict); redraw() on demand, or by itself every redraw_every training forwards"
)
FEATURES_NOTE = (
    "features=None (default): m = 2 * D random features, fixed when D is known (head_dim, a layer's Shape, "
    "or the first input): two orthogonal blocks of D, and a cost per key in a fixed ratio to softmax's "
    "at every head size (a fixed m = 256 was half softmax's speed at D = 64)"
)
#: Every random-feature member: m random features (rfa: 2m) per position, m x D_v sums.
RANDOM_FEATURES_COST = Complexity(
    time="O(N D m)", memory="O(N (D + m)) (+ (N/chunk) m D_v causal)", subquadratic_memory=True
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
        count nor redraw. The check reads the counter on the host once per training forward: under
        ``torch.compile`` that is a graph break (``fullgraph=True`` fails), so a compiled model
        leaves ``redraw_every`` unset and calls ``redraw()`` itself between compiled steps. A
        module built without ``head_dim`` draws its projection on the host at its first
        forward: run it once eagerly (or give it ``head_dim``) before compiling.
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
        return orthogonal_gaussian(self.config.features_for(d), d, generator=g).float()

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
class RandomFeatureConfig(KernelConfig):
    """The fields every ``RandomFeatureAttention`` reads (projection size and seed, redrawing;
    causal chunk and denominator eps from ``KernelConfig``), declared once so performer and rfa cannot drift apart;
    each config documents them and overrides the defaults that differ.

    ``features`` defaults to None: m = 2 D (``features_for``), so the feature map's cost stays in
    one ratio to softmax's whatever the head size (m D per key for the map, m D_v for the sums,
    against N D for softmax), and the orthogonal projection is two whole blocks of D orthogonal
    rows. A fixed m (the earlier default 256) was 4 D at D = 64, half softmax's speed there, and
    too few at D = 256. An int sets m whatever D is. m is the estimator's sample size, not a
    count of keys, so it does not follow the sequence length (no ``for_length``)."""

    features: int | None = bounded(None, ge=1, none="for 2 * head_dim, fixed when D is known")
    head_dim: int | None = bounded(None, ge=1, none="drawn on the first forward; a layer's Shape sets it")
    seed: int | None = bounded(None, ge=0, none="one seed per module from torch's global RNG")
    redraw_every: int | None = bounded(None, ge=1, none="never redraw")

    def features_for(self, head_dim: int) -> int:
        """m for heads of size ``head_dim``: ``features``, or ``2 * head_dim`` when it is None."""
        return 2 * head_dim if self.features is None else self.features


class _ScaledSinCos(torch.autograd.Function):
    """``scale * [sin u, cos u]`` in one buffer, and a backward that reuses it: the derivative of
    ``scale sin u`` is ``scale cos u``, the forward's other half, so no sine or cosine is
    evaluated again (nor a concatenation or a scaling pass made twice)."""

    @staticmethod
    def forward(ctx: Any, u: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        m = u.shape[-1]
        out = u.new_empty(*u.shape[:-1], 2 * m)
        torch.sin(u, out=out[..., :m])
        torch.cos(u, out=out[..., m:])
        if scale != 1.0:
            out.mul_(scale)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        m = out.shape[-1] // 2
        return torch.addcmul(grad[..., :m] * out[..., m:], grad[..., m:], out[..., :m], value=-1), None


def fourier_features(x: Tensor, w: Tensor, sigma: float, *, scaled: bool = True) -> Tensor:
    """RFA's random Fourier features of unit-normalised ``x``: ``(B, H, N, D) -> (B, H, N, 2m)``.

    ``phi(x) = sqrt(1/m) [sin(w^T x^ / sigma), cos(w^T x^ / sigma)]`` with ``x^ = x / |x|`` and
    rows of ``w (m, D)`` marginally ``N(0, I)``, so ``E[phi(x) . phi(y)] = exp(-|x^ - y^|^2 /
    (2 sigma^2)) = exp((x^ . y^ - 1) / sigma^2)``: softmax weights with temperature ``sigma^2``
    on unit vectors. The features, and so the estimated weights, can be negative.
    ``scaled=False`` leaves out the ``sqrt(1/m)``, a pass over the features: ``RFAAttention``,
    whose outputs are ratios in which it cancels (its ``eps`` carries it instead).
    """
    u = unit(x) @ (w.T / sigma)  # 1/sigma on the (D, m) matrix, not on (N, m)
    return _ScaledSinCos.apply(u, 1 / math.sqrt(w.shape[0]) if scaled else 1.0)


@dataclass(frozen=True, kw_only=True)
class RFAConfig(RandomFeatureConfig):
    """Config of ``rfa``.

    Args:
        features: m, the number of random frequencies (``phi`` has 2m features); default None
            for m = 2 D (128 at D = 64; see ``RandomFeatureConfig``).
        sigma: kernel width: the features estimate ``exp((q^ . k^ - 1) / sigma^2)``. Default 1.
        heads, head_dim: H and D of the gate parameters ``(H, D)``, ``(H,)`` (and D of the
            projection) to create them at construction (a layer's ``attnzoo.Shape`` sets both);
            default None creates them on the first causal forward / ``init_state`` (then make
            the optimizer after a first forward; see ``RandomFeatureAttention``).
        seed: seed of the projection and of the gate's initial weights; None (default) draws one
            per module from torch's global RNG at construction (see ``PerformerConfig``).
        redraw_every: in training mode, redraw the projection after this many training forward
            passes; None (default) never redraws by itself. The gate is a parameter: not redrawn.
        chunk: causal chunk length; None (default): ``kernel.causal_chunk``.
        eps: the denominator is kept at ``|phi(q)^T z| >= eps`` with its sign. Default 1e-6.
    """

    head_dim: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)
    sigma: float = bounded(1.0, gt=0)
    heads: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)


@register_kernel(
    "rfa",
    RFAConfig,
    "Random Feature Attention: random Fourier features, gated recurrence when causal.",
    "Peng et al. 2021, Random Feature Attention, https://arxiv.org/abs/2103.02143",
    RANDOM_FEATURES_COST,
    (
        "swapped in untrained: random Fourier features on unit-normalised q, k: not softmax attention",
        DRAWS_NOTE,
        FEATURES_NOTE,
        "q, k unit-normalised; phi = [sin, cos](w^T x / sigma) / sqrt(m) can be negative: "
        "|denominator| >= eps, sign kept",
        "causal: S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T, z likewise, g_t = sigmoid(w_g . k_t + b_g) per head",
        "non-causal: plain random-feature attention, no gate",
    ),
    causal=True,
    gqa_note="grouped-query K/V (H_kv dividing H): non-causal, S and z per K/V head, never repeated; causal "
    "(and decoding), K/V repeated per query head: the gate reads k with per-query-head weights (H, D), so "
    "the query heads of a group keep different sums",
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

    def _run(
        self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, state: KernelState | None = None
    ) -> tuple[Tensor, KernelState]:
        if args.causal:  # the gate weights are per query head: each keeps its own gated sums
            k, v = self._kv_heads(q, k, v, native=False)
            self.prepare(k.shape[1], k.shape[3], k.device, k.dtype)  # the core may run blocks of heads
        return super()._run(q, k, v, args, state)

    def _init_state(self, spec: StateSpec) -> KernelState:
        return super()._init_state(replace(spec, kv_heads=spec.heads))  # as _run: one state per query head

    @property
    def eps(self) -> float:
        """``config.eps`` in the units of the unscaled features (``fourier_features(scaled=False)``):
        each of ``phi(q)``, ``phi(k)`` lacks its ``sqrt(1/m)``, so numerator and denominator are
        ``m`` times the paper's and ``|den| >= m eps`` is the paper's ``|den| >= eps``. Leaving
        the scale out saves a pass over ``(B, H, N, 2m)`` per side: causal fwd+bwd 137.3 -> 136.5
        ms at 4K, 68.7 -> 67.5 at 2K (``benchmarks/ab-rfa-unscaled-cpu.txt``; a scratch run read
        147.5 -> 142.7), outputs equal to 7e-7."""
        m = 1 if self.projection is None else self.projection.shape[0]
        return self.config.eps * m

    def query_features(self, q: Tensor) -> Tensor:
        return fourier_features(q, self.projection_for(q), self.config.sigma, scaled=False)

    def key_features(
        self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None, heads: slice | None = None
    ) -> KeyFeatures:
        if not causal:
            return KeyFeatures(fourier_features(k, self.projection_for(k), self.config.sigma, scaled=False))
        if heads is None:  # all heads (a block of them comes after ``_run`` has prepared all)
            self.prepare(k.shape[1], k.shape[3], k.device, k.dtype)
        rows = slice(None) if heads is None else heads
        weight, bias = self.gate_weight[rows].to(k.dtype), self.gate_bias[rows].to(k.dtype)
        logit = torch.einsum("bhnd,hd->bhn", k, weight) + bias[:, None]
        # (1 - g_t) phi(k_t) as phi(k_t) and the weight 1 - g_t on the key's value row (E + 1
        # wide, not 2m); log g_t. Both through logsigmoid (stable for large logits).
        phi = fourier_features(k, self.projection_for(k), self.config.sigma, scaled=False)
        return KeyFeatures(phi, F.logsigmoid(logit), weight=F.logsigmoid(-logit).exp())

    def num_features(self, head_dim: int) -> int:
        return 2 * self.config.features_for(head_dim)
