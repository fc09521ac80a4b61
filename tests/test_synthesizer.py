"""Synthesizer (Tay et al. 2020): the random variant by hand, factorized shapes and ranks, and for
every variant strong causality, padding, zero rows, gradients, the plain reference, limits and
config errors, and use inside MultiHeadAttention."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.mechanisms.synthesizer import SynthesizerConfig, reference_synthesizer
from attnzoo.nn import MultiHeadAttention
from conftest import largest_tensor, padding_mask
from tolerances import assert_same

VARIANTS = ("dense", "random", "factorized_dense", "factorized_random", "mix")
ALL = [(v, "random") for v in VARIANTS] + [("mix", "dense")]
H, D, N, MAX = 2, 4, 10, 16


def _build(variant: str, mix_with: str = "random", **kw) -> torch.nn.Module:
    return attnzoo.build(
        "synthesizer", variant=variant, mix_with=mix_with, max_len=MAX, head_dim=D, heads=H, **kw
    ).double()


def _qkv(b: int = 3, n: int = N, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, H, n, D, generator=g, dtype=torch.float64) for _ in range(3))


def test_fixed_random_is_softmax_of_the_matrix_times_v():
    module = _build("random", fixed=True)
    assert not list(module.parameters()) and "random_matrix" in dict(module.named_buffers())
    q, k, v = _qkv()
    r = module.random_matrix[:, :N, :N]
    expected = torch.softmax(r, dim=-1) @ v  # the same (H, N, N) weights for every batch row
    assert_same(module(q, k, v), expected)
    # The input q, k do not matter at all.
    assert_same(module(q * 3 + 1, k - 2, v), expected)
    mask = torch.ones(N, N, dtype=torch.bool).tril()
    causal = torch.softmax(r.masked_fill(~mask, float("-inf")), dim=-1) @ v
    assert_same(module(q, k, v, causal=True), causal)


def test_learned_random_is_a_parameter():
    module = _build("random")
    assert [name for name, _ in module.named_parameters()] == ["random_matrix"]
    assert module.random_matrix.shape == (H, MAX, MAX)


def test_factorized_random_is_r1_r2t_of_rank_at_most_k():
    module = _build("factorized_random", rank=3)
    assert module.r1.shape == module.r2.shape == (H, MAX, 3)
    q, _, _ = _qkv()
    s = module.synthesized_scores(q)
    assert s.shape == (1, H, N, N)
    assert_same(s[0], module.r1[:, :N] @ module.r2[:, :N].transpose(-1, -2))
    full = module.r1 @ module.r2.transpose(-1, -2)
    assert all(int(torch.linalg.matrix_rank(full[h])) <= 3 for h in range(H))


def test_factorized_dense_shapes_and_outer_product():
    assert SynthesizerConfig().factors == (16, 32)  # 16 * 32 = 512
    assert SynthesizerConfig(max_len=12).factors == (3, 4)
    assert SynthesizerConfig(max_len=12, factor=6).factors == (6, 2)
    module = _build("factorized_dense", factor=8)  # a = 8, b = 2
    assert module.wa.shape == (H, D, 8) and module.wb.shape == (H, D, 2)
    q, _, _ = _qkv()
    s = module.synthesized_scores(q)
    assert s.shape == (3, H, N, N)
    hidden = torch.relu(torch.einsum("zhid,hde->zhie", q, module.w1) + module.b1[:, None])
    a = torch.einsum("zhie,hea->zhia", hidden, module.wa) + module.ba[:, None]
    b = torch.einsum("zhie,hef->zhif", hidden, module.wb) + module.bb[:, None]
    for j in range(N):  # key j = r * a + c scores A[c] * B[r]
        assert_same(s[..., j], a[..., j % 8] * b[..., j // 8])


def test_dense_scores_are_the_two_layer_net_of_q():
    module = _build("dense")
    q, _, _ = _qkv()
    hidden = torch.relu(q @ module.w1[None] + module.b1[None, :, None])
    expected = hidden @ module.w2[None, :, :, :N] + module.b2[None, :, None, :N]
    assert_same(module.synthesized_scores(q), expected)


@pytest.mark.parametrize("mix_with", ["random", "dense"])
def test_mix_is_alpha_synthesized_plus_dot_product(mix_with):
    module = _build("mix", mix_with, alpha=0.25)
    q, k, _ = _qkv()
    dot = q @ k.transpose(-1, -2) / D**0.5
    assert_same(module.scores(q, k), 0.25 * module.synthesized_scores(q) + 0.75 * dot)
    zero = _build("mix", mix_with, alpha=0.0)
    q, k, v = _qkv()
    assert_same(zero(q, k, v), torch.softmax(dot, dim=-1) @ v)


def test_mix_alpha_is_learned_per_head():
    module = _build("mix", alpha=0.25)
    assert isinstance(module.alpha, torch.nn.Parameter) and torch.equal(
        module.alpha, torch.full((H,), 0.25, dtype=torch.float64)
    )
    q, k, v = _qkv()
    loss = module(q, k, v).square().sum()
    loss.backward()
    assert module.alpha.grad is not None and bool((module.alpha.grad != 0).all())
    with torch.no_grad():
        module.alpha[0] = 0.0  # head 0 becomes plain dot-product attention, head 1 is untouched
    dot = q @ k.transpose(-1, -2) / D**0.5
    scores = module.scores(q, k)
    assert_same(scores[:, 0], dot[:, 0])
    assert_same(scores[:, 1], 0.25 * module.synthesized_scores(q)[:, 1] + 0.75 * dot[:, 1])
    fixed = _build("mix", alpha=0.25, learn_alpha=False)
    assert "alpha" not in dict(fixed.named_parameters()) and "alpha" in dict(fixed.named_buffers())


@pytest.mark.parametrize(("variant", "mix_with"), ALL)
def test_matches_the_plain_reference(variant, mix_with):
    module = _build(variant, mix_with)
    q, k, v = _qkv()
    mask = padding_mask(3, N)
    for causal in (False, True):
        out = module(q, k, v, causal=causal, key_mask=mask)
        qz, kz, vz = module.zero_padded(mask, q, k, v)  # self-attention only: padding reaches it as zeros
        ref = reference_synthesizer(module.scores(qz, kz), vz, causal=causal, key_mask=mask)
        assert_same(out, ref)
        weights = module.implied_attention(q, k, causal=causal, key_mask=mask)
        assert_same(weights @ v, out)


FUSED = [("dense", "random"), ("factorized_random", "random"), ("mix", "dense")]


@pytest.mark.parametrize(("variant", "mix_with"), FUSED)
def test_dot_product_variants_run_fused_without_a_batch_of_score_matrices(variant, mix_with):
    # Their scores are dot products of synthesized vectors: SDPA's kernel takes them, and no
    # (B, H, N, N) tensor is made (the padding mask, (B, 1, N, N) bool at most, is smaller).
    b, n = 3, 64
    module = attnzoo.build("synthesizer", variant=variant, mix_with=mix_with, max_len=n, head_dim=D, heads=H)
    q, k, v = (torch.randn(b, H, n, D) for _ in range(3))
    assert module.synthesized_qk(q, k) is not None
    for causal, mask in ((False, None), (True, None), (True, padding_mask(b, n))):
        assert largest_tensor(module, q, k, v, causal=causal, key_mask=mask) < b * H * n * n
    assert _build("random").synthesized_qk(*_qkv()[:2]) is None  # an explicit matrix: the reference


@pytest.mark.parametrize(("variant", "mix_with"), ALL)
def test_causal_in_the_strong_sense(variant, mix_with):
    module = _build(variant, mix_with)
    q, k, v = _qkv()
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :, 6:] = torch.randn_like(t[:, :, 6:]) * 3
    before, after = module(q, k, v, causal=True), module(q2, k2, v2, causal=True)
    assert_same(after[:, :, :6], before[:, :, :6])
    assert not torch.allclose(after[:, :, 6:], before[:, :, 6:])


@pytest.mark.parametrize(("variant", "mix_with"), ALL)
def test_padding_is_never_attended_and_empty_rows_are_zero(variant, mix_with):
    module = _build(variant, mix_with)
    q, k, v = _qkv()
    mask = padding_mask(3, N)  # batch 0: every key padded
    mask[1, 7:] = False
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[1, :, 7:] = torch.randn_like(t[1, :, 7:]) * 5
    for causal in (False, True):
        out = module(q, k, v, causal=causal, key_mask=mask)
        assert torch.isfinite(out).all()
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        weights = module.implied_attention(q, k, causal=causal, key_mask=mask)
        assert bool((weights[1, :, :, 7:] == 0).all()) and bool((weights[0] == 0).all())
        changed = module(q2, k2, v2, causal=causal, key_mask=mask)
        assert_same(changed[1, :, :7], out[1, :, :7])


@pytest.mark.parametrize(("variant", "mix_with"), ALL)
def test_gradients_reach_every_parameter_and_v(variant, mix_with):
    module = _build(variant, mix_with)
    q, k, v = (t.requires_grad_() for t in _qkv())
    mask = padding_mask(3, N)
    module(q, k, v, causal=True, key_mask=mask).square().sum().backward()
    params = dict(module.named_parameters())
    assert params
    for name, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        # Only the first N positions of max_len-sized parameters are used.
        assert p.grad.abs().sum() > 0, name
    assert v.grad is not None and v.grad.abs().sum() > 0
    if variant in ("dense", "factorized_dense", "mix"):
        assert q.grad is not None and q.grad.abs().sum() > 0


@pytest.mark.parametrize(("variant", "mix_with"), ALL)
def test_decode_steps_equal_the_causal_forward_up_to_max_len(variant, mix_with):
    # The contract test decodes the default variant; here every one, in uneven chunks (steps of
    # several tokens over a non-empty cache), up to max_len and no further.
    module = _build(variant, mix_with).eval()
    q, k, v = _qkv(b=2, n=MAX)
    mask = torch.ones(2, MAX, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 7] = False
    state = module.init_state(2, H, D, D, dtype=torch.float64, capacity=4 * MAX)
    outs = []
    for lo, hi in ((0, 5), (5, 6), (6, 11), (11, MAX)):
        out, state = module.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
        outs.append(out)
    assert_same(torch.cat(outs, 2), module(q, k, v, causal=True, key_mask=mask))
    assert state.k.shape[-1] == (D if variant == "mix" else 0)  # only mix reads a key
    with pytest.raises(ValueError, match="position 16, past max_len=16"):
        module.step(state, q[:, :, :1], k[:, :, :1], v[:, :, :1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_longer_than_max_len_raises(variant):
    module = _build(variant)
    q, k, v = _qkv(b=1, n=MAX + 1)
    with pytest.raises(ValueError, match="max_len=16"):
        module(q, k, v)
    q, k, v = _qkv(b=1, n=MAX)
    assert module(q, k, v).shape == (1, H, MAX, D)


def test_cross_attention_and_score_mod_are_refused():
    module = _build("dense")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="self-attention only"):
        module(q, k[:, :, :5], v[:, :, :5])
    with pytest.raises(ValueError, match="does not support score_mod"):
        module(q, k, v, score_mod=lambda s, b, h, i, j: s)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("variant", "sparse"),
        ("max_len", 0),
        ("head_dim", 0),
        ("heads", -1),
        ("rank", 0),
        ("factor", 5),
        ("factor", 0),
        ("alpha", 1.5),
        ("alpha", -0.1),
        ("mix_with", "factorized_random"),
    ],
)
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        attnzoo.build("synthesizer", **{"max_len": 16, field: value})


def test_wrong_heads_or_head_dim_raise_clearly():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="heads=2"):
        attnzoo.build("synthesizer", variant="random", max_len=MAX, heads=3, head_dim=D).double()(q, k, v)
    with pytest.raises(ValueError, match="head_dim=4"):
        attnzoo.build("synthesizer", variant="dense", max_len=MAX, heads=H, head_dim=8).double()(q, k, v)


def test_build_with_defaults_and_describe():
    module = attnzoo.build("synthesizer")
    assert module.config.variant == "dense" and module.config.max_len == 512
    spec = attnzoo.describe("synthesizer")
    assert spec.family == "synthesizer" and "2005.00743" in spec.paper
    caps = spec.capabilities
    assert caps.causal and caps.key_mask and not caps.cross_attention and not caps.score_mod
    assert not spec.complexity.subquadratic_memory
    q = torch.randn(1, 8, 20, 64)
    assert module(q, q, q, causal=True).shape == (1, 8, 20, 64)


@pytest.mark.parametrize("variant", VARIANTS)
def test_inside_multi_head_attention(variant):
    # MultiHeadAttention consumes heads= and head_dim= itself, so a synthesizer whose head_dim
    # or heads differ from the defaults is passed built.
    mechanism = attnzoo.build("synthesizer", variant=variant, max_len=32, head_dim=8, heads=8)
    layer = MultiHeadAttention(64, 8, mechanism, head_dim=8)
    x = torch.randn(2, 12, 64, requires_grad=True)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 9:] = False
    out = layer(x, causal=True, key_mask=mask)
    assert out.shape == (2, 12, 64) and torch.isfinite(out).all()
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in mechanism.parameters())


def test_multi_head_attention_by_name_takes_heads_and_head_dim_from_the_layer():
    # By name, MultiHeadAttention fills the synthesizer's heads and head_dim from itself.
    for variant, heads in (("random", 8), ("dense", 8), ("random", 4)):
        layer = MultiHeadAttention(64, heads, "synthesizer", variant=variant, max_len=32)
        assert (layer.attn.config.heads, layer.attn.config.head_dim) == (heads, 64 // heads)
        assert layer(torch.randn(2, 12, 64)).shape == (2, 12, 64)
    # A module built with other shapes still fails clearly, naming the field.
    layer = MultiHeadAttention(64, 8, attnzoo.build("synthesizer", variant="dense", max_len=32))
    with pytest.raises(ValueError, match="head_dim=8"):
        layer(torch.randn(2, 12, 64))
    layer = MultiHeadAttention(64, 4, attnzoo.build("synthesizer", variant="random", max_len=32))
    with pytest.raises(ValueError, match="heads=4"):
        layer(torch.randn(2, 12, 64))
