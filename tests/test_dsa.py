"""dsa (DeepSeek Sparse Attention) beyond the contracts (tests/test_contracts.py): the plain
function and its dense reference against the independent oracle of tests/oracles_modern.py
(forward and gradients, float64, padding with a fully padded row, top_k below and above the
candidate count, query chunks that do not divide N), ties to the lower key index, decode steps
at every position, the indexer's training loss, refusals, and no N x N tensor in forward or
backward."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.mechanisms.dsa import dsa_attention, index_scores, reference_dsa
from attnzoo.mechanisms.topk import topk_mask
from conftest import grads, largest_tensor
from oracles_modern import oracle_dsa_attention
from tolerances import assert_same

B, H, N, D, H_I, D_I = 2, 3, 37, 8, 2, 5


def _inputs(seed: int = 0, n: int = N) -> tuple[torch.Tensor, ...]:
    """q, k, v (with gradients) and the indexer's index_q, index_k, index_w, float64."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    index_q = torch.randn(B, n, H_I, D_I, generator=g, dtype=torch.float64)
    index_k = torch.randn(B, n, D_I, generator=g, dtype=torch.float64)
    index_w = torch.randn(B, n, H_I, generator=g, dtype=torch.float64)
    return q, k, v, index_q, index_k, index_w


def _mask(n: int = N) -> torch.Tensor:
    """Batch row 0 all padding (no query has a candidate), row 1 real up to 23 then padded."""
    return torch.arange(n)[None, :] < torch.tensor([[0], [23]])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("top_k", [1, 6, 50])  # 50 > N: every candidate is kept
def test_fast_path_and_reference_equal_the_oracle_forward_and_gradients(causal, padded, top_k):
    q, k, v, *index = _inputs()
    kw = dict(top_k=top_k, causal=causal, key_mask=_mask() if padded else None)
    want = oracle_dsa_attention(q, k, v, *index, **kw)
    want_grads = grads(want, (q, k, v))
    for what, got in (
        ("fast", dsa_attention(q, k, v, *index, **kw)),
        ("fast, chunks of 5", dsa_attention(q, k, v, *index, **kw, chunk=5)),
        ("reference", reference_dsa(q, k, v, *index, **kw)[0]),
    ):
        assert_same(got, want, what=f"{what} causal={causal} padded={padded} top_k={top_k}: output")
        for i, (g_got, g_want) in enumerate(zip(grads(got, (q, k, v)), want_grads)):
            assert_same(g_got, g_want, what=f"{what} causal={causal} padded={padded} top_k={top_k}: gradient {i}")
    if padded:
        assert not dsa_attention(q, k, v, *index, **kw)[0].any(), "a fully padded row has no candidate: zeros"


def test_a_scale_multiplies_the_attention_scores_only():
    q, k, v, *index = _inputs(1)
    kw = dict(top_k=4, causal=True)
    got = dsa_attention(q, k, v, *index, **kw, scale=0.7)
    assert_same(got, oracle_dsa_attention(q, k, v, *index, **kw, scale=0.7))
    assert_same(got, dsa_attention(q * (0.7 * D**0.5), k, v, *index, **kw))


def _tied_index() -> tuple[torch.Tensor, ...]:
    """Small integers (exact products and sums, any order) and repeated indexer keys, with
    negative indexer weights: equal index scores everywhere, many of them ReLU's exact 0."""
    g = torch.Generator().manual_seed(3)
    index_q = torch.randint(-1, 2, (B, N, H_I, D_I), generator=g).double()
    index_k = torch.randint(-1, 2, (B, 4, D_I), generator=g).double().repeat(1, 10, 1)[:, :N]
    index_w = torch.randint(-2, 3, (B, N, H_I), generator=g).double()
    return index_q, index_k, index_w


@pytest.mark.parametrize("causal", [False, True])
def test_ties_go_to_the_lower_key_index(causal):
    q, k, v, *_ = _inputs(2)
    index = _tied_index()
    scores = index_scores(*index)
    assert (scores == 0).float().mean() > 0.2 and scores.unique().numel() < 30, "the inputs must tie"
    for top_k in (3, 7):
        want = oracle_dsa_attention(q, k, v, *index, top_k=top_k, causal=causal)
        for chunk in (4, 256):
            got = dsa_attention(q, k, v, *index, top_k=top_k, causal=causal, chunk=chunk)
            assert_same(got, want, what=f"tied scores, top_k={top_k} causal={causal} chunk={chunk}")
    # All scores equal (no indexer weight): every query keeps its top_k lowest candidate indices.
    flat = (index[0], index[1], torch.zeros_like(index[2]))
    out, weights = reference_dsa(q, k, v, *flat, top_k=5, causal=causal)
    kept = torch.arange(N)[None, :] < 5
    if causal:
        kept = kept & (torch.arange(N)[None, :] <= torch.arange(N)[:, None])
    assert torch.equal(weights > 0, kept.expand_as(weights))
    assert_same(dsa_attention(q, k, v, *flat, top_k=5, causal=causal), out)


def test_the_dense_reference_keeps_exactly_the_top_k_by_index_score():
    q, k, v, *index = _inputs(4)
    weights = reference_dsa(q, k, v, *index, top_k=6, causal=False)[1]
    kept = weights[:, 0] > 0
    scores = index_scores(*index)
    assert torch.equal(kept.sum(-1), torch.full((B, N), 6))
    assert (scores.masked_fill(~kept, float("inf")).amin(-1) >= scores.masked_fill(kept, -float("inf")).amax(-1)).all()
    assert torch.equal(weights > 0, kept[:, None].expand_as(weights)), "one selection, shared by every head"


def _mechanism(topk: int = 6, chunk: int = 256) -> torch.nn.Module:
    torch.manual_seed(5)
    return attnzoo.build("dsa", topk=topk, head_dim=D, index_heads=H_I, index_dim=D_I, chunk=chunk).double().eval()


@pytest.mark.parametrize("padded", [False, True])
def test_the_mechanism_is_dsa_attention_of_its_indexer_and_decodes_at_every_position(padded):
    q, k, v, *_ = _inputs(6)
    mask = torch.arange(N)[None, :] >= torch.tensor([[7], [0]]) if padded else None  # row 0 left-padded
    attn = _mechanism(chunk=8)
    want = attn(q, k, v, causal=True, key_mask=mask)
    with torch.no_grad():
        index = attn.indexer(*(attn.zero_padded(mask, q, k) if padded else (q, k)))
    assert_same(want, oracle_dsa_attention(q, k, v, *index, top_k=6, causal=True, key_mask=mask))
    for steps in ([(0, N)], [(0, 9), *((t, t + 1) for t in range(9, N))], [(t, t + 1) for t in range(N)]):
        state, outs = attn.init_state(B, H, D, D, dtype=q.dtype), []
        for lo, hi in steps:
            step_mask = None if mask is None else mask[:, lo:hi]
            out, state = attn.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=step_mask)
            outs.append(out)
        assert_same(torch.cat(outs, 2), want, what=f"decode in pieces {steps[:2]}..., padded={padded}")
    assert state.index_keys.k.shape == (B, 1, N, D_I), "the indexer keys are cached, one d_I vector a token"


def test_the_indexer_gets_no_gradient_from_the_output():
    attn = _mechanism()
    q, k, v, *_ = _inputs(7)
    for call in (attn, attn.reference):
        out = call(q, k, v, causal=True)
        found = torch.autograd.grad(out.sum(), (q, *attn.parameters()), allow_unused=True)
        assert found[0] is not None and all(g is None for g in found[1:])


def _dense_indexer_loss(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The KL of section 2.1.2 written densely: p = the reference's weights averaged over heads,
    softmax of the index scores over the same kept keys, mean over the queries."""
    with torch.no_grad():
        p = attn.reference(q, k, k, causal=True, return_weights=True)[1].mean(1)  # (B, N, N)
    scores = index_scores(*attn.indexer(q, k))
    keep = topk_mask(scores.detach(), torch.ones(N, N, dtype=torch.bool).tril(), attn.config.topk)
    log_q = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), -1).masked_fill(~keep, 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum() / (B * N)


def test_the_indexer_loss_is_the_papers_kl_and_trains_the_indexer():
    attn = _mechanism(topk=6, chunk=8).train()
    q, k, _, *_ = _inputs(8)
    loss = attn.indexer_loss(q, k, causal=True)
    assert_same(loss, _dense_indexer_loss(attn, q, k))
    found = torch.autograd.grad(loss, (q, k, *attn.parameters()), allow_unused=True)
    assert found[0] is None and found[1] is None, "q and k are detached: the loss trains only the indexer"
    assert all(g is not None and g.abs().sum() > 0 for g in found[2:])

    def captured() -> float:  # share of the dense causal attention (heads averaged) on the kept keys
        with torch.no_grad():
            dense = attnzoo.build("softmax").reference(q, k, k, causal=True, return_weights=True)[1].mean(1)
            kept = attn.reference(q, k, k, causal=True, return_weights=True)[1][:, 0] > 0
            return float((dense * kept).sum(-1).mean())

    before, first = captured(), float(loss.detach())
    opt = torch.optim.Adam(attn.parameters(), lr=3e-2)
    for _ in range(30):
        opt.zero_grad()
        attn.indexer_loss(q, k, causal=True).backward()
        opt.step()
    assert float(attn.indexer_loss(q, k, causal=True).detach()) < 0.85 * first  # 0.107 -> 0.083
    assert captured() > before + 0.02, "(0.44 -> 0.49) a trained indexer keeps keys the attention weighs more"


def test_a_training_forward_leaves_the_indexer_loss_for_auxiliary_loss():
    attn = _mechanism(topk=6, chunk=8).train()
    q, k, v, *_ = _inputs(9)
    out = attn(q, k, v, causal=True)
    extra = attnzoo.nn.auxiliary_loss(attn)
    assert_same(extra, attn.indexer_loss(q, k, causal=True), what="the KL the forward left")
    assert attnzoo.nn.auxiliary_loss(attn) is None, "taken once, then cleared"
    found = torch.autograd.grad(extra, (q, k, v, *attn.parameters()), allow_unused=True)
    assert found[:3] == (None, None, None) and all(g is not None for g in found[3:]), "only the indexer learns"
    assert_same(out, attn.eval()(q, k, v, causal=True), what="the output does not depend on it")
    for quiet in (attn.eval(), attnzoo.build("dsa", head_dim=D, indexer_weight=0.0).double().train()):
        quiet(q, k, v, causal=True)
        assert attnzoo.nn.auxiliary_loss(quiet) is None, "eval mode or indexer_weight=0: no loss"
    with torch.no_grad():
        attn.train()(q, k, v, causal=True)
    assert attnzoo.nn.auxiliary_loss(attn) is None, "no gradients: no loss"


def test_a_model_sums_its_layers_auxiliary_losses():
    torch.manual_seed(0)
    model = attnzoo.nn.CausalLM(32, 16, 2, 2, "dsa", topk=4).train()
    tokens = torch.randint(0, 32, (2, 20))
    model(tokens)
    layers = [m for m in model.modules() if isinstance(m, type(_mechanism()))]
    each = [m._auxiliary_loss.detach() for m in layers]
    assert len(each) == 2 and all(float(x) > 0 for x in each)
    assert_same(attnzoo.nn.auxiliary_loss(model).detach(), each[0] + each[1], what="one loss per layer, summed")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_query_makes_its_position_nan_in_every_head(value):
    """The heads share one selection made from the head-mean of q, so a poisoned query in one
    head reaches every head at its position (loud), and no other position."""
    attn = _mechanism()
    q, k, v, *_ = (x.detach() for x in _inputs(10))
    clean = attn(q, k, v, causal=True)
    q[0, 1, 5, 2] = value
    out = attn(q, k, v, causal=True)
    assert out[0, :, 5].isnan().all()
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[0, :, 5] = False
    assert_same(out[others], clean[others], what="the other positions")


def test_bad_configs_and_inputs_are_refused_naming_the_field():
    for field, value in (("topk", 0), ("index_heads", 0), ("index_dim", 0), ("chunk", 0), ("scale", -1.0)):
        with pytest.raises(ValueError, match=f"DSAConfig: {field} must be"):
            attnzoo.build("dsa", **{field: value})
    q, k, v, index_q, index_k, index_w = _inputs()
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        dsa_attention(q, k, v, index_q, index_k, index_w, top_k=0, causal=False)
    with pytest.raises(ValueError, match="index_k must start with shape"):
        dsa_attention(q, k, v, index_q, index_k[:, :-1], index_w, top_k=2, causal=False)
    with pytest.raises(ValueError, match="index_w must start with shape"):
        dsa_attention(q, k, v, index_q, index_k, index_w[..., :1], top_k=2, causal=False)
    with pytest.raises(ValueError, match="k and v must have q's 3 heads"):
        dsa_attention(q, k[:, :1], v[:, :1], index_q, index_k, index_w, top_k=2, causal=False)
    with pytest.raises(TypeError, match="causal must be a bool"):
        dsa_attention(q, k, v, index_q, index_k, index_w, top_k=2, causal=None)
    with pytest.raises(ValueError, match="build it with head_dim=8"):
        attnzoo.build("dsa", head_dim=4)(q, k, v)
    with pytest.raises(ValueError, match="scale"):
        _mechanism()(q, k, v, scale=0.5)


def test_no_n_by_n_tensor_forward_or_backward():
    n, heads = 1024, 2
    attn = attnzoo.build("dsa", topk=32, head_dim=D, chunk=64)
    q, k, v = (torch.randn(1, heads, n, D, requires_grad=True) for _ in range(3))

    def run() -> None:
        attn(q, k, v, causal=True).sum().backward()
        attn.indexer_loss(q, k, causal=True).backward()

    # At most a chunk of 64 rows against every key, per head or per indexer head (H_I = 4):
    # a quarter of the (H, N, N) scores here, and a smaller share the longer the sequence.
    assert largest_tensor(run) <= 64 * max(heads, 4) * n
