"""graph_attention: CSR-style gather == masked dense attention on the adjacency, any degree."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.mechanisms.graph import degree_buckets, reference_graph_attention
from conftest import grads, padding_mask
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
    out = module(q, k, v, causal=causal, key_padding_mask=mask)
    ref = reference_graph_attention(q, k, v, module.graph, causal=causal, key_padding_mask=mask)
    assert_same(out, ref)
    for got, want, name in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_same(got, want, what=f"d{name}")
    if padded:
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    assert_close_to_golden(module(qf, kf, vf, causal=causal), reference_graph_attention(qf, kf, vf, module.graph, causal=causal),
                           reference_graph_attention(q, k, v, module.graph, causal=causal).detach())


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
    q, k, v = torch.randn(3, 1, 2, 12, 8, dtype=torch.float64).unbind(0)
    weights = module.implied_attention(q, k, causal=True)
    assert_same(weights @ v, module(q, k, v, causal=True))
    assert torch.equal(weights[0, 0] > 0, (module.graph.dense(12) & torch.ones(12, 12, dtype=torch.bool).tril()))
    with pytest.raises(ValueError, match="built for n=12"):
        module(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    with pytest.raises(ValueError, match=r"\[0, n=3\)"):
        attnzoo.build("graph_attention", edges=((0, 5),), n=3)
