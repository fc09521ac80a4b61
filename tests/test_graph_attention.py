"""graph_attention: CSR-style gather == masked dense attention on the adjacency, any degree."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.mechanisms import graph as graph_module
from attnzoo.mechanisms.graph import GraphArgs, degree_buckets, reference_graph_attention
from conftest import LargestTensor as Largest
from conftest import grads, padding_mask
from oracles import oracle_gat_attention
from tolerances import assert_close_to_golden, assert_same


def star_plus_ring(n: int) -> tuple[tuple[int, int], ...]:
    """A hub (node 0) attending to and attended by everyone, plus a ring: a skewed degree
    distribution (degree n for the hub, 3-4 for the rest)."""
    edges = {(0, j) for j in range(n)} | {(j, 0) for j in range(n)}
    edges |= {(i, (i + 1) % n) for i in range(n)} | {(i, (i - 1) % n) for i in range(n)}
    return tuple(sorted(edges))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_gather_equals_dense_adjacency_attention(causal, padded):
    n = 37
    module = attnzoo.build("graph_attention", edges=star_plus_ring(n), n=n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = padding_mask(2, n) if padded else None
    out = module(q, k, v, causal=causal, key_mask=mask)
    ref = reference_graph_attention(q, k, v, GraphArgs(module.graph, causal=causal, key_mask=mask))
    assert_same(out, ref)
    for got, want, name in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_same(got, want, what=f"d{name}")
    if padded:
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    assert_close_to_golden(
        module(qf, kf, vf, causal=causal),
        reference_graph_attention(qf, kf, vf, GraphArgs(module.graph, causal=causal)),
        reference_graph_attention(q, k, v, GraphArgs(module.graph, causal=causal)).detach(),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_dot_scores_on_even_degrees_run_as_sparse_rows_and_a_hub_in_degree_buckets(causal, monkeypatch):
    # Degrees within a few of each other: CSR products over each node's neighbours (the blocked
    # backend's gathered path), equal to the dense adjacency attention with padding, forward
    # and gradients (causal: on a prefix of the nodes too). A hub keeps the degree buckets.
    n = 41
    g = torch.Generator().manual_seed(1)
    edges = tuple((i, int(j)) for i in range(n) for j in torch.randint(0, n, (5,), generator=g))
    m = 30 if causal else n
    q, k, v = (torch.randn(2, 3, m, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = padding_mask(2, m)

    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the other path ran")

    for graph_edges, other in ((edges, "graph_attention"), (star_plus_ring(n), "gathered_attention")):
        module = attnzoo.build("graph_attention", edges=graph_edges, n=n)
        with monkeypatch.context() as patched:
            patched.setattr(graph_module, other, boom)
            out = module(q, k, v, causal=causal, key_mask=mask)
        ref = module.reference(q, k, v, causal=causal, key_mask=mask)
        assert_same(out, ref)
        for got, want, name in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
            assert_same(got, want, what=f"d{name}")


def test_degree_buckets_bound_the_padding():
    n = 200
    module = attnzoo.build("graph_attention", edges=star_plus_ring(n), n=n)
    buckets = degree_buckets(module.graph)
    slots = sum(nb.numel() for _, nb in buckets)
    edges = module.graph.edge_keys.numel()
    assert slots <= 2 * edges  # padding to the bucket's max degree at most doubles the work
    assert max(nb.shape[1] for _, nb in buckets) == n  # the hub keeps its full degree


def test_implied_attention_and_errors():
    module = attnzoo.build("graph_attention", edges=star_plus_ring(12), n=12)
    q, k = torch.randn(2, 1, 2, 12, 8, dtype=torch.float64).unbind(0)
    weights = module.implied_attention(q, k, causal=True)
    assert torch.equal(weights[0, 0] > 0, (module.graph.dense(12) & torch.ones(12, 12, dtype=torch.bool).tril()))
    with pytest.raises(ValueError, match="built for n=12"):
        module(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    with pytest.raises(ValueError, match=r"\[0, n=3\)"):
        attnzoo.build("graph_attention", edges=((0, 5),), n=3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_gat_score_matches_the_edge_loop_oracle(causal, padded):
    n, heads, d = 9, 2, 4
    edges = star_plus_ring(n)[::2]  # uneven degrees, some nodes without a self-loop partner
    module = attnzoo.build("graph_attention", edges=edges, n=n, score="gat", heads=heads, head_dim=d).double()
    q, k, v = (torch.randn(2, heads, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = padding_mask(2, n) if padded else None
    out = module(q, k, v, causal=causal, key_mask=mask)
    expected = oracle_gat_attention(q, k, v, edges, n, module.attention_vector, causal=causal, key_mask=mask)
    assert_same(out, expected)
    inputs = (q, k, v, module.attention_vector)
    for got, want, name in zip(grads(out, inputs), grads(expected, inputs), ("q", "k", "v", "a")):
        assert_same(got, want, what=f"d{name}")
    dense = reference_graph_attention(
        q, k, v, GraphArgs(module.graph, causal, mask, attention_vector=module.attention_vector)
    )
    assert_same(dense, out, what="dense reference")
    assert_same(module.implied_attention(q, k, causal=causal, key_mask=mask) @ v, out)


def test_gat_score_is_additive_not_dot_product():
    # GAT's e_ij = LeakyReLU(a_1.q_i + a_2.k_j): with LeakyReLU monotone, every query ranks its
    # neighbours by a_2.k_j alone, so all queries on a complete graph get the same argmax key.
    n = 6
    edges = tuple((i, j) for i in range(n) for j in range(n))
    gat = attnzoo.build("graph_attention", edges=edges, n=n, score="gat", heads=1, head_dim=4).double()
    q, k = torch.randn(2, 1, 1, n, 4, dtype=torch.float64).unbind(0)
    assert gat.implied_attention(q, k)[0, 0].argmax(-1).unique().numel() == 1
    dot = attnzoo.build("graph_attention", edges=edges, n=n).double()
    assert dot.implied_attention(q, k)[0, 0].argmax(-1).unique().numel() > 1


def test_gat_config_checks():
    with pytest.raises(ValueError, match="scale applies to score='dot' only"):
        attnzoo.build("graph_attention", score="gat", scale=0.5)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        attnzoo.build("graph_attention", score="gat", head_dim=0)
    module = attnzoo.build("graph_attention", edges=star_plus_ring(5), n=5, score="gat", heads=2, head_dim=4)
    with pytest.raises(ValueError, match="built for heads=2, head_dim=4 but q has H=3, D=4"):
        module(*(torch.randn(1, 3, 5, 4) for _ in range(3)))
    assert module.attention_vector.shape == (2, 2, 4)
    assert attnzoo.build("graph_attention").attention_vector is None


def test_gat_score_allocates_nothing_quadratic():
    n = 2048
    ring = tuple((i, (i + d) % n) for i in range(n) for d in (-1, 1))
    module = attnzoo.build("graph_attention", edges=ring, n=n, score="gat", heads=2, head_dim=8)
    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    with Largest() as largest:
        module(q, k, v)
    assert largest.numel < n * n // 8


@pytest.mark.parametrize("score", ["dot", "gat"])
def test_decode_steps_follow_the_edges_up_to_node_n(score):
    # The contract test decodes the dot score on a ring with chords; here GAT's score too, and a
    # hub (degree n, padded in batch row 1) in steps of several nodes, then the refusal at node n.
    n, heads, d = 23, 2, 4
    edges = star_plus_ring(n)
    module = attnzoo.build("graph_attention", edges=edges, n=n, score=score, heads=heads, head_dim=d).double()
    q, k, v = torch.randn(3, 2, heads, n, d, dtype=torch.float64).unbind(0)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :3], mask[1, 0] = False, False
    state, outs = module.init_state(2, heads, d, d, dtype=torch.float64), []
    for lo, hi in ((0, 4), (4, 5), (5, 15), *((t, t + 1) for t in range(15, n))):
        out, state = module.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
        outs.append(out)
    assert_same(torch.cat(outs, 2), module(q, k, v, causal=True, key_mask=mask))
    # Causal, the forward also takes the first nodes alone: what has been decoded so far.
    prefix = module(q[:, :, :9], k[:, :, :9], v[:, :, :9], causal=True, key_mask=mask[:, :9])
    assert_same(prefix, torch.cat(outs, 2)[:, :, :9])
    with pytest.raises(ValueError, match="reach node 23, but the graph has n=23 nodes"):
        module.step(state, q[:, :, :1], k[:, :, :1], v[:, :, :1])
