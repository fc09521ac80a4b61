"""Sparse Sinkhorn attention: fast path == reference for the same permutation on a partial last
block and with SortCut, limit laws, what the sort sees, Gumbel noise, decoding across blocks,
config errors. (tests/test_contracts.py holds the default config to the protocol.)"""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.mechanisms import sinkhorn_decode
from attnzoo.mechanisms.base import AttendArgs
from attnzoo.mechanisms.sinkhorn import SinkhornConfig, real_blocks, reference_sinkhorn, sinkhorn_attention
from conftest import grads, make_qkv, padding_mask
from tolerances import assert_close_to_golden, assert_same

B, H, N, D, BLOCK = 2, 3, 45, 8, 8  # 6 blocks, the last one 5/8 real
NB = -(-N // BLOCK)


def _build(**cfg):
    return attnzoo.build("sinkhorn", block=BLOCK, head_dim=D, **cfg).eval()


def _mask(padded):
    if not padded:
        return None
    mask = padding_mask(B, N)  # batch 0 all padding
    mask[1, 10:13] = False  # a hole inside a block of the unpadded row
    return mask


def _reference(module, q, k, v, causal, mask):
    q, k, v = module.zero_padded(mask, q, k, v)  # self-attention only: padded q, k, v reach it as zeros
    P = module.permutation(k, mask, causal)
    return reference_sinkhorn(q, k, v, P, module.config, AttendArgs(causal, mask, None))


# SortCut refuses causal (tested below).
CASES = [(False, None), (True, None), (False, 2)]


@pytest.mark.parametrize("causal, sortcut", CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_fast_equals_reference_float64_forward_and_gradients(causal, padded, sortcut):
    module, mask = _build(sortcut=sortcut), _mask(padded)
    q, k, v = make_qkv(B, H, N, N, D, d_v=5)
    inputs = (q, k, v, module.sort_weight)
    fast = module(q, k, v, causal=causal, key_mask=mask)
    ref = _reference(module, q, k, v, causal, mask)
    assert_same(fast, ref)
    if padded:
        assert torch.equal(fast[0], torch.zeros_like(fast[0]))
    for a, r, name in zip(grads(fast, inputs), grads(ref, inputs), ("q", "k", "v", "sort_weight")):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, name
        assert_same(a, r, what=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_within_policy_of_float64_golden(causal):
    module, mask = _build(), _mask(True)
    q, k, v = make_qkv(B, H, N, N, D, dtype=torch.float32)
    g_in = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    golden = _reference(module, *g_in, causal, mask)
    reference = _reference(module, q, k, v, causal, mask)
    actual = module(q, k, v, causal=causal, key_mask=mask)
    assert actual.dtype == torch.float32
    assert_close_to_golden(actual, reference, golden.detach())
    for a, r, g, name in zip(grads(actual, (q, k, v)), grads(reference, (q, k, v)), grads(golden, g_in), "qkv"):
        assert_close_to_golden(a, r, g, what=f"d{name}")


@pytest.mark.parametrize("sortcut", [None, 3])
def test_zero_values_give_exactly_zero(sortcut):
    # The sorted values are mixed from the value blocks, not the key blocks.
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    out = _build(sortcut=sortcut)(q, k, torch.zeros_like(v))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_identity_permutation_is_block_local(causal, padded):
    # P = I: block i attends to [K_i, K_i]; every key is doubled in numerator and denominator,
    # so the softmax equals block-local attention. Causal mode ignores P[i, j >= i]: I -> 0.
    mask = _mask(padded)
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    identity = torch.eye(NB, dtype=q.dtype).expand(B, H, NB, NB)
    local = attnzoo.build("block_local", block=BLOCK, backend="reference")(q, k, v, causal=causal, key_mask=mask)
    cfg, args = SinkhornConfig(block=BLOCK, head_dim=D), AttendArgs(causal, mask, None)
    for fn in (sinkhorn_attention, reference_sinkhorn):
        assert_same(fn(q, k, v, identity, cfg, args), local)


def test_gumbel_noise_only_in_training():
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    module = _build(seed=3)
    assert torch.equal(module(q, k, v), module(q, k, v))
    evaluated = module(q, k, v)
    module.train()
    trained = module(q, k, v)
    assert not torch.allclose(trained, evaluated)
    assert not torch.allclose(module(q, k, v), trained)  # fresh noise per call
    assert torch.equal(_build(seed=3).train()(q, k, v), trained)  # reproducible per seed
    assert torch.equal(_build(seed=3).sort_weight, module.sort_weight)
    assert not torch.equal(_build(seed=4).sort_weight, module.sort_weight)


def test_without_causal_the_sort_sees_the_future():
    # (That causal=True does not is the contract test's; here why it has to be made so.)
    t, module = 20, _build()  # position 20 is inside block 2
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[:, :, t + 1 :] = torch.randn_like(x[:, :, t + 1 :]) * 3
    assert not torch.allclose(module(q, k, v)[1, :, : t + 1], module(*changed)[1, :, : t + 1])


def test_permutation_is_doubly_stochastic_and_moves_with_temperature_and_iterations():
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    module = _build(n_iters=200)
    module.sort_weight.data.mul_(4)
    P = module.permutation(k)
    assert P.shape == (B, H, NB, NB)
    ones = torch.ones(B, H, NB, dtype=P.dtype)
    assert_same(P.sum(-1), ones, dtype=torch.float32)
    assert_same(P.sum(-2), ones, dtype=torch.float32)
    for other in (_build(n_iters=1), _build(temperature=0.1)):
        other.sort_weight.data.mul_(4)
        assert not torch.allclose(other.permutation(k), P, atol=1e-3)


def test_causal_permutation_sorts_only_past_blocks():
    mask = _mask(True)
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    P = _build().permutation(k, mask, causal=True)
    assert torch.equal(P, P.tril(-1))
    assert torch.equal(P[0], torch.zeros_like(P[0]))  # all padding: nothing to sort
    assert_same(P[1, :, 1:].sum(-1), torch.ones(H, NB - 1, dtype=P.dtype))
    assert P[1].sum(-1)[:, 0].eq(0).all()


def _max_saved_numel(fn):
    sizes = [0]

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes)


@pytest.mark.parametrize("sortcut", [None, 2])
def test_fast_path_memory_is_linear_in_n(sortcut):
    # Nothing N x N is kept for backward: the biggest saved tensor is the block scores.
    b, h, n, block = 1, 2, 512, 16
    module = attnzoo.build("sinkhorn", block=block, head_dim=D, sortcut=sortcut)
    q, k, v = make_qkv(b, h, n, n, D, dtype=torch.float32)
    slots = 2 * block if sortcut is None else sortcut * block
    assert _max_saved_numel(lambda: module(q, k, v)) <= b * h * n * max(slots, D)
    args = AttendArgs(False, None, None)
    _, weights = sinkhorn_attention(q, k, v, module.permutation(k), module.config, args, return_weights=True)
    assert weights.shape == (b, h, n // block, block, slots)


def test_sortcut_refuses_causal_and_clips_to_the_blocks():
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    with pytest.raises(ValueError, match="sortcut does not support causal=True"):
        _build(sortcut=2)(q, k, v, causal=True)
    assert_same(_build(sortcut=NB + 5)(q, k, v), _build(sortcut=NB)(q, k, v))


@pytest.mark.parametrize("causal, sortcut", CASES)
def test_implied_attention_reproduces_the_output(causal, sortcut):
    mask, module = _mask(True), _build(sortcut=sortcut)
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    weights = module.implied_attention(q, k, causal=causal, key_mask=mask)
    assert weights.shape == (B, H, N, N)
    assert_same(weights @ v, module(q, k, v, causal=causal, key_mask=mask))
    assert not weights[:, :, :, ~mask[1]][1].any()  # padded keys get no weight
    if causal:
        assert torch.equal(weights, weights.tril())


def test_decode_steps_across_blocks_sort_each_block_once(monkeypatch):
    # The contract test decodes one token at a time after a one-block prefill; here steps of
    # several tokens that start, span and end blocks over a non-empty state, a partial last
    # block and a padding hole, and each block's sort computed once however it is reached.
    module, mask = _build(), _mask(True)
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    sorts = []
    real_sort = sinkhorn_decode.sort_block
    monkeypatch.setattr(sinkhorn_decode, "sort_block", lambda *a: sorts.append(a[2]) or real_sort(*a))
    state, outs = module.init_state(B, H, D, D, dtype=q.dtype), []
    for lo, hi in ((0, 3), (3, 20), (20, 21), (21, 24), *((t, t + 1) for t in range(24, N))):
        out, state = module.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
        outs.append(out)
    assert_same(torch.cat(outs, 2), module(q, k, v, causal=True, key_mask=mask))
    assert sorts == list(range(NB))
    with pytest.raises(ValueError, match=r"step\(\) in training mode"):
        module.train().step(state, q[:, :, :1], k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="sortcut does not support causal"):
        _build(sortcut=2).init_state(B, H, D, D)


def test_real_blocks_pads_the_tail():
    real = real_blocks(None, 1, N, BLOCK, torch.device("cpu"))
    assert real.shape == (1, NB, BLOCK) and int(real.sum()) == N and not real[0, -1, N % BLOCK :].any()


@pytest.mark.parametrize(
    "field, value",
    [
        ("block", 0),
        ("n_iters", 0),
        ("temperature", 0.0),
        ("max_blocks", 0),
        ("head_dim", 0),
        ("sortcut", 0),
        ("sortcut", 300),
        ("scale", -1.0),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        attnzoo.build("sinkhorn", **{field: value})


def test_length_and_head_dim_limits():
    module = attnzoo.build("sinkhorn", block=4, max_blocks=3, head_dim=D)
    q, k, v = make_qkv(1, 1, 13, 13, D, requires_grad=False)
    with pytest.raises(ValueError, match=r"N=13 exceeds block \* max_blocks = 4 \* 3 = 12"):
        module(q, k, v)
    assert module(q[:, :, :12], k[:, :, :12], v[:, :, :12]).shape == (1, 1, 12, D)
    with pytest.raises(ValueError, match="head_dim=64 .* D=8"):
        attnzoo.build("sinkhorn")(q, k, v)
    spec = attnzoo.describe("sinkhorn")
    assert spec.family == "content" and spec.capabilities.causal and spec.capabilities.key_mask
    assert spec.complexity.subquadratic_memory and not spec.capabilities.cross_attention
