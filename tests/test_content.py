"""The DESIGN contracts, checked for every registered content-based mechanism (family
"content"): strong causality or a clear refusal, padding that changes nothing real, fully
padded rows that give zeros, eval-mode determinism, and implied_attention that is what the
forward pass applies."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from conftest import padding_mask
from tolerances import assert_same

CONTENT = attnzoo.names(family="content")
N = 48


def _module(name: str) -> torch.nn.Module:
    return attnzoo.build(name).double().eval()


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, N, 64, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("name", CONTENT)
def test_causal_in_the_strong_sense_or_refused(name):
    module, (q, k, v) = _module(name), _inputs()
    if not attnzoo.describe(name).capabilities.causal:
        with pytest.raises(ValueError, match="does not support causal"):
            module(q, k, v, causal=True)
        return
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :, 30:] = torch.randn_like(t[:, :, 30:]) * 3
    before, after = module(q, k, v, causal=True), module(q2, k2, v2, causal=True)
    assert_same(after[:, :, :30], before[:, :, :30], what=f"{name}: outputs before the change")


@pytest.mark.parametrize("name", CONTENT)
def test_padding_changes_nothing_real_and_empty_rows_are_zero(name):
    module, (q, k, v) = _module(name), _inputs()
    mask = padding_mask(2, N)  # batch 0: every key padded
    mask[1, 40:] = False
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[1, :, 40:] = torch.randn_like(t[1, :, 40:]) * 5
    for causal in (False, True) if attnzoo.describe(name).capabilities.causal else (False,):
        out = module(q, k, v, causal=causal, key_padding_mask=mask)
        assert torch.isfinite(out).all()
        assert torch.equal(out[0], torch.zeros_like(out[0])), f"{name}: fully padded rows must be zero"
        changed = module(q2, k2, v2, causal=causal, key_padding_mask=mask)
        assert_same(changed[1, :, :40], out[1, :, :40], what=f"{name}: real outputs after changing padding")


@pytest.mark.parametrize("name", CONTENT)
def test_eval_mode_is_deterministic_and_implied_attention_is_what_it_applies(name):
    module, (q, k, v) = _module(name), _inputs(1)
    out = module(q, k, v)
    assert torch.equal(out, module(q, k, v))
    weights = module.implied_attention(q, k)
    assert weights.shape == (2, 2, N, N) and bool((weights >= 0).all())
    assert_same(weights.to(v.dtype) @ v, out, what=f"{name}: implied_attention @ v vs forward")
