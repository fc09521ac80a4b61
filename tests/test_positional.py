"""Positional encodings: each against its formula / oracle, and each usable from the layers."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.backends.reference import reference_attention
from attnzoo.positional import (
    ALiBi,
    LearnedPositionalEncoding,
    RelativePositionalEncoding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_slopes,
    sinusoidal_table,
)
from conftest import grads, make_qkv
from oracles import (
    alibi_bias_oracle,
    alibi_slopes_oracle,
    attention_oracle,
    rope_oracle,
    shaw_relative_oracle,
    sinusoidal_oracle,
)
from tolerances import assert_same


@pytest.mark.parametrize("dim", [16, 7])
def test_sinusoidal_matches_formula(dim):
    table = sinusoidal_table(torch.arange(50), dim)
    assert_same(table, sinusoidal_oracle(50, dim))
    x = torch.zeros(2, 50, dim, dtype=torch.float64)
    assert_same(SinusoidalPositionalEncoding(dim).add_to_input(x, torch.arange(50))[1], sinusoidal_oracle(50, dim))


@pytest.mark.parametrize("heads", range(1, 17))
def test_alibi_slopes_match_paper(heads):
    assert_same(alibi_slopes(heads), torch.tensor(alibi_slopes_oracle(heads), dtype=torch.float64))


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_bias_is_minus_slope_times_distance(causal):
    q, k, v = make_qkv(2, 6, 9, 9)
    alibi = ALiBi(6).double()
    out = reference_attention(q, k, v, causal=causal, score_mod=alibi.score_mod(q, 9))
    bias = alibi_bias_oracle(6, 9)[None]
    assert_same(out, attention_oracle(q, k, v, causal=causal, score_bias=bias))


def test_rope_matches_rotate_half_formula_and_preserves_norm():
    x = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    pos = torch.arange(11) + 5
    rotated = RotaryEmbedding(8).rotate(x, pos)
    assert_same(rotated, rope_oracle(x, pos))
    assert_same(rotated.norm(dim=-1), x.norm(dim=-1))


def test_rope_scores_depend_only_on_relative_offset():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(2, 1, 1, 16, dtype=torch.float64)
    for i, j in [(0, 3), (7, 2), (100, 100)]:
        base = (rope.rotate(q, torch.tensor([i])) * rope.rotate(k, torch.tensor([j]))).sum()
        for shift in (1, 17, 1000):
            shifted = (rope.rotate(q, torch.tensor([i + shift])) * rope.rotate(k, torch.tensor([j + shift]))).sum()
            assert_same(shifted, base, what=f"score({i}+{shift}, {j}+{shift})")
    # and they do depend on the offset
    far = (rope.rotate(q, torch.tensor([0])) * rope.rotate(k, torch.tensor([5]))).sum()
    near = (rope.rotate(q, torch.tensor([0])) * rope.rotate(k, torch.tensor([1]))).sum()
    assert not torch.allclose(far, near)


@pytest.mark.parametrize("causal", [False, True])
def test_shaw_relative_matches_double_loop(causal):
    q, k, v = make_qkv(2, 3, 9, 9)
    pe = RelativePositionalEncoding(8, max_distance=3).double()
    softmax = attnzoo.build("softmax")
    out, weights = softmax.reference(q, k, v, causal=causal, score_mod=pe.score_mod(q, 9), return_weights=True)
    out = out + pe.value_term(weights)
    expected = shaw_relative_oracle(q, k, v, pe.rel_k, pe.rel_v, 3, causal=causal)
    assert_same(out, expected)
    inputs = (q, k, v, pe.rel_k, pe.rel_v)
    for got, want, name in zip(grads(out, inputs), grads(expected, inputs), ["q", "k", "v", "rel_k", "rel_v"]):
        assert_same(got, want, what=f"d{name}")


def test_learned_table_refuses_positions_beyond_its_length():
    pe = LearnedPositionalEncoding(8, max_len=4)
    with pytest.raises(ValueError, match="max_len=4"):
        pe.add_to_input(torch.zeros(1, 5, 8), torch.arange(5))
    with pytest.raises(ValueError, match="LearnedPositionalEncoding"):
        attnzoo.nn.MultiHeadAttention(8, 2, positional="learned")
    with pytest.raises(ValueError, match="one of"):
        attnzoo.nn.MultiHeadAttention(8, 2, positional="nope")
    with pytest.raises(ValueError, match="even head_dim"):
        attnzoo.nn.MultiHeadAttention(6, 2, positional="rope")


POSITIONALS = {
    "none": lambda: None,
    "sinusoidal": lambda: "sinusoidal",
    "learned": lambda: LearnedPositionalEncoding(32, max_len=16),
    "rope": lambda: "rope",
    "alibi": lambda: "alibi",
    "relative": lambda: "relative",
    "relative-keys-only": lambda: RelativePositionalEncoding(8, max_distance=4, values=False),
}


@pytest.mark.parametrize("name", POSITIONALS)
def test_every_encoding_decodes_step_by_step_like_the_full_forward(name):
    lm = attnzoo.nn.CausalLM(vocab_size=20, dim=32, depth=2, heads=4, positional=POSITIONALS[name]()).double().eval()
    tokens = torch.randint(0, 20, (2, 11))
    full = lm(tokens)
    state = lm.init_state(2)
    logits, state = lm.step(tokens[:, :3], state)  # prefill three tokens, then one at a time
    outs = [logits]
    for t in range(3, 11):
        logits, state = lm.step(tokens[:, t : t + 1], state)
        outs.append(logits)
    assert_same(torch.cat(outs, dim=1), full)


@pytest.mark.parametrize(
    ("mechanism", "config"),
    [("local", {"left": 4, "right": 0}), ("logsparse", {}), ("strided", {"stride": 3}), ("longformer", {"left": 4})],
)
def test_pattern_mechanisms_decode_with_alibi_like_their_forward(mechanism, config):
    # The forward takes ALiBi on the structured or gathered path, a step through the pattern
    # decode caches (pattern_decode: the score_mod at absolute positions): they must agree.
    torch.manual_seed(0)
    lm = attnzoo.nn.CausalLM(20, 32, 2, 4, mechanism=mechanism, positional="alibi", **config).double().eval()
    tokens = torch.randint(0, 20, (2, 11))
    full = lm(tokens)
    logits, state = lm.step(tokens[:, :3], lm.init_state(2))
    outs = [logits]
    for t in range(3, 11):
        logits, state = lm.step(tokens[:, t : t + 1], state)
        outs.append(logits)
    assert_same(torch.cat(outs, dim=1), full)


@pytest.mark.parametrize("name", POSITIONALS)
def test_every_encoding_changes_the_layer_and_trains(name):
    torch.manual_seed(0)
    mha = attnzoo.nn.MultiHeadAttention(32, 4, positional=POSITIONALS[name]())
    torch.manual_seed(0)
    plain = attnzoo.nn.MultiHeadAttention(32, 4)
    x = torch.randn(2, 12, 32)
    out = mha(x, causal=True)
    if name != "none":
        assert not torch.allclose(out, plain(x, causal=True))
    out.square().sum().backward()
    for param in mha.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()


def test_partial_rope_rotates_only_the_last_channels_as_a_full_rope_of_that_width():
    x = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    pos = torch.arange(11) + 5
    rotated = RotaryEmbedding(8, channels=4).rotate(x, pos)
    assert torch.equal(rotated[..., :4], x[..., :4])
    assert_same(rotated[..., 4:], rope_oracle(x[..., 4:], pos))
    assert torch.equal(RotaryEmbedding(8, channels=0).rotate(x, pos), x)
    for bad in (3, 10, -2, 2.0, True):
        with pytest.raises(ValueError, match="channels"):
            RotaryEmbedding(8, channels=bad)


def test_rope_by_name_rotates_the_channels_the_mechanism_asks_for():
    # mla's decoupled RoPE: only the last rope_dim channels carry positions (its latent would
    # otherwise mix rotated channels); every other mechanism gets all channels.
    mla = attnzoo.nn.MultiHeadAttention(64, 4, mechanism="mla", positional="rope", rope_dim=6)
    assert mla.positional.channels == 6 and mla.mechanisms[0].rotary_channels == 6
    assert attnzoo.nn.MultiHeadAttention(64, 4, positional="rope").positional.channels == 16
    mine = RotaryEmbedding(16)  # a user's instance is kept as given
    assert attnzoo.nn.MultiHeadAttention(64, 4, mechanism="mla", positional=mine).positional is mine
    with pytest.raises(ValueError, match="different numbers of channels"):
        attnzoo.nn.MultiHeadAttention(64, 4, mechanism=[("mla", {}, 2), ("softmax", {}, 2)], positional="rope")
