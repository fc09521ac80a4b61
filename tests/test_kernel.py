"""Kernel / linear attention beyond the contracts (tests/test_contracts.py): the fast path on sizes
the contracts do not reach (several chunks and blocks, N_q < N_kv), float32 against a float64
golden run, Performer's limit law, stability and exact gradients, the papers' own formulas, the
random projections' seeds and redraws, and the two forms of the chunk scan."""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo
import attnzoo.mechanisms.kernel as kernel
from attnzoo.mechanisms.kernel_performer import favor_exponent
from conftest import LargestTensor as Largest
from conftest import grads, make_qkv, padding_mask
from tolerances import assert_close_to_golden, assert_same

KERNEL = attnzoo.names(family="kernel")
CAUSAL = attnzoo.names(family="kernel", causal=True)
B, H, N, D = 2, 3, 37, 8


def mask_of() -> torch.Tensor:
    """``(B=2, N)`` key padding: batch 0 all padding (its rows see no key), batch 1 half."""
    return padding_mask(3, N)[:2]


def build(name: str, **config):
    """Small chunks (N = 37 is not a multiple of 8) where the mechanism has them."""
    if "chunk" in attnzoo.registry.config_fields(name):
        config.setdefault("chunk", 8)
    return attnzoo.build(name, **config)


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    # several non-causal blocks of 5 positions (B * H = 6 rows each) at these sizes, and the
    # causal path one head at a time (``causal_block_heads``; whole at these sizes by default)
    monkeypatch.setattr(kernel, "BLOCK_ROWS", 30)
    monkeypatch.setattr(kernel, "CAUSAL_BLOCK_BYTES", 1)
    monkeypatch.setattr(kernel, "CAUSAL_BLOCK_ROWS", 1)


def _cases():
    for name in KERNEL:
        for causal in (False, True) if name in CAUSAL else (False,):
            for n_q in (N, 20):
                yield name, causal, n_q


@pytest.mark.parametrize("name, causal, n_q", list(_cases()))
def test_fast_path_equals_reference_forward_and_gradients(name, causal, n_q):
    attn = build(name).double()
    q, k, v = make_qkv(B, H, n_q, N, d=D, d_v=5)
    mask = mask_of()
    attn(q, k, v, causal=causal, key_mask=mask)  # makes lazy buffers / parameters
    inputs = (q, k, v, *attn.parameters())
    fast = attn(q, k, v, causal=causal, key_mask=mask)
    ref = attn.reference(q, k, v, causal=causal, key_mask=mask)
    assert_same(fast, ref, what=f"{name} forward")
    assert torch.equal(fast[0], torch.zeros_like(fast[0]))  # batch 0 is all padding
    fast_grads = grads(fast, inputs)
    for i, (got, want) in enumerate(zip(fast_grads, grads(ref, inputs))):
        assert_same(got, want, what=f"{name} gradient {i}")
        assert torch.isfinite(got).all()
    assert torch.count_nonzero(fast_grads[0][0]) == 0  # rows that see no key pass no gradient


@pytest.mark.parametrize("name", CAUSAL)
def test_steps_of_several_chunks_on_a_carried_state_equal_the_forward(name):
    # The contract decodes one token at a time after a prefill from an empty state; here steps of
    # 11, 1, 13 and 12 tokens with chunks of 8 carry a non-empty state (and its decays) into the
    # chunked path and its scan.
    attn = build(name).double()
    q, k, v = make_qkv(B, H, N, N, d=D, requires_grad=False)
    want = attn(q, k, v, causal=True)
    state, outs = attn.init_state(B, H, D, D, dtype=torch.float64), []
    for lo, hi in ((0, 11), (11, 12), (12, 25), (25, N)):
        out, state = attn.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi])
        outs.append(out)
    assert_same(torch.cat(outs, dim=2), want, what=f"{name}: steps of 11, 1, 13, 12 tokens")


@pytest.mark.parametrize("name, causal, n_q", [c for c in _cases() if c[2] == N])
def test_fp32_within_policy_of_float64_golden(name, causal, n_q):
    attn = build(name)
    q, k, v = make_qkv(B, H, n_q, N, d=D, dtype=torch.float32)
    mask = mask_of()
    fast = attn(q, k, v, causal=causal, key_mask=mask)
    ref = attn.reference(q, k, v, causal=causal, key_mask=mask)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    golden = attn.reference(q64, k64, v64, causal=causal, key_mask=mask)
    assert_close_to_golden(fast, ref, golden, what=f"{name} fp32 forward")
    for i, (a, r, g) in enumerate(zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), grads(golden, (q64, k64, v64)))):
        assert_close_to_golden(a, r, g, what=f"{name} fp32 gradient {i}")


@pytest.mark.parametrize("causal", [False, True])
def test_performer_gradients_are_exact_at_the_default_eps(causal):
    # FAVOR+'s stabilisers (per-row maxima) cancel in num / (den + eps) only up to eps, so they stay
    # on the graph: detached, the gradients were off by up to ~1e-3 relative (causal, padded).
    attn = build("performer", features=8).double()
    q, k, v = make_qkv(2, 2, 8, 8, d=4)
    mask = torch.arange(8)[None, :] < torch.tensor([[5], [8]])
    attend = lambda q, k, v: attn(q, k, v, causal=causal, key_mask=mask)  # noqa: E731
    assert torch.autograd.gradcheck(attend, (q, k, v), atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_relu_feature_map_and_half_precision(causal):
    attn = build("linear", feature_map="relu").double()
    q, k, v = make_qkv(B, H, N, N, d=D)
    q = torch.where(torch.arange(N)[:, None] == 3, -q.abs(), q)  # row 3: all features 0
    out = attn(q, k, v, causal=causal, key_mask=mask_of())
    assert_same(out, attn.reference(q, k, v, causal=causal, key_mask=mask_of()))
    assert torch.count_nonzero(out[:, :, 3]) == 0
    half = build("performer")(*(x.detach().bfloat16() for x in (q, k, v)), causal=causal)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()


def test_performer_error_against_softmax_shrinks_as_features_grow():
    exact_attn = attnzoo.build("softmax")
    errors = {}
    for m in (16, 256, 1024):
        total = 0.0
        for seed in range(4):
            g = torch.Generator().manual_seed(100 + seed)
            q, k, v = (torch.randn(1, 2, 24, 16, generator=g, dtype=torch.float64) * 0.7 for _ in range(3))
            performer = attnzoo.build("performer", features=m, seed=seed)
            total += (performer(q, k, v) - exact_attn(q, k, v)).pow(2).mean().sqrt().item()
        errors[m] = total / 4
    assert errors[16] > errors[256] > errors[1024], errors
    assert errors[1024] < 0.05, errors


def test_performer_equals_the_unstabilised_formula_forward_and_gradients():
    # FAVOR+ with no stabiliser at all, in float64 at moderate scores: the independent oracle.
    performer = build("performer", features=64, eps=1e-200).double()
    q, k, v = make_qkv(B, H, N, N, d=D)
    mask = mask_of()
    w = performer.projection_for(q).double()
    for causal in (False, True):
        phi_q, phi_k = (torch.exp(favor_exponent(x * D**-0.25, w)) / 8.0 for x in (q, k))
        oracle = kernel.reference_kernel_attention(phi_q, phi_k, v, causal=causal, key_mask=mask, eps=0.0)
        fast = performer(q, k, v, causal=causal, key_mask=mask)
        # batch 0 has no real key: 0 / 0 in the eps-free oracle
        assert_same(fast[1:], oracle[1:], what="forward")
        for got, want in zip(grads(fast[1:], (q, k, v)), grads(oracle[1:], (q, k, v))):
            assert_same(got, want, what="gradient")


@pytest.mark.parametrize("eps", [1e-6, 0.05])
def test_rfa_equals_its_gated_recurrence_written_out(eps):
    # eps = 0.05 binds for some rows: the module's unscaled features carry the paper's eps
    attn = build("rfa", features=16, sigma=0.8, heads=H, head_dim=D, eps=eps).double()
    q, k, v = make_qkv(B, H, N, N, d=D)
    fast = attn(q, k, v, causal=True)
    w = attn.projection.double()
    g = torch.sigmoid(torch.einsum("bhnd,hd->bhn", k, attn.gate_weight) + attn.gate_bias[:, None])

    def fourier_features(x, w, sigma):  # the paper's phi written out (the library's has its own backward)
        u = torch.nn.functional.normalize(x, dim=-1) @ w.T / sigma
        return torch.cat([u.sin(), u.cos()], dim=-1) / math.sqrt(w.shape[0])

    s, z, expected = torch.zeros(B, H, 32, D, dtype=torch.float64), torch.zeros(B, H, 32, dtype=torch.float64), []
    bound = []
    for t in range(N):
        phi_k = fourier_features(k[:, :, t], w, 0.8)  # [B, H, 2m]
        s = g[:, :, t, None, None] * s + (1 - g[:, :, t, None, None]) * phi_k[..., None] * v[:, :, t, None, :]
        z = g[:, :, t, None] * z + (1 - g[:, :, t, None]) * phi_k
        phi_q = fourier_features(q[:, :, t], w, 0.8)
        den = (phi_q * z).sum(-1)
        bound.append(den.abs() < eps)
        den = torch.where(den >= 0, den.clamp(min=eps), den.clamp(max=-eps))
        expected.append(torch.einsum("bhm,bhme->bhe", phi_q, s) / den[..., None])
    expected = torch.stack(expected, dim=2)
    assert torch.stack(bound).any() == (eps > 1e-3)  # the clamp binds where it should
    assert_same(fast, expected)
    inputs = (q, k, v, attn.gate_weight, attn.gate_bias)
    for got, want in zip(grads(fast, inputs), grads(expected, inputs)):
        assert_same(got, want, what="gradient")
    plain = attn(q, k, v)  # non-causal: no gate
    phi_q, phi_k = (fourier_features(x, w, 0.8) for x in (q, k))
    a = phi_q @ phi_k.transpose(-1, -2)
    assert_same(plain, (a / a.sum(-1, keepdim=True)) @ v)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_is_finite_in_fp32_at_scores_of_50(causal):
    d = 16
    q = torch.nn.functional.normalize(torch.randn(2, 2, 40, d), dim=-1) * math.sqrt(50 * math.sqrt(d))
    v = torch.randn(2, 2, 40, d)
    performer = attnzoo.build("performer", chunk=8)
    assert (q @ q.transpose(-1, -2) / math.sqrt(d)).max() > 49
    out = performer(q, q, v, causal=causal)
    golden = performer(q.double(), q.double(), v.double(), causal=causal)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), golden, atol=1e-3, rtol=1e-3)


def test_performer_features_are_seeded_and_redraw_changes_them():
    q = torch.randn(1, 1, 4, 8)
    a, b, c = (attnzoo.build("performer", features=32, seed=s) for s in (0, 0, 1))
    for m in (a, b, c):
        m(q, q, q)
    assert torch.equal(a.projection, b.projection) and not torch.equal(a.projection, c.projection)
    before = a.projection.clone()
    a.redraw()
    assert not torch.equal(a.projection, before) and a.projection.shape == before.shape
    b.redraw()
    assert torch.equal(a.projection, b.projection)  # redraws are reproducible too
    eager = attnzoo.build("performer", features=32, head_dim=8, seed=0)
    assert torch.equal(eager.projection, before)
    with pytest.raises(ValueError, match="head_dim=8"):
        eager(torch.randn(1, 1, 4, 6), torch.randn(1, 1, 4, 6), torch.randn(1, 1, 4, 6))


@pytest.mark.parametrize("name", ["performer", "rfa"])
def test_feature_count_follows_the_head_size_unless_set(name):
    # features=None: m = 2 D, from head_dim (a layer's Shape) or from the first input; an int wins.
    shaped = attnzoo.build(name, shape=attnzoo.Shape(heads=2, head_dim=24))
    assert shaped.projection.shape == (48, 24) and shaped.num_features(24) == (48 if name == "performer" else 96)
    lazy = attnzoo.build(name)
    q = torch.randn(1, 2, 5, 16)
    lazy(q, q, q)
    assert lazy.projection.shape == (32, 16)
    fixed = attnzoo.build(name, features=7, head_dim=16)
    assert fixed.projection.shape == (7, 16)


@pytest.mark.parametrize("name", ["performer", "rfa"])
def test_lazy_buffers_and_parameters_load_into_a_module_built_with_the_shape(name):
    q, k, v = make_qkv(1, 2, 6, 6, requires_grad=False)
    first = attnzoo.build(name, seed=3).double()
    expected = first(q, k, v, causal=True)  # makes the projection (and rfa's gate)
    shape = attnzoo.Shape(heads=q.shape[1], head_dim=q.shape[-1])
    second = attnzoo.build(name, seed=4, shape=shape).double()  # complete before any forward
    second.load_state_dict(first.state_dict())
    assert_same(second(q, k, v, causal=True), expected)
    with pytest.raises(RuntimeError, match="Unexpected key"):  # built without a shape: nothing to load into
        attnzoo.build(name, seed=4).load_state_dict(first.state_dict())


RANDOM = ["performer", "rfa"]


def _random_features(name: str, **config):
    """A random-feature module with its projection (and rfa's gate) made at construction."""
    return (
        attnzoo.build(name, features=16, heads=2, head_dim=6, **config)
        if name == "rfa"
        else attnzoo.build(name, features=16, head_dim=6, **config)
    )


@pytest.mark.parametrize("name", RANDOM)
def test_each_layer_draws_its_own_projection_unless_given_a_seed(name):
    torch.manual_seed(0)
    a, b = _random_features(name), _random_features(name)
    assert not torch.equal(a.projection, b.projection)
    if name == "rfa":
        assert not torch.equal(a.gate_weight, b.gate_weight)
    torch.manual_seed(0)
    assert torch.equal(_random_features(name).projection, a.projection)  # reproducible from the global seed
    state = torch.get_rng_state()
    c, d = _random_features(name, seed=7), _random_features(name, seed=7)
    assert torch.equal(c.projection, d.projection) and int(c.projection_seed) == 7
    assert torch.equal(torch.get_rng_state(), state)  # an explicit seed leaves the global RNG alone
    torch.manual_seed(0)
    layers = [attnzoo.nn.MultiHeadAttention(12, 2, name, features=16) for _ in range(2)]
    first, second = (layer.attn.projection for layer in layers)
    assert first.shape == (16, 6) and not torch.equal(first, second)


@pytest.mark.parametrize("name", RANDOM)
def test_a_reloaded_module_is_the_same_module_before_and_after_redraws(name):
    q, k, v = make_qkv(1, 2, 6, 6, requires_grad=False)
    for redraws in (0, 2):
        torch.manual_seed(redraws)
        first = attnzoo.build(name).double()  # lazy: nothing drawn before the first forward
        for _ in range(redraws):
            first.redraw()
        second = attnzoo.build(name).double()
        second.load_state_dict(first.state_dict())  # strict
        assert_same(second(q, k, v, causal=True), first(q, k, v, causal=True))
        first.redraw(), second.redraw()
        assert torch.equal(first.projection, second.projection)  # the redraw sequence continues alike


@pytest.mark.parametrize("name", RANDOM)
def test_redraw_every_redraws_after_that_many_training_forwards_and_never_in_eval(name):
    q, k, v = make_qkv(1, 2, 5, 5, d=6, requires_grad=False)
    attn = _random_features(name, seed=1, redraw_every=2)
    twin = _random_features(name, seed=1)
    seen = []
    for _ in range(5):
        seen.append(attn.projection.clone())
        out = attn(q, k, v)
        assert torch.equal(attn.projection, seen[-1]) or len(seen) in (3, 5)
    assert [torch.equal(a, b) for a, b in zip(seen, seen[1:])] == [True, True, False, True]
    assert int(attn.draws) == 2 and not torch.equal(seen[0], attn.projection)
    twin.redraw(), twin.redraw()
    assert torch.equal(twin.projection, attn.projection)  # the same sequence as redraw() by hand
    assert_same(out, twin(q, k, v))  # the fifth forward ran on the second redraw
    attn.eval()
    for _ in range(6):
        attn(q, k, v)
    assert int(attn.draws) == 2 and int(attn.forwards) == 1
    plain = _random_features(name, seed=1)
    for _ in range(5):
        plain(q, k, v)
    assert int(plain.draws) == 0 and torch.equal(plain.projection, seen[0])  # default: never by itself


def test_efficient_is_the_paper_formula():
    q, k, v = make_qkv(B, H, N, N, d=D)
    attn = attnzoo.build("efficient")
    fast, paper = attn(q, k, v), q.softmax(-1) @ (k.softmax(-2).transpose(-1, -2) @ v)
    assert_same(fast, paper)
    for got, want in zip(grads(fast, (q, k, v)), grads(paper, (q, k, v))):
        assert_same(got, want, what="gradient")


@pytest.mark.parametrize("name", KERNEL)
def test_fast_path_never_allocates_n_by_n(name, monkeypatch):
    # On the meta device nothing is computed; every intermediate shape is recorded.
    monkeypatch.setattr(kernel, "BLOCK_ROWS", 8192)
    n, heads = 16384, 2
    q, k, v = torch.empty(3, 1, heads, n, 16, device="meta").unbind(0)
    mask = torch.ones(1, n, dtype=torch.bool, device="meta")
    attn = attnzoo.build(name)
    # features (H, N, m), never N x N; m <= 256 but for Based's 1 + 16 + 16 * 17 / 2 Taylor features
    width = max(256, attn.num_features(16)) if name in CAUSAL else 256
    for causal in (False, True) if name in CAUSAL else (False,):
        with torch.no_grad(), Largest() as largest:
            attn(q, k, v, causal=causal, key_mask=mask)
        assert largest.numel <= heads * n * width, (causal, largest.numel)


@pytest.mark.parametrize("rows", [1, 4], ids=["gate-per-chunk", "gate-per-row"])
def test_gated_scan_equals_the_recurrence_written_out(rows):
    # _ops.gated_scan's hand-written forward and backward loops against S_{c+1} = g_c S_c + U_c
    # written with autograd ops, forward and gradients, strong decays, a carried state.
    from attnzoo.mechanisms._ops import gated_scan

    g = torch.Generator().manual_seed(0)
    sums = torch.randn(2, 3, 9, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    gates = (-torch.rand(2, 3, 9, rows, 1, generator=g, dtype=torch.float64) * 30).exp().requires_grad_()
    s0 = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)

    def written_out(sums, gates, s0):
        states, s = [], s0
        for c in range(sums.shape[2]):
            states.append(s)
            s = gates[:, :, c] * s + sums[:, :, c]
        return torch.stack(states, dim=2), s

    results = []
    for scan in (gated_scan, written_out):
        starts, final = scan(sums, gates, s0)
        grads = torch.autograd.grad((starts.sin().sum() + final.cos().sum()), (sums, gates, s0))
        results.append((starts, final, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    some = (sums[:, :, :3], torch.rand(2, 3, 3, rows, 1, dtype=torch.float64, requires_grad=True), s0)
    assert torch.autograd.gradcheck(gated_scan, some)
    one = gated_scan(sums[:, :, :1], gates[:, :, :1], s0)  # one chunk
    torch.testing.assert_close(one[1], gates[:, :, 0] * s0 + sums[:, :, 0])


@pytest.mark.parametrize("groups", [1, 3], ids=["mha", "gqa"])
def test_decayed_chunks_equal_the_recurrence_written_out(groups):
    # kernel_chunks.decayed_chunks' hand-written forward and backward (the log decays' gradient
    # included) against the token-by-token recurrence S_t = exp(a_t) S_{t-1} + k_t v_t^T,
    # o_i = q_i S_i with autograd ops, a carried state, strong and weak decays; then float64
    # gradcheck of the function itself (finite differences).
    from attnzoo.mechanisms.kernel_chunks import decayed_chunks

    g = torch.Generator().manual_seed(0)
    b, h, c, size, m, e = 2, 2, 3, 4, 5, 3

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v = leaf(b, h, c, groups * size, m), leaf(b, h, c, size, m), leaf(b, h, c, size, e)
    log_decay = (-torch.rand(b, h, c, size, generator=g, dtype=torch.float64) * 3).requires_grad_()
    s0 = leaf(b, h, m, e)

    def written_out(q, k, v, log_decay, s0):
        keys, values, logs = (x.flatten(2, 3) for x in (k, v, log_decay))  # [B, H, C L, ...]
        queries = q.unflatten(-2, (groups, size)).transpose(2, 3).flatten(3, 4)  # [B, H, G, C L, m]
        s, outs = s0, []
        for t in range(keys.shape[2]):
            s = logs[:, :, t, None, None].exp() * s + keys[:, :, t, :, None] * values[:, :, t, None, :]
            outs.append(queries[:, :, :, t] @ s)  # [B, H, G, E]
        out = torch.stack(outs, dim=3).unflatten(3, (c, size)).transpose(2, 3).flatten(3, 4)
        return out, s

    results = []
    for fn in (decayed_chunks, written_out):
        out, final = fn(q, k, v, log_decay, s0)
        grads = torch.autograd.grad(out.sin().sum() + final.cos().sum(), (q, k, v, log_decay, s0))
        results.append((out, final, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    small = (q[:, :1, :2], k[:, :1, :2], v[:, :1, :2], log_decay[:, :1, :2], s0[:, :1])
    assert torch.autograd.gradcheck(decayed_chunks, small)


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_blocks_of_heads_equal_one_call(name, monkeypatch):
    # The causal path in blocks of K/V heads (uneven: 2 + 1 of 3, or of grouped K/V heads) against
    # all heads at once: outputs and the gradients of the inputs and of every parameter (RFA's
    # per-head gate rows), under key padding.
    attn = build(name).double()
    grouped = attn.spec.capabilities.gqa and name != "rfa"  # rfa repeats K/V per query head
    q, k, v = make_qkv(B, 6 if grouped else H, N, N, d=D, d_v=5)
    if grouped:
        k, v = (x[:, :H].detach().requires_grad_() for x in (k, v))  # 3 K/V heads, 2 query heads each
    mask = mask_of()
    attn(q, k, v, causal=True, key_mask=mask)  # makes lazy buffers / parameters
    inputs = (q, k, v, *attn.parameters())
    results = []
    for block_bytes in (2**40, 2 * 2 * N * attn.num_features(D) * 8):  # all heads; 2 K/V heads a block
        monkeypatch.setattr(kernel, "CAUSAL_BLOCK_BYTES", block_bytes)
        out = attn(q, k, v, causal=True, key_mask=mask)
        results.append((out, *grads(out, inputs)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


def test_causal_blocks_of_heads_run_on_the_cpu_only(monkeypatch):
    # The blocks keep feature tensors on glibc's heap; off the CPU (the meta device stands in for
    # a GPU here) every head runs in one call, where more blocks would only repeat the launches.
    calls = []
    causal = kernel._causal
    monkeypatch.setattr(kernel, "_causal", lambda *a: calls.append(a[0].shape[1]) or causal(*a))
    attn = build("rfa", heads=H, head_dim=D)  # one byte and one row (the autouse fixture): a head a block
    for device, want in (("cpu", [1] * H), ("meta", [H])):
        calls.clear()
        q = torch.randn(B, H, N, D, device=device)
        assert attn.to(device)(q, q, q, causal=True).device.type == device
        assert calls == want, device


def test_non_causal_blocks_of_rows_on_the_cpu_only(monkeypatch):
    # 30 rows a block on the CPU (the autouse fixture): N = 37 positions of B * H = 6 rows in
    # blocks of 5; off the CPU (the meta device stands in for a GPU) blocks of DEVICE_BLOCK_BYTES
    # of features: all N positions in one where they fit, where more would only repeat the
    # launches, and 2 positions a block under a cap of 2.5 positions' features.
    calls = []
    attn = build("performer", head_dim=D)
    features = attn.key_features
    monkeypatch.setattr(attn, "key_features", lambda k, *a, **kw: calls.append(k.shape[2]) or features(k, *a, **kw))
    position_bytes = B * H * attn.num_features(D) * 4
    for device, cap, want in (
        ("cpu", 1, [5] * 7 + [2]),
        ("meta", N * position_bytes, [N]),
        ("meta", position_bytes * 5 // 2, [2] * 18 + [1]),
    ):
        monkeypatch.setattr(kernel, "DEVICE_BLOCK_BYTES", cap)
        calls.clear()
        q = torch.randn(B, H, N, D, device=device)
        assert attn.to(device)(q, q, q).device.type == device
        assert calls == want, (device, cap)


@pytest.mark.parametrize(("block_bytes", "block_rows", "want"), [(1, 2 * B * N, [2, 1]), (1, 3 * B * N - 1, [2, 1])])
def test_causal_blocks_hold_at_least_the_block_rows(monkeypatch, block_bytes, block_rows, want):
    # Heads per block: what CAUSAL_BLOCK_BYTES of key features hold, or CAUSAL_BLOCK_ROWS rows
    # (batch x head x position) where that is more heads (whole heads: 2 below 3 heads' rows).
    calls = []
    causal = kernel._causal
    monkeypatch.setattr(kernel, "_causal", lambda *a: calls.append(a[0].shape[1]) or causal(*a))
    monkeypatch.setattr(kernel, "CAUSAL_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(kernel, "CAUSAL_BLOCK_ROWS", block_rows)
    q = torch.randn(B, H, N, D)
    build("rfa", heads=H, head_dim=D)(q, q, q, causal=True)
    assert calls == want
    features = build("performer").num_features(D)
    monkeypatch.setattr(kernel, "CAUSAL_BLOCK_BYTES", 3 * B * N * features * 4)  # 3 heads of features
    calls.clear()
    build("performer")(q, q, q, causal=True)
    assert calls == [3]


def test_the_causal_chunk_is_64_on_the_cpu_and_longer_for_wide_maps_elsewhere(monkeypatch):
    # A GPU pays per launch: 256-long chunks for maps of 128 features or more (the meta device
    # stands in for a GPU). A chunk given in the config is kept everywhere.
    features, want = (16, 64, 127, 128, 1024), [64, 64, 64, 256, 256]
    assert [kernel.causal_chunk(None, m, torch.device("meta")) for m in features] == want
    assert kernel.causal_chunk(None, 256, torch.device("cpu")) == 64
    assert kernel.causal_chunk(32, 256, torch.device("meta")) == 32
    chunks = []
    sums = kernel._causal_sums
    monkeypatch.setattr(kernel, "_causal_sums", lambda *a, **kw: chunks.append(a[5]) or sums(*a, **kw))
    q = torch.randn(1, 2, 300, 16)
    for device, config, want in (("cpu", {}, 64), ("meta", {}, 256), ("meta", {"chunk": 32}, 32)):
        attn = attnzoo.build("rfa", heads=2, head_dim=16, features=64, **config).to(device)  # sin and cos: m = 128
        chunks.clear()
        attn(*(q.to(device),) * 3, causal=True)
        assert chunks and set(chunks) == {want}, (device, config)


class _MatmulDenormals(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the denormal entries of every matrix product's operands and result, and their size."""

    PRODUCTS = (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.addmm)

    def __init__(self) -> None:
        super().__init__()
        self.denormal = self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.PRODUCTS:
            for t in (*args, out):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    a = t.abs()
                    self.denormal += int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())
                    self.total += t.numel()
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_performer_on_large_inputs_keeps_denormals_out_of_its_products_and_its_answer(causal):
    # q, k 10x larger than unit variance (a trained model's can be): the features spread over
    # exponents far below 0. Below eps^2 of their maximum they are 0 (_ops.feature_floor), and
    # causal, the states' tiny entries too (_ops.flush_tiny_): with the floor at float32's
    # smallest normal thousands of denormals reached the products (several times slower on a
    # CPU); now at most one entry in 10^4. The answer is float64's (whose floor is at -72) to
    # float32's rounding of exponents near 100.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 512, 64, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = q * 10, k * 10
    attn = attnzoo.build("performer", seed=0)
    x32 = [t.float().requires_grad_() for t in (q, k, v)]
    count = _MatmulDenormals()
    with count:
        out = attn(*x32, causal=causal)
        out.sum().backward()
    assert count.total > 10**6 and count.denormal <= count.total // 10**4
    want = attn(q, k, v, causal=causal)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


def test_causal_performer_flushes_its_states_only_where_a_feature_was_flushed_and_the_maximum_rose():
    # The flush (KeyFeatures.sparse) costs a pass over every state: unit-variance keys at
    # N = 512 never need it; keys 10x larger do (features at 0, a running maximum that rises by
    # more than 31.8). Non-causal keys never carry the flag.
    from attnzoo.mechanisms.kernel_performer import favor_keys

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 4, 512, 64, generator=g) * 64**-0.25
    w = torch.randn(128, 64, generator=g)
    assert not favor_keys(k, w, None, causal=True).sparse
    assert favor_keys(10 * k, w, None, causal=True).sparse
    assert not favor_keys(10 * k, w, None, causal=False).sparse
