"""Based: linear attention with the 2nd-order Taylor feature map (Arora et al. 2024, "Simple
linear attention language models balance the recall-throughput tradeoff",
https://arxiv.org/abs/2402.18668), a member of the kernel family.

``exp(q . k / sqrt(d))`` is replaced by its Taylor expansion to second order,
``1 + q . k / sqrt(d) + (q . k)^2 / (2 d)``, which is a dot product of features::

    phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))]    (1 + d + d^2 features)

(stored with each symmetric pair x_i x_j once, weighted sqrt(2): 1 + d + d (d + 1) / 2 features,
the same dot product)

so the kernel core (``kernel.py``) runs it unchanged: non-causal as the sums ``phi(K)^T [V, 1]``,
causal chunkwise with the sums carried across chunks, decoding on the running sums. The weights
are never negative (``phi(q) . phi(k) = (1 + s / sqrt(d))^2 / 2 + 1/2 >= 1/2`` for ``s = q . k``),
so rows are normalised as in linear attention. The features grow as d^2, which is why Based
projects q and k to a small d first (16 in the paper: 273 features, 153 stored).

- ``taylor_linear_attention``: the plain function on q, k as given (the fast path);
- ``reference_taylor_linear_attention``: the dense form, ``phi(Q) phi(K)^T`` masked and
  row-normalised, as the paper writes it;
- ``based``: the mechanism, a learned per-head projection ``D -> feature_dim`` of q and k, then
  the above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from attnzoo._checks import check_causal, check_key_mask, check_qkv
from attnzoo.mechanisms._ops import compute_dtype
from attnzoo.mechanisms.base import AttendArgs, Weighted
from attnzoo.mechanisms.kernel import (
    KernelState,
    KeyFeatures,
    Normalizer,
    kernel_attention,
    reference_kernel_attention,
)
from attnzoo.mechanisms.kernel_linear import KernelAttention, KernelConfig, register_kernel
from attnzoo.registry import LAZY_GEOMETRY, bounded
from attnzoo.spec import Complexity

#: Causal chunk length of the plain function (the mechanism's is ``BasedConfig.chunk``).
CHUNK = 64


def taylor_features(x: Tensor) -> Tensor:
    """The 2nd-order Taylor feature map of ``exp(q . k / sqrt(d))``: ``(..., d) -> (..., 1 + d + d (d + 1) / 2)``,
    ``[1, x / d^(1/4), c_ij x_i x_j / sqrt(2 d) for i <= j]`` with ``c_ii = 1``, ``c_ij = sqrt(2)``
    (``i < j``), so that ``phi(q) . phi(k) = 1 + q . k / sqrt(d) + (q . k)^2 / (2 d)``.

    The paper writes the quadratic part as all ``d^2`` products ``vec(x x^T)``; ``x x^T`` is
    symmetric, so each product ``x_i x_j`` (``i < j``) appears twice there and once here with
    ``sqrt(2)``: the same dot product with 153 features instead of 273 at ``d = 16`` (44% less work
    in every feature-wide product and a state that much smaller)."""
    d = x.shape[-1]
    pairs, weight = _upper_triangle(d, x.device, x.dtype)
    half = x * (2 * d) ** -0.25  # products of x / (2 d)^(1/4): x_i x_j / sqrt(2 d)
    # the whole outer product as a batch of (d, 1) @ (1, d) matmuls (their backward is matmuls too),
    # then its upper triangle: faster on CPU than products of two index_selects, fwd + bwd
    outer = rearrange(half[..., :, None] @ half[..., None, :], "... i j -> ... (i j)")
    quadratic = outer.index_select(-1, pairs) * weight
    return torch.cat([torch.ones_like(x[..., :1]), x * d**-0.25, quadratic], dim=-1)


def _upper_triangle(d: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Where the pairs ``i <= j`` sit in ``vec(x x^T)`` (``i d + j``) and their weights (1 on the
    diagonal, ``sqrt(2)`` above it: the two mirror products of ``vec(x x^T)`` in one)."""
    rows, cols = torch.triu_indices(d, d, device=device)
    weight = torch.full(rows.shape, math.sqrt(2), dtype=dtype, device=device).masked_fill_(rows == cols, 1.0)
    return rows * d + cols, weight


def taylor_size(d: int) -> int:
    """Number of Taylor features of a ``d``-dim input: ``1 + d + d (d + 1) / 2``."""
    return 1 + d + d * (d + 1) // 2


class _Taylor(torch.autograd.Function):
    """``1 + u + u^2 / 2`` elementwise, with the backward ``g (1 + u)`` as one fused op (autograd's
    own graph of the polynomial makes about five passes over the ``(L, L)`` pairs)."""

    @staticmethod
    def forward(ctx: Any, u: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(u)
        return torch.addcmul(u, u, u, value=0.5).add_(1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        (u,) = ctx.saved_tensors
        return torch.addcmul(grad, grad, u)


def taylor_pair_weights(q: Tensor, k: Tensor) -> Tensor:
    """``taylor_features(q) @ taylor_features(k)^T`` for ``q (..., L, d)``, ``k (..., L, d)``
    without the features: ``1 + u + u^2 / 2`` with ``u = q k^T / sqrt(d)``, a ``d``-wide matmul
    where the features are ``1 + d + d^2`` wide (what the causal chunks use inside a chunk)."""
    return _Taylor.apply((q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2))


class _TaylorFeatures:
    """The feature-map half of the core's ``FeatureMaps``: Taylor features of q and k as the
    core gets them, and the in-chunk weights from ``q . k``."""

    def query_features(self, q: Tensor) -> Tensor:
        return taylor_features(q)

    def key_features(
        self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None, heads: slice | None = None
    ) -> KeyFeatures:
        return KeyFeatures(taylor_features(k))

    def pair_weights(self, q: Tensor, k: Tensor) -> Tensor:
        return taylor_pair_weights(q, k)

    def num_features(self, head_dim: int) -> int:
        return taylor_size(head_dim)


@dataclass(frozen=True)
class _TaylorMaps(_TaylorFeatures):
    """The core's ``FeatureMaps`` for q and k used as given (the plain function)."""

    chunk: int
    eps: float
    normalizer: Normalizer = "rows"


def _checked(q: Any, k: Any, v: Any, causal: Any, key_mask: Any, eps: Any) -> AttendArgs:
    """Validate the plain functions' arguments (same heads and length for q, k, v)."""
    check_qkv(q, k, v, cross_attention=False)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k and v must have q's H heads, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    causal = check_causal(causal, q.shape[2], k.shape[2])
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ValueError(f"eps must be a number > 0, got {eps!r}")
    return AttendArgs(causal, check_key_mask(key_mask, q.shape[0], k.shape[2], q.device), None)


def taylor_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None = None, eps: float = 1e-6
) -> Tensor:
    """Based's linear attention on q, k as given: ``o_i = sum_j w_ij v_j / (sum_j w_ij + eps)``
    with ``w_ij = phi(q_i) . phi(k_j)`` (``taylor_features``) over the keys ``j`` that query ``i``
    sees (``key_mask[b, j]``, and ``j <= i`` if ``causal``); a query that sees no key gets zeros.

    Args:
        q, k: ``(B, H, N, d)``, v: ``(B, H, N, Dv)``; key_mask: bool ``(B, N)``, True = a real key.
        eps: added to each row's denominator (which is >= 1/2 per visible key).

    Returns:
        ``(B, H, N, Dv)``. float16/bfloat16 are computed in float32 and cast back.

    Notes:
        The kernel core (``kernel.kernel_attention``) with ``1 + d + d^2`` features. Non-causal:
        ``phi(Q) (phi(K)^T [V, 1])`` in blocks of rows; causal: chunks of ``CHUNK`` positions,
        the pairs inside a chunk from ``q . k`` (``taylor_pair_weights``), the sums of earlier
        chunks carried as ``(1 + d + d^2, Dv + 1)`` states. O(N d^2 Dv) time, never N x N.
    """
    args = _checked(q, k, v, causal, key_mask, eps)
    ct = compute_dtype(q)
    out, _ = kernel_attention(q.to(ct), k.to(ct), v.to(ct), _TaylorMaps(CHUNK, float(eps)), args)
    return out.to(q.dtype)


def reference_taylor_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_mask: Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The dense form of ``taylor_linear_attention`` (same arguments): ``A = phi(Q) phi(K)^T``,
    the pairs a query does not see set to 0, rows divided by their sum + eps, ``O = A V``.
    ``return_weights``: also the normalised ``A (B, H, N, N)``. O(N^2) memory."""
    args = _checked(q, k, v, causal, key_mask, eps)
    ct = compute_dtype(q)
    out = reference_kernel_attention(
        taylor_features(q.to(ct)),
        taylor_features(k.to(ct)),
        v.to(ct),
        causal=args.causal,
        key_mask=args.key_mask,
        eps=float(eps),
        return_weights=return_weights,
    )
    if return_weights:
        return out[0].to(q.dtype), out[1]
    return out.to(q.dtype)


@dataclass(frozen=True, kw_only=True)
class BasedConfig(KernelConfig):
    """Config of ``based``.

    Args:
        feature_dim: d, the size q and k are projected to before the Taylor map (1 + d + d^2
            features; the paper's 16 gives 273, stored as 153).
        heads, head_dim: H and D of the projection ``(H, D, feature_dim)`` (a layer's ``Shape``
            sets them); None (default) creates it on the first forward / ``init_state`` (then
            make the optimizer after a first forward).
        chunk: causal chunk length. Default 64.
        eps: added to the denominator ``phi(q)^T z``. Default 1e-6.
    """

    feature_dim: int = bounded(16, ge=1)
    heads: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)
    head_dim: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)


@register_kernel(
    "based",
    BasedConfig,
    "Based: linear attention with the 2nd-order Taylor feature map of exp on q, k projected to 16 dims.",
    "Arora et al. 2024, Simple linear attention language models balance the recall-throughput tradeoff "
    "(Based), https://arxiv.org/abs/2402.18668",
    Complexity(
        time="O(N f^2 (chunk + D_v) + N D f)",
        memory="O(N f^2) (+ (N/chunk) f^2 D_v causal)",
        subquadratic_memory=True,
    ),
    (
        "phi(x) = [1, x / f^(1/4), vec(x x^T) / sqrt(2 f)] on x = q W_h, k W_h (f = feature_dim = 16, the paper's): "
        "phi(q).phi(k) = 1 + s / sqrt(f) + s^2 / (2 f) with s = (q W_h).(k W_h), the Taylor expansion of "
        "exp(s / sqrt(f)); always >= 1/2, rows normalised by their sum + eps",
        "decode state: S (1 + f + f (f + 1) / 2) x D_v and z per head (153 x (D_v + 1) at f = 16: the paper's 273 "
        "features with each symmetric product x_i x_j, i < j, stored once with weight sqrt(2)), "
        "whatever the position",
        "the projection W_h (H, D, f) is learned, one per head, shared by q and k, from head_dim D "
        "(nn.Linear's uniform init): the paper projects q and k from the model width; composed with the "
        "layer's own q and k projections it is the same family of maps when D >= f",
        "the paper's Based model interleaves these layers with small sliding-window softmax layers (`local` "
        "with left=63, right=0 here) and BaseConv (gated short convolution) layers; that hybrid is a per-layer "
        "choice: attnzoo.hf.use(model, [...]) takes one mechanism per layer; attnzoo.nn.TransformerEncoder / "
        "CausalLM take one mechanism for all layers; BaseConv is not built",
        "swapped in untrained: a learned projection to 16 dims and a Taylor kernel: not an approximation "
        "of the model's softmax attention",
        "grouped-query K/V (H_kv dividing H) are repeated per query head: each head projects its keys with its "
        "own W_h, so the query heads of a group cannot share one state",
    ),
    causal=True,
    gqa_note=None,
)
class BasedAttention(_TaylorFeatures, KernelAttention):
    """Based: ``taylor_features`` of q and k projected per head to ``feature_dim`` dims.

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``.

    Notes:
        Parameter ``projection (H, D, feature_dim)``, uniform in ``+-1/sqrt(D)`` (``nn.Linear``'s
        init), made at construction when ``heads`` and ``head_dim`` are set, else on the first
        forward. A cross-attention call (``N_q != N_kv``) works as in the whole kernel family.
    """

    config: BasedConfig

    def __init__(self, config: BasedConfig) -> None:
        super().__init__(config)
        self.register_parameter("projection", None)
        if config.heads is not None and config.head_dim is not None:
            self.prepare(config.heads, config.head_dim, None, torch.float32)

    def prepare(self, heads: int, head_dim: int, device: Any, dtype: torch.dtype) -> None:
        if self.projection is None:
            bound = 1 / math.sqrt(head_dim)
            weight = torch.empty(heads, head_dim, self.config.feature_dim).uniform_(-bound, bound)
            self.projection = nn.Parameter(weight.to(device=device, dtype=dtype))
        elif tuple(self.projection.shape[:2]) != (heads, head_dim):
            raise ValueError(
                f"based's projection was made for (heads, head_dim) = {tuple(self.projection.shape[:2])}, got "
                f"inputs with ({heads}, {head_dim}); build it with heads={heads}, head_dim={head_dim}"
            )

    def _project(self, x: Tensor) -> Tensor:
        """``(B, H, N, D) -> (B, H, N, feature_dim)`` through each head's projection."""
        self.prepare(x.shape[1], x.shape[3], x.device, x.dtype)
        return torch.einsum("bhnd,hdf->bhnf", x, self.projection.to(x.dtype))

    def _run(
        self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, state: KernelState | None = None
    ) -> tuple[Tensor, KernelState]:
        """The kernel core on the projected q and k (the feature maps below take them)."""
        ct = compute_dtype(q)
        out, state = super()._run(self._project(q.to(ct)), self._project(k.to(ct)), v.to(ct), args, state)
        return out.to(q.dtype), state

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        ct = compute_dtype(q)
        out = super()._reference(self._project(q.to(ct)), self._project(k.to(ct)), v.to(ct), args, return_weights)
        return (out[0].to(q.dtype), out[1]) if return_weights else out.to(q.dtype)

    def num_features(self, head_dim: int) -> int:
        return taylor_size(self.config.feature_dim)
