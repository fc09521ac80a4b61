"""mla: ``latent_attention`` against the independent oracle, the absorbed decode form, the decode
cache's size in bytes, and the limit where the latent loses nothing (MLA is then softmax).
Fast == reference and step == forward of the default config are the contract tests'; here are
odd geometries (H = 3, N = 37, D_v != D, rope_dim 0) they do not reach."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.mechanisms.mla import absorbed_attention, latent_attention
from conftest import grads, padding_mask
from oracles_modern import oracle_latent_attention
from tolerances import assert_same

B, H, N, DN, DR, DV, R = 2, 3, 37, 5, 2, 3, 4


def _latent_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, N, DN), (B, H, N, DR), (B, N, R), (B, N, DR), (H, R, DN), (H, R, DV))
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes)


@pytest.mark.parametrize("causal", [False, True])
def test_latent_attention_equals_the_oracle_forward_and_gradients(causal):
    inputs = _latent_inputs(1)
    got, want = latent_attention(*inputs, causal=causal), oracle_latent_attention(*inputs, causal=causal)
    assert_same(got, want, what=f"causal={causal}")
    for i, (a, b) in enumerate(zip(grads(got, inputs), grads(want, inputs))):
        assert_same(a, b, what=f"causal={causal}: gradient {i}")


def test_the_absorbed_form_equals_the_expanded_one_with_padding():
    q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = (x.detach() for x in _latent_inputs(2))
    mask = padding_mask(B, N)
    for causal in (False, True):
        want = latent_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal=causal, key_mask=mask, scale=0.4)
        latent = torch.cat([c_kv, k_rope], -1)
        got = absorbed_attention(q_nope, q_rope, latent, w_uk, w_uv, causal=causal, key_mask=mask, scale=0.4)
        assert_same(got, want, what=f"causal={causal}")


def _mla(**config: object) -> torch.nn.Module:
    shape = attnzoo.Shape(heads=H, head_dim=DN + DR, value_dim=DV)
    return attnzoo.build("mla", shape=shape, **{"latent": R, "rope_dim": DR, **config}).double()


def _qkv(seed: int, d: int = DN + DR) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, N, w, generator=g, dtype=torch.float64) for w in (d, d, DV))


@pytest.mark.parametrize("rope_dim", [DR, 0])
def test_decode_equals_the_forward_and_the_cache_holds_r_plus_dr_numbers_per_token(rope_dim):
    attn = _mla(rope_dim=rope_dim)
    q, k, v = _qkv(3)
    mask = padding_mask(B, N, empty_row=False)
    mask[1, :4] = False  # a left-padded prompt
    state = attn.init_state(B, H, DN + DR, DV, dtype=torch.float64, capacity=N)
    outs = []
    with torch.no_grad():
        for lo, hi in [(0, 6), *((t, t + 1) for t in range(6, N))]:
            out, state = attn.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
            outs.append(out)
        assert_same(torch.cat(outs, 2), attn(q, k, v, causal=True, key_mask=mask), what=f"rope_dim={rope_dim}")
    cached = sum(t.numel() * t.element_size() for t in (state.k_buffer, state.v_buffer))
    assert cached == B * N * (R + rope_dim) * 8, "c_kv and k_rope only: (R + D_r) float64 per token"
    full_kv = attnzoo.build("softmax").init_state(B, H, DN + DR, DV, dtype=torch.float64, capacity=N)
    assert cached < sum(t.numel() * t.element_size() for t in (full_kv.k_buffer, full_kv.v_buffer)) / 4


def test_a_latent_that_loses_nothing_is_softmax_attention():
    # One head, R = D_n + D_v, identity down-projection, up-projections that pick k_nope and v
    # back, the rope key the head's own: MLA is then exact attention on the layer's q, k, v.
    attn = attnzoo.build("mla", heads=1, head_dim=DN + DR, value_dim=DV, latent=DN + DV, rope_dim=DR).double()
    eye = torch.eye(DN + DV, dtype=torch.float64)
    with torch.no_grad():
        attn.w_dkv.copy_(eye[None])
        attn.w_uk.copy_(eye[None, :, :DN])
        attn.w_uv.copy_(eye[None, :, DN:])
        attn.w_kr.fill_(1.0)
    q, k, v = (x[:, :1] for x in _qkv(4))
    for causal in (False, True):
        assert_same(attn(q, k, v, causal=causal), F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def test_gradients_reach_every_projection_and_the_config_is_checked():
    attn = _mla()
    q, k, v = _qkv(5)
    out = attn(q, k, v, causal=True)
    found = torch.autograd.grad(out.square().sum(), list(attn.parameters()))
    assert all(g.abs().sum() > 0 for g in found)
    with pytest.raises(ValueError, match="rope_dim"):
        attnzoo.build("mla", head_dim=8, rope_dim=8)
    with pytest.raises(ValueError, match="was built for"):
        attn(q[:, :2], k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="depend on v"):
        attn.implied_attention(q, k)
    assert _mla(rope_dim=None, latent=None).config.sizes() == (
        DN + DR - (DN + DR) // 2,
        (DN + DR) // 2,
        DV,
        4 * (DN + DR),
    )
