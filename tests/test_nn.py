"""Layers: MultiHeadAttention against a hand computation, masking invariances, the causal LM."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

import attnzoo
from attnzoo.bench.configs import sized
from attnzoo.nn.sampling import filtered_probabilities
from oracles import attention_oracle
from tolerances import assert_same


def test_mha_equals_hand_computation_with_cross_attention_and_padding():
    mha = attnzoo.nn.MultiHeadAttention(12, 3, kv_dim=5).double()
    x, ctx = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 6, 5, dtype=torch.float64)
    mask = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    split = lambda t: rearrange(t, "b n (h d) -> b h n d", h=3)  # noqa: E731
    q, k, v = split(mha.q_proj(x)), split(mha.k_proj(ctx)), split(mha.v_proj(ctx))
    heads = attention_oracle(q, k, v, key_mask=mask)
    expected = mha.out_proj(rearrange(heads, "b h n d -> b n (h d)"))
    assert_same(mha(x, ctx, key_mask=mask), expected)


def test_encoder_ignores_the_content_of_padded_tokens():
    enc = attnzoo.nn.TransformerEncoder(16, depth=2, heads=2).eval()
    x = torch.randn(2, 9, 16)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    y = enc(x, key_mask=mask)
    x2 = x.clone()
    x2[0, 6:] = torch.randn(3, 16) * 100
    y2 = enc(x2, key_mask=mask)
    assert torch.allclose(y[0, :6], y2[0, :6], atol=1e-5) and torch.allclose(y[1], y2[1])
    assert not torch.allclose(y[0, 6:], y2[0, 6:])


@pytest.mark.parametrize("positional", [None, "rope", "alibi"])
def test_causal_outputs_ignore_the_future(positional):
    enc = attnzoo.nn.TransformerEncoder(16, depth=2, heads=2, positional=positional).eval()
    x = torch.randn(1, 10, 16)
    x2 = x.clone()
    x2[:, 6:] = torch.randn(1, 4, 16)
    y, y2 = enc(x, causal=True), enc(x2, causal=True)
    assert torch.allclose(y[:, :6], y2[:, :6], atol=1e-6)
    assert not torch.allclose(y[:, 6:], y2[:, 6:])


@pytest.mark.parametrize("mechanism", attnzoo.names(kind="attention", decode_step=True))
def test_generate_is_greedy_over_the_full_forward_with_a_left_padded_prompt(mechanism):
    # Every mechanism that decodes, sized for the 16 tokens generated, in float64 (argmax ties
    # between near-equal logits would otherwise make the comparison flaky); row 0's prompt is
    # left-padded by 2 tokens, whose content must not matter.
    lm = attnzoo.nn.CausalLM(30, 16, 2, 2, mechanism, **sized(mechanism, 16)).double().eval()
    prompt = torch.randint(0, 30, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :2] = False
    out = lm.generate(prompt, max_new_tokens=11, key_mask=mask)
    assert out.shape == (2, 16) and torch.equal(out[:, :5], prompt)
    full_mask = torch.cat([mask, torch.ones(2, 11, dtype=torch.bool)], 1)
    with torch.no_grad():
        logits = lm(out[:, :-1], key_mask=full_mask[:, :-1])
    assert torch.equal(logits[:, 4:].argmax(-1), out[:, 5:])
    other = prompt.clone()
    other[0, :2] = (prompt[0, :2] + 1) % 30
    assert torch.equal(lm.generate(other, max_new_tokens=11, key_mask=mask)[:, 5:], out[:, 5:])


def test_sampling_repeats_with_a_seed_and_its_filters_keep_what_they_say():
    lm = attnzoo.nn.CausalLM(30, 16, 2, 2, "local", left=4, right=0).eval()
    prompt = torch.randint(0, 30, (3, 4))
    sampled = attnzoo.nn.Sampling(temperature=1.5, top_k=10, top_p=0.9, seed=7)
    first, again = (lm.generate(prompt, 12, sampling=sampled) for _ in range(2))
    assert torch.equal(first, again)
    greedy = lm.generate(prompt, 12)
    assert torch.equal(lm.generate(prompt, 12, sampling=attnzoo.nn.Sampling(top_k=1, seed=1)), greedy)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = filtered_probabilities(logits, attnzoo.nn.Sampling(top_k=3))
    assert (probs[0, 3:] == 0).all() and torch.allclose(probs[0, :3], logits[0, :3].softmax(-1))
    # top_p: the most likely token alone holds ~64% of the mass; 0.6 keeps it only, 0.7 two.
    assert (filtered_probabilities(logits, attnzoo.nn.Sampling(top_p=0.6)) > 0).sum() == 1
    assert (filtered_probabilities(logits, attnzoo.nn.Sampling(top_p=0.7)) > 0).sum() == 2


def test_generate_stops_every_row_at_the_end_token():
    lm = attnzoo.nn.CausalLM(30, 16, 2, 2, "softmax").eval()
    prompt = torch.randint(0, 30, (2, 4))
    greedy = lm.generate(prompt, 20)
    eos = int(greedy[0, 6])  # row 0 emits it by its third new token at the latest
    out = lm.generate(prompt, 20, eos_token_id=eos)
    assert (out[0, 4:7] == eos).any(), "greedy decoding is deterministic: row 0 meets the end token again"
    for row in out[:, 4:]:
        hits = (row == eos).nonzero()
        if len(hits):  # after the first end token, only end tokens
            assert (row[int(hits[0]) :] == eos).all()
    assert out.shape[1] <= 24 and (out.shape[1] == 24 or (out[:, -1] == eos).all())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"temperature": 0}, "temperature must be > 0"), ({"top_k": 0}, "top_k"), ({"top_p": 1.5}, "top_p")],
)
def test_sampling_names_a_bad_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attnzoo.nn.Sampling(**kwargs)


def test_generate_refuses_a_right_padded_prompt():
    lm = attnzoo.nn.CausalLM(30, 16, 2, 2, "softmax").eval()
    mask = torch.tensor([[True, True, False]])
    with pytest.raises(ValueError, match="pad prompts on the left"):
        lm.generate(torch.zeros(1, 3, dtype=torch.long), 2, key_mask=mask)


def test_layer_errors_are_clear():
    with pytest.raises(ValueError, match="divisible by heads"):
        attnzoo.nn.MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="unknown config key"):
        attnzoo.nn.MultiHeadAttention(8, 2, windw=3)
    with pytest.raises(ValueError, match="already built"):
        attnzoo.nn.MultiHeadAttention(8, 2, attnzoo.build("softmax"), scale=1.0)
    with pytest.raises(TypeError, match="registered name"):
        attnzoo.nn.MultiHeadAttention(8, 2, mechanism=torch.nn.Linear(2, 2))
    mha = attnzoo.nn.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="dim=8"):
        mha(torch.randn(1, 3, 7))
    with pytest.raises(ValueError, match="3 dimensions"):
        mha(torch.randn(3, 8))
    with pytest.raises(ValueError, match="context must have shape"):
        mha(torch.randn(1, 3, 8), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"\(B, N_kv\)"):
        mha(torch.randn(1, 3, 8), key_mask=torch.ones(1, 4, dtype=torch.bool))
    lm = attnzoo.nn.CausalLM(vocab_size=10, dim=8, depth=1, heads=2)
    with pytest.raises(ValueError, match="vocab_size=10"):
        lm(torch.tensor([[1, 10]]))
    with pytest.raises(TypeError, match="integer tensor"):
        lm(torch.randn(1, 3))


def test_head_dim_can_differ_from_dim_over_heads():
    mha = attnzoo.nn.MultiHeadAttention(10, 3, head_dim=4)
    assert mha(torch.randn(2, 5, 10)).shape == (2, 5, 10)


def test_heterogeneous_heads_equal_each_group_run_separately():
    # 2 local + 1 strided + 1 global + 4 softmax heads, with ALiBi: each group must see the
    # layer's own head indices (so slopes match the heads), and the outputs are concatenated.
    groups = [
        ("local", {"left": 2, "right": 2, "tile": 16}, 2),
        ("strided", {"stride": 5, "tile": 16}, 1),
        ("global", {"indices": (0,), "tile": 16}, 1),
        ("softmax", {}, 4),
    ]
    mha = attnzoo.nn.MultiHeadAttention(64, 8, groups, positional="alibi").double()
    x = torch.randn(2, 30, 64, dtype=torch.float64)
    split = lambda t: rearrange(t, "b n (h d) -> b h n d", h=8)  # noqa: E731
    q, k, v = split(mha.q_proj(x)), split(mha.k_proj(x)), split(mha.v_proj(x))
    alibi = mha.positional.score_mod(q, 30)
    parts, start = [], 0
    for attn, n in zip(mha.mechanisms, mha.group_heads):
        shifted = lambda s, b, h, i, j, o=start: alibi(s, b, h + o, i, j)  # noqa: E731
        parts.append(
            attn(
                q[:, start : start + n],
                k[:, start : start + n],
                v[:, start : start + n],
                causal=True,
                score_mod=shifted,
            )
        )
        start += n
    expected = mha.out_proj(rearrange(torch.cat(parts, dim=1), "b h n d -> b n (h d)"))
    assert mha.group_heads == (2, 1, 1, 4)
    assert_same(mha(x, causal=True), expected)
    with pytest.raises(ValueError, match="'linear' does not support ALiBi"):
        attnzoo.nn.MultiHeadAttention(64, 8, [("linear", {}, 4), ("softmax", {}, 4)], positional="alibi")


def test_heterogeneous_heads_forward_and_decode_step():
    groups = [("local", {"left": 3, "right": 0, "tile": 16}, 2), ("linear", {}, 2), ("softmax", {}, 4)]
    mha = attnzoo.nn.MultiHeadAttention(64, 8, groups).double().eval()
    x = torch.randn(2, 20, 64, dtype=torch.float64)
    out = mha(x, causal=True)
    split = lambda t: rearrange(t, "b n (h d) -> b h n d", h=8)  # noqa: E731
    q, k, v = split(mha.q_proj(x)), split(mha.k_proj(x)), split(mha.v_proj(x))
    parts = [
        mha.mechanisms[0](q[:, :2], k[:, :2], v[:, :2], causal=True),
        mha.mechanisms[1](q[:, 2:4], k[:, 2:4], v[:, 2:4], causal=True),
        mha.mechanisms[2](q[:, 4:], k[:, 4:], v[:, 4:], causal=True),
    ]
    expected = mha.out_proj(rearrange(torch.cat(parts, dim=1), "b h n d -> b n (h d)"))
    assert_same(out, expected)
    with pytest.raises(ValueError, match="does not support a decode step"):
        attnzoo.nn.MultiHeadAttention(64, 8, [("random", {}, 4), ("softmax", {}, 4)]).init_state(2)
    # Each group decodes with its own state: a window cache, running sums, a KV cache.
    state, steps = mha.init_state(2, dtype=torch.float64), []
    for t in range(20):
        y, state = mha.step(x[:, t : t + 1], state)
        steps.append(y)
    assert_same(torch.cat(steps, dim=1), out)
    with pytest.raises(ValueError, match="add up to|in all"):
        attnzoo.nn.MultiHeadAttention(64, 8, [("softmax", {}, 3)])
    with pytest.raises(ValueError, match="each head group"):
        attnzoo.nn.MultiHeadAttention(64, 8, [("softmax", 8)])


@pytest.mark.parametrize("mechanism", attnzoo.names(kind="attention"))
def test_grouped_query_layer_equals_the_layer_with_repeated_kv_projections(mechanism):
    # kv_heads=2 for 4 heads: the same layer with 4 K/V heads whose projections repeat each of
    # the 2 (head 0's rows for heads 0 and 1, head 1's for 2 and 3) must give the same output.
    config = sized(mechanism, 16)
    gqa = attnzoo.nn.MultiHeadAttention(32, 4, mechanism, kv_heads=2, max_len=16, **config).double().eval()
    full = attnzoo.nn.MultiHeadAttention(32, 4, mechanism, max_len=16, **config).double().eval()
    state = gqa.state_dict()
    for proj in ("k_proj", "v_proj"):
        for part in ("weight", "bias"):
            heads = state[f"{proj}.{part}"].unflatten(0, (2, 8))  # (kv_heads, head_dim, ...)
            state[f"{proj}.{part}"] = heads.repeat_interleave(2, dim=0).flatten(0, 1)
    full.load_state_dict(state)
    assert gqa.k_proj.weight.shape == (16, 32) and full.k_proj.weight.shape == (32, 32)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    causal = attnzoo.describe(mechanism).capabilities.causal
    assert_same(gqa(x, causal=causal), full(x, causal=causal), what=f"{mechanism}: kv_heads=2 vs repeated")


def test_head_groups_must_cover_whole_kv_groups():
    with pytest.raises(ValueError, match="whole K/V groups"):
        attnzoo.nn.MultiHeadAttention(32, 4, [("softmax", {}, 1), ("local", {}, 3)], kv_heads=2)
    with pytest.raises(ValueError, match="kv_heads .3. must divide heads .4."):
        attnzoo.nn.MultiHeadAttention(32, 4, kv_heads=3)


def test_a_torch_style_key_padding_mask_gets_the_rename_error_everywhere():
    # torch.nn.MultiheadAttention's key_padding_mask is True at padding; attnzoo's key_mask is True
    # at real tokens: the old name must fail loudly, saying so, not silently invert.
    x, q = torch.randn(2, 6, 16), torch.randn(2, 2, 6, 8)
    torch_style = torch.zeros(2, 6, dtype=torch.bool)
    torch_style[1, 4:] = True  # padding, torch's way
    calls = [
        lambda: attnzoo.build("softmax")(q, q, q, key_padding_mask=torch_style),
        lambda: attnzoo.build("local").reference(q, q, q, key_padding_mask=torch_style),
        lambda: attnzoo.build("fnet", dim=16)(x, key_padding_mask=torch_style),
        lambda: attnzoo.attend(q, q, q, key_padding_mask=torch_style),
        lambda: attnzoo.nn.MultiHeadAttention(16, 2)(x, key_padding_mask=torch_style),
        lambda: attnzoo.nn.TransformerEncoder(16, depth=1, heads=2)(x, key_padding_mask=torch_style),
        lambda: attnzoo.nn.CausalLM(10, 16, 1, 2)(torch.zeros(2, 6, dtype=torch.long), key_padding_mask=torch_style),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"renamed key_mask.*True where a token is real.*~key_padding_mask"):
            call()


def test_layer_attention_dropout_acts_in_training_only_and_needs_a_mechanism_that_has_it():
    layer = attnzoo.nn.MultiHeadAttention(16, 2, attn_dropout=0.5)
    x = torch.randn(2, 8, 16)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    torch.manual_seed(0)
    first = layer(x)
    torch.manual_seed(0)
    assert torch.equal(first, layer(x)) and not torch.allclose(first, layer.eval()(x))
    with pytest.raises(ValueError, match="does not support attention dropout"):
        attnzoo.nn.MultiHeadAttention(16, 2, "linformer", attn_dropout=0.1)
    with pytest.raises(ValueError, match="dropout_p must be a number in"):
        attnzoo.nn.MultiHeadAttention(16, 2, attn_dropout=1.5)
