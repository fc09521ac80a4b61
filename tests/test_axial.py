"""nn.AxialAttention (Ho et al. 2019): a row pass then a column pass, each its own softmax, against a
double-loop oracle (forward and gradients), its causal receptive field, and shape checks; and the
registered ``axial`` pattern, which is something else (one softmax over row and column)."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.nn import AxialAttention
from conftest import grads
from oracles import oracle_axial_attention
from tolerances import assert_same

H, W, DIM, HEADS = 3, 4, 6, 2


def _params(part: torch.nn.Module) -> list[torch.Tensor | None]:
    return [t for p in (part.q_proj, part.k_proj, part.v_proj, part.out_proj) for t in (p.weight, p.bias)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_the_double_loop_oracle_forward_and_gradients(causal, bias):
    layer = AxialAttention(DIM, HEADS, shape=(H, W), causal=causal, bias=bias).double()
    x = torch.randn(2, H * W, DIM, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    expected = oracle_axial_attention(x, H, W, HEADS, _params(layer.row), _params(layer.column), causal=causal)
    assert out.shape == (2, H * W, DIM)
    assert_same(out, expected)
    inputs = (x, *layer.parameters())
    for got, want in zip(grads(out, inputs), grads(expected, inputs)):
        assert_same(got, want, what="gradient")


def test_the_passes_have_their_own_softmax_and_projections():
    layer = AxialAttention(DIM, HEADS, shape=(H, W)).double()
    assert not any(p is q for p in layer.row.parameters() for q in layer.column.parameters())
    x = torch.randn(1, H * W, DIM, dtype=torch.float64)
    assert_same(layer(x), layer.column_attention(layer.row_attention(x)))


def _dependence(layer: AxialAttention, n: int) -> torch.Tensor:
    """(N, N) bool: output token i depends on input token j (from the Jacobian)."""
    x = torch.randn(1, n, DIM, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda t: layer(t), x)  # (1, N, DIM, 1, N, DIM)
    return jac[0, :, :, 0].abs().sum(dim=(1, 3)) > 0


def test_receptive_fields():
    full = _dependence(AxialAttention(DIM, HEADS, shape=(H, W)).double(), H * W)
    assert full.all()  # every token sees the whole grid in one layer
    seen = _dependence(AxialAttention(DIM, HEADS, shape=(H, W), causal=True).double(), H * W)
    expected = torch.tensor([[j // W <= i // W and j % W <= i % W for j in range(H * W)] for i in range(H * W)])
    assert torch.equal(seen, expected)


def test_causal_outputs_ignore_later_raster_positions():
    layer = AxialAttention(DIM, HEADS, shape=(H, W), causal=True).double()
    x = torch.randn(2, H * W, DIM, dtype=torch.float64)
    out = layer(x)
    for p in range(H * W):
        x2 = x.clone()
        x2[:, p:] += 10 * torch.randn(2, H * W - p, DIM, dtype=torch.float64)
        assert torch.equal(layer(x2)[:, :p], out[:, :p])
        assert not torch.allclose(layer(x2)[:, p], out[:, p])


def test_float32_matches_float64():
    layer = AxialAttention(DIM, HEADS, shape=(H, W), causal=True)
    x = torch.randn(2, H * W, DIM)
    assert_same(layer(x), layer.double()(x.double()).float())


def test_bad_shapes_and_arguments_raise():
    layer = AxialAttention(DIM, HEADS, shape=(H, W))
    with pytest.raises(ValueError, match=r"shape=\(3, 4\) needs N = h\*w = 12 .* got N=10"):
        layer(torch.randn(1, 10, DIM))
    with pytest.raises(ValueError, match="width dim=6"):
        layer(torch.randn(1, 12, 5))
    with pytest.raises(ValueError, match="shape must be a pair"):
        AxialAttention(DIM, HEADS, shape=12)
    with pytest.raises(ValueError, match=r"shape\[1\] \(w\) must be an int >= 1"):
        AxialAttention(DIM, HEADS, shape=(3, 0))
    with pytest.raises(ValueError, match="divisible by heads"):
        AxialAttention(DIM, 4, shape=(H, W))


def test_registered_axial_pattern_says_it_is_not_ho_et_al():
    spec = attnzoo.describe("axial")
    text = " ".join((spec.summary, *spec.notes))
    assert "one softmax" in text and "nn.AxialAttention" in text
