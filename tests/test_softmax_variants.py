"""softcap, learned_sinks, differential, gated: the plain functions against the independent
oracles (``oracles_modern``) on awkward sizes, forward and gradients, and each paper's limit laws.
Fast == reference, padding, causality and decoding of the default configs are the contract
tests' (``test_contracts.py``); here are the configs and sizes they do not reach (windows,
several query chunks, a position bias under the cap)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms import score_chunks
from attnzoo.mechanisms import softmax_variants as sv
from attnzoo.score_mods import chain, softcap
from conftest import grads, padding_mask, refused
from oracles_modern import (
    oracle_diff_lambda,
    oracle_differential_attention,
    oracle_gated_attention,
    oracle_lambda_init,
    oracle_sink_softmax_attention,
    oracle_softcap_attention,
)
from tolerances import assert_same

B, H, N, D, DV = 2, 3, 37, 8, 6


def _qkv(seed: int, n_q: int = N, d: int = D) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, n_q, d), (B, H, N, d), (B, H, N, DV))
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes)


def _extra(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    shape = {"sinks": (H,), "differential": (H,), "gated": (B, H, N, DV), "softcap": ()}[name]
    return (torch.randn(shape, generator=g, dtype=torch.float64) + (2.0 if name == "softcap" else 0.0)).abs()


PAIRS = {
    "softcap": (sv.softcap_attention, oracle_softcap_attention),
    "sinks": (sv.sink_softmax_attention, oracle_sink_softmax_attention),
    "differential": (sv.differential_attention, oracle_differential_attention),
    "gated": (sv.gated_attention, oracle_gated_attention),
}


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("causal", [False, True])
def test_plain_functions_equal_the_oracles_forward_and_gradients(name, causal):
    fn, oracle = PAIRS[name]
    q, k, v = _qkv(1)
    extra = _extra(name)
    extra = extra.item() if name == "softcap" else extra.requires_grad_()
    inputs = (q, k, v) if name == "softcap" else (q, k, v, extra)
    got, want = fn(q, k, v, extra, causal=causal, scale=0.3), oracle(q, k, v, extra, causal=causal, scale=0.3)
    assert_same(got, want, what=f"{name} causal={causal}")
    for i, (a, b) in enumerate(zip(grads(got, inputs), grads(want, inputs))):
        assert_same(a, b, what=f"{name} causal={causal}: gradient {i}")


@pytest.mark.parametrize("n_q", [N, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_the_off_cpu_sink_as_a_key_equals_the_oracle(n_q, causal):
    # Off the CPU the sink is one more key of zero value through SDPA; run it here and compare
    # with the oracle, and padded (batch row 0 all padding; the oracle takes no padding) with the
    # CPU kernel path; also with fewer queries than keys.
    q, k, v = _qkv(3, n_q=n_q)
    sinks = _extra("sinks").requires_grad_()
    for key_mask in (None, padding_mask(B, N)):
        got = sv.sink_key_attention(q, k, v, sinks, causal, key_mask, 0.3)
        if key_mask is None:
            want = oracle_sink_softmax_attention(q, k, v, sinks, causal=causal, scale=0.3)
        else:
            want = sv.sink_softmax_attention(q, k, v, sinks, causal=causal, scale=0.3, key_mask=key_mask)
        assert_same(got, want, what=f"causal={causal} padded={key_mask is not None}")
        for a, b in zip(grads(got, (q, k, v, sinks)), grads(want, (q, k, v, sinks))):
            assert_same(a, b, what=f"causal={causal} padded={key_mask is not None}: a gradient")


def test_the_default_scales_are_the_oracles():
    q, k, v = _qkv(2)
    for name, (fn, oracle) in PAIRS.items():
        assert_same(
            fn(q, k, v, _extra(name).item() if name == "softcap" else _extra(name)),
            oracle(q, k, v, _extra(name).item() if name == "softcap" else _extra(name)),
            what=name,
        )


def test_differential_lambda_and_its_init_are_the_papers():
    g = torch.Generator().manual_seed(3)
    vectors = torch.randn(4, D // 2, generator=g, dtype=torch.float64) * 0.1
    for layer in (1, 2, 7, 24):
        assert sv.lambda_init(layer) == pytest.approx(oracle_lambda_init(layer), abs=1e-15)
        assert_same(
            sv.diff_lambda(*vectors, sv.lambda_init(layer)), oracle_diff_lambda(*vectors, oracle_lambda_init(layer))
        )
    assert sv.lambda_init(1) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="layer_index"):
        sv.lambda_init(0)
    attn = attnzoo.build("differential", head_dim=D, layer_index=5).double()
    assert_same(
        attn.lam(),
        oracle_diff_lambda(attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2, oracle_lambda_init(5)),
    )


def test_differential_module_is_the_normed_difference_and_lambda_zero_is_one_softmax():
    q, k, v = (x.detach() for x in _qkv(4))
    attn = attnzoo.build("differential", head_dim=D, value_dim=DV, layer_index=3).double()
    lam_init = oracle_lambda_init(3)
    plain = oracle_differential_attention(q, k, v, attn.lam().detach(), causal=True)
    want = F.rms_norm(plain, (DV,), eps=1e-5) * (1 - lam_init)
    assert_same(attn(q, k, v, causal=True), want)
    half = D // 2
    one = F.scaled_dot_product_attention(q[..., :half], k[..., :half], v, is_causal=True)
    assert_same(sv.differential_attention(q, k, v, 0.0, causal=True), one)


def test_softcap_tends_to_softmax_as_the_cap_grows_and_bounds_the_scores():
    q, k, v = (x.detach() * 3 for x in _qkv(5))
    exact = F.scaled_dot_product_attention(q, k, v)
    errors = [(sv.softcap_attention(q, k, v, cap) - exact).abs().max().item() for cap in (5.0, 50.0, 5000.0)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-4, errors
    assert_same(
        attnzoo.build("softcap", cap=1e9)(q, k, v, causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    weights = attnzoo.build("softcap", cap=1.0).implied_attention(q * 100, k)
    ratio = (weights.amax(-1) / weights.amin(-1)).max()
    assert ratio <= math.exp(2.0) * (1 + 1e-9), "scores capped to (-1, 1): a row's weights within e^2"


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_over_several_query_chunks_with_a_position_bias(causal, monkeypatch):
    # The chunked path with 16-row chunks (the contract's N = 16 is one chunk): positions of a
    # score_mod stay absolute in every chunk, the bias goes in before the cap, gradients match.
    monkeypatch.setattr(sv, "SCORE_BUDGET", 1)
    q, k, v = _qkv(6)
    mask = padding_mask(B, N, empty_row=False)
    alibi = attnzoo.positional.ALiBi(H).score_mod(q, N)
    attn = attnzoo.build("softcap", cap=2.0).double()
    fast = attn(q, k, v, causal=causal, key_mask=mask, score_mod=alibi)
    ref = attn.reference(q, k, v, causal=causal, key_mask=mask, score_mod=alibi)
    dense = attnzoo.build("softmax").double()(
        q, k, v, causal=causal, key_mask=mask, score_mod=chain(alibi, softcap(2.0))
    )
    assert_same(fast, ref, what="chunked vs reference")
    assert_same(fast, dense, what="the softcap mechanism vs softmax with chain(alibi, softcap)")
    for a, b in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v))):
        assert_same(a, b, what="chunked gradients")


_generic_path_refused = refused("softcap without a score_mod took the generic chunked_attention path")


@pytest.mark.parametrize(("n_q", "causal"), [(N, False), (5, False), (45, False), (N, True), (5, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_softcap_by_hand_over_several_chunks_equals_the_reference(n_q, causal, padded, monkeypatch):
    # softcap_chunks' forward and backward in 16-row chunks over N = 37 keys (not a multiple):
    # fewer and more queries than keys (causal: end-aligned, so fewer only), batch row 0 all
    # padding (its rows see nothing: 0 and no gradient), a cap that binds (2, scores up to ~3);
    # against the dense reference with the cap as a score_mod, forward and gradients.
    monkeypatch.setattr(score_chunks, "CHUNK_SCORES", 1)
    monkeypatch.setattr(sv, "chunked_attention", _generic_path_refused)
    q, k, v = _qkv(8, n_q=n_q)
    mask = padding_mask(B, N) if padded else None
    fast = sv.softcap_attention(q, k, v, 2.0, causal=causal, key_mask=mask, scale=0.6)
    ref = reference_attention(q, k, v, causal=causal, key_mask=mask, score_mod=softcap(2.0), scale=0.6)
    assert_same(fast, ref, what=f"n_q={n_q} causal={causal} padded={padded}")
    for i, (a, b) in enumerate(zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)))):
        assert_same(a, b, what=f"n_q={n_q} causal={causal} padded={padded}: gradient {i}")


def test_softcap_by_hand_rows_before_the_first_key_and_dtypes():
    # The mechanism refuses causal N_q > N_kv; the function called directly gives the rows that
    # see no key 0 and the others what they get without those rows. bfloat16 in, bfloat16 out.
    q, k, v = (x.detach() for x in _qkv(10, n_q=45))
    got = score_chunks.softmax_chunks(q, k, v, cap=2.0, causal=True, key_mask=None, scale=0.6)
    assert torch.equal(got[:, :, :8], torch.zeros_like(got[:, :, :8]))
    rest = score_chunks.softmax_chunks(q[:, :, 8:], k, v, cap=2.0, causal=True, key_mask=None, scale=0.6)
    assert_same(got[:, :, 8:], rest)
    low = sv.softcap_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 2.0)
    assert low.dtype == torch.bfloat16


def test_softcap_by_hand_refuses_a_second_derivative_by_name():
    q, k, v = _qkv(9)
    out = sv.softcap_attention(q, k, v, 2.0)
    g = torch.ones_like(out, requires_grad=True)
    first = torch.autograd.grad(out, q, g, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="once_differentiable"):
        first.sum().backward()


def test_softcap_score_mod_checks_its_cap_and_chain_skips_none():
    for bad in (0, -1.0, True, "50"):
        with pytest.raises(ValueError, match="cap must be a number > 0"):
            softcap(bad)
    mod = softcap(3.0)
    assert chain(None, mod, None) is mod and chain() is None
    s = torch.linspace(-100, 100, 11)
    zero = torch.zeros(())
    assert_same(chain(lambda x, *_: x + 1, mod)(s, zero, zero, zero, zero), 3.0 * torch.tanh((s + 1) / 3.0))


def test_sinks_at_minus_infinity_are_softmax_and_a_sink_only_takes_weight():
    q, k, v = (x.detach() for x in _qkv(8))
    none = torch.full((H,), -math.inf, dtype=torch.float64)
    for causal in (False, True):
        exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert_same(sv.sink_softmax_attention(q, k, v, none, causal=causal), exact)
        heavy = sv.sink_softmax_attention(q, k, v, torch.full((H,), 3.0, dtype=torch.float64), causal=causal)
        assert (heavy.norm(dim=-1) < exact.norm(dim=-1) + 1e-12).all(), "a sink only shrinks rows towards 0"
    attn = attnzoo.build("learned_sinks", heads=H).double()
    with torch.no_grad():
        attn.sinks.fill_(-math.inf)
    assert_same(attn(q, k, v, causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("window", [dict(left=5), dict(left=4, right=2), dict(right=3)])
def test_learned_sinks_with_a_window_fast_reference_gradients_and_decode(window):
    q, k, v = _qkv(9)
    mask = padding_mask(B, N)
    attn = attnzoo.build("learned_sinks", heads=H, **window).double()
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([-1.0, 0.5, 2.0]))
    params = (attn.sinks,)
    for causal in (False, True):
        fast, ref = attn(q, k, v, causal=causal, key_mask=mask), attn.reference(q, k, v, causal=causal, key_mask=mask)
        assert_same(fast, ref, what=f"{window} causal={causal}")
        for a, b in zip(grads(fast, (q, k, v, *params)), grads(ref, (q, k, v, *params))):
            assert_same(a, b, what=f"{window} causal={causal}: gradients")
    state, outs = attn.init_state(B, H, D, DV, dtype=torch.float64), []
    with torch.no_grad():
        for t in range(N):
            out, state = attn.step(state, *(x[:, :, t : t + 1] for x in (q, k, v)), key_mask=mask[:, t : t + 1])
            outs.append(out)
        assert_same(torch.cat(outs, 2), attn(q, k, v, causal=True, key_mask=mask), what=f"{window}: decode")


def test_gated_module_gates_softmax_with_a_map_of_q_and_a_saturated_gate_is_softmax():
    q, k, v = (x.detach() for x in _qkv(10))
    attn = attnzoo.build("gated", heads=H, head_dim=D, value_dim=DV).double()
    logits = torch.einsum("bhnd,hde->bhne", q, attn.gate_weight) + attn.gate_bias[:, None]
    assert_same(attn(q, k, v, causal=True), oracle_gated_attention(q, k, v, logits, causal=True))
    assert_same(sv.gated_output(v, torch.full_like(v, 1e3)), v)


@pytest.mark.parametrize("name", ["learned_sinks", "differential", "gated"])
def test_a_module_built_for_one_geometry_refuses_another(name):
    attn = attnzoo.build(name, shape=attnzoo.Shape(heads=H, head_dim=D, value_dim=DV))
    q, k, v = (x.float().detach() for x in _qkv(11))
    attn(q, k, v)
    if name != "differential":  # its lambda is one per layer: any number of heads
        with pytest.raises(ValueError, match="was built for"):
            attn(q[:, :2], k[:, :2], v[:, :2])
    if name != "learned_sinks":
        with pytest.raises(ValueError, match="was built for"):
            attn(q, k, v[..., :2])
