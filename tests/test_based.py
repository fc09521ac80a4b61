"""Based (Arora et al. 2024, https://arxiv.org/abs/2402.18668) beyond the contracts
(tests/test_contracts.py): the plain function ``taylor_linear_attention`` and its dense reference
against the independent oracle of ``oracles_modern.py`` (outputs and gradients, N = 37 against
chunks of 16 and 64, causal and not, padded, with a batch row that is all padding), the Taylor
feature map's identity, the mechanism as its projection followed by the function, decode steps
and a state whose size does not grow, and the refusals of bad configs and inputs."""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo
from attnzoo.mechanisms import based
from conftest import grads, largest_tensor
from oracles_modern import oracle_taylor_linear_attention
from tolerances import assert_same

B, H, N, D, DV = 2, 3, 37, 4, 5
F64 = torch.float64


def _inputs(seed: int = 0, n: int = N, d: int = D) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, d, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(B, H, n, DV, generator=g, dtype=F64)
    return tuple(x.requires_grad_() for x in (q, k, v))


def _mask(n: int = N) -> torch.Tensor:
    """Batch 0 all padding (every row sees no key); batch 1 padded left (5) and right (3), so
    its first causal rows see no key either."""
    mask = torch.zeros(B, n, dtype=torch.bool)
    mask[1, 5 : n - 3] = True
    return mask


@pytest.mark.parametrize("chunk", [16, 64])  # 37 = 2 x 16 + 5: state carried over chunks; one partial chunk
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_the_function_and_its_reference_equal_the_oracle_forward_and_gradients(monkeypatch, chunk, causal, padded):
    monkeypatch.setattr(based, "CHUNK", chunk)
    inputs = _inputs()
    mask = _mask() if padded else None
    want = oracle_taylor_linear_attention(*inputs, causal=causal, key_mask=mask)
    want_grads = grads(want, inputs)
    what = f"chunk={chunk} causal={causal} padded={padded}"
    for fn in (based.taylor_linear_attention, based.reference_taylor_linear_attention):
        got = fn(*inputs, causal=causal, key_mask=mask)
        assert got.shape == (B, H, N, DV)
        assert_same(got, want, what=f"{fn.__name__} {what}: output")
        for i, (g_got, g_want) in enumerate(zip(grads(got, inputs), want_grads)):
            assert_same(g_got, g_want, what=f"{fn.__name__} {what}: gradient {i}")
    if padded:
        out = based.taylor_linear_attention(*inputs, causal=causal, key_mask=mask)
        assert not out[0].any(), "a batch row that is all padding sees no key: zeros"
        assert not causal or not out[1, :, :5].any(), "causal rows before the first real key: zeros"


def test_padded_keys_cannot_leak_whatever_they_hold():
    q, k, v = (x.detach() for x in _inputs(1))
    mask = _mask()
    k2, v2 = k.clone(), v.clone()
    k2[1, :, :5], v2[1, :, -3:] = math.nan, math.inf
    for causal in (False, True):
        want = based.taylor_linear_attention(q, k, v, causal=causal, key_mask=mask)
        got = based.taylor_linear_attention(q, k2, v2, causal=causal, key_mask=mask)
        assert torch.isfinite(got).all()
        assert_same(got, want, what=f"causal={causal}: NaN / inf in padded keys and values")


def test_the_taylor_feature_map_is_the_second_order_expansion_of_exp():
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(7, 16, generator=g, dtype=F64) for _ in range(2))
    phi_q, phi_k = based.taylor_features(q), based.taylor_features(k)
    # the paper's 1 + d + d^2 = 273 features at d = 16, each symmetric product x_i x_j stored once: 153
    assert phi_q.shape == (7, 153) == (7, based.taylor_size(16))
    s = q @ k.T
    want = 1 + s / 4 + s**2 / 32  # 1 + q.k / sqrt(d) + (q.k)^2 / (2 d)
    assert_same(phi_q @ phi_k.T, want, what="phi(q) . phi(k)")
    assert_same(based.taylor_pair_weights(q, k), want, what="the in-chunk weights without features")
    assert (want >= 0.5 - 1e-12).all(), "(1 + u)^2 / 2 + 1/2 >= 1/2"
    small = 1e-3 * q  # log(1 + x + x^2 / 2) = x - x^3 / 6 + ...: exp(x) to the third order
    torch.testing.assert_close((based.taylor_features(small) @ phi_k.T).log(), small @ k.T / 4, rtol=0, atol=1e-8)


def _model(**config: object) -> torch.nn.Module:
    return attnzoo.build("based", shape=attnzoo.Shape(heads=H, head_dim=D), **config).double().eval()


@pytest.mark.parametrize("causal", [False, True])
def test_the_mechanism_is_its_projection_then_the_function(causal):
    attn = _model(feature_dim=3)
    assert tuple(attn.projection.shape) == (H, D, 3), "made at construction from the Shape"
    inputs = _inputs(3)
    mask = _mask()
    w = attn.projection
    projected = tuple(torch.einsum("bhnd,hdf->bhnf", x, w) for x in inputs[:2])
    want = oracle_taylor_linear_attention(*projected, inputs[2], causal=causal, key_mask=mask)
    got = attn(*inputs, causal=causal, key_mask=mask)
    assert_same(got, want, what=f"causal={causal}: based vs oracle on q W_h, k W_h")
    params = (*inputs, w)
    for i, (g_got, g_want) in enumerate(zip(grads(got, params), grads(want, params))):
        assert_same(g_got, g_want, what=f"causal={causal}: gradient {i} (3: the projection)")


def test_decode_steps_equal_the_causal_forward_and_the_state_does_not_grow():
    attn = _model()
    q, k, v = (x.detach() for x in _inputs(4))
    mask = _mask()
    want = attn(q, k, v, causal=True, key_mask=mask)
    state = attn.init_state(B, H, D, DV, dtype=F64)
    size = 1 + 16 + 16 * 17 // 2  # the paper's feature_dim = 16: 273 features, 153 stored (x_i x_j once)
    shapes = {(tuple(state.s.shape), tuple(state.z.shape))}
    outs = []
    for lo, hi in [(0, 9), *((t, t + 1) for t in range(9, N))]:  # a prompt of 9, then token by token
        out, state = attn.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
        outs.append(out)
        shapes.add((tuple(state.s.shape), tuple(state.z.shape)))
    assert_same(torch.cat(outs, 2), want, what="prefill of 9 then steps vs forward")
    assert shapes == {((B, H, size, DV), (B, H, size))}, f"state shapes over positions: {shapes}"
    assert state.s[0].abs().sum() == 0 and state.z[0].abs().sum() == 0, "an all-padding row adds nothing"


def test_the_fast_path_never_makes_an_n_by_n_tensor():
    n = 512
    q, k, v = (x.detach() for x in _inputs(5, n=n))
    mask = torch.arange(n)[None].expand(B, n) < n - 7
    for causal in (False, True):
        largest = largest_tensor(based.taylor_linear_attention, q, k, v, causal=causal, key_mask=mask)
        assert largest < B * H * n * n // 4, f"causal={causal}: a tensor of {largest} elements"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"feature_dim": 0}, "feature_dim"),
        ({"chunk": 0}, "chunk"),
        ({"eps": 0.0}, "eps"),
        ({"eps": -1e-3}, "eps"),
        ({"heads": 0}, "heads"),
        ({"head_dim": 0}, "head_dim"),
    ],
)
def test_bad_config_values_are_refused_naming_the_field(values, field):
    with pytest.raises(ValueError, match=f"BasedConfig: {field} must be"):
        attnzoo.build("based", **values)


def test_bad_inputs_are_refused_naming_the_argument():
    q, k, v = (x.detach() for x in _inputs(6))
    call = based.taylor_linear_attention
    with pytest.raises(ValueError, match="eps"):
        call(q, k, v, causal=True, eps=0.0)
    with pytest.raises(ValueError, match="key_mask"):
        call(q, k, v, causal=True, key_mask=torch.ones(B, N + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_mask"):
        call(q, k, v, causal=True, key_mask=torch.ones(B, N))
    with pytest.raises(ValueError, match="same length"):
        call(q[:, :, :5], k, v, causal=False)
    with pytest.raises(ValueError, match="heads"):
        call(q, k[:, :1], v[:, :1], causal=False)
    with pytest.raises(TypeError, match="causal"):
        call(q, k, v, causal=None)
    attn = _model()
    with pytest.raises(ValueError, match="head_dim=8"):
        attn(*(torch.randn(1, H, 4, 8, dtype=F64) for _ in range(3)))


def test_the_paper_and_the_departures_are_declared():
    spec = attnzoo.describe("based")
    assert spec.family == "kernel" and "2402.18668" in spec.paper
    caps = spec.capabilities
    assert caps.causal and caps.key_mask and caps.decode_step and spec.complexity.subquadratic_memory
    notes = " ".join(spec.notes)
    for needed in ("left=63", "BaseConv", "attnzoo.hf.use", "model width", "273", "153"):
        assert needed in notes, needed
    assert attnzoo.build("based").config.feature_dim == 16
