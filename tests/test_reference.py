"""The dense reference backend against the independent double-loop oracle (tests/oracles.py)."""

from __future__ import annotations

import pytest
import torch

from attnzoo.backends.reference import reference_attention
from conftest import grads, make_qkv, padding_mask
from oracles import attention_oracle, attention_weights_oracle
from tolerances import assert_close_to_golden, assert_same

# (B, H, N_q, N_kv): N = 1, 7, 63, cross-attention both ways, B and H > 1.
SHAPES = [(1, 1, 1, 1), (2, 3, 7, 7), (2, 2, 63, 63), (2, 3, 5, 9), (3, 2, 9, 4)]


# causal needs N_q <= N_kv (the other case is an error, tested in test_softmax.py).
CASES = [(shape, causal) for shape in SHAPES for causal in (False, True) if not (causal and shape[2] > shape[3])]


@pytest.mark.parametrize(("shape", "causal"), CASES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("normalizer", ["softmax", "relu"])
def test_reference_equals_oracle(shape, causal, padded, normalizer):
    b, h, n_q, n_kv = shape
    q, k, v = make_qkv(b, h, n_q, n_kv, d=8, d_v=5)
    mask = padding_mask(b, n_kv) if padded else None
    kwargs = dict(causal=causal, key_mask=mask, normalizer=normalizer)
    out = reference_attention(q, k, v, **kwargs)
    expected = attention_oracle(q, k, v, **kwargs)
    assert_same(out, expected, what="forward")
    for got, want, name in zip(grads(out, (q, k, v)), grads(expected, (q, k, v)), "qkv"):
        assert_same(got, want, what=f"d{name}")


def test_reference_equals_oracle_n257_causal_padded():
    q, k, v = make_qkv(1, 1, 257, 257, d=4)
    mask = torch.ones(1, 257, dtype=torch.bool)
    mask[0, 200:] = False
    out = reference_attention(q, k, v, causal=True, key_mask=mask)
    expected = attention_oracle(q, k, v, causal=True, key_mask=mask)
    assert_same(out, expected, what="forward N=257")
    for got, want, name in zip(grads(out, (q, k, v)), grads(expected, (q, k, v)), "qkv"):
        assert_same(got, want, what=f"d{name} N=257")


def test_score_mod_is_an_additive_bias_like_the_oracle():
    q, k, v = make_qkv(2, 3, 6, 6)
    bias = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    out = reference_attention(q, k, v, causal=True, score_mod=lambda s, b, h, i, j: s + bias[b, h, i, j])
    assert_same(out, attention_oracle(q, k, v, causal=True, score_bias=bias))


def test_custom_scale_and_mask_mod_and_weights():
    q, k, v = make_qkv(2, 2, 7, 7)
    band = lambda b, h, i, j: (i - j).abs() <= 2  # noqa: E731
    out, weights = reference_attention(q, k, v, mask_mod=band, scale=0.3, return_weights=True)
    idx = torch.arange(7)
    bias = torch.where((idx[:, None] - idx[None, :]).abs() <= 2, 0.0, float("-inf")).to(torch.float64)
    assert_same(out, attention_oracle(q, k, v, scale=0.3, score_bias=bias))
    assert_same(weights, attention_weights_oracle(q, k, scale=0.3, score_bias=bias), what="weights")


def test_fully_masked_rows_are_zero_with_zero_gradient():
    q, k, v = make_qkv(2, 2, 5, 5)
    mask = padding_mask(2, 5)  # batch 0: every key is padding
    assert not mask[0].any()
    for normalizer in ("softmax", "relu"):
        out = reference_attention(q, k, v, key_mask=mask, normalizer=normalizer)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        dq, dk, dv = grads(out, (q, k, v))
        assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
        assert torch.equal(dq[0], torch.zeros_like(dq[0])) and torch.equal(dv[0], torch.zeros_like(dv[0]))
        assert dq[1].abs().sum() > 0


def test_gradcheck_float64():
    q, k, v = make_qkv(2, 2, 4, 5, d=3)
    mask = torch.tensor([[True, True, False, True, True], [True, True, True, True, True]])
    for normalizer in ("softmax", "relu"):
        fn = lambda q, k, v, normalizer=normalizer: reference_attention(  # noqa: E731
            q, k, v, causal=True, key_mask=mask, normalizer=normalizer
        )
        assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_is_float32_accumulated(dtype, causal):
    # Against a float64 golden run on the same (rounded) inputs, the reference in dtype X may
    # err by at most a small factor over the unavoidable error: rounding the golden output to X.
    q, k, v = (t.detach().to(dtype) for t in make_qkv(2, 3, 63, 63, d=16))
    mask = padding_mask(2, 63)
    out = reference_attention(q, k, v, causal=causal, key_mask=mask)
    golden = attention_oracle(q, k, v, causal=causal, key_mask=mask).detach()
    assert out.dtype == dtype
    assert_close_to_golden(out, golden.to(dtype), golden, what=f"reference in {dtype}")
