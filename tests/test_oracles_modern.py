"""The modern-mechanism oracles checked against a second form written from the same papers.

Recurrent oracles against their parallel / closed / online-learning forms; attention oracles against
dense masked formulas and limit laws (a huge cap, a -inf sink, lam = 0, all blocks selected, ...).
Nothing here imports the library: these are tests of ``oracles_modern`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from oracles import attention_oracle, sliding_window_oracle
from oracles_modern import (
    oracle_delta_rule,
    oracle_diff_lambda,
    oracle_differential_attention,
    oracle_gated_attention,
    oracle_gated_delta_rule,
    oracle_gla,
    oracle_lambda_init,
    oracle_latent_attention,
    oracle_moba,
    oracle_nsa,
    oracle_retention,
    oracle_sink_softmax_attention,
    oracle_softcap_attention,
    oracle_ssd,
)
from tolerances import assert_same

F64 = torch.float64
B, H, D, DV = 2, 3, 4, 5


def rand(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=F64)


def qkv(n: int, d: int = D) -> tuple[Tensor, Tensor, Tensor]:
    return rand(B, H, n, d), rand(B, H, n, d), rand(B, H, n, DV)


def unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def decays(*shape: int) -> Tensor:
    """log of decays drawn from (0.6, 1)."""
    return torch.log(0.6 + 0.4 * torch.rand(*shape, dtype=F64))


def mask_from(n_q: int, n_k: int, visible: Callable[[int, int], bool]) -> Tensor:
    """(n_q, n_k) bool mask, entry by entry."""
    return torch.tensor([[visible(i, j) for j in range(n_k)] for i in range(n_q)], dtype=torch.bool)


def causal_mask(n: int) -> Tensor:
    return mask_from(n, n, lambda i, j: j <= i)


def dense_softmax(scores: Tensor, mask: Tensor, v: Tensor, sink: Tensor | None = None) -> Tensor:
    """``softmax`` of the masked ``scores`` (B, H, Nq, Nk) times v, written as exp / sum; rows with no key -> 0."""
    e = torch.where(mask, torch.exp(scores), torch.zeros((), dtype=F64))
    denom = e.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink)[None, :, None, None]
    denom = torch.where(denom > 0, denom, torch.ones((), dtype=F64))
    return (e / denom) @ v


def scores_of(q: Tensor, k: Tensor, scale: float) -> Tensor:
    return scale * q @ k.transpose(-1, -2)


# --------------------------------------------------------------------------
# Recurrences vs their parallel forms
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [13, 37])
def test_retention_matches_parallel_form(n: int) -> None:
    # RetNet parallel form: O = (Q K^T * D) V, D_nm = gamma^(n-m) for n >= m else 0; an initial state
    # S_0 adds gamma^(n+1) q_n S_0 (it has decayed n+1 times by token n)
    q, k, v = qkv(n)
    log_gamma = decays(H)
    s0 = rand(B, H, D, DV)
    gamma = torch.exp(log_gamma)
    dmat = torch.stack(
        [
            mask_from(n, n, lambda i, j: j <= i) * gamma[h] ** (torch.arange(n)[:, None] - torch.arange(n))
            for h in range(H)
        ]
    )
    o_par = (q @ k.transpose(-1, -2) * dmat) @ v
    o_par = o_par + gamma[:, None, None] ** (torch.arange(n, dtype=F64)[:, None] + 1) * (q @ s0)
    state_par = torch.einsum("hm,bhmd,bhme->bhde", dmat[:, -1], k, v) + gamma[:, None, None] ** n * s0
    o, state = oracle_retention(q, k, v, log_gamma, initial_state=s0)
    assert_same(o, o_par)
    assert_same(state, state_par, what="state")


def test_gla_matches_parallel_form() -> None:
    # GLA parallel form O = ((Q * Bc)(K / Bc)^T * M) V with Bc_t = prod_{r<=t} alpha_r, in log space:
    # o_t = sum_{s<=t} sum_d q_td k_sd exp(c_td - c_sd) v_s, c = cumsum(log_alpha)
    n = 13
    q, k, v = qkv(n)
    log_alpha = decays(B, H, n, D)
    c = log_alpha.cumsum(2)
    ratio = torch.exp(c[:, :, :, None, :] - c[:, :, None, :, :])  # [B, H, t, s, D]
    ratio = torch.where(causal_mask(n)[:, :, None], ratio, torch.zeros((), dtype=F64))
    attn = torch.einsum("bhtd,bhsd,bhtsd->bhts", q, k, ratio)
    o, state = oracle_gla(q, k, v, log_alpha)
    assert_same(o, attn @ v)
    assert_same(state, torch.einsum("bhsd,bhsd,bhse->bhde", ratio[:, :, -1], k, v), what="state")


def test_ssd_matches_quadratic_form() -> None:
    # Mamba-2 SSD dual: Y = (L * C B^T) X with the 1-semiseparable mask L_ts = a_{s+1} ... a_t for s <= t
    n = 13
    q, k, v = qkv(n)
    log_a = decays(B, H, n)
    L = torch.zeros(B, H, n, n, dtype=F64)
    for t in range(n):
        for s in range(t + 1):
            L[:, :, t, s] = torch.exp(log_a[:, :, s + 1 : t + 1].sum(-1))
    o, state = oracle_ssd(q, k, v, log_a)
    assert_same(o, (L * (q @ k.transpose(-1, -2))) @ v)
    assert_same(state, torch.einsum("bhs,bhsd,bhse->bhde", L[:, :, -1], k, v), what="state")


def test_decays_agree_where_they_coincide() -> None:
    # a GLA decay equal on every channel, and an SSD decay constant in time, are both retention
    n = 13
    q, k, v = qkv(n)
    log_gamma = decays(H)
    o_ret, s_ret = oracle_retention(q, k, v, log_gamma)
    o_gla, s_gla = oracle_gla(q, k, v, log_gamma[None, :, None, None].expand(B, H, n, D))
    o_ssd, s_ssd = oracle_ssd(q, k, v, log_gamma[None, :, None].expand(B, H, n))
    for o, s in ((o_gla, s_gla), (o_ssd, s_ssd)):
        assert_same(o, o_ret)
        assert_same(s, s_ret, what="state")


def _closed_form_delta(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor, s0: Tensor) -> Tensor:
    """o_t = q_t S_t with S_t = A_t ... A_1 S_0 + sum_{s<=t} A_t ... A_{s+1} beta_s k_s^T v_s,
    A_r = alpha_r (I - beta_r k_r^T k_r): the unrolled product of transition matrices."""
    n = q.shape[2]
    eye = torch.eye(D, dtype=F64)
    out = torch.zeros(B, H, n, DV, dtype=F64)
    for b in range(B):
        for h in range(H):
            A = [alpha[b, h, r] * (eye - beta[b, h, r] * torch.outer(k[b, h, r], k[b, h, r])) for r in range(n)]
            for t in range(n):
                prod = eye
                S = torch.zeros(D, DV, dtype=F64)
                for s in range(t, -1, -1):  # prod = A_t ... A_{s+1}
                    S = S + prod @ (beta[b, h, s] * torch.outer(k[b, h, s], v[b, h, s]))
                    prod = prod @ A[s]
                out[b, h, t] = q[b, h, t] @ (S + prod @ s0[b, h])
    return out


def test_delta_rules_match_closed_form() -> None:
    n = 13
    q, k, v = qkv(n)
    k = unit(k)
    beta, log_alpha, s0 = torch.rand(B, H, n, dtype=F64), decays(B, H, n), rand(B, H, D, DV)
    o, _ = oracle_delta_rule(q, k, v, beta, initial_state=s0)
    assert_same(o, _closed_form_delta(q, k, v, beta, torch.ones(B, H, n, dtype=F64), s0))
    o, _ = oracle_gated_delta_rule(q, k, v, beta, log_alpha, initial_state=s0)
    assert_same(o, _closed_form_delta(q, k, v, beta, torch.exp(log_alpha), s0))


def test_delta_rules_are_one_gradient_step() -> None:
    # online regression: S_t = alpha_t S_{t-1} - beta_t grad L_t(alpha_t S_{t-1}), L_t(S) = ||k_t S - v_t||^2 / 2
    # (alpha = 1 for DeltaNet; Gated DeltaNet's online-learning view)
    n = 13
    q, k, v = qkv(n)
    k = unit(k)
    beta, log_alpha = torch.rand(B, H, n, dtype=F64), decays(B, H, n)
    for gated in (False, True):
        alpha = torch.exp(log_alpha) if gated else torch.ones(B, H, n, dtype=F64)
        states = torch.zeros(B, H, D, DV, dtype=F64)
        outs = torch.zeros(B, H, n, DV, dtype=F64)
        for b in range(B):
            for h in range(H):
                S = torch.zeros(D, DV, dtype=F64)
                for t in range(n):
                    start = (alpha[b, h, t] * S).detach().requires_grad_(True)
                    loss = 0.5 * ((k[b, h, t] @ start - v[b, h, t]) ** 2).sum()
                    (grad,) = torch.autograd.grad(loss, start)
                    S = start.detach() - beta[b, h, t] * grad
                    outs[b, h, t] = q[b, h, t] @ S
                states[b, h] = S
        o, state = oracle_gated_delta_rule(q, k, v, beta, log_alpha) if gated else oracle_delta_rule(q, k, v, beta)
        assert_same(o, outs)
        assert_same(state, states, what="state")


def test_delta_rule_with_beta_one_stores_exactly() -> None:
    # with a unit key and beta = 1 the memory returns v_t for k_t right after writing it (queries = keys)
    n = 13
    _, k, v = qkv(n)
    k = unit(k)
    ones = torch.ones(B, H, n, dtype=F64)
    assert_same(oracle_delta_rule(k, k, v, ones)[0], v)
    assert_same(oracle_gated_delta_rule(k, k, v, ones, decays(B, H, n))[0], v)
    # and with no decay the gated rule is the plain one
    beta = torch.rand(B, H, n, dtype=F64)
    zero = torch.zeros(B, H, n, dtype=F64)
    for a, b in zip(oracle_gated_delta_rule(k, k, v, beta, zero), oracle_delta_rule(k, k, v, beta)):
        assert_same(a, b)


def _recurrent_cases(n: int) -> dict[str, tuple[Callable, tuple[Tensor, ...], Callable[[Tensor, slice], Tensor]]]:
    """name -> (oracle, extra inputs, how to slice an extra input along N)."""

    def by_token(x: Tensor, sl: slice) -> Tensor:
        return x[:, :, sl]

    def per_head(x: Tensor, sl: slice) -> Tensor:
        return x

    return {
        "retention": (oracle_retention, (decays(H),), per_head),
        "gla": (oracle_gla, (decays(B, H, n, D),), by_token),
        "ssd": (oracle_ssd, (decays(B, H, n),), by_token),
        "delta_rule": (oracle_delta_rule, (torch.rand(B, H, n, dtype=F64),), by_token),
        "gated_delta_rule": (oracle_gated_delta_rule, (torch.rand(B, H, n, dtype=F64), decays(B, H, n)), by_token),
    }


@pytest.mark.parametrize("name", ["retention", "gla", "ssd", "delta_rule", "gated_delta_rule"])
def test_initial_state_continues_the_sequence(name: str) -> None:
    n, cut = 37, 16
    q, k, v = qkv(n)
    k = unit(k)
    oracle, extra, cut_extra = _recurrent_cases(n)[name]
    s0 = rand(B, H, D, DV)
    o, state = oracle(q, k, v, *extra, initial_state=s0)
    first, second = slice(0, cut), slice(cut, n)
    o1, s1 = oracle(
        q[:, :, first], k[:, :, first], v[:, :, first], *(cut_extra(x, first) for x in extra), initial_state=s0
    )
    o2, s2 = oracle(
        q[:, :, second], k[:, :, second], v[:, :, second], *(cut_extra(x, second) for x in extra), initial_state=s1
    )
    assert_same(torch.cat([o1, o2], dim=2), o)
    assert_same(s2, state, what="state")


@pytest.mark.parametrize("name", ["retention", "gla", "ssd", "delta_rule", "gated_delta_rule"])
def test_recurrent_oracles_are_differentiable(name: str) -> None:
    n = 13
    q, k, v = (x.requires_grad_(True) for x in qkv(n))
    oracle, extra, _ = _recurrent_cases(n)[name]
    s0 = rand(B, H, D, DV).requires_grad_(True)
    o, state = oracle(q, k, v, *extra, initial_state=s0)
    (o.sum() + state.sum()).backward()
    for x in (q, k, v, s0):
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


# --------------------------------------------------------------------------
# Softmax variants: limit laws and dense forms
# --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_softcap(causal: bool) -> None:
    n = 13
    q, k, v = qkv(n)
    q = 4 * q  # large scores, so that a small cap matters
    mask = causal_mask(n) if causal else torch.ones(n, n, dtype=torch.bool)
    assert_same(
        oracle_softcap_attention(q, k, v, 1e7, causal=causal, scale=0.5),
        attention_oracle(q, k, v, causal=causal, scale=0.5),
    )
    capped = 2.0 * torch.tanh(scores_of(q, k, 0.5) / 2.0)
    assert_same(oracle_softcap_attention(q, k, v, 2.0, causal=causal, scale=0.5), dense_softmax(capped, mask, v))


@pytest.mark.parametrize("causal", [False, True])
def test_sink_softmax(causal: bool) -> None:
    n = 37
    q, k, v = qkv(n)
    mask = causal_mask(n) if causal else torch.ones(n, n, dtype=torch.bool)
    scale = 1 / math.sqrt(D)
    no_sink = torch.full((H,), -math.inf, dtype=F64)
    assert_same(
        oracle_sink_softmax_attention(q, k, v, no_sink, causal=causal), attention_oracle(q, k, v, causal=causal)
    )
    sink = rand(H)
    expected = dense_softmax(scores_of(q, k, scale), mask, v, sink=sink)
    assert_same(oracle_sink_softmax_attention(q, k, v, sink, causal=causal, scale=scale), expected)


def test_sink_with_one_key_by_hand() -> None:
    q, k, v = torch.ones(1, 1, 1, 2, dtype=F64), torch.ones(1, 1, 1, 2, dtype=F64), torch.tensor([[[[3.0]]]], dtype=F64)
    # s = 1 * (1 + 1) = 2, sink 0: o = 3 e^2 / (1 + e^2)
    o = oracle_sink_softmax_attention(q, k, v, torch.zeros(1, dtype=F64), causal=True, scale=1.0)
    assert abs(float(o) - 3 * math.exp(2) / (1 + math.exp(2))) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_differential_attention(causal: bool) -> None:
    n = 13
    q, k, v = qkv(n, d=2 * D)
    half = 1 / math.sqrt(D)
    q1, q2, k1, k2 = q[..., :D], q[..., D:], k[..., :D], k[..., D:]
    # lam = 0: softmax attention on the first halves, at the half-width scale (the default)
    zero = torch.zeros((), dtype=F64)
    assert_same(
        oracle_differential_attention(q, k, v, zero, causal=causal),
        attention_oracle(q1, k1, v, causal=causal, scale=half),
    )
    # identical halves and lam = 1 cancel exactly
    same = torch.cat([q1, q1], -1), torch.cat([k1, k1], -1)
    assert_same(oracle_differential_attention(*same, v, 1.0, causal=causal), torch.zeros(B, H, n, DV, dtype=F64))
    # dense: (softmax1 - lam_h softmax2) V with the weight matrices formed first
    lam = torch.rand(H, dtype=F64)
    mask = causal_mask(n) if causal else torch.ones(n, n, dtype=torch.bool)
    eye = torch.eye(n, dtype=F64).expand(B, H, n, n)
    w1 = dense_softmax(scores_of(q1, k1, half), mask, eye)
    w2 = dense_softmax(scores_of(q2, k2, half), mask, eye)
    expected = (w1 - lam[:, None, None] * w2) @ v
    assert_same(oracle_differential_attention(q, k, v, lam, causal=causal), expected)
    scalar = oracle_differential_attention(q, k, v, torch.tensor(0.3, dtype=F64), causal=causal)
    assert_same(scalar, oracle_differential_attention(q, k, v, torch.full((H,), 0.3, dtype=F64), causal=causal))


def test_diff_lambda_and_init_by_hand() -> None:
    assert abs(oracle_lambda_init(1) - 0.2) < 1e-15
    assert abs(oracle_lambda_init(2) - (0.8 - 0.6 * math.exp(-0.3))) < 1e-15
    assert abs(oracle_lambda_init(1000) - 0.8) < 1e-12
    with pytest.raises(ValueError, match="layer_index"):
        oracle_lambda_init(0)
    z = torch.zeros(3, dtype=F64)
    assert abs(float(oracle_diff_lambda(z, z, z, z, 0.2)) - 0.2) < 1e-15  # e^0 - e^0 + 0.2
    a = torch.tensor([1.0, 2.0], dtype=F64)
    b = torch.tensor([0.5, -0.25], dtype=F64)  # a.b = 0
    lam = oracle_diff_lambda(a, a, a, b, 0.5)  # e^5 - e^0 + 0.5
    assert abs(float(lam) - (math.exp(5) - 1 + 0.5)) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_gated_attention(causal: bool) -> None:
    n = 13
    q, k, v = qkv(n)
    plain = attention_oracle(q, k, v, causal=causal)
    open_gate = torch.full((B, H, n, DV), 60.0, dtype=F64)
    assert_same(oracle_gated_attention(q, k, v, open_gate, causal=causal), plain)
    half_gate = torch.zeros(B, H, n, DV, dtype=F64)
    assert_same(oracle_gated_attention(q, k, v, half_gate, causal=causal), plain / 2)
    g = rand(B, H, n, DV)
    assert_same(oracle_gated_attention(q, k, v, g, causal=causal), plain / (1 + torch.exp(-g)))


@pytest.mark.parametrize("causal", [False, True])
def test_latent_attention(causal: bool) -> None:
    n, dn, dr, r = 13, 4, 2, 3
    q_nope, q_rope = rand(B, H, n, dn), rand(B, H, n, dr)
    c_kv, k_rope = rand(B, n, r), rand(B, n, dr)
    w_uk, w_uv = rand(H, r, dn), rand(H, r, DV)
    o = oracle_latent_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal=causal)
    # ordinary attention over the explicit per-head keys [c W_uk; k_rope] and values c W_uv
    k_full = torch.cat([torch.einsum("bnr,hrd->bhnd", c_kv, w_uk), k_rope[:, None].expand(B, H, n, dr)], -1)
    v_full = torch.einsum("bnr,hre->bhne", c_kv, w_uv)
    q_full = torch.cat([q_nope, q_rope], -1)
    assert_same(o, attention_oracle(q_full, k_full, v_full, causal=causal, scale=1 / math.sqrt(dn + dr)))
    # the absorbed form (the decode path): W_uk folded into the query, W_uv applied after the latent mix
    mask = causal_mask(n) if causal else torch.ones(n, n, dtype=torch.bool)
    q_lat = torch.einsum("bhnd,hrd->bhnr", q_nope, w_uk)
    scores = (q_lat @ c_kv[:, None].transpose(-1, -2) + q_rope @ k_rope[:, None].transpose(-1, -2)) * 0.3
    mixed = dense_softmax(scores, mask, c_kv[:, None].expand(B, H, n, r))
    absorbed = torch.einsum("bhnr,hre->bhne", mixed, w_uv)
    assert_same(oracle_latent_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal=causal, scale=0.3), absorbed)


# --------------------------------------------------------------------------
# Block selection
# --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("topk", [4, 9])
def test_moba_with_every_block_is_full_attention(causal: bool, topk: int) -> None:
    q, k, v = qkv(13)  # blocks of 4: 4 blocks, the last holds one key
    assert_same(oracle_moba(q, k, v, block=4, topk=topk, causal=causal), attention_oracle(q, k, v, causal=causal))


def test_moba_one_key_blocks_causal_top1_is_identity() -> None:
    q, k, v = qkv(13)
    assert_same(oracle_moba(q, k, v, block=1, topk=1, causal=True), v)


def _one_dim(keys: list[float]) -> tuple[Tensor, Tensor, Tensor]:
    """q = 1 everywhere, so a block's gate is the mean of its keys; v random."""
    n = len(keys)
    k = torch.tensor(keys, dtype=F64).reshape(1, 1, n, 1).expand(B, H, n, 1).contiguous()
    return torch.ones(B, H, n, 1, dtype=F64), k, rand(B, H, n, DV)


def test_moba_by_hand() -> None:
    # blocks of 2: [0,1] [2,3] [4,5] [6,7] [8]; block means 0, 2, 0, -1, 5
    q, k, v = _one_dim([0, 0, 1, 3, -1, 1, -1, -1, 5])
    scores = scores_of(q, k, 1.0)
    # non-causal, top-2: blocks 4 (gate 5) and 1 (gate 2) for every query
    mask = mask_from(9, 9, lambda i, j: j // 2 in (1, 4))
    assert_same(oracle_moba(q, k, v, block=2, topk=2, causal=False, scale=1.0), dense_softmax(scores, mask, v))
    # causal, top-2: own block (keys <= i) + the best earlier one: block 1 once it exists, else block 0
    # (queries 6, 7 see blocks 0..2 with gates 0, 2, 0; query 8 sees block 3 too, gate -1)
    own_and = {0: (), 1: (0,), 2: (1,), 3: (1,), 4: (1,)}
    mask = mask_from(9, 9, lambda i, j: j <= i and (j // 2 == i // 2 or j // 2 in own_and[i // 2]))
    assert_same(oracle_moba(q, k, v, block=2, topk=2, causal=True, scale=1.0), dense_softmax(scores, mask, v))
    # ties go to the lower block: blocks 0 and 2 both have gate 0; top-3 at query 7 takes 1 and then 0
    # (every query's earlier top-2 is then blocks 0 and 1, or all earlier blocks when fewer exist)
    mask = mask_from(9, 9, lambda i, j: j <= i and (j // 2 == i // 2 or (j // 2 < i // 2 and j // 2 in (0, 1))))
    assert_same(oracle_moba(q, k, v, block=2, topk=3, causal=True, scale=1.0), dense_softmax(scores, mask, v))


def _nsa_inputs(n: int, block: int, gates: tuple[float, float, float]) -> tuple[Tensor, ...]:
    q, k, v = qkv(n)
    c = n // block
    g = torch.tensor(gates, dtype=F64).expand(B, H, n, 3)
    return q, k, v, rand(B, H, c, D), rand(B, H, c, DV), g


def test_nsa_window_branch_is_sliding_window() -> None:
    n, window = 13, 4
    q, k, v, k_cmp, v_cmp, g = _nsa_inputs(n, 3, (0.0, 0.0, 1.0))
    mask = sliding_window_oracle(n, n, window - 1, 0)
    expected = dense_softmax(scores_of(q, k, 0.5), mask, v)
    assert_same(oracle_nsa(q, k, v, k_cmp, v_cmp, g, block=3, n_select=2, window=window, scale=0.5), expected)


@pytest.mark.parametrize("n_select", [5, 7])
def test_nsa_selecting_every_block_is_causal_attention(n_select: int) -> None:
    q, k, v, k_cmp, v_cmp, g = _nsa_inputs(13, 3, (0.0, 1.0, 0.0))  # 4 full blocks and a one-token block
    expected = attention_oracle(q, k, v, causal=True)
    assert_same(oracle_nsa(q, k, v, k_cmp, v_cmp, g, block=3, n_select=n_select, window=2), expected)


def test_nsa_compressed_branch() -> None:
    n, block = 13, 3
    q, k, v, k_cmp, v_cmp, g = _nsa_inputs(n, block, (1.0, 0.0, 0.0))
    # block c is visible once complete: (c + 1) block - 1 <= i; queries 0, 1 see none -> 0
    mask = mask_from(n, n // block, lambda i, c: (c + 1) * block - 1 <= i)
    expected = dense_softmax(scores_of(q, k_cmp, 0.5), mask, v_cmp)
    out = oracle_nsa(q, k, v, k_cmp, v_cmp, g, block=block, n_select=2, window=2, scale=0.5)
    assert_same(out, expected)
    assert (out[:, :, :2] == 0).all()


def test_nsa_selection_by_hand() -> None:
    n, block = 13, 3
    q, k, v, _, v_cmp, g = _nsa_inputs(n, block, (0.0, 1.0, 0.0))
    scores = scores_of(q, k, 0.5)
    # n_select = 2: only the forced blocks, block 0 and the query's own
    mask = mask_from(n, n, lambda i, j: j <= i and j // block in (0, i // block))
    out = oracle_nsa(q, k, v, rand(B, H, 4, D), v_cmp, g, block=block, n_select=2, window=2, scale=0.5)
    assert_same(out, dense_softmax(scores, mask, v))
    # n_select = 3 with q = 1 and compressed keys (0, 0, 3, 0): block 2 is the most important once complete
    # (i >= 8); before that the third pick is the lowest complete block not forced (ties), if any
    q = torch.ones(B, H, n, D, dtype=F64)
    k_cmp = torch.tensor([0.0, 0.0, 3.0, 0.0], dtype=F64)[:, None].expand(B, H, 4, D)
    scores = scores_of(q, k, 0.5)

    def third(i: int) -> int | None:
        rest = [c for c in range(4) if (c + 1) * block - 1 <= i and c not in (0, i // block)]
        return 2 if 2 in rest else (rest[0] if rest else None)

    mask = mask_from(n, n, lambda i, j: j <= i and j // block in (0, i // block, third(i)))
    out = oracle_nsa(q, k, v, k_cmp, v_cmp, g, block=block, n_select=3, window=2, scale=0.5)
    assert_same(out, dense_softmax(scores, mask, v))


def test_nsa_mixes_branches_with_gates() -> None:
    n, block = 13, 3
    q, k, v, k_cmp, v_cmp, _ = _nsa_inputs(n, block, (0.0, 0.0, 0.0))
    gates = torch.rand(B, H, n, 3, dtype=F64)
    kw = dict(block=block, n_select=3, window=4, scale=0.5)
    parts = [oracle_nsa(q, k, v, k_cmp, v_cmp, torch.eye(3, dtype=F64)[c].expand(B, H, n, 3), **kw) for c in range(3)]
    expected = sum(gates[..., c : c + 1] * parts[c] for c in range(3))
    assert_same(oracle_nsa(q, k, v, k_cmp, v_cmp, gates, **kw), expected)
