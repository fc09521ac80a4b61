"""Sized configs: on the quick tasks' short sequences every pattern mechanism is really sparse
(its defaults would cover the whole sequence and make it full attention)."""

from __future__ import annotations

import pytest

import attnzoo
from attnzoo.bench.configs import sized


@pytest.mark.parametrize("n", [64, 100])
@pytest.mark.parametrize("name", attnzoo.names(family="sparse"))
def test_sized_patterns_fit_the_length_and_drop_most_pairs(name, n):
    pattern = attnzoo.build(name, **sized(name, n)).pattern.resolve_heads(4)
    density = float(pattern.dense(n).float().mean())
    assert 0 < density < 0.6, (name, n, density)


def test_defaults_are_full_attention_at_quick_lengths_which_is_why_sizing_exists():
    pattern = attnzoo.build("local").pattern
    assert bool(pattern.dense(64).all())  # left = right = 64 by default


@pytest.mark.parametrize("n", [4, 8, 12])
def test_every_mechanism_builds_and_runs_sized_for_short_lengths(n):
    import torch

    for name in attnzoo.names():
        attn = attnzoo.build(name, **sized(name, n))
        if attnzoo.describe(name).capabilities.kind == "attention":
            fields = attnzoo.registry.config_fields(name)
            h, d = (fields.get(key, (None, 0))[1] or default for key, default in (("heads", 2), ("head_dim", 8)))
            q = torch.randn(1, h, n, d)
            causal = not attnzoo.describe(name).capabilities.bidirectional
            assert attn(q, q, q, causal=causal).shape == q.shape, name
