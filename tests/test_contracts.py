"""The mechanism protocol's contracts, checked for every registered attention mechanism.

Parametrised over ``attnzoo.names(kind="attention")``; what each mechanism is held to comes from
its registration (``attnzoo.describe(name)``): its capabilities and complexity, never its name.
A new mechanism is covered by registering it.

* fast == reference: ``forward`` (the fast path) and ``reference`` (the dense twin) agree in
  float64, outputs and gradients; ``implied_attention @ v`` is the reference output.
* causal: outputs of the first t rows do not change when later tokens change (strong causality),
  or ``causal=True`` is refused.
* padding: changing padded tokens changes no real output; a query that sees no key gets zeros.
* memory: where ``subquadratic_memory``, no tensor as large as the dense score matrix is made.
* decode: where ``decode_step``, ``step`` token by token equals the causal ``forward``, also
  after a left-padded prefill (``step(..., key_mask=)``), B = 2, H = 6, N = 77.

Tolerances: ``tolerances.assert_same`` (float64 row), the suite's one policy.
"""

from __future__ import annotations

import pytest
import torch

import attnzoo
from conftest import grads, largest_tensor, padding_mask, small_mechanism
from tolerances import assert_same

ATTENTION = attnzoo.names(kind="attention")
B, HEADS, HEAD_DIM, N = 3, 2, 4, 16  # every sized config fits N = 16 (axial, block2d: a 4x4 grid)


def _caps(name: str) -> attnzoo.spec.Capabilities:
    return attnzoo.describe(name).capabilities


def _causal_modes(name: str) -> tuple[bool, ...]:
    caps = _caps(name)
    return tuple(causal for causal in (False, True) if (caps.causal if causal else caps.bidirectional))


def _qkv(seed: int = 0, batch: int = B, n: int = N) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, HEADS, n, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(3))


def _mask() -> torch.Tensor:
    """Batch 0 all padding (its queries see nothing), batch 1 partly padded, batch 2 real."""
    return padding_mask(B, N)


@pytest.mark.parametrize("name", ATTENTION)
def test_fast_path_equals_reference_forward_and_gradients(name):
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    params = tuple(attn.parameters())
    for causal in _causal_modes(name):
        for mask in (None, _mask()):
            what = f"{name} causal={causal} padded={mask is not None}"
            inputs = tuple(x.requires_grad_() for x in _qkv())
            kw = dict(causal=causal, key_mask=mask)
            fast, ref = attn(*inputs, **kw), attn.reference(*inputs, **kw)
            assert_same(fast, ref, what=f"{what}: output")
            assert torch.equal(fast, attn(*inputs, **kw)), f"{what}: eval mode is not deterministic"
            for i, (g_fast, g_ref) in enumerate(zip(grads(fast, inputs + params), grads(ref, inputs + params))):
                assert_same(g_fast, g_ref, what=f"{what}: gradient {i}")


@pytest.mark.parametrize("name", ATTENTION)
def test_implied_attention_is_what_the_reference_applies(name):
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    q, k, v = _qkv(1)
    for causal in _causal_modes(name):
        for mask in (None, _mask()):
            out, weights = attn.reference(q, k, v, causal=causal, key_mask=mask, return_weights=True)
            assert weights.shape == (B, HEADS, N, N)
            if not _caps(name).weights_apply_to_v:
                continue  # declared: a gate, a norm or a latent comes after (or before) the weighting
            assert_same(attn.implied_attention(q, k, causal=causal, key_mask=mask), weights)
            assert_same(weights.to(v.dtype) @ v, out, what=f"{name} causal={causal}: weights @ v vs reference")


@pytest.mark.parametrize("name", ATTENTION)
def test_causal_outputs_depend_only_on_the_past_or_causal_is_refused(name):
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    q, k, v = _qkv(2)
    if not _caps(name).causal:
        with pytest.raises(ValueError, match="does not support causal"):
            attn(q, k, v, causal=True)
        return
    t = N // 2 + 1
    later = tuple(x.clone() for x in (q, k, v))
    for x in later:
        x[:, :, t:] = torch.randn_like(x[:, :, t:]) * 3
    for call in (attn, attn.reference):
        before, after = call(q, k, v, causal=True), call(*later, causal=True)
        assert_same(after[:, :, :t], before[:, :, :t], what=f"{name}: the first {t} rows after changing later tokens")


@pytest.mark.parametrize("name", ATTENTION)
def test_padding_changes_nothing_real_and_rows_that_see_nothing_are_zero(name):
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    mask = _mask()
    q, k, v = _qkv(3)
    pad = ~mask[:, None, :, None]
    # The mask marks keys; for a self-attention-only mechanism it marks the queries too, so
    # padded queries change as well and only the real rows are compared.
    self_only = not _caps(name).cross_attention
    changed = tuple(x.masked_fill(pad, 0) + torch.randn_like(x).masked_fill(~pad, 0) * 5 for x in (q, k, v))
    changed = changed if self_only else (q, *changed[1:])
    real = ~pad.expand_as(q[..., :1]) if self_only else torch.ones_like(q[..., :1], dtype=torch.bool)
    for causal in _causal_modes(name):
        for call in (attn, attn.reference):
            out = call(q, k, v, causal=causal, key_mask=mask)
            what = f"{name} causal={causal} {getattr(call, '__name__', 'forward')}"
            assert torch.isfinite(out).all(), what
            assert not out[0].any(), f"{what}: batch 0 sees no key, its rows must be zero"
            again = call(*changed, causal=causal, key_mask=mask)
            got, want = (x.masked_select(real) for x in (again, out))
            assert_same(got, want, what=f"{what}: real outputs after changing the padding")


@pytest.mark.parametrize("name", [n for n in ATTENTION if attnzoo.describe(n).complexity.subquadratic_memory])
def test_subquadratic_memory_never_makes_a_dense_score_tensor(name):
    # A config sized for a short sequence, run on a long one: its windows, blocks and features
    # stay small while N grows. A mechanism defined on a fixed shape (a grid, a graph) is built
    # for the long length instead. Measured after a warm-up call: plans and graphs are cached.
    n = 2048
    q, k, v = _qkv(4, batch=1, n=n)
    try:
        attn = small_mechanism(name, 128, heads=HEADS, head_dim=HEAD_DIM, **_max_len(name, n))
        attn(q, k, v, causal=not _caps(name).bidirectional)
    except ValueError:  # built for 128 positions exactly
        attn = small_mechanism(name, n, heads=HEADS, head_dim=HEAD_DIM, **_max_len(name, n))
    mask = torch.arange(n)[None] < n - 5
    dense = HEADS * n * n
    with torch.no_grad():
        for causal in _causal_modes(name):
            attn(q, k, v, causal=causal, key_mask=mask)
            largest = largest_tensor(attn, q, k, v, causal=causal, key_mask=mask)
            assert largest < dense, f"{name} causal={causal}: a tensor of {largest} elements, dense scores are {dense}"


def _max_len(name: str, n: int) -> dict[str, int]:
    return {"max_len": n} if "max_len" in attnzoo.registry.config_fields(name) else {}


@pytest.mark.parametrize("name", attnzoo.names(kind="attention", decode_step=True))
def test_decode_steps_equal_the_causal_forward(name):
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    q, k, v = _qkv(5)
    want = attn(q, k, v, causal=True)
    state = attn.init_state(B, HEADS, HEAD_DIM, HEAD_DIM, dtype=q.dtype)
    outs = []
    for t in range(N):
        out, state = attn.step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(out)
    assert_same(torch.cat(outs, 2), want, what=f"{name}: step by step vs forward")
    # An odd length, sized for it, B = 2 and H = 6 (3 per group of a two-pattern per-head
    # mechanism), batch row 0 left-padded (a batched prompt), decoded after a prefill: a prompt of
    # 9, then one token at a time.
    attn, n, heads = small_mechanism(name, 77, heads=6, head_dim=HEAD_DIM), 77, 6
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, heads, n, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :5] = False
    want = attn(q, k, v, causal=True, key_mask=mask)
    state = attn.init_state(2, heads, HEAD_DIM, HEAD_DIM, dtype=q.dtype)
    outs = []
    for lo, hi in [(0, 9), *((t, t + 1) for t in range(9, n))]:
        out, state = attn.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
        outs.append(out)
    got = torch.cat(outs, 2)
    assert not got[0, :, :5].any(), f"{name}: the padded prefix sees no real key, its rows must be zero"
    assert_same(got, want, what=f"{name}: left-padded prefill of 9, then steps, B = 2, H = 6, N = 77")


@pytest.mark.parametrize("name", ATTENTION)
def test_grouped_kv_heads_equal_repeated_ones_forward_gradients_and_decode(name):
    """Grouped-query attention: K/V with H_kv = 1 head for H = 2 query heads give what the K/V
    repeated per query head give, outputs and gradients (the gradient of a shared K/V head is the
    sum over the query heads it serves), causal where the mechanism can be, and step by step."""
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    q, k, v = _qkv(7)
    k1, v1 = (x[:, :1].clone().requires_grad_(True) for x in (k, v))
    q = q.requires_grad_(True)
    for causal in _causal_modes(name):
        grouped = attn(q, k1, v1, causal=causal)
        repeated = attn(q, k1.expand_as(k), v1.expand_as(v), causal=causal)
        assert_same(grouped, repeated, what=f"{name} causal={causal}: grouped K/V vs repeated")
        for got, want in zip(grads(grouped, (q, k1, v1)), grads(repeated, (q, k1, v1))):
            assert_same(got, want, what=f"{name} causal={causal}: gradients, grouped vs repeated")
    if not _caps(name).decode_step:
        return
    state = attn.init_state(B, HEADS, HEAD_DIM, HEAD_DIM, kv_heads=1, dtype=q.dtype)
    outs = []
    with torch.no_grad():
        for t in range(N):
            out, state = attn.step(state, q[:, :, t : t + 1], k1[:, :, t : t + 1], v1[:, :, t : t + 1])
            outs.append(out)
        assert_same(torch.cat(outs, 2), attn(q, k1, v1, causal=True), what=f"{name}: grouped decode vs forward")


@pytest.mark.parametrize("name", ATTENTION)
def test_dropout_is_the_seeded_mask_the_reference_applies_or_is_refused(name):
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    q, k, v = (x.requires_grad_(True) for x in _qkv(8))
    if not _caps(name).dropout:
        with pytest.raises(ValueError, match="does not support attention dropout"):
            attn(q, k, v, dropout_p=0.1)
        return
    for causal in _causal_modes(name):
        torch.manual_seed(3)
        fast = attn(q, k, v, causal=causal, key_mask=_mask(), dropout_p=0.25)
        torch.manual_seed(3)
        ref, weights = attn.reference(q, k, v, causal=causal, key_mask=_mask(), dropout_p=0.25, return_weights=True)
        assert_same(fast, ref, what=f"{name} causal={causal}: dropout, fast vs reference (one seed)")
        for got, want in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v))):
            assert_same(got, want, what=f"{name}: dropout gradients")
        plain = attn.reference(q, k, v, causal=causal, key_mask=_mask(), return_weights=True)[1]
        dropped = (weights == 0) & (plain > 0)
        assert 0.15 < dropped.sum() / (plain > 0).sum() < 0.35, f"{name}: about a quarter of the weights dropped"
        kept = ~dropped & (plain > 0)
        torch.testing.assert_close(weights[kept], plain[kept] / 0.75)  # the survivors rescaled by 1 / (1 - p)
    with pytest.raises(ValueError, match="dropout_p must be a number in"):
        attn(q, k, v, dropout_p=1.0)


def _general_masks() -> tuple[torch.Tensor, torch.Tensor]:
    """A bool (B, 1, N, N) mask with one row that sees nothing, and an additive (1, H, N, N)
    bias with -inf entries."""
    g = torch.Generator().manual_seed(9)
    allowed = torch.rand(B, 1, N, N, generator=g) > 0.3
    allowed[1, 0, 5] = False
    bias = torch.randn(1, HEADS, N, N, generator=g, dtype=torch.float64)
    return allowed, bias.masked_fill(torch.rand(1, HEADS, N, N, generator=g) > 0.8, -torch.inf)


@pytest.mark.parametrize("name", ATTENTION)
def test_a_general_attn_mask_is_what_the_reference_applies_or_is_refused(name):
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    q, k, v = (x.requires_grad_(True) for x in _qkv(10))
    allowed, bias = _general_masks()
    if not _caps(name).attn_mask:
        with pytest.raises(ValueError, match="does not support a general attn_mask"):
            attn(q, k, v, attn_mask=allowed)
        return
    for causal in _causal_modes(name):
        for mask in (allowed, bias):
            fast = attn(q, k, v, causal=causal, key_mask=_mask(), attn_mask=mask)
            ref, weights = attn.reference(q, k, v, causal=causal, key_mask=_mask(), attn_mask=mask, return_weights=True)
            assert_same(fast, ref, what=f"{name} causal={causal} attn_mask {mask.dtype}: fast vs reference")
            for got, want in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v))):
                assert_same(got, want, what=f"{name}: attn_mask gradients")
            blocked = ~allowed if mask.dtype == torch.bool else torch.isinf(bias)
            assert not weights.masked_select(blocked.expand_as(weights)).any(), "masked pairs get no weight"
        emptied = attn(q, k, v, causal=causal, key_mask=_mask(), attn_mask=allowed)[1, :, 5]
        assert not emptied.any(), f"{name}: a row the mask empties is zero"


@pytest.mark.parametrize("name", ATTENTION)
def test_a_per_call_scale_multiplies_the_dot_products_or_is_refused(name):
    """``scale=s``: every weight the mechanism applies is proportional to ``exp(s q_i . k_j)`` over
    the keys row i sees (log-weights minus ``s q_i . k_j`` constant along each row), the fast
    path equals the reference, and decode steps equal the forward; elsewhere refused."""
    attn = small_mechanism(name, N, heads=HEADS, head_dim=HEAD_DIM)
    q, k, v = _qkv(11)
    if not _caps(name).scale:
        with pytest.raises(ValueError, match="scale"):
            attn(q, k, v, causal=not _caps(name).bidirectional, scale=0.3)
        return
    for causal in _causal_modes(name):
        fast = attn(q, k, v, causal=causal, scale=0.3)
        out, weights = attn.reference(q, k, v, causal=causal, scale=0.3, return_weights=True)
        assert_same(fast, out, what=f"{name} causal={causal}: fast vs reference with scale")
        seen = weights > 0
        shifted = torch.where(seen, weights.log() - 0.3 * q @ k.transpose(-1, -2), 0.0)
        row_mean = shifted.sum(-1, keepdim=True) / seen.sum(-1, keepdim=True).clamp_min(1)
        spread = torch.where(seen, shifted - row_mean, 0.0).abs().max()
        assert spread < 1e-9, f"{name} causal={causal}: weights are not exp(scale q.k) normalised ({spread})"
    with pytest.raises(ValueError, match="scale must be a positive"):
        attn(q, k, v, scale=-1.0)
    if _caps(name).decode_step:
        state = attn.init_state(B, HEADS, HEAD_DIM, HEAD_DIM, dtype=q.dtype)
        outs = []
        for t in range(N):
            out, state = attn.step(state, *(x[:, :, t : t + 1] for x in (q, k, v)), scale=0.3)
            outs.append(out)
        assert_same(torch.cat(outs, 2), attn(q, k, v, causal=True, scale=0.3), what=f"{name}: steps with scale")


def test_a_per_call_scale_and_a_configured_one_are_not_combined():
    attn = attnzoo.build("topk", topk=4, scale=0.5)
    q, k, v = _qkv(12)
    with pytest.raises(ValueError, match="set one of them"):
        attn(q, k, v, scale=0.3)
