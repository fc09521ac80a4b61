"""Attention-free token mixers (family "mixing"): fnet, gmlp, mixer."""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo
from attnzoo.mechanisms.base import TokenMixer
from attnzoo.nn import TransformerEncoder, TransformerEncoderLayer

MIXERS = ["fnet", "gmlp", "mixer"]


def _x(b: int = 2, n: int = 12, dim: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _dft(n: int) -> torch.Tensor:
    idx = torch.arange(n, dtype=torch.float64)
    angle = -2 * math.pi * idx[:, None] * idx[None, :] / n
    return torch.complex(torch.cos(angle), torch.sin(angle))


def test_registered_as_mixers_with_defaults():
    assert attnzoo.names(family="mixing") == MIXERS == attnzoo.names(kind="mixer")
    for name in MIXERS:
        spec = attnzoo.describe(name)
        assert spec.capabilities.kind == "mixer" and "arxiv.org" in spec.paper
        module = attnzoo.build(name)
        assert isinstance(module, TokenMixer) and module.spec is spec and module.config.dim == 64
        assert module(torch.randn(2, 8, 64)).shape == (2, 8, 64)
    assert attnzoo.describe("gmlp").capabilities.causal
    assert not attnzoo.describe("fnet").capabilities.causal and not attnzoo.describe("mixer").capabilities.causal


def test_fnet_equals_explicit_dft_matrices():
    x = _x(n=12, dim=16)
    expected = (_dft(12) @ (x.to(torch.complex128) @ _dft(16).T)).real
    out = attnzoo.build("fnet", dim=16)(x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert len(list(attnzoo.build("fnet").parameters())) == 0


def test_gmlp_gate_is_near_one_at_init():
    module = attnzoo.build("gmlp", dim=16, max_len=32).double()
    x = _x(n=20, dim=16)
    u = torch.nn.functional.gelu(module.proj_in(x)).chunk(2, dim=-1)[0]
    plain = module.proj_out(u)  # the output if the gate v' were exactly 1
    out = module(x)
    assert (out - plain).abs().max() < 1e-3 * plain.abs().max()
    # and exactly so with the spatial weight zero (bias 1): v' == 1
    with torch.no_grad():
        module.spatial_weight.zero_()
    torch.testing.assert_close(module(x), plain)
    assert torch.equal(module.spatial_bias, torch.ones(32, dtype=torch.float64))


def test_gmlp_causal_future_cannot_change_the_past():
    module = attnzoo.build("gmlp", dim=16, max_len=32).double()
    with torch.no_grad():  # make the spatial mixing strong, so leakage would show
        module.spatial_weight.normal_()
    x = _x(n=20, dim=16)
    x2 = x.clone()
    x2[:, 12:] = torch.randn_like(x2[:, 12:]) * 3
    a, b = module(x, causal=True), module(x2, causal=True)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-12)
    assert not torch.allclose(module(x)[:, :12], module(x2)[:, :12])  # not causal: it leaks


@pytest.mark.parametrize("name", ["fnet", "mixer"])
def test_non_causal_mixers_refuse_causal_naming_those_that_can(name):
    module = attnzoo.build(name, dim=16)
    with pytest.raises(ValueError, match=rf"'{name}' does not support causal=True; token mixers that do: gmlp"):
        module(_x().float(), causal=True)
    layer = TransformerEncoderLayer(16, 2, name)
    with pytest.raises(ValueError, match="token mixers that do: gmlp"):
        layer(torch.randn(2, 8, 16), causal=True)


@pytest.mark.parametrize("name", ["gmlp", "mixer"])
def test_longer_than_max_len_raises(name):
    module = attnzoo.build(name, dim=16, max_len=8)
    with pytest.raises(ValueError, match="max_len=8 .* got N=9"):
        module(torch.randn(1, 9, 16))
    assert module(torch.randn(1, 5, 16)).shape == (1, 5, 16)  # shorter uses the first rows/cols


def test_input_validation():
    module = attnzoo.build("gmlp", dim=16)
    with pytest.raises(ValueError, match="last dimension dim=16"):
        module(torch.randn(2, 8, 12))
    with pytest.raises(ValueError, match="3 dimensions"):
        module(torch.randn(8, 16))
    with pytest.raises(TypeError, match="causal must be a bool"):
        module(torch.randn(2, 8, 16), causal=1)
    with pytest.raises(TypeError, match="torch.bool"):
        module(torch.randn(2, 8, 16), key_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="shape"):
        module(torch.randn(2, 8, 16), key_mask=torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="dim must be >= 1"):
        attnzoo.build("mixer", dim=0)


@pytest.mark.parametrize("name", MIXERS)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_content_changes_nothing_real(name, causal):
    if causal and not attnzoo.describe(name).capabilities.causal:
        return
    module = attnzoo.build(name, dim=16, **({} if name == "fnet" else {"max_len": 32})).double()
    x = _x(n=20, dim=16)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, 14:] = False
    x2 = x.clone()
    x2[0, 14:] = torch.randn_like(x2[0, 14:]) * 5
    out, changed = module(x, key_mask=mask, causal=causal), module(x2, key_mask=mask, causal=causal)
    torch.testing.assert_close(changed[0, :14], out[0, :14], rtol=0, atol=1e-12)
    assert torch.equal(out[0, 14:], torch.zeros_like(out[0, 14:]))  # padded outputs are zero
    torch.testing.assert_close(out[1], module(x[1:], causal=causal)[0])  # unpadded row unaffected


def test_fnet_padding_length_still_matters():
    """What holds for fnet: padded content is ignored (above), but the FFT runs over all N
    positions, so real outputs are not those of the unpadded sequence alone."""
    module = attnzoo.build("fnet", dim=16)
    x = _x(b=1, n=20, dim=16)
    mask = torch.arange(20)[None] < 14
    padded = module(x, key_mask=mask)[0, :14]
    alone = module(x[:, :14])[0]
    assert not torch.allclose(padded, alone)


def test_gmlp_and_mixer_padding_at_the_end_equals_the_shorter_sequence():
    for name in ("gmlp", "mixer"):
        module = attnzoo.build(name, dim=16, max_len=32).double()
        x = _x(b=1, n=20, dim=16)
        mask = torch.arange(20)[None] < 14
        torch.testing.assert_close(module(x, key_mask=mask)[0, :14], module(x[:, :14])[0])


@pytest.mark.parametrize("name", MIXERS)
def test_inside_layers_and_encoder_and_trains(name):
    layer = TransformerEncoderLayer(64, 4, name)
    assert layer.attn is None and layer.mixer.spec.name == name and layer.mixer.config.dim == 64
    x = torch.randn(2, 10, 64)
    assert layer(x).shape == (2, 10, 64)
    with pytest.raises(ValueError, match="no decode step"):
        layer.init_state(2)
    torch.manual_seed(0)
    model = TransformerEncoder(32, 2, 4, name, **({} if name == "fnet" else {"max_len": 16}))
    x = torch.randn(4, 12, 32)
    target = x + x.mean(dim=1, keepdim=True)  # needs token mixing (a sequence mean)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_layer_dim_conflicts_and_positional_are_refused():
    # (dim=... cannot reach **mechanism_config: it is the layer's own argument, so the layer's
    # dim always wins for a mixer named by string; a built mixer must match it.)
    assert TransformerEncoderLayer(64, 4, "gmlp", max_len=20).mixer.config.max_len == 20
    with pytest.raises(ValueError, match="was built with dim=16"):
        TransformerEncoderLayer(64, 4, attnzoo.build("fnet", dim=16))
    with pytest.raises(ValueError, match="positional encodings act inside attention"):
        TransformerEncoderLayer(64, 4, "fnet", positional="rope")
    with pytest.raises(ValueError, match="depth > 1"):
        TransformerEncoder(64, 2, 4, attnzoo.build("fnet"))
    with pytest.raises(ValueError, match="token mixer"):
        attnzoo.nn.MultiHeadAttention(64, 4, "fnet")


def test_causal_lm_with_a_token_mixer():
    import attnzoo as az

    lm = az.nn.CausalLM(vocab_size=20, dim=32, depth=1, heads=4, mechanism="gmlp", positional=None, max_len=16)
    assert lm(torch.randint(0, 20, (2, 10))).shape == (2, 10, 20)
    with pytest.raises(ValueError, match="does not support causal"):
        az.nn.CausalLM(vocab_size=20, dim=32, depth=1, heads=4, mechanism="fnet", positional=None)
    with pytest.raises(ValueError, match="no decode step"):
        lm.init_state(2)


def test_feedforward_false_makes_the_layer_the_papers_gmlp_block():
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(16, 2, "gmlp", max_len=12, feedforward=False).double()
    assert layer.ff is None and layer.norm2 is None
    assert not any(name.startswith(("ff.", "norm2.")) for name in layer.state_dict())
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 9:] = False
    for causal in (False, True):  # x + gMLP(LN(x)): the block of Liu et al. 2021, nothing after it
        expected = x + layer.mixer(layer.norm1(x), causal=causal, key_mask=mask)
        torch.testing.assert_close(layer(x, causal=causal, key_mask=mask), expected, rtol=0, atol=0)
    default = TransformerEncoderLayer(16, 2, "gmlp", max_len=12)
    assert default.ff is not None  # unchanged unless asked
    encoder = TransformerEncoder(16, 2, 2, "gmlp", max_len=12, feedforward=False)
    assert all(block.ff is None for block in encoder.layers)
    lm = attnzoo.nn.CausalLM(
        vocab_size=7, dim=16, depth=1, heads=2, mechanism="gmlp", positional=None, max_len=12, feedforward=False
    )
    assert lm.decoder.layers[0].ff is None and lm(torch.randint(0, 7, (1, 5))).shape == (1, 5, 7)
    with pytest.raises(TypeError, match="feedforward must be a bool"):
        TransformerEncoderLayer(16, 2, "gmlp", feedforward="no")
