"""The kernel family as mechanisms: ``KernelAttention`` (a mechanism = two feature maps on the
shared core of ``kernel.py``), its registration (``register_kernel``), and the members with fixed
feature maps: ``linear`` and ``efficient``. The random-feature members are in
``kernel_features.py`` (``rfa``) and ``kernel_performer.py`` (``performer``).

- ``linear``: ``phi = elu + 1`` (Katharopoulos et al. 2020, https://arxiv.org/abs/2006.16236).
- ``efficient``: softmax feature maps (Shen et al. 2018/2021, https://arxiv.org/abs/1812.01243).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.mechanisms._ops import compute_dtype, floored_exp_
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.mechanisms.kernel import KernelState, KeyFeatures, Normalizer, kernel_attention, reference_kernel_attention
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


class KernelAttention(Attention):
    """Base of the family: a subclass supplies ``query_features`` and ``key_features`` (and
    ``num_features`` for decoding); this class runs the shared core, the reference, and
    ``init_state`` / ``step``. It is the core's ``FeatureMaps``, with ``chunk`` and ``eps``
    read from its config.

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``.

    Notes:
        float16/bfloat16 inputs are computed in float32 and cast back.
    """

    normalizer: Normalizer = "rows"

    @property
    def chunk(self) -> int | None:
        return self.config.chunk

    @property
    def eps(self) -> float:
        return self.config.eps

    def query_features(self, q: Tensor) -> Tensor:
        """``(B, H, N, D) -> (B, H, N, m)``."""
        raise NotImplementedError

    def key_features(
        self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None, heads: slice | None = None
    ) -> KeyFeatures:
        """``k (B, H, N, D)``, ``real`` bool ``(B, 1, N)`` or None -> ``KeyFeatures``. ``heads``:
        which of the module's heads ``k`` holds (None: all of them); the causal core runs
        blocks of heads (``kernel.causal_block_heads``), and a map with a parameter per head
        takes those rows."""
        raise NotImplementedError

    def num_features(self, head_dim: int) -> int:
        raise NotImplementedError

    def prepare(self, heads: int, head_dim: int, device: Any, dtype: torch.dtype) -> None:
        """Create lazily-sized buffers/parameters for ``heads`` and ``head_dim`` (if any)."""

    def _run(
        self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, state: KernelState | None = None
    ) -> tuple[Tensor, KernelState]:
        qc, kc, vc = (x.to(compute_dtype(q)) for x in (q, k, v))
        if state is not None:
            state = KernelState(state.s.to(qc.dtype), state.z.to(qc.dtype), state.c)
        out, state = kernel_attention(qc, kc, vc, self, args, state)
        return out.to(q.dtype), state

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return self._run(q, k, v, args)[0]

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """The same function through ``reference_kernel_attention`` (same features, dense): the
        normalised ``phi(Q) phi(K)^T`` as an explicit matrix."""
        qc, kc, vc = (x.to(compute_dtype(q)) for x in (q, k, v))
        mask = args.key_mask
        f = self.key_features(kc, None if mask is None else mask[:, None], causal=args.causal)
        return reference_kernel_attention(
            self.query_features(qc),
            f.phi if f.weight is None else f.phi * f.weight[..., None],
            vc,
            causal=args.causal,
            key_mask=mask,
            log_decay=f.log_decay,
            eps=self.eps,
            normalizer=self.normalizer,
            return_weights=return_weights,
        )

    def _init_state(self, spec: StateSpec) -> KernelState:
        """Empty sums (zeros; ``c`` -inf) for ``step``, in float64 for float64, else float32;
        ``spec.capacity`` is ignored (the sums do not grow)."""
        dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32
        self.prepare(spec.heads, spec.head_dim, spec.device, dtype)
        features = self.num_features(spec.head_dim)
        # Per K/V head: the query heads of a group read one state (spec.kv_heads = H unless grouped)
        s = torch.zeros(spec.batch, spec.kv_heads, features, spec.value_dim, device=spec.device, dtype=dtype)
        c = torch.full((spec.batch, spec.kv_heads), -math.inf, device=spec.device, dtype=dtype)
        return KernelState(s, s.new_zeros(s.shape[:3]), c)

    def _step(
        self, state: KernelState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs
    ) -> tuple[Tensor, KernelState]:
        """The recurrence for the next ``T`` tokens (O(m D_v) per token): equals the matching
        rows of ``forward(..., causal=True)`` over the whole sequence."""
        return self._run(q, k, v, args, state)


_CORE_NOTES = (
    "causal aligns queries to the end of the keys: query i sees keys j <= i + N_kv - N_q",
    "padded keys never enter S or z; a query with no visible key returns zeros (num = den = 0)",
    "causal: chunkwise (quadratic inside a chunk of `chunk` positions, sums carried across chunks); "
    "a decay factor below eps^4 (e^-64 in float32) counts as 0, beside the row's own key at factor 1",
    "decode step: the recurrence on (S, z), O(1) per token",
)
#: Every member whose key features read the keys alone (no per-query-head parameter).
GQA_NOTE = (
    "grouped-query K/V (H_kv dividing H): the sums S, z are per K/V head (a decode state too), the H / H_kv "
    "query heads of a group read them as extra rows; K/V never repeated"
)


def register_kernel(
    name: str,
    config: type,
    summary: str,
    paper: str,
    complexity: Complexity,
    notes: tuple[str, ...],
    *,
    causal: bool,
    gqa_note: str | None = GQA_NOTE,
) -> Callable[[type], type]:
    """Register a member of the kernel family: key padding and cross-attention always, grouped-query
    K/V (``gqa``: the core keeps its sums per K/V head) unless ``gqa_note`` is None (key features
    made with per-query-head parameters: the base repeats K/V); a causal member also decodes (the
    recurrence on ``(S, z)``) and its notes follow the core's."""
    gqa = gqa_note is not None
    caps = Capabilities(causal=causal, key_mask=True, decode_step=causal, cross_attention=True, gqa=gqa)
    notes = (_CORE_NOTES + notes if causal else notes) + ((gqa_note,) if gqa else ())
    about = dict(family="kernel", summary=summary, paper=paper, notes=notes)
    return register(name, config=config, capabilities=caps, complexity=complexity, **about)


@dataclass(frozen=True, kw_only=True)
class KernelConfig(Config):
    """The fields ``KernelAttention`` reads from a member's config, declared once for every member
    that has them: ``chunk``, the causal chunk length (None: ``kernel.causal_chunk`` picks it per
    device and feature count), and ``eps``, the guard of the denominator ``phi(q)^T z`` (1e-6;
    each member's config says how its normalizer applies it)."""

    chunk: int | None = bounded(None, ge=1, none="64 on the CPU; off it, 256 for maps of 128 features or more")
    eps: float = bounded(1e-6, gt=0)


@dataclass(frozen=True, kw_only=True)
class LinearConfig(KernelConfig):
    """Config of ``linear``.

    Args:
        feature_map: ``"elu"`` (default, ``phi(x) = elu(x) + 1``) or ``"relu"`` (``relu(x)``; a
            query whose features are all 0 gets output 0), on the unscaled q and k.
        chunk: causal chunk length; None (default): ``kernel.causal_chunk``.
        eps: added to the denominator ``phi(q)^T z``. Default 1e-6.
    """

    feature_map: Literal["elu", "relu"] = "elu"


@register_kernel(
    "linear",
    LinearConfig,
    "Linear attention: phi(x) = elu(x) + 1 feature maps, O(N) time, an RNN when causal.",
    "Katharopoulos et al. 2020, Transformers are RNNs, https://arxiv.org/abs/2006.16236",
    Complexity(time="O(N D D_v)", memory="O(N D) (+ (N/chunk) D D_v causal)", subquadratic_memory=True),
    ("swapped in untrained: elu+1 feature map: not an approximation of softmax attention",),
    causal=True,
)
class LinearAttention(KernelAttention):
    """Linear attention (Katharopoulos et al. 2020, https://arxiv.org/abs/2006.16236):
    ``phi = elu + 1`` (or ``relu``) on q and k as they are, m = D features."""

    config: LinearConfig

    def query_features(self, q: Tensor) -> Tensor:
        return F.elu(q) + 1 if self.config.feature_map == "elu" else F.relu(q)

    def key_features(
        self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None, heads: slice | None = None
    ) -> KeyFeatures:
        return KeyFeatures(self.query_features(k))

    def num_features(self, head_dim: int) -> int:
        return head_dim


@dataclass(frozen=True, kw_only=True)
class EfficientConfig(Config):
    """Config of ``efficient`` (no options)."""


@register_kernel(
    "efficient",
    EfficientConfig,
    "Efficient attention: softmax(Q over features) (softmax(K over positions)^T V).",
    "Shen et al. 2018/2021, Efficient Attention, https://arxiv.org/abs/1812.01243",
    Complexity(time="O(N D D_v)", memory="O(N D + D D_v)", subquadratic_memory=True),
    (
        "swapped in untrained: softmax over q's channels and k's positions: not an approximation of softmax attention",
        "not causal: the softmax of K runs over all positions",
        "rows are normalised by construction (no denominator); padded keys get weight 0",
    ),
    causal=False,
)
class EfficientAttention(KernelAttention):
    """Efficient Attention (Shen et al., https://arxiv.org/abs/1812.01243):
    ``O = rho_q(Q) (rho_k(K)^T V)``, ``rho_q`` a softmax of each query over its D features,
    ``rho_k`` a softmax of each key feature over the real positions.

    Notes:
        The rows of ``rho_q rho_k^T`` sum to 1 by construction, so there is no denominator
        (normalizer ``"keys"``, which reads no ``eps``). ``key_features`` returns ``exp(k -
        max)`` per block with the per-feature max as its offset; the core divides by the sum
        over all real keys. A batch row with no real key gets output 0. Not causal (no chunks).
    """

    config: EfficientConfig
    normalizer: Normalizer = "keys"
    # Class attributes in place of the config fields the core would read (it reads neither).
    chunk, eps = 0, 0.0

    def query_features(self, q: Tensor) -> Tensor:
        return q.softmax(dim=-1)

    def key_features(
        self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None, heads: slice | None = None
    ) -> KeyFeatures:
        logits = k if real is None else k.masked_fill(~real[..., None], -math.inf)
        c = logits.detach().amax(2)  # [B, H, D]: per-feature max over the real keys
        # floored_exp_ (in place on the difference): large keys spread their exponents past -87.
        exponents = logits - torch.where(torch.isfinite(c), c, 0.0)[:, :, None]
        return KeyFeatures(floored_exp_(exponents), None, c)

    def num_features(self, head_dim: int) -> int:
        return head_dim  # a softmax over each key's own D channels
