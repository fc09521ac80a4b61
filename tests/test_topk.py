"""topk (explicit sparse attention) and sac (sparse adaptive connections): fast == reference,
limit laws, causality, padding, the learned predictor, and config checks."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.mechanisms.topk import reference_sac, reference_topk, sac_candidates, topk_mask
from conftest import LargestTensor as Largest
from conftest import grads, make_qkv, padding_mask
from tolerances import assert_path_close_to_golden, assert_same

B, H, N, D = 2, 3, 37, 8
SAC = dict(topk=4, candidates=7, n_random=3, seed=1, head_dim=D)


def _mask(causal_ok_n_kv: int, padded: bool) -> torch.Tensor | None:
    if not padded:
        return None
    mask = padding_mask(B, causal_ok_n_kv)  # batch 0 is all padding: its rows see no key
    mask[1, -3:] = False
    return mask


def _ref_topk(module, causal, mask):
    return lambda q, k, v: reference_topk(q, k, v, topk=module.config.topk, causal=causal, key_padding_mask=mask)


def _ref_sac(module, causal, mask):
    cfg = module.config

    def reference(q, k, v):
        q, k, v = module.zero_padded(mask, q, k, v)  # sac is self-attention only: padded q is zeroed too
        return reference_sac(
            q,
            k,
            v,
            module.predictor,
            topk=cfg.topk,
            candidates=cfg.candidates,
            n_random=cfg.n_random,
            seed=cfg.seed,
            causal=causal,
            key_padding_mask=mask,
        )

    return reference


@pytest.mark.parametrize("n_q", [N, 23])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_topk_fast_equals_reference_float64(n_q, causal, padded):
    mask = _mask(N, padded)
    module = attnzoo.build("topk", topk=5, chunk=10)  # 10 does not divide 37 or 23
    q, k, v = make_qkv(B, H, n_q, N, D, d_v=5)
    fast = module(q, k, v, causal=causal, key_padding_mask=mask)
    ref = _ref_topk(module, causal, mask)(q, k, v)
    assert_same(fast, ref)
    fast_grads = grads(fast, (q, k, v))
    for a, r, name in zip(fast_grads, grads(ref, (q, k, v)), "qkv"):
        assert_same(a, r, what=f"grad {name}")
    if padded:
        assert torch.equal(fast[0], torch.zeros_like(fast[0]))
        assert all(torch.equal(g[0], torch.zeros_like(g[0])) for g in fast_grads)


@pytest.mark.parametrize("name", ["topk", "sac"])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_is_as_accurate_as_the_reference(name, causal):
    mask = _mask(N, True)
    module = attnzoo.build(name, topk=5, chunk=16) if name == "topk" else attnzoo.build("sac", **SAC)
    reference = (_ref_topk if name == "topk" else _ref_sac)(module, causal, mask)
    fast = lambda q, k, v: module(q, k, v, causal=causal, key_padding_mask=mask)  # noqa: E731
    assert_path_close_to_golden(fast, reference, make_qkv(B, H, N, N, D, dtype=torch.float32), what=name)


@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_topk_does_not_depend_on_the_chunk(chunk):
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    expected = attnzoo.build("topk", topk=6, chunk=N)(q, k, v, causal=True)
    assert_same(attnzoo.build("topk", topk=6, chunk=chunk)(q, k, v, causal=True), expected)


@pytest.mark.parametrize("n_q", [N, 23])
@pytest.mark.parametrize("causal", [False, True])
def test_topk_with_k_at_least_n_is_full_attention(n_q, causal):
    mask = _mask(N, True)
    q, k, v = make_qkv(B, H, n_q, N, D)
    full = attnzoo.build("softmax")(q, k, v, causal=causal, key_padding_mask=mask)
    full_grads = grads(full, (q, k, v))
    for topk in (N, N + 10):
        out = attnzoo.build("topk", topk=topk, chunk=9)(q, k, v, causal=causal, key_padding_mask=mask)
        assert_same(out, full)
        for a, r, name in zip(grads(out, (q, k, v)), full_grads, "qkv"):
            assert_same(a, r, what=f"grad {name}")


def test_topk_rows_with_fewer_than_k_visible_keys_keep_them_all():
    q, k, v = make_qkv(1, 2, N, N, D, requires_grad=False)
    out = attnzoo.build("topk", topk=6)(q, k, v, causal=True)
    full = attnzoo.build("softmax")(q, k, v, causal=True)
    assert_same(out[:, :, :6], full[:, :, :6])
    assert not torch.allclose(out[:, :, 6:], full[:, :, 6:])
    weights = attnzoo.build("topk", topk=6).implied_attention(q, k, causal=True)
    assert torch.equal((weights > 0).sum(-1), torch.arange(N).clamp(max=5).add(1).expand(1, 2, N))


def test_topk_ties_go_to_the_lower_key_index():
    # Every key is the same vector: all scores of a row tie, so the first k visible keys win.
    q, _, v = make_qkv(1, 1, 9, 9, 4, requires_grad=False)
    k = torch.ones(1, 1, 9, 4, dtype=torch.float64)
    mask = torch.tensor([[False, True] + [True] * 7])
    out = attnzoo.build("topk", topk=3, chunk=4)(q, k, v, key_padding_mask=mask)
    assert_same(out, v[:, :, 1:4].mean(2, keepdim=True).expand_as(out))
    keep = topk_mask(torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]]), None, 2)
    assert keep.tolist() == [[False, True, True, False, False]]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_sac_fast_equals_reference_float64(causal, padded):
    mask = _mask(N, padded)
    module = attnzoo.build("sac", **SAC).double()
    with torch.no_grad():  # a predictor that differs from the plain attention scores
        module.predictor.add_(0.5 * torch.randn(D, D, dtype=torch.float64))
    q, k, v = make_qkv(B, H, N, N, D, d_v=5)
    inputs = (q, k, v, module.predictor)
    fast = module(q, k, v, causal=causal, key_padding_mask=mask)
    ref = _ref_sac(module, causal, mask)(q, k, v)
    assert_same(fast, ref)
    for a, r, name in zip(grads(fast, inputs), grads(ref, inputs), ("q", "k", "v", "predictor")):
        assert_same(a, r, what=f"grad {name}")
    if padded:
        assert torch.equal(fast[0], torch.zeros_like(fast[0]))


def test_sac_candidates_are_bounded_distinct_and_causal():
    cand, valid = sac_candidates(N, candidates=7, n_random=3, seed=1, causal=True, device=torch.device("cpu"))
    assert cand.shape == (N, 10)
    rows = torch.arange(N)[:, None]
    assert bool(((cand <= rows) | ~valid).all())
    assert bool((valid & (cand >= rows - 6)).sum(1).eq(torch.arange(N).clamp(max=6) + 1).all())  # the window
    for row, ok in zip(cand, valid):
        assert len(set(row[ok].tolist())) == int(ok.sum())
    cand, valid = sac_candidates(N, candidates=7, n_random=0, seed=1, causal=False, device=torch.device("cpu"))
    assert bool(valid.all()) and bool(((cand - rows).abs() <= 6).all())


@pytest.mark.parametrize("causal", [False, True])
def test_sac_with_every_candidate_kept_is_full_attention(causal):
    mask = _mask(N, True)
    module = attnzoo.build("sac", topk=N, candidates=N, n_random=2, head_dim=D).double()
    q, k, v = make_qkv(B, H, N, N, D)
    out = module(q, k, v, causal=causal, key_padding_mask=mask)
    # sac zeroes padded queries (self-attention only); softmax, a cross-attention mechanism, does not.
    full = attnzoo.build("softmax")(*module.zero_padded(mask, q, k, v), causal=causal, key_padding_mask=mask)
    assert_same(out, full)
    for a, r, name in zip(grads(out, (q, k, v)), grads(full, (q, k, v)), "qkv"):
        assert_same(a, r, what=f"grad {name}")


@pytest.mark.parametrize("name", ["topk", "sac"])
def test_causal_outputs_do_not_see_the_future(name):
    module = attnzoo.build(name, topk=4) if name == "topk" else attnzoo.build("sac", **SAC)
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    out = module(q, k, v, causal=True)
    t = 20
    changed = tuple(x.clone() for x in (q, k, v))
    for x in changed:
        x[:, :, t + 1 :] = torch.randn_like(x[:, :, t + 1 :]) * 5
    again = module(*changed, causal=True)
    assert torch.equal(out[:, :, : t + 1], again[:, :, : t + 1])
    assert not torch.allclose(out[:, :, t + 1 :], again[:, :, t + 1 :])


@pytest.mark.parametrize("name", ["topk", "sac"])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_change_nothing(name, causal):
    module = attnzoo.build(name, topk=4) if name == "topk" else attnzoo.build("sac", **SAC)
    mask = _mask(N, True)
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    out = module(q, k, v, causal=causal, key_padding_mask=mask)
    k2, v2 = k.clone(), v.clone()
    pad = ~mask[:, None, :, None]
    k2 = torch.where(pad, 100 * torch.randn_like(k), k)  # huge padded keys would win any top-k
    v2 = torch.where(pad, torch.randn_like(v), v)
    assert torch.equal(module(q, k2, v2, causal=causal, key_padding_mask=mask), out)


def test_sac_predictor_gets_gradient_and_a_tiny_training_loop_learns():
    torch.manual_seed(0)
    module = attnzoo.build("sac", topk=3, candidates=6, n_random=2, head_dim=D)
    q, k, v = (torch.nn.Parameter(x) for x in make_qkv(1, 2, 24, 24, D, dtype=torch.float32, requires_grad=False))
    target = torch.randn(1, 2, 24, D)
    loss = (module(q, k, v, causal=True) - target).pow(2).mean()
    loss.backward()
    assert module.predictor.grad is not None and module.predictor.grad.abs().sum() > 0
    opt = torch.optim.Adam([q, k, v, *module.parameters()], lr=0.05)
    start = module.predictor.detach().clone()
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (module(q, k, v, causal=True) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert not torch.equal(module.predictor.detach(), start)


@pytest.mark.parametrize("name", ["topk", "sac"])
def test_implied_attention_is_the_applied_weights(name):
    module = attnzoo.build(name, topk=5) if name == "topk" else attnzoo.build("sac", **SAC)
    mask = _mask(N, True)
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    weights = module.implied_attention(q.float(), k.float(), causal=True, key_padding_mask=mask)
    assert weights.shape == (B, H, N, N)
    assert_same(weights.sum(-1)[1:], torch.ones(B - 1, H, N))
    assert bool((weights > 0).sum(-1)[1:].le(5).all()) and bool(weights.triu(1).eq(0).all())
    out = module(q.float(), k.float(), v.float(), causal=True, key_padding_mask=mask)
    assert_same(out, weights @ v.float())


def test_topk_never_allocates_n_by_n():
    # On the meta device nothing is computed; every intermediate shape is recorded.
    n, heads = 16384, 8
    q, k, v = torch.empty(3, 1, heads, n, 64, device="meta").unbind(0)
    mask = torch.ones(1, n, dtype=torch.bool, device="meta")
    with torch.no_grad(), Largest() as largest:
        attnzoo.build("topk")(q, k, v, causal=True, key_padding_mask=mask)
    assert largest.numel == heads * 256 * n  # one chunk of scores: H x chunk x N, never N x N


def test_bad_configs_and_requests_are_refused():
    for name, key, value in [
        ("topk", "topk", 0),
        ("topk", "chunk", 0),
        ("topk", "scale", -1.0),
        ("sac", "topk", 0),
        ("sac", "candidates", 0),
        ("sac", "n_random", -1),
        ("sac", "seed", -1),
        ("sac", "head_dim", 0),
        ("sac", "scale", 0.0),
    ]:
        with pytest.raises(ValueError, match=key):
            attnzoo.build(name, **{key: value})
    q = torch.randn(1, 2, 10, D)
    with pytest.raises(ValueError, match="head_dim=8"):
        attnzoo.build("sac")(q, q, q)
    with pytest.raises(ValueError, match="self-attention only"):
        attnzoo.build("sac", head_dim=D)(q, q[:, :, :5], q[:, :, :5])
    with pytest.raises(ValueError, match="score_mod"):
        attnzoo.build("topk")(q, q, q, score_mod=lambda s, b, h, i, j: s)
    spec = attnzoo.describe("topk")
    assert spec.capabilities.cross_attention and spec.complexity.subquadratic_memory
    assert "1912.11637" in spec.paper and "2003.09833" in attnzoo.describe("sac").paper
