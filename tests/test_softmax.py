"""The ``softmax`` mechanism: the SDPA fast path equals the dense reference; bad input errors."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.backends.reference import reference_attention
from conftest import decode_all, grads, make_qkv, padding_mask
from oracles import attention_oracle
from tolerances import assert_close_to_golden, assert_same

SHAPES = [(1, 1, 1, 1), (2, 3, 7, 7), (2, 2, 63, 63), (2, 3, 5, 9), (1, 2, 257, 257)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_fast_path_equals_reference_fp32(shape, causal, padded):
    b, h, n_q, n_kv = shape
    attn = attnzoo.build("softmax")
    assert attn.uses_fast_path()
    q, k, v = make_qkv(b, h, n_q, n_kv, d=16, d_v=8, dtype=torch.float32)
    mask = padding_mask(b, n_kv) if padded else None
    fast = attn(q, k, v, causal=causal, key_mask=mask)
    ref = reference_attention(q, k, v, causal=causal, key_mask=mask)
    assert_same(fast, ref, what="forward")
    for got, want, name in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_same(got, want, what=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
def test_fast_path_bf16_within_policy(causal):
    q, k, v = (t.detach().bfloat16() for t in make_qkv(2, 3, 100, 100, d=32))
    mask = padding_mask(2, 100)
    fast = attnzoo.build("softmax")(q, k, v, causal=causal, key_mask=mask)
    ref = reference_attention(q, k, v, causal=causal, key_mask=mask)
    golden = reference_attention(*(t.double() for t in (q, k, v)), causal=causal, key_mask=mask)
    assert fast.dtype == torch.bfloat16
    assert_close_to_golden(fast, ref, golden, what="SDPA bf16")


def test_fast_path_fully_masked_rows_zero_without_nan():
    q, k, v = make_qkv(2, 2, 6, 6, dtype=torch.float32)
    mask = padding_mask(2, 6)
    out = attnzoo.build("softmax")(q, k, v, key_mask=mask, causal=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    dq, dk, dv = grads(out, (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[0], torch.zeros_like(dq[0]))


def test_relu_normalizer_and_score_mod_use_reference_and_match_oracle():
    q, k, v = make_qkv(2, 2, 7, 7)
    relu = attnzoo.build("softmax", normalizer="relu")
    assert not relu.uses_fast_path()
    assert_same(relu(q, k, v, causal=True), attention_oracle(q, k, v, causal=True, normalizer="relu"))
    bias = torch.randn(7, 7, dtype=torch.float64)
    plain = attnzoo.build("softmax", scale=0.5)
    out = plain(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[i, j])
    assert_same(out, attention_oracle(q, k, v, scale=0.5, score_bias=bias))


def test_implied_attention_rows_sum_to_one():
    q, k, _ = make_qkv(2, 2, 9, 9)
    w = attnzoo.build("softmax").implied_attention(q, k, causal=True)
    assert w.shape == (2, 2, 9, 9)
    assert torch.allclose(w.sum(-1), torch.ones(2, 2, 9, dtype=w.dtype))
    assert torch.equal(w.triu(1), torch.zeros_like(w))


def test_decode_step_equals_causal_forward():
    attn = attnzoo.build("softmax")
    q, k, v = make_qkv(2, 3, 10, 10, requires_grad=False)
    full = attn(q, k, v, causal=True)
    state = attn.init_state(2, 3, 8, 8, dtype=q.dtype)
    assert_same(decode_all(attn, state, q, k, v, prefill=4), full)  # a 4-token prefill, then one at a time


BAD_INPUTS = [
    ("rank", lambda q, k, v, m: ((q[0], k, v), {}), ValueError, "4 dimensions"),
    ("not a tensor", lambda q, k, v, m: ((q.tolist(), k, v), {}), TypeError, "torch.Tensor"),
    ("int dtype", lambda q, k, v, m: ((q.long(), k.long(), v.long()), {}), TypeError, "floating"),
    ("mixed dtype", lambda q, k, v, m: ((q.float(), k, v), {}), TypeError, "one dtype"),
    ("batch", lambda q, k, v, m: ((q, k[:1], v[:1]), {}), ValueError, "batch size"),
    (
        "heads",
        lambda q, k, v, m: ((q, k.repeat(1, 2, 1, 1)[:, :3], v.repeat(1, 2, 1, 1)[:, :3]), {}),
        ValueError,
        "H_kv",
    ),
    ("head dim", lambda q, k, v, m: ((q, k[..., :3], v), {}), ValueError, "head dimension"),
    ("k/v length", lambda q, k, v, m: ((q, k, v[:, :, :2]), {}), ValueError, "same length"),
    ("mask shape", lambda q, k, v, m: ((q, k, v), {"key_mask": m[:, :3]}), ValueError, "(B, N_kv)"),
    ("mask dtype", lambda q, k, v, m: ((q, k, v), {"key_mask": m.float()}), TypeError, "torch.bool"),
    ("mask 4-D", lambda q, k, v, m: ((q, k, v), {"key_mask": m[:, None, None]}), ValueError, "(B, N_kv)"),
    ("causal Nq>Nkv", lambda q, k, v, m: ((q, k[:, :, :3], v[:, :, :3]), {"causal": True}), ValueError, "N_q <= N_kv"),
    ("causal not bool", lambda q, k, v, m: ((q, k, v), {"causal": "yes"}), TypeError, "causal must be a bool"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_clear_error(case):
    _, make, error, words = case
    q, k, v = make_qkv(2, 2, 5, 5, requires_grad=False)
    args, kwargs = make(q, k, v, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        attnzoo.build("softmax")(*args, **kwargs)
    with pytest.raises(error):
        reference_attention(*args, **kwargs)


def test_attn_mask_bool_and_additive_equal_a_hand_computation():
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 1, 6, 6, dtype=torch.float64)
    bias[0, 0, 2, :] = -torch.inf  # a row that sees nothing
    allowed = torch.rand(1, 3, 6, 6) > 0.4
    allowed[..., 0] = True
    scores = q @ k.transpose(-1, -2) / 2.0  # scale 1/sqrt(4)
    for mask, added in ((bias, scores + bias), (allowed, scores.masked_fill(~allowed, -torch.inf))):
        want = torch.nan_to_num(added.softmax(-1), nan=0.0) @ v
        assert_same(attnzoo.build("softmax")(q, k, v, attn_mask=mask), want)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(B or 1, H or 1, N_q, N_kv\)"):
        attnzoo.build("softmax")(q, k, v, attn_mask=allowed[:, :, :5])
    with pytest.raises(TypeError, match="bool .* or floating"):
        attnzoo.build("softmax")(q, k, v, attn_mask=allowed.long())
