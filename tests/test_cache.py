"""The decode KV cache: appends write into spare room (no per-token copy of the cache), grow by
doubling, stay values (an old state reads the same keys after a later append), and branch by
copy on write."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnzoo
from attnzoo.mechanisms import pattern_decode
from attnzoo.mechanisms.cache import MIN_CAPACITY, KVCache


def _token(t: int, d: int = 4) -> torch.Tensor:
    return torch.full((2, 3, 1, d), float(t))


def test_appends_reallocate_only_when_the_room_doubles():
    cache, buffers = KVCache.empty(2, 3, 4, 4), set()
    for t in range(100):
        cache = cache.append(_token(t), _token(-t))
        buffers.add(cache.k_buffer.data_ptr())
    # 16, 32, 64, 128: four buffers for 100 tokens, not one per token.
    assert len(buffers) == 4 and cache.capacity == 8 * MIN_CAPACITY
    assert torch.equal(cache.k[0, 0, :, 0], torch.arange(100.0)) and torch.equal(
        cache.v[1, 2, :, 3], -torch.arange(100.0)
    )


def test_a_known_capacity_is_allocated_once():
    cache = KVCache.empty(2, 3, 4, 4, capacity=100)
    first = cache.k_buffer.data_ptr()
    for t in range(100):
        cache = cache.append(_token(t), _token(t))
    assert cache.k_buffer.data_ptr() == first and cache.length == 100


def test_old_states_keep_their_keys_and_two_continuations_do_not_collide():
    prefix = KVCache.empty(2, 3, 4, 4).append(_token(1), _token(1))
    a = prefix.append(_token(2), _token(2))
    b = prefix.append(_token(3), _token(3))  # the room after prefix is a's: b copies first
    assert prefix.k[0, 0, :, 0].tolist() == [1.0]
    assert a.k[0, 0, :, 0].tolist() == [1.0, 2.0] and b.k[0, 0, :, 0].tolist() == [1.0, 3.0]
    assert b.k_buffer.data_ptr() != a.k_buffer.data_ptr()
    a2 = a.append(_token(4), _token(4))  # a is still the newest state on its buffers: no copy
    assert a2.k_buffer.data_ptr() == a.k_buffer.data_ptr() and a2.k[0, 0, :, 0].tolist() == [1.0, 2.0, 4.0]


def test_gradients_flow_through_appended_keys():
    k = torch.randn(1, 1, 3, 2, requires_grad=True)
    cache = KVCache.empty(1, 1, 2, 2).append(k[:, :, :2], k[:, :, :2]).append(k[:, :, 2:], k[:, :, 2:])
    (cache.k.sum() + 2 * cache.v.sum()).backward()
    assert torch.equal(k.grad, torch.full_like(k, 3.0))


def test_softmax_steps_write_into_one_preallocated_cache_and_equal_the_forward():
    attn = attnzoo.build("softmax").double().eval()
    q, k, v = (torch.randn(2, 3, 40, 8, dtype=torch.float64) for _ in range(3))
    state = attn.init_state(2, 3, 8, 8, dtype=torch.float64, capacity=40)
    first, outs = state.k_buffer.data_ptr(), []
    for t in range(40):
        out, state = attn.step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(out)
        assert state.k_buffer.data_ptr() == first
    torch.testing.assert_close(torch.cat(outs, 2), attn(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


def test_window_decode_keeps_o_window_state_and_equals_the_causal_forward():
    # local (left 6) and dilated (3 steps of 2) in a layer, with ALiBi (steps through the
    # mechanism's forward) and without (single tokens through one masked SDPA): a prompt, a chunk
    # longer than DIRECT_STEP_TOKENS, then single tokens; every step's output equals the causal
    # forward's rows, and the state holds the last left (x dilation) keys whatever the position.
    # sinks (the first 3 keys + a window of 6) keeps 9 keys at positions that are not
    # contiguous: its ALiBi steps go through the dense reference at absolute positions; longformer
    # with global tokens 0 and 5 keeps every key up to 5 (token 5's row saw them) + the window.
    windows = (
        ("local", dict(left=6, right=2)),
        ("dilated", dict(left=3, right=1, dilation=2)),
        ("sinks", dict(sinks=3, left=6, right=2)),
        ("longformer", dict(left=6, right=6, global_indices=(0, 5))),
    )
    kept_keys = {"local": 6, "dilated": 6, "sinks": 9, "longformer": 12}
    for (mechanism, config), positional in itertools.product(windows, ("alibi", None)):
        layer = attnzoo.nn.MultiHeadAttention(24, 3, mechanism, positional=positional, **config).double().eval()
        x = torch.randn(2, 100, 24, dtype=torch.float64)
        full = layer(x, causal=True)
        state = layer.init_state(2, dtype=torch.float64)
        out, state = layer.step(x[:, :10], state)  # a short prompt: one masked SDPA
        outs = [out]
        out, state = layer.step(x[:, 10:80], state)  # a long chunk: the forward, or the dense path
        outs.append(out)
        for t in range(80, 100):
            out, state = layer.step(x[:, t : t + 1], state)
            outs.append(out)
            assert state.mechanism.k.shape == (2, 3, kept_keys[mechanism], 8) and state.mechanism.seen == t + 1
        torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-12, atol=1e-12, msg=f"{mechanism} {positional}")


def test_patterns_whose_rows_depend_on_the_final_length_refuse_to_decode_saying_why():
    with pytest.raises(ValueError, match="decode step.*local"):
        attnzoo.build("random").init_state(1, 1, 4, 4)
    assert any("final length N" in note for note in attnzoo.describe("random").notes)
    assert any("no decode step" in note for note in attnzoo.describe("axial").notes)


def test_strided_and_global_patterns_decode_over_a_kv_cache():
    attn = attnzoo.build("strided", stride=4).double().eval()
    q, k, v = (torch.randn(2, 2, 30, 4, dtype=torch.float64) for _ in range(3))
    state = attn.init_state(2, 2, 4, 4, dtype=torch.float64, capacity=30)
    assert isinstance(state, KVCache) and state.capacity == 30
    outs = []
    for t in range(30):
        out, state = attn.step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2), attn(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"heads": 0}, "heads must be a positive int"), ({"capacity": -1}, "capacity must be an int >= 0")],
)
def test_init_state_names_a_bad_argument(kwargs, match):
    args = {"batch": 1, "heads": 2, "head_dim": 4, "value_dim": 4} | kwargs
    capacity = args.pop("capacity", 0)
    with pytest.raises(ValueError, match=match):
        attnzoo.build("softmax").init_state(*args.values(), capacity=capacity)


def test_step_checks_its_inputs_once_for_every_mechanism():
    state = attnzoo.build("local", left=2, right=0).init_state(1, 2, 4, 4)
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match="k"):
        attnzoo.build("local", left=2, right=0).step(state, q, torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))


def test_a_step_gathers_only_the_keys_its_row_sees_and_rows_that_see_none_are_zero():
    # global token 5 alone: causal rows 0..4 see no key (zeros, as in the forward); strided rows
    # see t / 4 of the t cached keys, which a step gathers instead of masking all of them.
    for name, config in (("global", {"indices": (5,)}), ("strided", {"stride": 4})):
        attn = attnzoo.build(name, **config).double().eval()
        q, k, v = (torch.randn(2, 2, 40, 4, dtype=torch.float64) for _ in range(3))
        state, outs = attn.init_state(2, 2, 4, 4, dtype=torch.float64), []
        for t in range(40):
            out, state = attn.step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, 2), attn(q, k, v, causal=True), rtol=1e-12, atol=1e-12)
    seen = pattern_decode._seen_keys_only(k, v, torch.arange(40)[None, None, :] % 4 == 3)
    assert seen[0].shape[2] == 10 and seen[2].all()
