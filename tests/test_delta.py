"""DeltaNet and Gated DeltaNet (``attnzoo.mechanisms.delta``): the plain functions against the
independent oracles of ``tests/oracles_modern.py`` (outputs, final state, gradients), the
recurrence against the same oracles, chunk sizes, long-sequence stability, the delta rule's
overwrite, and what the mechanisms add (the short convolution against torch's conv1d and the rule
written out, normalisation, padding, the causal-only refusal, geometry).

fast == reference, causal prefix, padding and step == forward for the registered mechanisms are
the contract tests' (``tests/test_contracts.py``); here only what they do not reach: chunk
boundaries (the contracts run N = 16 inside one chunk)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.mechanisms import delta_chunks
from attnzoo.mechanisms.delta import delta_rule, gated_delta_rule, naive_delta_rule, naive_gated_delta_rule
from conftest import decode_all, grads, padding_mask, small_mechanism
from tolerances import assert_close_to_golden, assert_same

RULES = {
    "delta_rule": (delta_rule, naive_delta_rule, False),
    "gated_delta_rule": (gated_delta_rule, naive_gated_delta_rule, True),
}


def _oracle(rule: str):  # noqa: ANN202
    oracles = pytest.importorskip("oracles_modern", reason="tests/oracles_modern.py (issue 19's oracles) is missing")
    return getattr(oracles, f"oracle_{rule}")


def _inputs(
    gated: bool, n: int, *, b: int = 2, h: int = 3, d: int = 8, dv: int = 5, dtype=torch.float64, seed: int = 0
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``(q, k, v, beta[, log_alpha]), initial_state``, leaves: k unit rows (as the mechanisms
    give it), beta in (0, 1), log_alpha <= 0."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    q, k, v = randn(b, h, n, d), F.normalize(randn(b, h, n, d), dim=-1), randn(b, h, n, dv)
    beta = torch.sigmoid(randn(b, h, n))
    args = (q, k, v, beta, -F.softplus(randn(b, h, n))) if gated else (q, k, v, beta)
    s0 = randn(b, h, d, dv) * 0.5
    return tuple(x.requires_grad_() for x in args), s0.requires_grad_()


def _both(result: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Output and final state as one vector, so one random cotangent covers both."""
    return torch.cat([result[0].flatten(), result[1].flatten()])


def _assert_agree(got, want, inputs, what):  # noqa: ANN001
    assert_same(got[0], want[0], what=f"{what}: output")
    assert_same(got[1], want[1], what=f"{what}: final state")
    for i, (g_got, g_want) in enumerate(zip(grads(_both(got), inputs), grads(_both(want), inputs))):
        assert_same(g_got, g_want, what=f"{what}: gradient {i} (q, k, v, beta, [log_alpha,] initial_state)")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("n, chunk", [(37, 16), (37, 64), (48, 16), (1, 64)])
def test_chunkwise_equals_the_oracle_outputs_state_and_gradients(rule, n, chunk):
    """B = 2, H = 3, float64, an initial state; N = 37 is not a multiple of 16 (a short last
    chunk) and fits one chunk of 64; N = 48 is three whole chunks."""
    fast, _, gated = RULES[rule]
    args, s0 = _inputs(gated, n)
    got = fast(*args, initial_state=s0, chunk=chunk)
    want = _oracle(rule)(*args, initial_state=s0)
    _assert_agree(got, want, (*args, s0), f"{rule} N={n} chunk={chunk} vs oracle")


@pytest.mark.parametrize("rule", RULES)
def test_naive_recurrence_equals_the_oracle(rule):
    _, naive, gated = RULES[rule]
    args, s0 = _inputs(gated, 37, seed=1)
    for state in (None, s0):
        got, want = naive(*args, initial_state=state), _oracle(rule)(*args, initial_state=state)
        inputs = (*args, s0) if state is not None else args
        _assert_agree(got, want, inputs, f"naive {rule} initial_state={state is not None} vs oracle")


@pytest.mark.parametrize("rule", RULES)
def test_the_chunk_length_changes_nothing_chunk_one_is_the_recurrence(rule):
    fast, naive, gated = RULES[rule]
    args, s0 = _inputs(gated, 37, seed=2)
    for chunk in (1, 5, 37, 100):
        got, want = fast(*args, initial_state=s0, chunk=chunk), naive(*args, initial_state=s0)
        _assert_agree(got, want, (*args, s0), f"{rule} chunk={chunk}")


@pytest.mark.parametrize("rule", RULES)
def test_stable_over_a_thousand_tokens_in_float32(rule):
    """N = 1000 in float32, strong writes (beta up to 1) and decays from none to e^-20 per
    token: the chunkwise form is as close to the float64 recurrence as the float32 recurrence
    is, forward, state and gradients, and finite everywhere."""
    fast, naive, gated = RULES[rule]
    args, s0 = _inputs(gated, 1000, b=1, h=2, d=16, dv=16, seed=3)
    args = list(args)
    args[3] = torch.sigmoid(args[3].detach() * 4).requires_grad_()
    if gated:
        args[4] = (-F.softplus(args[4].detach() * 6)).requires_grad_()
    golden = naive(*args, initial_state=s0)
    low = [x.detach().float().requires_grad_() for x in (*args, s0)]
    reference, actual = naive(*low[:-1], initial_state=low[-1]), fast(*low[:-1], initial_state=low[-1])
    for i, what in enumerate(("output", "final state")):
        assert torch.isfinite(actual[i]).all(), what
        assert_close_to_golden(actual[i], reference[i], golden[i], what=f"{rule} N=1000 float32 {what}")
    # One cotangent for all three runs (drawn in float64, used in float32 by the float32 runs).
    cotangent = torch.randn(_both(golden).shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = torch.autograd.grad(_both(golden), (*args, s0), cotangent)
    ref = torch.autograd.grad(_both(reference), low, cotangent.float())
    for i, (got, r, g) in enumerate(zip(torch.autograd.grad(_both(actual), low, cotangent.float()), ref, want)):
        assert torch.isfinite(got).all(), f"gradient {i}"
        assert_close_to_golden(got, r, g, what=f"{rule} N=1000 float32 gradient {i}")


@pytest.mark.parametrize("n", [1, 2, 5, 16, 37])
def test_the_doubling_inverse_equals_the_triangular_solve(n):
    """``(I + tril(a, -1))^-1`` by recursive doubling (n = 5, 37: padded to a power of two) against
    LAPACK's solve; the entries on and above the diagonal are junk that must be ignored. (Its
    adjoint is part of ``_ChunkRule``'s backward, checked below.)"""
    g = torch.Generator().manual_seed(n)
    a = torch.randn(2, 3, n, n, generator=g, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    want = torch.linalg.solve_triangular(eye + a.tril(-1), eye.expand_as(a), upper=False, unitriangular=True)
    assert_same(delta_chunks._unit_lower_inverse(a), want, what=f"inverse n={n}")


@pytest.mark.parametrize("gated", [False, True])
def test_the_hand_written_backward_is_the_gradient_of_the_forward(gated):
    """``_ChunkRule``'s backward (the reverse scan, the inverse's adjoint, the decays) against
    finite differences through both outputs (O and S_N): 3 chunks of 4 tokens, BH = 2, D = 3,
    D_v = 2, unit keys, an initial state; g the in-chunk cumulative log decays."""
    g = torch.Generator().manual_seed(7)

    def leaf(*shape: int, scale: float = 0.5) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    q, v = leaf(3, 2, 4, 3), leaf(3, 2, 4, 2)
    k = F.normalize(torch.randn(3, 2, 4, 3, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    beta = torch.rand(3, 2, 4, generator=g, dtype=torch.float64).requires_grad_()
    log_g = (-torch.rand(3, 2, 4, generator=g, dtype=torch.float64)).cumsum(-1).requires_grad_() if gated else None
    assert torch.autograd.gradcheck(delta_chunks._ChunkRule.apply, (q, k, v, beta, log_g, leaf(2, 3, 2)))


def test_the_delta_rule_overwrites_what_a_key_holds_where_linear_attention_adds():
    """Orthonormal keys and beta = 1: writing (k1, v1), (k2, v2), then (k1, v3) leaves k1 -> v3
    and k2 -> v2 (linear attention would return v1 + v3 for k1); beta = 1/2 moves half way each time."""
    keys, values = torch.eye(4, dtype=torch.float64)[:2], torch.randn(3, 5, dtype=torch.float64)
    k = torch.stack([keys[0], keys[1], keys[0]])[None, None]  # [1, 1, 3, 4]
    for beta, held in ((1.0, values[2]), (0.5, values[0] / 4 + values[2] / 2)):
        _, s = delta_rule(k, k, values[None, None], torch.full((1, 1, 3), beta, dtype=torch.float64), chunk=2)
        torch.testing.assert_close(keys[0] @ s[0, 0], held)
        torch.testing.assert_close(keys[1] @ s[0, 0], values[1] * beta)
    # alpha = 1 everywhere: Gated DeltaNet is DeltaNet.
    args, s0 = _inputs(False, 20, seed=4)
    zero = torch.zeros_like(args[3])
    _assert_agree(
        gated_delta_rule(*args, zero, initial_state=s0, chunk=8), delta_rule(*args, initial_state=s0), args, "alpha = 1"
    )


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_fast_equals_reference_across_chunk_boundaries_with_padding(name):
    """The contracts' fast == reference at N = 16 stays inside one chunk; here N = 37 over chunks
    of 8 (a short last one), B = 3 with padding, H = 2, causal and not, gradients of the
    parameters too."""
    attn = small_mechanism(name, 37, heads=2, head_dim=4, chunk=8)
    q, k, v = (torch.randn(3, 2, 37, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    params = tuple(attn.parameters())
    for mask in (None, padding_mask(3, 37)):
        fast = attn(q, k, v, causal=True, key_mask=mask)
        ref = attn.reference(q, k, v, causal=True, key_mask=mask)
        what = f"{name} padded={mask is not None}"
        assert_same(fast, ref, what=what)
        for g_fast, g_ref in zip(grads(fast, (q, k, v, *params)), grads(ref, (q, k, v, *params))):
            assert_same(g_fast, g_ref, what=f"{what}: gradients")


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_mechanism_normalises_q_and_padded_tokens_leave_the_state_untouched(name):
    q, k, v = (torch.randn(2, 2, 12, 4, dtype=torch.float64) for _ in range(3))
    plain = small_mechanism(name, 12, heads=2, head_dim=4, short_conv=0)  # with it, SiLU(conv(q)) is normalised
    assert_same(plain(q * 3, k, v, causal=True), plain(q, k, v, causal=True), what="q is L2-normalised")
    attn = small_mechanism(name, 12, heads=2, head_dim=4)
    state = attn.init_state(2, 2, 4, 4, dtype=torch.float64)
    _, state = attn.step(state, q[:, :, :5], k[:, :, :5], v[:, :, :5])
    padded = torch.tensor([[False], [True]])
    out, after = attn.step(state, q[:, :, 5:6], k[:, :, 5:6], v[:, :, 5:6], key_mask=padded)
    assert torch.equal(after.s[0], state.s[0]), "a padded token neither writes nor decays"
    assert not torch.equal(after.s[1], state.s[1]) and not out[0].any()


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_non_causal_is_refused(name):
    attn = small_mechanism(name, 12, heads=2, head_dim=4, chunk=5)
    q = torch.randn(2, 2, 12, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="causal=False"):
        attn(q, q, q)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_parameters_are_sized_by_the_layer_geometry_and_checked(name):
    attn = attnzoo.build(name, shape=attnzoo.Shape(heads=3, head_dim=6))
    shapes = {key: tuple(p.shape) for key, p in attn.named_parameters()}
    assert shapes["beta_proj"] == (3, 6) and shapes["beta_bias"] == (3,)
    if name == "gated_deltanet":
        assert shapes["gate_proj"] == (3, 6) and shapes["a_log"] == shapes["dt_bias"] == (3,)
        log_alpha = attn.log_alpha(torch.randn(1, 3, 7, 6))
        assert (log_alpha < 0).all()
    q = torch.randn(1, 2, 7, 6)
    with pytest.raises(ValueError, match="build it with heads=2, head_dim=6"):
        attn(q, q, q, causal=True)


def _torch_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The short convolution by torch's own conv1d (depthwise, left-padded), then SiLU: a second
    implementation to check ``short_conv``'s shifted multiply-adds against."""
    b, h, n, c = x.shape
    width = weight.shape[1]
    flat = F.pad(x.permute(0, 1, 3, 2).reshape(b, h * c, n), (width - 1, 0))
    kernel = weight.permute(0, 2, 1).reshape(h * c, 1, width)
    return F.silu(F.conv1d(flat, kernel, groups=h * c)).reshape(b, h, c, n).permute(0, 1, 3, 2)


def test_short_conv_equals_torch_conv1d_and_continues_from_its_tail(monkeypatch):
    from attnzoo.mechanisms import delta

    monkeypatch.setattr(delta, "CONV_BLOCK", 4)  # three blocks of 4 and a short one
    x = torch.randn(2, 3, 15, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    whole, _ = delta.short_conv(x, weight, x.new_zeros(2, 3, 3, 5))
    want = _torch_conv(x, weight)
    assert_same(whole, want, what="short_conv vs conv1d")
    for got, expected, what in zip(grads(whole, (x, weight)), grads(want, (x, weight)), ("x", "weight")):
        assert_same(got, expected, what=f"gradient of {what}")
    first, tail = delta.short_conv(x[:, :, :7], weight, x.new_zeros(2, 3, 3, 5))
    rest, _ = delta.short_conv(x[:, :, 7:], weight, tail)
    assert_same(torch.cat([first, rest], 2), whole, what="continued from the tail")


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_mechanism_is_the_rule_on_the_convolved_normalised_q_and_k(name):
    """The paper's composition, written out: beta (and the decay) from the raw k; q and k through
    conv1d + SiLU, L2-normalised, q scaled; then the token-by-token rule."""
    attn = small_mechanism(name, 13, heads=2, head_dim=4)
    q, k, v = (torch.randn(2, 2, 13, 4, dtype=torch.float64) for _ in range(3))
    beta = torch.sigmoid(torch.einsum("bhnd,hd->bhn", k, attn.beta_proj) + attn.beta_bias[:, None])
    log_alpha = attn.log_alpha(k)
    qk = _torch_conv(torch.cat([q, k], -1), attn.conv_qk)
    qc, kc = F.normalize(qk[..., :4], dim=-1) * 4**-0.5, F.normalize(qk[..., 4:], dim=-1)
    if log_alpha is None:
        want, _ = naive_delta_rule(qc, kc, v, beta)
    else:
        want, _ = naive_gated_delta_rule(qc, kc, v, beta, log_alpha)
    assert_same(attn(q, k, v, causal=True), want, what=f"{name} vs the rule written out")


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_left_padding_enters_the_convolution_as_the_sequence_start(name):
    """A left-padded prompt's real tokens get what the unpadded prompt gives: the pads are zeros
    in the convolution, as the zeros before the first token."""
    attn = small_mechanism(name, 12, heads=2, head_dim=4)
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    junk = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    padded = [torch.cat([junk, x], 2) for x in (q, k, v)]
    mask = torch.tensor([[False] * 3 + [True] * 9])
    out = attn(*padded, causal=True, key_mask=mask)
    assert_same(out[:, :, 3:], attn(q, k, v, causal=True), what=f"{name}: real tokens after left padding")
    assert not out[:, :, :3].any(), "padded rows are 0"


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_without_the_convolution_decode_steps_equal_the_forward(name):
    """``short_conv=0`` (the rule on the projected q, k; older weights load here): token-by-token
    steps and a prefill continue the causal forward, as the contract tests check for the default."""
    attn = small_mechanism(name, 10, heads=2, head_dim=4, short_conv=0)
    assert attn.conv_qk is None
    q, k, v = (torch.randn(2, 2, 10, 4, dtype=torch.float64) for _ in range(3))
    state = attn.init_state(2, 2, 4, 4, dtype=torch.float64)
    steps = decode_all(attn, state, q, k, v, prefill=6)
    assert_same(steps, attn(q, k, v, causal=True), what=f"{name} short_conv=0: steps vs forward")
