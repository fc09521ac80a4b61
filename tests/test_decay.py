"""Linear attention with decay (``recurrent`` family: retnet, gla, ssd, lightning) beyond the contracts
(tests/test_contracts.py): the plain functions of issue 19 against the independent oracles of
``oracles_modern.py`` (outputs, final states and gradients, N = 37 against chunks of 8 and 64,
with and without an initial state), the naive recurrences against the same oracles, stability
under strong decays over 1000 tokens in float32, and the papers' parametrisations (RetNet's
gammas, GLA's gate, SSD's dt / A / D) and the choices the contracts do not pin down (padding is
skipped, not decayed through; causal only; parameters sized at construction)."""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo
from attnzoo.mechanisms import decay
from conftest import grads
from oracles_modern import oracle_gla, oracle_retention, oracle_ssd
from tolerances import assert_close_to_golden, assert_same

B, H, N, D, DV = 2, 3, 37, 5, 4
F64 = torch.float64


def _decay_shape(name: str, n: int = N) -> tuple[int, ...]:
    return {"retention": (H,), "gla": (B, H, n, D), "ssd": (B, H, n)}[name]


def _inputs(name: str, *, n: int = N, strength: float = 1.0, dtype: torch.dtype = F64, seed: int = 0):
    """q, k, v, log decays (uniform in (-strength, 0)) and an initial state, all leaves."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, n, DV, generator=g, dtype=dtype)
    log_decay = -torch.rand(_decay_shape(name, n), generator=g, dtype=dtype) * strength
    s0 = torch.randn(B, H, D, DV, generator=g, dtype=dtype)
    return q, k, v, log_decay, s0


FUNCTIONS = {
    "retention": (decay.retention, decay.naive_retention, oracle_retention),
    "gla": (decay.gla, decay.naive_gla, oracle_gla),
    "ssd": (decay.ssd, decay.naive_ssd, oracle_ssd),
}


@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_chunkwise_function_equals_the_oracle_outputs_states_and_gradients(name, chunk, initial):
    fast, _, oracle = FUNCTIONS[name]
    q, k, v, log_decay, s0 = _inputs(name)
    leaves = (q, k, v, log_decay, s0) if initial else (q, k, v, log_decay)
    for x in leaves:
        x.requires_grad_(True)
    state = s0 if initial else None
    got = fast(q, k, v, log_decay, initial_state=state, chunk=chunk)
    want = oracle(q, k, v, log_decay, initial_state=state)
    what = f"{name} chunk={chunk} initial={initial}"
    for part, a, b in zip(("output", "state"), got, want):
        assert_same(a, b, what=f"{what}: {part}")
    # one backward through output and state together: every input's gradient, the decays' too
    g_got = grads(torch.cat([got[0].flatten(), got[1].flatten()]), leaves)
    g_want = grads(torch.cat([want[0].flatten(), want[1].flatten()]), leaves)
    for i, (a, b) in enumerate(zip(g_got, g_want)):
        assert_same(a, b, what=f"{what}: gradient {i}")


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_naive_recurrence_equals_the_oracle(name):
    _, naive, oracle = FUNCTIONS[name]
    q, k, v, log_decay, s0 = _inputs(name, seed=1)
    for state in (None, s0):
        for a, b in zip(
            naive(q, k, v, log_decay, initial_state=state), oracle(q, k, v, log_decay, initial_state=state)
        ):
            assert_same(a, b, what=f"naive {name}")


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_strong_decays_over_1000_tokens_stay_finite_and_accurate_in_float32(name):
    # Log decays down to -40 per token: cumulative products reach exp(-40000), far below
    # float32's range, so any division by one would give inf or NaN.
    fast, naive, _ = FUNCTIONS[name]
    q, k, v, log_decay, s0 = _inputs(name, n=1000, strength=40.0, dtype=torch.float32, seed=2)
    if name != "retention":  # a few channels / tokens that barely decay, beside the strong ones
        log_decay = torch.where(torch.rand(log_decay.shape) < 0.2, log_decay * 1e-3, log_decay)
    leaves = tuple(x.requires_grad_(True) for x in (q, k, v, log_decay, s0))
    out, state = fast(*leaves[:4], initial_state=s0)
    assert torch.isfinite(out).all() and torch.isfinite(state).all(), name
    for i, g in enumerate(grads(out.sum() + state.sum(), leaves)):
        assert torch.isfinite(g).all(), f"{name}: gradient {i} not finite"
    golden = naive(*(x.detach().double() for x in leaves[:4]), initial_state=s0.detach().double())
    reference = naive(*(x.detach() for x in leaves[:4]), initial_state=s0.detach())
    for a, r, g in zip((out, state), reference, golden):
        assert_close_to_golden(a.detach(), r, g, what=f"{name} float32 vs float64 recurrence")


def test_gla_chunk_must_be_a_power_of_two():
    q, k, v, log_alpha, _ = _inputs("gla")
    with pytest.raises(ValueError, match="power of two"):
        decay.gla(q, k, v, log_alpha, chunk=48)
    with pytest.raises(ValueError, match="power of two"):
        attnzoo.build("gla", chunk=48)
    with pytest.raises(ValueError, match="log_alpha must have shape"):
        decay.gla(q, k, v, log_alpha[..., 0])


def _mechanism_inputs(n: int = 23, seed: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g, dtype=F64) for _ in range(3))


def _build(name: str) -> torch.nn.Module:
    shape = attnzoo.Shape(heads=H, head_dim=D)
    return attnzoo.build(name, shape=shape, chunk=8).double()


def test_retnet_decays_by_the_papers_gamma_per_head():
    # q = k = 1: every q . k is D, times the scale 1/sqrt(D): weights are sqrt(D) gamma_h^(i - j)
    ones = torch.ones(1, H, 6, D, dtype=F64)
    weights = _build("retnet").implied_attention(ones, ones, causal=True)[0]
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    for h in range(H):
        gamma = 1 - 2 ** (-5 - h)
        want = math.sqrt(D) * torch.where(j <= i, gamma ** (i - j).clamp(min=0).double(), 0.0)
        assert_same(weights[h], want, what=f"retnet head {h}")


def test_lightning_decays_by_alibi_slopes_that_weaken_with_depth():
    ones = torch.ones(1, 4, 5, D, dtype=F64)
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    for layer, depth in ((0, 1.0), (2, 0.5), (4, 0.0)):
        attn = attnzoo.build("lightning", layer_index=layer, layers=5).double()
        weights = attn.implied_attention(ones, ones, causal=True)[0]
        for h in range(4):
            rate = 2 ** (-8 * (h + 1) / 4) * (depth + 1e-5)
            want = D * torch.nn.functional.silu(torch.tensor(1.0, dtype=F64)) ** 2 * torch.exp(-rate * (i - j))
            assert_same(weights[h], want.masked_fill(j > i, 0.0), what=f"lightning layer {layer} head {h}")


def test_gla_gate_is_a_low_rank_logsigmoid_over_temperature_16():
    attn = _build("gla")
    q, k, v = _mechanism_inputs()
    logits = (k @ attn.gate_down) @ attn.gate_up + attn.gate_bias[:, None]  # per head: (N, D) @ (D, 16) @ (16, D)
    log_alpha = torch.nn.functional.logsigmoid(logits) / 16
    want, _ = decay.naive_gla(q / math.sqrt(D), k, v, log_alpha)
    assert attn.gate_down.shape == (H, D, 16)
    assert_same(attn(q, k, v, causal=True), want, what="gla vs its gate by hand")


def test_ssd_folds_dt_into_values_decays_by_dt_a_and_adds_the_skip():
    attn = _build("ssd")
    q, k, v = _mechanism_inputs()
    dt = torch.nn.functional.softplus((k * attn.dt_weight[:, None]).sum(-1) + attn.dt_bias[:, None])  # [B, H, N]
    a = -attn.a_log.exp()
    assert (a <= -1).all() and (a >= -16).all(), "A initialised in -[1, 16]"
    want, _ = decay.naive_ssd(q, k, v * dt[..., None], dt * a[:, None])
    want = want + attn.d_skip[:, None, None] * v
    assert_same(attn(q, k, v, causal=True), want, what="ssd vs Mamba-2's recurrence by hand")


@pytest.mark.parametrize("name", ["retnet", "gla", "ssd", "lightning"])
def test_left_padding_is_skipped_not_decayed_through(name):
    # a padded token neither writes nor decays the state: a left-padded row's real outputs are
    # the outputs of the same tokens unpadded
    attn = _build(name)
    q, k, v = _mechanism_inputs()
    mask = torch.ones(B, q.shape[2], dtype=torch.bool)
    mask[0, :7] = False
    out = attn(q, k, v, causal=True, key_mask=mask)
    alone = attn(*(x[:1, :, 7:] for x in (q, k, v)), causal=True)
    assert_same(out[:1, :, 7:], alone, what=f"{name}: left-padded row vs the unpadded tokens")
    assert not out[0, :, :7].any()


@pytest.mark.parametrize("name", ["retnet", "gla", "ssd", "lightning"])
def test_non_causal_calls_are_refused(name):
    q, k, v = _mechanism_inputs()
    attn = _build(name)
    for call in (attn, attn.reference):
        with pytest.raises(ValueError, match="causal=False"):
            call(q, k, v)


@pytest.mark.parametrize("name", ["gla", "ssd"])
def test_parameters_exist_at_construction_with_a_shape_and_on_first_use_without(name):
    shaped = attnzoo.build(name, shape=attnzoo.Shape(heads=H, head_dim=D))
    assert all(p is not None for p in shaped.parameters()) and len(list(shaped.parameters())) > 0
    bare = attnzoo.build(name)
    assert not list(bare.parameters())
    q, k, v = (x.float() for x in _mechanism_inputs())
    bare(q, k, v, causal=True)
    assert {n for n, _ in bare.named_parameters()} == {n for n, _ in shaped.named_parameters()}
    with pytest.raises(ValueError, match="build it with heads=2"):
        bare(q[:, :2], k[:, :2], v[:, :2], causal=True)
