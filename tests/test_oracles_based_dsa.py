"""The Based and DSA oracles of ``oracles_modern`` checked against second forms written from the same papers.

Based (Taylor linear attention): the closed form ``1 + s/sqrt(d) + s^2/(2d)`` as a dense matrix, the
causal recurrent form (running sums of ``phi(k) v^T`` and ``phi(k)``), causality, masking = deletion.
DSA (indexer + top-k): a dense form where a key is selected iff fewer than ``top_k`` candidates beat it,
limit laws (top_k >= N is softmax attention), hand-built ties, invariances. Nothing here imports the library.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from oracles import attention_oracle
from oracles_modern import _taylor_features, oracle_dsa_attention, oracle_taylor_linear_attention
from tolerances import assert_same

F64 = torch.float64
B, H, D, DV, N = 2, 3, 4, 5, 11


def rand(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=F64)


def qkv(n: int = N, d: int = D) -> tuple[Tensor, Tensor, Tensor]:
    return rand(B, H, n, d), rand(B, H, n, d), rand(B, H, n, DV)


def visible(n: int, causal: bool, key_mask: Tensor | None) -> Tensor:
    """(B, n, n) bool: key j visible to query i."""
    vis = torch.ones(B, n, n, dtype=torch.bool)
    if causal:
        vis = vis & torch.ones(n, n, dtype=torch.bool).tril()
    if key_mask is not None:
        vis = vis & key_mask[:, None, :]
    return vis


def some_key_mask(n: int = N) -> Tensor:
    """Batch 0: keys 2, 5, 6 padded; batch 1: key 0 padded too (causal query 0 then sees nothing)."""
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[:, [2, 5, 6]] = False
    mask[1, 0] = False
    return mask


def dense_softmax(scores: Tensor, mask: Tensor, v: Tensor) -> Tensor:
    """masked softmax(scores) @ v as exp / sum; rows with no key -> 0. scores (B, H, Nq, Nk), mask broadcastable."""
    e = torch.where(mask, torch.exp(scores), torch.zeros((), dtype=F64))
    denom = e.sum(-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones((), dtype=F64)) @ v


# --------------------------------------------------------------------------
# Based
# --------------------------------------------------------------------------


def taylor_closed_form(q: Tensor, k: Tensor, v: Tensor, vis: Tensor, eps: float) -> Tensor:
    d = q.shape[-1]
    s = q @ k.transpose(-1, -2)
    a = (1 + s / math.sqrt(d) + s**2 / (2 * d)) * vis[:, None]  # (B, H, N, N), 0 where invisible
    return a @ v / (a.sum(-1, keepdim=True) + eps)


def features(x: Tensor) -> Tensor:
    """phi of every row of x (..., d) -> (..., 1 + d + d^2), built with einsum for the recurrent form."""
    d = x.shape[-1]
    outer = torch.einsum("...i,...j->...ij", x, x).flatten(-2) / math.sqrt(2 * d)
    return torch.cat([torch.ones_like(x[..., :1]), x / d**0.25, outer], -1)


@pytest.mark.parametrize("d", [3, 4])
def test_taylor_feature_vector_is_the_closed_form(d: int) -> None:
    x, y = rand(7, d), rand(7, d)
    for i in range(7):
        fx, fy = _taylor_features(x[i]), _taylor_features(y[i])
        assert fx.shape == (1 + d + d * d,) and float(fx[0]) == 1.0
        s = float(x[i] @ y[i])
        assert abs(float(fx @ fy) - (1 + s / math.sqrt(d) + s * s / (2 * d))) < 1e-12
        assert_same(fx, features(x[i]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_taylor_matches_closed_form(causal: bool, masked: bool) -> None:
    q, k, v = qkv(d=3)
    key_mask = some_key_mask() if masked else None
    out = oracle_taylor_linear_attention(q, k, v, causal=causal, key_mask=key_mask)
    assert_same(out, taylor_closed_form(q, k, v, visible(N, causal, key_mask), 1e-6))
    if masked and causal:
        assert (out[1, :, 0] == 0).all()  # batch 1, query 0: its only key is padded


@pytest.mark.parametrize("masked", [False, True])
def test_taylor_causal_matches_recurrent_form(masked: bool) -> None:
    q, k, v = qkv()
    key_mask = some_key_mask() if masked else torch.ones(B, N, dtype=torch.bool)
    phi_q, phi_k = features(q), features(k) * key_mask[:, None, :, None]  # padded keys add nothing
    state = torch.zeros(B, H, phi_k.shape[-1], DV, dtype=F64)  # running sum of phi(k_j) v_j^T
    norm = torch.zeros(B, H, phi_k.shape[-1], dtype=F64)  # running sum of phi(k_j)
    outs = []
    for t in range(N):
        state = state + torch.einsum("bhf,bhe->bhfe", phi_k[:, :, t], v[:, :, t])
        norm = norm + phi_k[:, :, t]
        num = torch.einsum("bhf,bhfe->bhe", phi_q[:, :, t], state)
        outs.append(num / (torch.einsum("bhf,bhf->bh", phi_q[:, :, t], norm)[..., None] + 1e-6))
    out = oracle_taylor_linear_attention(q, k, v, causal=True, key_mask=key_mask if masked else None)
    assert_same(out, torch.stack(outs, 2))


def test_taylor_causal_output_ignores_the_future() -> None:
    q, k, v = qkv()
    i = 4
    out = oracle_taylor_linear_attention(q, k, v, causal=True)
    late = [x.clone() for x in (q, k, v)]
    for x in late:
        x[:, :, i + 1 :] += rand(*x[:, :, i + 1 :].shape)
    changed = oracle_taylor_linear_attention(*late, causal=True)
    assert_same(changed[:, :, : i + 1], out[:, :, : i + 1])
    assert not torch.allclose(changed[:, :, i + 1 :], out[:, :, i + 1 :])
    # without causality every output sees the change
    full = oracle_taylor_linear_attention(q, k, v, causal=False)
    assert not torch.allclose(oracle_taylor_linear_attention(*late, causal=False)[:, :, 0], full[:, :, 0])


def test_taylor_one_key_row_returns_its_value() -> None:
    q, k, v = qkv()
    assert_same(oracle_taylor_linear_attention(q, k, v, causal=True, eps=0.0)[:, :, 0], v[:, :, 0])
    # with eps: v_0 a / (a + eps), a = phi(q_0).phi(k_0) from the closed form
    s = (q[:, :, 0] * k[:, :, 0]).sum(-1, keepdim=True)
    a = 1 + s / 2 + s**2 / 8  # d = 4
    assert_same(oracle_taylor_linear_attention(q, k, v, causal=True)[:, :, 0], v[:, :, 0] * a / (a + 1e-6))


@pytest.mark.parametrize("causal", [False, True])
def test_taylor_key_mask_equals_deleting_the_tokens(causal: bool) -> None:
    q, k, v = qkv()
    keep = [j for j in range(N) if j not in (2, 5, 6)]
    key_mask = torch.zeros(B, N, dtype=torch.bool)
    key_mask[:, keep] = True
    out = oracle_taylor_linear_attention(q, k, v, causal=causal, key_mask=key_mask)
    short = oracle_taylor_linear_attention(q[:, :, keep], k[:, :, keep], v[:, :, keep], causal=causal)
    assert_same(out[:, :, keep], short)
    assert (oracle_taylor_linear_attention(q, k, v, causal=causal, key_mask=torch.zeros_like(key_mask)) == 0).all()


def test_taylor_gradients_match_closed_form() -> None:
    q, k, v = (x.requires_grad_(True) for x in qkv())
    key_mask = some_key_mask()
    g = rand(B, H, N, DV)
    got = torch.autograd.grad(
        (oracle_taylor_linear_attention(q, k, v, causal=True, key_mask=key_mask) * g).sum(), (q, k, v)
    )
    want = torch.autograd.grad((taylor_closed_form(q, k, v, visible(N, True, key_mask), 1e-6) * g).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert_same(a, b, what="grad")


# --------------------------------------------------------------------------
# DSA
# --------------------------------------------------------------------------


def indexer(n: int = N, h_i: int = 2, d_i: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """Random indexer inputs; positive head weights, so I = 0 exactly where every ReLU is 0 (ties)."""
    return rand(B, n, h_i, d_i), rand(B, n, d_i), 0.1 + torch.rand(B, n, h_i, dtype=F64)


def dense_dsa(q, k, v, iq, ik, iw, *, top_k: int, causal: bool, key_mask: Tensor | None, scale: float) -> Tensor:
    """Selected iff a candidate and fewer than top_k candidates beat it (higher I, or equal I and lower index)."""
    n = q.shape[2]
    score = torch.einsum("btj,btjs->bts", iw, torch.einsum("btjd,bsd->btjs", iq, ik).clamp(min=0))
    cand = visible(n, causal, key_mask)
    other, this = score[:, :, None, :], score[:, :, :, None]  # [b, t, s, s']: s' against s
    lower = torch.arange(n)[None, :] < torch.arange(n)[:, None]  # [s, s']: s' < s
    beats = (other > this) | ((other == this) & lower)
    selected = cand & ((beats & cand[:, :, None, :]).sum(-1) < top_k)
    return dense_softmax(scale * q @ k.transpose(-1, -2), selected[:, None], v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("top_k", [1, 3, 6])
@pytest.mark.parametrize("masked", [False, True])
def test_dsa_matches_dense_rank_form(causal: bool, top_k: int, masked: bool) -> None:
    q, k, v = qkv()
    iq, ik, iw = indexer()
    key_mask = some_key_mask() if masked else None
    out = oracle_dsa_attention(q, k, v, iq, ik, iw, top_k=top_k, causal=causal, key_mask=key_mask)
    kw = dict(top_k=top_k, causal=causal, key_mask=key_mask, scale=1 / math.sqrt(D))
    assert_same(out, dense_dsa(q, k, v, iq, ik, iw, **kw))
    out = oracle_dsa_attention(q, k, v, iq, ik, iw, top_k=top_k, causal=causal, key_mask=key_mask, scale=0.7)
    assert_same(out, dense_dsa(q, k, v, iq, ik, iw, **(kw | {"scale": 0.7})))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("top_k", [N, N + 4])
def test_dsa_with_every_key_is_softmax_attention(causal: bool, top_k: int) -> None:
    q, k, v = qkv()
    key_mask = some_key_mask()
    out = oracle_dsa_attention(q, k, v, *indexer(), top_k=top_k, causal=causal, key_mask=key_mask)
    assert_same(out, attention_oracle(q, k, v, causal=causal, key_mask=key_mask))


# one indexer head, q^I = 1, w = 1: I[t, s] = ReLU(KEYS[s]); ties at 2 (keys 1, 3, 6) and at 0 (0, 2, 4, 7, 8)
KEYS = [0.0, 2.0, -1.0, 2.0, 0.0, 3.0, 2.0, -3.0, 0.0, 1.0]


def hand_indexer() -> tuple[Tensor, Tensor, Tensor]:
    n = len(KEYS)
    ik = torch.tensor(KEYS, dtype=F64).reshape(1, n, 1).expand(B, n, 1)
    return torch.ones(B, n, 1, 1, dtype=F64), ik, torch.ones(B, n, 1, dtype=F64)


def hand_mask(chosen: dict[int, set[int]] | set[int]) -> Tensor:
    """(n, n) bool from a set of keys for every query, or a per-query dict."""
    n = len(KEYS)
    rows = [chosen if isinstance(chosen, set) else chosen[t] for t in range(n)]
    return torch.tensor([[s in rows[t] for s in range(n)] for t in range(n)], dtype=torch.bool)


def test_dsa_ties_go_to_the_lower_key() -> None:
    q, k, v = qkv(len(KEYS))
    scores = 0.5 * q @ k.transpose(-1, -2)

    def run(top_k: int, causal: bool) -> Tensor:
        return oracle_dsa_attention(q, k, v, *hand_indexer(), top_k=top_k, causal=causal, scale=0.5)

    assert_same(run(3, False), dense_softmax(scores, hand_mask({5, 1, 3}), v))
    assert_same(run(6, False), dense_softmax(scores, hand_mask({5, 1, 3, 6, 9, 0}), v))
    # causal top-2: 0 and 1 first; from t = 2 key 1 (I = 2) and the lowest zero (key 0); key 3 ties key 1 and
    # beats 0; from t = 5 key 5 (I = 3) and key 1 (the lower of the twos)
    by_query = {0: {0}, 1: {0, 1}, 2: {0, 1}, 3: {1, 3}, 4: {1, 3}} | {t: {1, 5} for t in range(5, len(KEYS))}
    assert_same(run(2, True), dense_softmax(scores, hand_mask(by_query), v))


def test_dsa_unselected_value_is_ignored() -> None:
    q, k, v = qkv(len(KEYS))
    out = oracle_dsa_attention(q, k, v, *hand_indexer(), top_k=3, causal=False)  # selects {1, 3, 5}
    for s, matters in ((6, False), (0, False), (3, True), (5, True)):
        v2 = v.clone()
        v2[:, :, s] += 10.0
        out2 = oracle_dsa_attention(q, k, v2, *hand_indexer(), top_k=3, causal=False)
        assert (not torch.allclose(out2, out)) == matters, s


def test_dsa_index_w_positive_scale_changes_nothing() -> None:
    q, k, v = qkv()
    iq, ik, iw = indexer()
    out = oracle_dsa_attention(q, k, v, iq, ik, iw, top_k=3, causal=True)
    assert_same(oracle_dsa_attention(q, k, v, iq, ik, 3.7 * iw, top_k=3, causal=True), out)
    assert_same(oracle_dsa_attention(q, k, v, 2.5 * iq, ik, iw, top_k=3, causal=True), out)


def test_dsa_query_without_candidates_outputs_zeros() -> None:
    q, k, v = qkv()
    key_mask = some_key_mask()
    out = oracle_dsa_attention(q, k, v, *indexer(), top_k=2, causal=True, key_mask=key_mask)
    assert (out[1, :, 0] == 0).all() and (out[0, :, 0] != 0).all()
    none = torch.zeros(B, N, dtype=torch.bool)
    assert (oracle_dsa_attention(q, k, v, *indexer(), top_k=2, causal=False, key_mask=none) == 0).all()


def test_dsa_gradients_reach_qkv_not_the_indexer() -> None:
    q, k, v = (x.requires_grad_(True) for x in qkv())
    iq, ik, iw = (x.requires_grad_(True) for x in indexer())
    g = rand(B, H, N, DV)
    out = oracle_dsa_attention(q, k, v, iq, ik, iw, top_k=3, causal=True)
    got = torch.autograd.grad((out * g).sum(), (q, k, v, iq, ik, iw), allow_unused=True)
    assert got[3:] == (None, None, None)
    dense = dense_dsa(q, k, v, iq.detach(), ik.detach(), iw.detach(), top_k=3, causal=True, key_mask=None, scale=0.5)
    for a, b in zip(got[:3], torch.autograd.grad((dense * g).sum(), (q, k, v))):
        assert_same(a, b, what="grad")


def test_bad_arguments_are_refused() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="top_k"):
        oracle_dsa_attention(q, k, v, *indexer(), top_k=0, causal=True)
    with pytest.raises(ValueError, match="index_k"):
        oracle_dsa_attention(q, k, v, *indexer(d_i=3)[:1], rand(B, N, 2), indexer()[2], top_k=2, causal=True)
    with pytest.raises(TypeError, match="key_mask"):
        oracle_taylor_linear_attention(q, k, v, causal=True, key_mask=torch.ones(B, N))
    with pytest.raises(ValueError, match="key_mask"):
        oracle_taylor_linear_attention(q, k, v, causal=True, key_mask=torch.ones(B, N + 1, dtype=torch.bool))
