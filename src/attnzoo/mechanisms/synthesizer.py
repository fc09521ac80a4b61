"""Synthesizer attention (Tay et al. 2020, https://arxiv.org/abs/2005.00743).

The Synthesizer replaces the query-key scores ``q_i . k_j`` by *synthesized* scores that do
not come from token-token interactions. In attnzoo's ``(q, k, v)`` interface it is an
``Attention`` mechanism with its own parameters, one set per head:

* ``dense``: ``B_i = W2 relu(W1 q_i + b1) + b2`` in ``R^max_len`` (W1: ``(D, D)``, W2:
  ``(D, max_len)``); query ``i`` scores key ``j`` by ``B_i[j]`` for ``j < N``. The paper feeds
  the layer input ``x_i``; here the per-head query ``q_i`` (already a projection of ``x_i``)
  plays that role.
* ``random``: a learned ``(heads, max_len, max_len)`` matrix ``R``, scores ``R[:N, :N]``,
  identical for every input. ``fixed=True`` keeps it as a buffer (not trained).
* ``factorized_dense``: ``A_i = W_a relu(W1 q_i + b1) + b_a`` in ``R^a`` and
  ``B_i = W_b relu(W1 q_i + b1) + b_b`` in ``R^b`` with ``a * b = max_len`` (the first layer is
  shared), and the score of key ``j = r * a + c`` is ``A_i[c] * B_i[r]``: the paper's
  ``H_A(A) * H_B(B)``, with ``A`` tiled ``b`` times and each entry of ``B`` repeated ``a``
  times. ``factor`` sets ``a`` (default: the largest divisor of ``max_len`` <= sqrt(max_len)).
* ``factorized_random``: ``R = R1 R2^T`` with ``R1, R2`` of shape ``(max_len, rank)`` per
  head (rank <= ``rank``); ``fixed=True`` keeps them as buffers.
* ``mix``: ``alpha_h * S + (1 - alpha_h) * q k^T / sqrt(D)`` where ``S`` is the synthesized
  score of ``mix_with`` (``"random"``, the paper's R+V, by default; or ``"dense"``, D+V). As in
  the paper's mixture of synthesizers, the mixing weight is learned: ``alpha`` is a parameter,
  one per head, initialised to ``config.alpha`` and used as is (no sigmoid), so the two weights
  sum to 1 as the paper requires but are not clamped to [0, 1] in training.
  ``learn_alpha=False`` keeps it fixed (a buffer).

Then ``Y = softmax(scores + masks) V``. ``causal=True`` masks future keys; this is causal in the
strong sense because dense scores of row ``i`` depend only on ``q_i``, random scores on no input,
and the dot-product part of ``mix`` is masked as usual. Padded keys are masked; a row with no
visible key returns zeros. Time ``O(N^2 D)`` (dense also ``O(N D max_len)`` for the synthesis).
Where the scores are dot products of synthesized vectors (``dense``: ``[h_i, 1] . [W2[:, j],
b2[j]]``; ``factorized_random``: ``R1[i] . R2[j]``; ``mix`` with dense, which appends
``q_i . k_j``) the fast path hands those vectors to SDPA's fused kernel with scale 1
(``synthesized_qk``): memory ``O(N)`` beyond the parameters, no ``(B, H, N, N)`` tensor. The
other variants (``random``, ``factorized_dense``, ``mix`` with random) build the explicit
``N x N`` score matrix, as the paper defines them: memory ``O(N^2)`` per batch row.

Decoding: row t of the causal synthesized matrix involves positions ``<= t`` only (the synthesized
row of query t, restricted to keys ``0..t``), so ``step`` keeps the values (and the keys, for
``mix``) in a ``KVCache`` and computes row t directly; it refuses positions past ``max_len``.

Limits: ``N <= max_len`` (longer inputs raise); self-attention only (``N_q == N_kv``), since
synthesized scores index keys by position; the input must have ``heads`` heads and, for the
variants that read ``q`` (dense, factorized_dense, mix), head dimension ``head_dim``. Inside
``attnzoo.nn.MultiHeadAttention`` (whose own ``heads``/``head_dim`` arguments take those names)
pass a built module: ``MultiHeadAttention(64, 8, attnzoo.build("synthesizer", heads=8,
head_dim=8))``; a mismatch raises a ValueError naming ``heads``/``head_dim`` on the first call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from attnzoo.backends.reference import normalize_scores, visible_pairs
from attnzoo.mechanisms._ops import compute_dtype, same_width
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.softmax import sdpa_attention
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity

VARIANTS = ("dense", "random", "factorized_dense", "factorized_random", "mix")


@dataclass(frozen=True, kw_only=True)
class SynthesizerConfig(Config):
    """Config of ``synthesizer``.

    Args:
        variant: ``"dense"`` (default), ``"random"``, ``"factorized_dense"``,
            ``"factorized_random"`` or ``"mix"``.
        max_len: the longest sequence (synthesized scores are indexed by position). Default 512.
        head_dim: the head dimension D of the inputs (used by dense, factorized_dense, mix
            with dense). Default 64.
        heads: the number of heads H of the inputs (parameters are per head). Default 8.
        fixed: random variants only: keep the random matrices fixed (buffers, not trained).
        rank: rank k of ``R1 R2^T`` in ``factorized_random``. Default 8.
        factor: ``a`` of ``factorized_dense`` (must divide max_len); default None picks the
            largest divisor of max_len that is <= sqrt(max_len).
        alpha: ``mix`` weight of the synthesized scores, in [0, 1]: the initial value of the
            learned per-head weight. Default 0.5.
        learn_alpha: ``mix`` only: learn alpha (default True, as in the paper) or keep it fixed.
        mix_with: the synthesized scores ``mix`` adds to q k^T / sqrt(D): ``"random"``
            (default) or ``"dense"``.
    """

    variant: Literal["dense", "random", "factorized_dense", "factorized_random", "mix"] = "dense"
    max_len: int = bounded(512, ge=1)
    head_dim: int = bounded(64, ge=1)
    heads: int = bounded(8, ge=1)
    fixed: bool = False
    rank: int = bounded(8, ge=1)
    factor: int | None = None
    alpha: float = bounded(0.5, ge=0.0, le=1.0)
    mix_with: Literal["random", "dense"] = "random"
    learn_alpha: bool = True

    def validate(self) -> None:
        if self.factor is not None and (self.factor < 1 or self.max_len % self.factor):
            raise ValueError(f"factor must be a positive divisor of max_len={self.max_len}, got {self.factor}")

    @property
    def factors(self) -> tuple[int, int]:
        """``(a, b)`` of factorized_dense, ``a * b = max_len``."""
        a = self.factor
        if a is None:
            a = max(d for d in range(1, math.isqrt(self.max_len) + 1) if self.max_len % d == 0)
        return a, self.max_len // a


def _uniform(*shape: int, fan_in: int) -> nn.Parameter:
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))


@register(
    "synthesizer",
    config=SynthesizerConfig,
    family="synthesizer",
    summary="Synthesizer: softmax of synthesized (dense, random, factorized or mixed) scores times V.",
    paper="Tay et al. 2020, Synthesizer: Rethinking Self-Attention in Transformer Models, "
    "https://arxiv.org/abs/2005.00743",
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True),
    complexity=Complexity(
        time="O(N^2 D) (dense also O(N D max_len) to synthesize)",
        memory="O(N) fused for dense, factorized_random, mix(dense); O(N^2) scores for the others; "
        "parameters O(H max_len^2) for random",
    ),
    notes=(
        "not a drop-in for pretrained attention: synthesized attention weights are trained parameters "
        "(no q.k): needs retraining",
        "self-attention only, N <= max_len; inputs must have `heads` heads (and `head_dim` for "
        "variants that read q) - in MultiHeadAttention pass a built module",
        "dense/factorized_dense synthesize from the per-head query q_i (the paper uses x_i)",
        "mix = alpha_h * synthesized(mix_with) + (1 - alpha_h) * q k^T / sqrt(D), alpha_h learned per head "
        "(the paper learns the mixture weights; per head is this library's choice) from config.alpha, "
        "unconstrained (no sigmoid); learn_alpha=False fixes it",
        "a query with no visible key returns zeros",
        "dense, factorized_random and mix with dense run SDPA's fused kernel on synthesized query/key vectors "
        "whose dot products are the scores (zero-padded to one width with v); the other variants build the "
        "N x N score matrix",
        "decode step: the values kept in a KV cache (the keys too for mix only), row t synthesized over "
        "keys 0..t directly: O(t D_v) per token (+ O(D^2 + t D) dense, O(t rank) factorized_random, "
        "O(t D) mix), O(t D_v) memory; positions past max_len are refused",
    ),
)
class SynthesizerAttention(Attention):
    """Synthesizer attention; see the module docstring for the variants."""

    config: SynthesizerConfig

    def __init__(self, config: SynthesizerConfig) -> None:
        super().__init__(config)
        c = config
        h, d, n = c.heads, c.head_dim, c.max_len
        #: the synthesized part: the variant itself, or mix_with for "mix".
        self._base = c.variant if c.variant != "mix" else c.mix_with
        if self._base in ("dense", "factorized_dense"):
            self.w1 = _uniform(h, d, d, fan_in=d)
            self.b1 = _uniform(h, d, fan_in=d)
        if self._base == "dense":
            self.w2 = _uniform(h, d, n, fan_in=d)
            self.b2 = _uniform(h, n, fan_in=d)
        elif self._base == "factorized_dense":
            a, b = c.factors
            self.wa, self.ba = _uniform(h, d, a, fan_in=d), _uniform(h, a, fan_in=d)
            self.wb, self.bb = _uniform(h, d, b, fan_in=d), _uniform(h, b, fan_in=d)
        elif self._base == "random":
            self._tensor("random_matrix", torch.randn(h, n, n))
        elif self._base == "factorized_random":
            std = c.rank**-0.25  # entries of R1 R2^T then have unit variance
            self._tensor("r1", torch.randn(h, n, c.rank) * std)
            self._tensor("r2", torch.randn(h, n, c.rank) * std)
        if c.variant == "mix":
            alpha = torch.full((h,), float(c.alpha))
            if c.learn_alpha:
                self.alpha = nn.Parameter(alpha)
            else:
                self.register_buffer("alpha", alpha)

    def _tensor(self, name: str, value: Tensor) -> None:
        if self.config.fixed:
            self.register_buffer(name, value)
        else:
            setattr(self, name, nn.Parameter(value))

    # -- scores -------------------------------------------------------------------------------

    def _check(self, q: Tensor, n: int) -> None:
        c = self.config
        if n > c.max_len:
            raise ValueError(
                f"synthesizer: sequence length N={n} exceeds max_len={c.max_len}; build it with a larger max_len"
            )
        if q.shape[1] != c.heads:
            raise ValueError(
                f"synthesizer: inputs have H={q.shape[1]} heads but the config has heads={c.heads}; "
                f"build it with heads={q.shape[1]}"
            )
        if self._base in ("dense", "factorized_dense") and q.shape[-1] != c.head_dim:
            raise ValueError(
                f"synthesizer: inputs have head dimension D={q.shape[-1]} but the config has "
                f"head_dim={c.head_dim}; build it with head_dim={q.shape[-1]}"
            )

    def synthesized_scores(self, q: Tensor, n_kv: int | None = None) -> Tensor:
        """The synthesized scores (before mixing and masking) of the queries ``q (B, H, T, D)``
        over ``n_kv`` keys (default T), the queries standing at the last T positions (aligned to
        the end of the keys, as ``causal`` is): ``(B, H, T, n_kv)`` for dense variants,
        ``(1, H, T, n_kv)`` for random ones, in float32 (float64 for float64 ``q``)."""
        t = q.shape[2]
        n = t if n_kv is None else n_kv
        self._check(q, n)
        compute = compute_dtype(q)
        p = lambda x: x.to(compute)  # noqa: E731
        if self._base == "random":
            return p(self.random_matrix[:, n - t : n, :n]).unsqueeze(0)
        if self._base == "factorized_random":
            return (p(self.r1[:, n - t : n]) @ p(self.r2[:, :n]).transpose(-1, -2)).unsqueeze(0)
        hidden = torch.relu(torch.einsum("bhid,hde->bhie", q.to(compute), p(self.w1)) + p(self.b1)[:, None])
        if self._base == "dense":
            w2, b2 = p(self.w2[:, :, :n]), p(self.b2[:, :n])
            return torch.einsum("bhie,hej->bhij", hidden, w2) + b2[:, None]
        a_vec = torch.einsum("zhie,hea->zhia", hidden, p(self.wa)) + p(self.ba)[:, None]
        b_vec = torch.einsum("zhie,hef->zhif", hidden, p(self.wb)) + p(self.bb)[:, None]
        # key j = r * a + c scores A[c] * B[r]: the flattened outer product B (x) A.
        full = (b_vec[..., :, None] * a_vec[..., None, :]).flatten(-2)
        return full[..., :n]

    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        """The pre-mask scores ``(B or 1, H, N_q, N_kv)`` the softmax is taken over (the queries
        at the last N_q of the N_kv positions)."""
        s = self.synthesized_scores(q, k.shape[2])
        if self.config.variant == "mix":
            alpha = self.alpha.to(s.dtype)[:, None, None]  # one weight per head: [H, 1, 1]
            dot = torch.einsum("bhid,bhjd->bhij", q.to(s.dtype), k.to(s.dtype)) * q.shape[-1] ** -0.5
            s = alpha * s + (1.0 - alpha) * dot
        return s

    def _weighted(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(output (B, H, N_q, D_v), weights (B, H, N_q, N_kv))``: the softmax of ``scores``
        over the visible keys, and v weighed by it (N_q < N_kv only from ``step``: the last rows)."""
        (batch, heads, n_q, _), n_kv = q.shape, k.shape[2]
        scores = self.scores(q, k).expand(batch, heads, n_q, n_kv)
        visible = visible_pairs(
            batch, heads, n_q, n_kv, causal=causal, key_mask=key_mask, mask_mod=None, device=q.device
        )
        weights = normalize_scores(scores, visible, "softmax")
        return torch.einsum("bhij,bhjd->bhid", weights, v.to(weights.dtype)).to(v.dtype), weights

    def synthesized_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor] | None:
        """Queries and keys ``(B, H, N, E)`` whose plain dot products are the pre-mask scores,
        for the variants whose scores are such a product, else None (``random``,
        ``factorized_dense`` and ``mix`` with random: an explicit matrix). Dense:
        ``[relu(W1 q_i + b1), 1] . [W2[:, j], b2[j]]``; factorized_random: ``R1[i] . R2[j]``; mix
        with dense: ``[alpha h_i, alpha, (1 - alpha) q_i / sqrt(D)] . [W2[:, j], b2[j], k_j]``."""
        (batch, heads, n, d), c = q.shape, self.config
        if self._base not in ("dense", "factorized_random") or (c.variant == "mix" and self._base != "dense"):
            return None
        self._check(q, n)
        p = lambda x: x.to(compute_dtype(q))  # noqa: E731
        if self._base == "factorized_random":
            return p(self.r1[:, :n]).expand(batch, -1, -1, -1), p(self.r2[:, :n]).expand(batch, -1, -1, -1)
        hidden = torch.relu(torch.einsum("bhid,hde->bhie", p(q), p(self.w1)) + p(self.b1)[:, None])
        ones = hidden.new_ones(batch, heads, n, 1)
        keys = torch.cat([p(self.w2[:, :, :n]).transpose(-1, -2), p(self.b2[:, :n, None])], dim=-1)
        keys = keys.expand(batch, -1, -1, -1)  # shared by the batch: (B, H, N, D + 1)
        if c.variant != "mix":
            return torch.cat([hidden, ones], dim=-1), keys
        alpha = p(self.alpha)[:, None, None]  # one weight per head: [H, 1, 1]
        queries = torch.cat([alpha * hidden, alpha * ones, (1.0 - alpha) * d**-0.5 * p(q)], dim=-1)
        return queries, torch.cat([keys, p(k)], dim=-1)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        # Where the synthesized scores are dot products of synthesized vectors, SDPA's fused
        # kernel takes them (scale 1): no (B, H, N, N) tensor. Elsewhere the scores are an
        # explicit N x N matrix by definition (the paper's point): the reference.
        pair = self.synthesized_qk(q, k)
        if pair is None:
            return self._reference(q, k, v, args, return_weights=False)
        sq, sk, wide_v = same_width(*pair, v.to(pair[0].dtype))  # one width, as fused kernels want
        out = sdpa_attention(sq, sk, wide_v, causal=args.causal, key_mask=args.key_mask, scale=1.0)
        return out[..., : v.shape[-1]].to(v.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        out, weights = self._weighted(q, k, v, args.causal, args.key_mask)
        return (out, weights) if return_weights else out

    def _init_state(self, spec: StateSpec) -> KVCache:
        """A ``KVCache`` of the values, and of the keys for ``mix`` only (the other variants never
        read a key: theirs hold no feature), with room for ``max_len`` tokens at most."""
        key_dim = spec.head_dim if self.config.variant == "mix" else 0
        size = (spec.batch, spec.heads, key_dim, spec.value_dim)
        capacity = min(spec.capacity, self.config.max_len)
        return KVCache.empty(*size, capacity=capacity, device=spec.device, dtype=spec.dtype)

    def _step(self, state: KVCache, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, KVCache]:
        """Rows ``t - T + 1 .. t`` of the causal forward: the new queries over the cached keys."""
        end = state.length + q.shape[2]
        if end > self.config.max_len:
            raise ValueError(
                f"synthesizer: step() would reach position {end - 1}, past max_len={self.config.max_len} "
                "(the synthesized scores are defined for max_len positions); build it with a larger max_len"
            )
        state = state.append(k[..., : state.k_buffer.shape[-1]], v, args.key_mask)
        out, _ = self._weighted(q, state.k, state.v, True, state.key_mask)
        return nan_rows_of_non_finite_queries(out, q), state


def reference_synthesizer(scores: Tensor, v: Tensor, *, causal: bool = False, key_mask: Tensor | None = None) -> Tensor:
    """Plain row-by-row ``softmax(scores + masks) V`` for given pre-mask ``scores``
    ``(B or 1, H, N, N)`` and ``v (B, H, N, D_v)``: query ``i`` sees keys ``j`` with ``j <= i``
    (when causal) and ``key_mask[b, j]`` True; a row with no visible key gives zeros."""
    batch, heads, n, d_v = v.shape
    out = torch.zeros(batch, heads, n, d_v, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(n):
                keys = [j for j in range(n) if (not causal or j <= i) and (key_mask is None or bool(key_mask[b, j]))]
                if not keys:
                    continue
                row = scores[min(b, scores.shape[0] - 1), h, i, keys].double()
                w = torch.softmax(row, dim=-1)
                out[b, h, i] = w @ v[b, h, keys].double()
    return out.to(v.dtype)
