"""Independent test oracles for the modern mechanisms of issue 19 (see ``modern-spec``).

Each ``oracle_<name>`` takes exactly the arguments of the library function ``<name>`` and is
written from the paper, not from the library's source:

* the recurrent mechanisms (retention, GLA, SSD, delta rule, gated delta rule) as the paper's
  token-by-token recurrence, a Python loop over ``t`` for every (batch, head);
* the attention mechanisms as a Python loop over queries, where each query's visible keys are
  listed by plain comparisons and its softmax is taken over exactly that list;
* Based's Taylor linear attention (``oracle_taylor_linear_attention``) the same way, with the feature
  map phi built explicitly as a ``1 + d + d^2`` vector (so the closed form ``1 + x + x^2/2`` can check it);
* DeepSeek Sparse Attention (``oracle_dsa_attention``) as the lightning indexer's score per
  (query, key), an explicit sort of each query's candidates (ties to the lower key), then softmax
  over the selected keys.

Rules shared with ``oracles.py``: all arithmetic in float64 (``.to(float64)`` keeps the autograd
graph, so gradients can be compared too); outputs are built with ``torch.stack``, never
in place, so they stay differentiable; shapes in tests are tiny.

Conventions (from the spec): q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)``; no scaling of q unless
the function has ``scale`` (``None`` means ``1/sqrt(D)`` of the scores' width); causal means key
``j`` is visible to query ``i`` iff ``j <= i``; the recurrent state ``S`` is ``(B, H, D, Dv)``
with ``o_t = q_t S_t``, returned after the last token; ``initial_state`` replaces ``S_0 = 0``.
A query that sees no key outputs zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

F64 = torch.float64

__all__ = [
    "oracle_retention",
    "oracle_gla",
    "oracle_ssd",
    "oracle_delta_rule",
    "oracle_gated_delta_rule",
    "oracle_softcap_attention",
    "oracle_sink_softmax_attention",
    "oracle_differential_attention",
    "oracle_diff_lambda",
    "oracle_lambda_init",
    "oracle_gated_attention",
    "oracle_latent_attention",
    "oracle_moba",
    "oracle_nsa",
    "oracle_taylor_linear_attention",
    "oracle_dsa_attention",
]

# update(S_prev, b, h, t) -> S_t, for one (batch, head); S is (D, Dv)
Update = Callable[[Tensor, int, int, int], Tensor]


# --------------------------------------------------------------------------
# Linear attention with decay / delta rule: token-by-token recurrences
# --------------------------------------------------------------------------


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-d (B, H, N, D|Dv); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape != k.shape or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree on (B, H, N, D)")


def _recurrence(q: Tensor, k: Tensor, v: Tensor, initial_state: Tensor | None, update: Update) -> tuple[Tensor, Tensor]:
    """Run ``S_t = update(S_{t-1}, b, h, t)``, ``o_t = q_t S_t`` over t for every (b, h).

    Returns ``(o (B, H, N, Dv), S_N (B, H, D, Dv))`` in float64.
    """
    _check_qkv(q, k, v)
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    if initial_state is not None and tuple(initial_state.shape) != (B, H, D, Dv):
        raise ValueError(f"initial_state must be (B, H, D, Dv) = {(B, H, D, Dv)}, got {tuple(initial_state.shape)}")
    q = q.to(F64)
    out_b, state_b = [], []
    for b in range(B):
        out_h, state_h = [], []
        for h in range(H):
            if initial_state is None:
                S = torch.zeros(D, Dv, dtype=F64, device=q.device)
            else:
                S = initial_state[b, h].to(F64)
            out_t = []
            for t in range(N):
                S = update(S, b, h, t)
                out_t.append(q[b, h, t] @ S)  # o_t = q_t S_t
            out_h.append(torch.stack(out_t) if out_t else q.new_zeros(0, Dv))
            state_h.append(S)
        out_b.append(torch.stack(out_h))
        state_b.append(torch.stack(state_h))
    return torch.stack(out_b), torch.stack(state_b)


def oracle_retention(
    q: Tensor, k: Tensor, v: Tensor, log_gamma: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Retention, recurrent form, without the group norm.

    RetNet, Sun et al. 2023, arXiv:2307.08621, Sec. 2.1, recurrent representation of retention:
    ``S_n = gamma S_{n-1} + K_n^T V_n``, ``o_n = Q_n S_n``, one ``gamma = exp(log_gamma[h])`` per head.
    The xPos rotation of Q and K and the group norm belong to the mechanism (spec), not here.

    Shapes: ``log_gamma (H,)``; returns ``(o (B, H, N, Dv), state (B, H, D, Dv))``.
    """
    k, v, log_gamma = k.to(F64), v.to(F64), log_gamma.to(F64)

    def update(S: Tensor, b: int, h: int, t: int) -> Tensor:
        return torch.exp(log_gamma[h]) * S + torch.outer(k[b, h, t], v[b, h, t])

    return _recurrence(q, k, v, initial_state, update)


def oracle_gla(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Gated linear attention, recurrent form.

    GLA, Yang et al. 2023, arXiv:2312.06635, Sec. 4.1 (recurrent form):
    ``S_t = (alpha_t^T 1) * S_{t-1} + k_t^T v_t`` = ``diag(alpha_t) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``:
    ``alpha_t = exp(log_alpha[b, h, t])`` decays row d of S (key channel d).

    Shapes: ``log_alpha (B, H, N, D)``; returns ``(o, state)``.
    """
    k, v, log_alpha = k.to(F64), v.to(F64), log_alpha.to(F64)

    def update(S: Tensor, b: int, h: int, t: int) -> Tensor:
        alpha_t = torch.exp(log_alpha[b, h, t])  # (D,)
        return torch.diag(alpha_t) @ S + torch.outer(k[b, h, t], v[b, h, t])

    return _recurrence(q, k, v, initial_state, update)


def oracle_ssd(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Mamba-2 state space duality (SSD), recurrent (linear) form, scalar decay per head and token.

    Dao & Gu 2024, arXiv:2405.21060, Sec. 3 (the selective SSM ``h_t = A_t h_{t-1} + B_t x_t``,
    ``y_t = C_t^T h_t`` with scalar-times-identity ``A_t = a_t I``), written as in the spec:
    ``S_t = a_t S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``, ``a_t = exp(log_a[b, h, t])``
    (q plays C, k plays B, v plays dt * x; the D skip term is the mechanism's).

    Shapes: ``log_a (B, H, N)``; returns ``(o, state)``.
    """
    k, v, log_a = k.to(F64), v.to(F64), log_a.to(F64)

    def update(S: Tensor, b: int, h: int, t: int) -> Tensor:
        return torch.exp(log_a[b, h, t]) * S + torch.outer(k[b, h, t], v[b, h, t])

    return _recurrence(q, k, v, initial_state, update)


def oracle_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """DeltaNet: the delta-rule fast-weight update.

    Schlag et al. 2021, arXiv:2102.11174, Sec. 4.2 (delta update rule); Yang et al. 2024,
    arXiv:2406.06484, Sec. 2.2: ``S_t = S_{t-1} - beta_t (S_{t-1} k_t - v_t) k_t^T`` in their
    ``(Dv, D)`` layout; in the spec's ``(D, Dv)`` layout with ``o_t = q_t S_t``:
    ``S_t = S_{t-1} + beta_t k_t^T (v_t - k_t S_{t-1})``.
    k is used as given (the mechanism L2-normalises it first).

    Shapes: ``beta (B, H, N)``; returns ``(o, state)``.
    """
    k, v, beta = k.to(F64), v.to(F64), beta.to(F64)

    def update(S: Tensor, b: int, h: int, t: int) -> Tensor:
        k_t, v_t = k[b, h, t], v[b, h, t]
        v_old = k_t @ S  # what the memory currently returns for key k_t
        return S + beta[b, h, t] * torch.outer(k_t, v_t - v_old)

    return _recurrence(q, k, v, initial_state, update)


def oracle_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_alpha: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet: the delta rule with a scalar decay per head and token.

    Yang, Kautz & Hatamizadeh 2024, arXiv:2412.06464, Sec. 3.1 (the gated delta rule):
    ``S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T`` in their ``(Dv, D)`` layout;
    in the spec's ``(D, Dv)`` layout:
    ``S_t = alpha_t (S_{t-1} - beta_t k_t^T (k_t S_{t-1})) + beta_t k_t^T v_t``, ``alpha_t = exp(log_alpha)``.

    Shapes: ``beta, log_alpha (B, H, N)``; returns ``(o, state)``.
    """
    k, v, beta, log_alpha = k.to(F64), v.to(F64), beta.to(F64), log_alpha.to(F64)

    def update(S: Tensor, b: int, h: int, t: int) -> Tensor:
        k_t, v_t, beta_t = k[b, h, t], v[b, h, t], beta[b, h, t]
        erased = S - beta_t * torch.outer(k_t, k_t @ S)
        return torch.exp(log_alpha[b, h, t]) * erased + beta_t * torch.outer(k_t, v_t)

    return _recurrence(q, k, v, initial_state, update)


# --------------------------------------------------------------------------
# Softmax attention, one query at a time
# --------------------------------------------------------------------------


def _softmax_over(scores: Tensor, values: Tensor, keys: list[int], extra_logit: Tensor | None = None) -> Tensor:
    """``sum_{j in keys} p_j values[j]`` with ``p = softmax(scores[keys])`` (an ``extra_logit``, if given,
    joins the denominator and has no value). No key -> zeros."""
    if not keys:
        return torch.zeros(values.shape[-1], dtype=F64, device=values.device)
    s = scores[keys]
    if extra_logit is not None:
        s = torch.cat([s, extra_logit.reshape(1)])
    p = torch.softmax(s, dim=0)[: len(keys)]
    return p @ values[keys]


def _visible(i: int, nq: int, nk: int, causal: bool) -> list[int]:
    """Keys visible to query i: all, or (causal) ``j <= i`` (bottom-right aligned when nq != nk)."""
    return [j for j in range(nk) if not causal or j <= i + (nk - nq)]


def _per_query(q: Tensor, k: Tensor, v: Tensor, row: Callable[[int, int, int, Tensor], Tensor]) -> Tensor:
    """Stack ``row(b, h, i, scores_i)`` over (b, h, i), with ``scores_i = k[b, h] @ q[b, h, i]`` (unscaled)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[:2] != k.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be (B, H, N, D|Dv)")
    q, k = q.to(F64), k.to(F64)
    B, H, Nq, _ = q.shape
    if B * H * Nq == 0:
        return torch.zeros(B, H, Nq, v.shape[-1], dtype=F64, device=q.device)
    out = [
        torch.stack([torch.stack([row(b, h, i, k[b, h] @ q[b, h, i]) for i in range(Nq)]) for h in range(H)])
        for b in range(B)
    ]
    return torch.stack(out)


def _plain_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> Tensor:
    v = v.to(F64)
    nq, nk = q.shape[2], k.shape[2]
    return _per_query(q, k, v, lambda b, h, i, s: _softmax_over(scale * s, v[b, h], _visible(i, nq, nk, causal)))


def oracle_softcap_attention(
    q: Tensor, k: Tensor, v: Tensor, cap: float, *, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Softmax attention with logit soft-capping.

    Gemma 2, Gemma Team 2024, arXiv:2408.00118, Sec. 2 ("logit soft-capping"):
    ``s_ij = cap * tanh(scale * q_i.k_j / cap)``, applied after the scale and before mask and softmax.
    """
    v = v.to(F64)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    nq, nk = q.shape[2], k.shape[2]

    def row(b: int, h: int, i: int, s: Tensor) -> Tensor:
        capped = cap * torch.tanh(scale * s / cap)
        return _softmax_over(capped, v[b, h], _visible(i, nq, nk, causal))

    return _per_query(q, k, v, row)


def oracle_sink_softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, sink_logits: Tensor, *, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Softmax attention with one learned sink logit per head (gpt-oss).

    OpenAI 2025, gpt-oss model card, arXiv:2508.10925, "attention sinks": a learned per-head logit joins
    the softmax denominator and carries no value:
    ``o_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))``. Shapes: ``sink_logits (H,)``.
    """
    v, sink_logits = v.to(F64), sink_logits.to(F64)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    nq, nk = q.shape[2], k.shape[2]

    def row(b: int, h: int, i: int, s: Tensor) -> Tensor:
        return _softmax_over(scale * s, v[b, h], _visible(i, nq, nk, causal), extra_logit=sink_logits[h])

    return _per_query(q, k, v, row)


def oracle_differential_attention(
    q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, *, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Differential attention, before the per-head norm.

    Diff Transformer, Ye et al. 2024, arXiv:2410.05258, eq. (1):
    ``DiffAttn(X) = (softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T / sqrt(d))) V``, with
    ``[Q1; Q2]`` and ``[K1; K2]`` the two halves of q and k along D (spec). ``lam`` is a scalar or ``(H,)``;
    ``scale`` defaults to ``1/sqrt(D/2)`` (the half width, as in the paper).
    """
    D = q.shape[-1]
    if D % 2:
        raise ValueError(f"differential attention splits D in two halves; D = {D} is odd")
    scale = 1.0 / math.sqrt(D // 2) if scale is None else scale
    lam = torch.as_tensor(lam, dtype=F64, device=q.device)
    if lam.dim() == 0:
        lam = lam.expand(q.shape[1])
    half = D // 2
    a1 = _plain_attention(q[..., :half], k[..., :half], v, causal=causal, scale=scale)
    a2 = _plain_attention(q[..., half:], k[..., half:], v, causal=causal, scale=scale)
    # (softmax1 - lam softmax2) v == softmax1 v - lam (softmax2 v): the product distributes over the difference
    return a1 - lam[None, :, None, None] * a2


def oracle_diff_lambda(lq1: Tensor, lk1: Tensor, lq2: Tensor, lk2: Tensor, lambda_init: float) -> Tensor:
    """The re-parameterised lambda, Ye et al. 2024, arXiv:2410.05258, eq. (2):
    ``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` (dot over the last axis)."""
    lq1, lk1, lq2, lk2 = (t.to(F64) for t in (lq1, lk1, lq2, lk2))
    return torch.exp((lq1 * lk1).sum(-1)) - torch.exp((lq2 * lk2).sum(-1)) + lambda_init


def oracle_lambda_init(layer_index: int) -> float:
    """Ye et al. 2024, arXiv:2410.05258, Sec. 2.1: ``lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))``, l from 1."""
    if layer_index < 1:
        raise ValueError(f"layer_index counts from 1; got {layer_index}")
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_index - 1))


def oracle_gated_attention(
    q: Tensor, k: Tensor, v: Tensor, gate_logits: Tensor, *, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Softmax attention with an elementwise sigmoid output gate.

    Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv:2505.06708, Sec. 2 (gate at
    position G1, after scaled dot-product attention, elementwise, head-specific):
    ``Y' = Y * sigmoid(gate_logits)``. Shapes: ``gate_logits (B, H, N, Dv)``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    y = _plain_attention(q, k, v, causal=causal, scale=scale)
    return y * torch.sigmoid(gate_logits.to(F64))


def oracle_latent_attention(
    q_nope: Tensor,
    q_rope: Tensor,
    c_kv: Tensor,
    k_rope: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Multi-head latent attention (MLA), keys and values decompressed per head.

    DeepSeek-V2, arXiv:2405.04434, Sec. 2.1.2-2.1.3 (low-rank key-value compression, decoupled RoPE):
    ``k^C_h = c^KV W^UK_h``, ``v^C_h = c^KV W^UV_h``, ``k_h = [k^C_h; k^R]`` (k^R shared by all heads),
    ``q_h = [q^C_h; q^R_h]``, ``o_h = softmax(q_h k_h^T * scale) v^C_h``; ``scale`` defaults to
    ``1/sqrt(Dn + Dr)`` (the paper's ``1/sqrt(d_h + d_h^R)``). Rotations are applied by the caller.

    Shapes: ``q_nope (B, H, N, Dn)``, ``q_rope (B, H, N, Dr)``, ``c_kv (B, N, R)``, ``k_rope (B, N, Dr)``,
    ``w_uk (H, R, Dn)``, ``w_uv (H, R, Dv)`` -> ``(B, H, N, Dv)``.
    """
    q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = (t.to(F64) for t in (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv))
    B, H, Nq, Dn = q_nope.shape
    Nk = c_kv.shape[1]
    scale = 1.0 / math.sqrt(Dn + q_rope.shape[-1]) if scale is None else scale
    out_b = []
    for b in range(B):
        out_h = []
        for h in range(H):
            k_h = c_kv[b] @ w_uk[h]  # (Nk, Dn)
            v_h = c_kv[b] @ w_uv[h]  # (Nk, Dv)
            out_i = []
            for i in range(Nq):
                s = (k_h @ q_nope[b, h, i] + k_rope[b] @ q_rope[b, h, i]) * scale
                out_i.append(_softmax_over(s, v_h, _visible(i, Nq, Nk, causal)))
            out_h.append(torch.stack(out_i) if out_i else v_h.new_zeros(0, w_uv.shape[-1]))
        out_b.append(torch.stack(out_h))
    return torch.stack(out_b)


# --------------------------------------------------------------------------
# Trainable sparse attention: block selection
# --------------------------------------------------------------------------


def _top(candidates: list[int], score: Callable[[int], float], count: int) -> list[int]:
    """The ``count`` candidates with the highest score; ties go to the lower index."""
    return sorted(candidates, key=lambda c: (-score(c), c))[: max(count, 0)]


def oracle_moba(
    q: Tensor, k: Tensor, v: Tensor, *, block: int, topk: int, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Mixture of Block Attention (MoBA).

    Lu et al. 2025, arXiv:2502.13189, Sec. 2.2 (MoBA and its gating): keys are cut into blocks of ``block``
    (the last may be short); gate ``s_i = q_i . mean_pool(K[I_b])``; query i attends to the keys of its
    ``topk`` highest-gated blocks. Causal (Sec. 2.2 "causality"): blocks starting after i are never chosen,
    i's own block is always chosen and counts toward ``topk``, inside it only keys ``j <= i``; the other
    ``topk - 1`` are the highest-gated earlier blocks. Ties: lower block index (spec). Softmax over the
    union of the chosen keys, scores ``scale * q_i.k_j``.
    """
    if block < 1 or topk < 1:
        raise ValueError(f"block and topk must be >= 1; got block={block}, topk={topk}")
    v = v.to(F64)
    kf = k.to(F64)
    nq, nk = q.shape[2], k.shape[2]
    if causal and nq != nk:
        raise ValueError(f"causal MoBA needs as many queries as keys; got {nq} and {nk}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n_blocks = -(-nk // block)

    def row(b: int, h: int, i: int, s: Tensor) -> Tensor:
        qi = q[b, h, i].to(F64)
        gates = [float((qi @ kf[b, h, c * block : (c + 1) * block].mean(0)).detach()) for c in range(n_blocks)]
        if causal:
            own = i // block
            chosen = [own] + _top(list(range(own)), lambda c: gates[c], topk - 1)
        else:
            chosen = _top(list(range(n_blocks)), lambda c: gates[c], topk)
        keys = [j for j in range(nk) if j // block in chosen and (not causal or j <= i)]
        return _softmax_over(scale * s, v[b, h], keys)

    return _per_query(q, k, v, row)


def oracle_nsa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cmp: Tensor,
    v_cmp: Tensor,
    gates: Tensor,
    *,
    block: int,
    n_select: int,
    window: int,
    scale: float | None = None,
) -> Tensor:
    """Native Sparse Attention (NSA), causal, with compression block = stride = selection block = ``block``.

    Yuan et al. 2025, arXiv:2502.11089, Sec. 3.2-3.3 (output gating, compression, selection, window):
    ``o_i = g_cmp o_cmp + g_slc o_slc + g_win o_win``, where

    * compressed: softmax over the compressed blocks c complete by i (``(c+1) block - 1 <= i``), with
      ``k_cmp, v_cmp (B, H, C, D|Dv)``, ``C = N // block``; no complete block -> ``o_cmp = 0``;
    * selected: importance of block c = its compressed attention probability
      ``p_cmp = softmax(scale q_i K_cmp^T)`` over the complete blocks, 0 for the others (compression and
      selection blocks are equal, so no re-aggregation); block 0 and i's own block are always taken (the
      paper's initial block and local blocks) and count toward ``n_select``; the rest are the most important
      complete blocks (ties: lower index); softmax over the keys ``j <= i`` of the chosen blocks. If the two
      forced blocks already exceed ``n_select`` they are still both taken (spec: "always selected");
    * window: softmax over keys ``max(0, i - window + 1) .. i``.

    Per-head importance (no sum over a GQA group: the spec's heads are independent).
    ``gates (B, H, N, 3)`` in order (compressed, selected, window). All scores ``scale * q.k``.
    """
    if block < 1 or n_select < 1 or window < 1:
        raise ValueError(f"block, n_select, window must be >= 1; got {block}, {n_select}, {window}")
    _check_qkv(q, k, v)
    B, H, N, D = q.shape
    C = N // block
    if k_cmp.shape[:3] != (B, H, C) or v_cmp.shape[:3] != (B, H, C):
        raise ValueError(
            f"k_cmp, v_cmp must be (B, H, N // block = {C}, .); got {tuple(k_cmp.shape)}, {tuple(v_cmp.shape)}"
        )
    v, k_cmp, v_cmp, gates = v.to(F64), k_cmp.to(F64), v_cmp.to(F64), gates.to(F64)
    scale = 1.0 / math.sqrt(D) if scale is None else scale

    def row(b: int, h: int, i: int, s: Tensor) -> Tensor:
        qi = q[b, h, i].to(F64)
        complete = [c for c in range(C) if (c + 1) * block - 1 <= i]
        s_cmp = scale * (k_cmp[b, h] @ qi)
        o_cmp = _softmax_over(s_cmp, v_cmp[b, h], complete)
        importance = [0.0] * C
        if complete:
            p_cmp = torch.softmax(s_cmp[complete], dim=0)
            for c, p in zip(complete, p_cmp):
                importance[c] = float(p.detach())
        forced = sorted({0, i // block})
        rest = [c for c in complete if c not in forced]
        chosen = forced + _top(rest, lambda c: importance[c], n_select - len(forced))
        o_sel = _softmax_over(scale * s, v[b, h], [j for j in range(i + 1) if j // block in chosen])
        o_win = _softmax_over(scale * s, v[b, h], list(range(max(0, i - window + 1), i + 1)))
        g = gates[b, h, i]
        return g[0] * o_cmp + g[1] * o_sel + g[2] * o_win

    return _per_query(q, k, v, row)


# --------------------------------------------------------------------------
# Based (Taylor linear attention) and DSA (indexer + top-k selection)
# --------------------------------------------------------------------------


def _check_key_mask(key_mask: Tensor | None, B: int, N: int) -> None:
    if key_mask is None:
        return
    if key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be a bool tensor (True = real key); got {key_mask.dtype}")
    if tuple(key_mask.shape) != (B, N):
        raise ValueError(f"key_mask must be (B, N) = {(B, N)}; got {tuple(key_mask.shape)}")


def _is_real(key_mask: Tensor | None, b: int, j: int) -> bool:
    return key_mask is None or bool(key_mask[b, j])


def _taylor_features(x: Tensor) -> Tensor:
    """phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))], a vector of length 1 + d + d^2 (x is (d,))."""
    d = x.shape[-1]
    second = torch.outer(x, x).reshape(-1) / (math.sqrt(2) * math.sqrt(d))
    return torch.cat([x.new_ones(1), x / d**0.25, second])


def oracle_taylor_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None = None, eps: float = 1e-6
) -> Tensor:
    """Based: linear attention with the 2nd-order Taylor feature map.

    Arora et al. 2024, arXiv:2402.18668, Sec. 4 (the Taylor approximation of exp, ``exp(x) ~ 1 + x + x^2/2``,
    as a feature map ``phi``): ``phi(q) . phi(k) = 1 + q.k / sqrt(d) + (q.k)^2 / (2 d)``;
    ``o_i = sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + eps)`` over the keys j visible to i:
    ``key_mask[b, j]`` and (causal) ``j <= i``. A row with no visible key outputs zeros.
    q, k ``(B, H, N, d)`` as given (no projection here), v ``(B, H, N, Dv)``, key_mask ``(B, N)`` bool.
    """
    _check_qkv(q, k, v)
    B, H, N, _ = q.shape
    _check_key_mask(key_mask, B, N)
    v = v.to(F64)
    if B * H * N == 0:
        return torch.zeros(B, H, N, v.shape[-1], dtype=F64, device=q.device)
    q, k = q.to(F64), k.to(F64)
    out_b = []
    for b in range(B):
        out_h = []
        for h in range(H):
            phi_k = [_taylor_features(k[b, h, j]) for j in range(N)]
            out_i = []
            for i in range(N):
                keys = [j for j in range(N) if _is_real(key_mask, b, j) and (not causal or j <= i)]
                if not keys:
                    out_i.append(torch.zeros(v.shape[-1], dtype=F64, device=v.device))
                    continue
                phi_q = _taylor_features(q[b, h, i])
                weights = torch.stack([phi_q @ phi_k[j] for j in keys])  # (len(keys),), each >= 1/2
                out_i.append(weights @ v[b, h, keys] / (weights.sum() + eps))
            out_h.append(torch.stack(out_i))
        out_b.append(torch.stack(out_h))
    return torch.stack(out_b)


def _index_score(index_q: Tensor, index_k: Tensor, index_w: Tensor, b: int, t: int, s: int) -> float:
    """Lightning indexer: ``I[b, t, s] = sum_j w[b, t, j] ReLU(q^I[b, t, j] . k^I[b, s])`` (no gradient)."""
    total = 0.0
    for j in range(index_q.shape[2]):
        total += float(index_w[b, t, j]) * max(float(index_q[b, t, j] @ index_k[b, s]), 0.0)
    return total


def oracle_dsa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index_q: Tensor,
    index_k: Tensor,
    index_w: Tensor,
    *,
    top_k: int,
    causal: bool,
    key_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """DeepSeek Sparse Attention: lightning indexer, top-k key selection, softmax over the selection.

    DeepSeek-V3.2-Exp tech report, Sec. 2.1 (eq. 1, the lightning indexer
    ``I_ts = sum_j w_tj ReLU(q^I_tj . k^I_s)``; eq. 2, ``u_t = Attn(h_t, {c_s | I_ts in Top-k(I_t:)})``).
    Candidates of query t: keys s with ``key_mask[b, s]`` and (causal) ``s <= t``; the ``top_k`` highest
    scores are kept (all candidates if fewer), ties to the LOWER s; one selection per (b, t), shared by
    every head (MLA in MQA mode). Per head: softmax of ``scale * q.k`` over the selected keys, ``scale``
    ``None`` -> ``1/sqrt(D)``. No candidate -> zeros. The selection is discrete: index_* get no gradient.

    Shapes: q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)``, index_q ``(B, N, H_I, d_I)``,
    index_k ``(B, N, d_I)``, index_w ``(B, N, H_I)``, key_mask ``(B, N)`` bool -> ``(B, H, N, Dv)``.
    """
    _check_qkv(q, k, v)
    B, H, N, D = q.shape
    _check_key_mask(key_mask, B, N)
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1; got {top_k}")
    if index_q.dim() != 4 or index_q.shape[:2] != (B, N):
        raise ValueError(f"index_q must be (B, N, H_I, d_I) with (B, N) = {(B, N)}; got {tuple(index_q.shape)}")
    H_I, d_I = index_q.shape[2:]
    if tuple(index_k.shape) != (B, N, d_I) or tuple(index_w.shape) != (B, N, H_I):
        raise ValueError(
            f"index_k must be (B, N, d_I) = {(B, N, d_I)} and index_w (B, N, H_I) = {(B, N, H_I)}; "
            f"got {tuple(index_k.shape)}, {tuple(index_w.shape)}"
        )
    iq, ik, iw = (x.detach().to(F64) for x in (index_q, index_k, index_w))
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    selected = []  # selected[b][t]: the key indices chosen for query t, shared by all heads
    for b in range(B):
        rows = []
        for t in range(N):
            candidates = [s for s in range(N) if _is_real(key_mask, b, s) and (not causal or s <= t)]
            # sort by (score descending, key ascending): equal scores rank the lower key first
            ranked = sorted((-_index_score(iq, ik, iw, b, t, s), s) for s in candidates)
            rows.append([s for _, s in ranked[:top_k]])
        selected.append(rows)
    v = v.to(F64)
    return _per_query(q, k, v, lambda b, h, i, s: _softmax_over(scale * s, v[b, h], selected[b][i]))
