"""``hierarchical`` (BP-Transformer): the graph rule, fast path vs dense oracle on awkward sizes
(float64 and float32), limit laws, and the decode state's size. (tests/test_contracts.py holds
the default config to the protocol: padding, causal prefixes, memory, step == forward.)"""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms.base import AttendArgs
from attnzoo.mechanisms.hierarchical import (
    HierarchicalConfig,
    dense_graph_mask,
    dense_membership,
    hierarchical_graph,
    level_offsets,
    reference_hierarchical,
)
from conftest import grads, make_qkv, padding_mask
from tolerances import assert_close_to_golden, assert_same

CASES = [(n, causal, pad) for n in (37, 64) for causal in (False, True) for pad in (False, True)]


def _graph_matrix(n, k, causal):
    offsets = level_offsets(n)
    g = hierarchical_graph(n, k, causal)
    m = torch.zeros(n, offsets[-1] + 1, dtype=torch.bool)
    for i, nodes in enumerate(g):
        for level, j in nodes:
            m[i, offsets[level] + j] = True
    return m


@pytest.mark.parametrize("n", [1, 2, 5, 37, 64])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_graph_matches_dense_rule_and_partitions_the_sequence(n, k, causal):
    g = _graph_matrix(n, k, causal)
    assert torch.equal(g, dense_graph_mask(n, k, causal))
    assert all(len(set(nodes)) == len(nodes) for nodes in hierarchical_graph(n, k, causal))
    # each token's spans cover every position (causal: every position <= i) exactly once
    cover = g.double() @ dense_membership(n).double()
    expected = torch.ones(n, n, dtype=torch.float64)
    assert torch.equal(cover, torch.tril(expected) if causal else expected)


@pytest.mark.parametrize("n,causal,pad", CASES)
@pytest.mark.parametrize("slabs", [False, True], ids=["one-slab", "a-slab-per-row"])
def test_fast_equals_reference_forward_and_gradients(n, causal, pad, slabs, monkeypatch):
    # With slabs, each (batch, head) row runs alone (_ops.in_slabs), with its batch row's padding.
    if slabs:
        monkeypatch.setattr(attnzoo.mechanisms._ops, "SLAB_BYTES", 1)
    attn = attnzoo.build("hierarchical", k=3)
    q, k, v = make_qkv(2, 3, n, n)
    mask = padding_mask(2, n) if pad else None
    out = attn(q, k, v, causal=causal, key_mask=mask)
    cfg, args = HierarchicalConfig(k=3), AttendArgs(causal, mask, None)
    ref = reference_hierarchical(q, k, v, cfg, args)
    assert_same(out, ref)
    ref_grads = grads(ref, (q, k, v))
    for a, b in zip(grads(out, (q, k, v)), ref_grads):
        assert_same(a, b, what="gradient")
    if pad:  # batch 0 is all padding: its rows see nothing
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    # float32 fast path vs float32 reference, both against the float64 golden
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out32 = attn(q32, k32, v32, causal=causal, key_mask=mask)
    ref32 = reference_hierarchical(q32, k32, v32, cfg, args)
    assert_close_to_golden(out32, ref32, ref)
    for a, b, g in zip(grads(out32, (q32, k32, v32)), grads(ref32, (q32, k32, v32)), ref_grads):
        assert_close_to_golden(a, b, g, what="gradient")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_causal_spans_are_complete_and_among_the_last_2k_plus_1_of_their_level(k):
    # Every span a causal token attends to ends at or before it, whatever the sequence's length
    # (so a decode step has seen it), and is among the last 2k + 1 complete spans of its level
    # (the ring a SpanTree keeps per level).
    for i, nodes in enumerate(hierarchical_graph(2048, k, True)):
        assert all(j < ((i + 1) >> level) <= j + 2 * k + 1 for level, j in nodes), i


@pytest.mark.parametrize("k", [1, 4])
def test_attended_nodes_grow_like_k_log_n(k):
    for n in (64, 256, 1024):
        most = max(len(nodes) for nodes in hierarchical_graph(n, k, False))
        assert most <= 2 * k + 1 + 2 * (k + 1) * math.ceil(math.log2(n))
        assert most <= 5 * k * math.log2(n)
    assert max(len(x) for x in hierarchical_graph(1024, 4, False)) < 1024 // 8


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pad", [False, True])
def test_k_at_least_n_is_full_attention(causal, pad):
    n = 37
    q, k, v = make_qkv(2, 3, n, n)
    mask = padding_mask(2, n) if pad else None
    assert all(level == 0 for nodes in hierarchical_graph(n, n, causal) for level, _ in nodes)
    out = attnzoo.build("hierarchical", k=n)(q, k, v, causal=causal, key_mask=mask)
    assert_same(out, reference_attention(q, k, v, causal=causal, key_mask=mask))


@pytest.mark.parametrize("n,causal,pad", CASES[:4])
def test_implied_attention_times_v_is_forward(n, causal, pad):
    attn = attnzoo.build("hierarchical", k=2)
    q, k, v = make_qkv(2, 3, n, n, requires_grad=False)
    mask = padding_mask(2, n) if pad else None
    w = attn.implied_attention(q, k, causal=causal, key_mask=mask)
    assert w.shape == (2, 3, n, n)
    assert_same(w @ v, attn(q, k, v, causal=causal, key_mask=mask))
    if mask is not None:
        assert torch.all(w[~mask[:, None, None, :].expand_as(w)] == 0)
        rows = w.sum(-1)
        assert_same(rows[1:], torch.ones_like(rows[1:]))
        assert torch.all(rows[0] == 0)


@pytest.mark.parametrize("k", [1, 2])
def test_decode_state_grows_like_log_t_and_steps_equal_the_forward(k):
    # Longer than the contract test's 77 tokens, small k (the ring bound is tightest), random
    # padding, and a step of many tokens over a non-empty tree.
    n, d, d_v = 300, 3, 5
    attn = attnzoo.build("hierarchical", k=k).double()
    g = torch.Generator().manual_seed(k)
    q, key = (torch.randn(2, 2, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, n, d_v, generator=g, dtype=torch.float64)
    mask = torch.rand(2, n, generator=g) > 0.3
    state, outs = attn.init_state(2, 2, d, d_v, dtype=torch.float64), []
    for lo, hi in ((0, 1), (1, 100), *((t, t + 1) for t in range(100, n))):
        out, state = attn.step(state, q[:, :, lo:hi], key[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
        outs.append(out)
        assert state.sums.shape == (2, 2, hi.bit_length() + 1, 2 * k + 1, d + d_v)  # no token kept
    assert_same(torch.cat(outs, 2), attn(q, key, v, causal=True, key_mask=mask))


def test_build_and_spec():
    spec = attnzoo.describe("hierarchical")
    assert spec.family == "hierarchical" and "1911.04070" in spec.paper
    caps = spec.capabilities
    assert caps.causal and caps.key_mask and not caps.cross_attention and not caps.score_mod
    assert spec.complexity.subquadratic_memory
    attn = attnzoo.build("hierarchical", k=8)
    assert attn.config.k == 8
    with pytest.raises(ValueError, match="k must be >= 1"):
        attnzoo.build("hierarchical", k=0)
    q, k, v = make_qkv(2, 3, 10, 12)
    with pytest.raises(ValueError):
        attn(q, k, v)
