"""Low rank and compression (linformer, compressed, nystrom; LAMAPooling): limit laws, the
compressed causal rule, the pseudo-inverse, configs the contract tests do not reach, config checks.

``tests/test_contracts.py`` holds each of these mechanisms to fast == reference (forward and
gradients), causal prefix invariance, padding invariance, rows that see nothing = 0, and no N x N
tensor, on a length-sized config with N_q = N_kv; this file keeps what those do not reach."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms.nystrom import iterative_pinv, landmark_segments, nystrom_weights
from attnzoo.nn import LAMAPooling
from conftest import grads, make_qkv, padding_mask
from oracles import oracle_lama_weights
from tolerances import assert_path_close_to_golden, assert_same

B, H, N, D = 2, 3, 37, 8
LOW_RANK = attnzoo.names(family="low_rank")
# Configs the contract tests do not reach: per-head parameters, k > N, random (unequal) taps for
# keys and values, several causal chunks, compression windows that overlap (3, 2), tile (4, 4)
# or leave gaps (2, 3), uneven landmark segments (37 = 5 x 5 + 3 x 4); run on N = 37, D_v != D
# and, where allowed, cross-attention sizes (N_q = 23).
CASES = [
    ("linformer", dict(k=16, max_len=64)),
    ("linformer", dict(k=50, max_len=64, sharing="kv")),
    ("linformer", dict(k=5, max_len=40, sharing="none", heads=H)),
    ("compressed", dict(kernel=3, stride=2, chunk=10)),
    ("compressed", dict(kernel=4, stride=4, per_head=True, heads=H, chunk=16)),
    ("compressed", dict(kernel=2, stride=3, chunk=8)),
    ("nystrom", dict(landmarks=8, pinv_iters=6)),
]


def _mask(padded: bool, n: int = N) -> torch.Tensor | None:
    if not padded:
        return None
    mask = padding_mask(B, n)  # batch 0 is all padding: its rows see no key
    mask[1, -3:] = False
    return mask


def _build(name: str, config: dict) -> torch.nn.Module:
    module = attnzoo.build(name, **config).double()
    if name == "compressed":  # taps that are not all equal, so that the reference check means something
        with torch.no_grad():
            module.taps.copy_(torch.rand_like(module.taps) + 0.1)
    return module


def _causal_modes(module: torch.nn.Module) -> tuple[bool, ...]:
    return (False, True) if module.spec.capabilities.causal else (False,)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(map(str, c[1].values()))}")
@pytest.mark.parametrize("padded", [False, True])
def test_fast_equals_reference_on_configs_the_contracts_do_not_reach(case, padded):
    name, config = case
    module, mask = _build(name, config), _mask(padded)
    params = tuple(module.parameters())
    for causal in _causal_modes(module):
        for n_q in (N, 23) if module.spec.capabilities.cross_attention else (N,):
            q, k, v = make_qkv(B, H, n_q, N, D, d_v=5)
            kw = dict(causal=causal, key_mask=mask)
            fast, ref = module(q, k, v, **kw), module.reference(q, k, v, **kw)
            what = f"{name} causal={causal} n_q={n_q}"
            assert_same(fast, ref, what=what)
            for i, (a, r) in enumerate(zip(grads(fast, (q, k, v) + params), grads(ref, (q, k, v) + params))):
                assert_same(a, r, what=f"{what} grad {i}")


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6]], ids=lambda c: c[0])
def test_float32_is_as_accurate_as_the_reference(case):
    name, config = case
    module, mask = _build(name, config).float(), _mask(True)
    for causal in _causal_modes(module):
        kw = dict(causal=causal, key_mask=mask)
        fast = lambda q, k, v, kw=kw: module(q, k, v, **kw)  # noqa: E731
        reference = lambda q, k, v, kw=kw: module.reference(q, k, v, **kw)  # noqa: E731
        assert_path_close_to_golden(fast, reference, make_qkv(B, H, N, N, D, dtype=torch.float32), what=name)


@pytest.mark.parametrize("n_q", [N, 23])
def test_linformer_with_identity_projections_and_k_equal_n_is_softmax(n_q):
    q, k, v = make_qkv(B, H, n_q, N, D)
    full = attnzoo.build("softmax")(q, k, v)
    full_grads = grads(full, (q, k, v))
    for sharing in ("headwise", "kv", "layerwise", "none"):
        out = attnzoo.build("linformer", k=N, max_len=50, sharing=sharing, heads=H, init="identity")(q, k, v)
        assert_same(out, full, what=f"linformer sharing={sharing}")
        for a, r, w in zip(grads(out, (q, k, v)), full_grads, "qkv"):
            assert_same(a, r, what=f"grad {w}")


def test_linformer_sharing_modes_hold_what_they_say():
    shapes = {
        s: tuple(attnzoo.build("linformer", k=4, max_len=10, sharing=s, heads=H).proj.shape)
        for s in ("headwise", "kv", "layerwise", "none")
    }
    assert shapes == {"headwise": (2, 1, 4, 10), "kv": (1, 1, 4, 10), "layerwise": (1, 1, 4, 10), "none": (2, H, 4, 10)}
    a, b = attnzoo.build("linformer", k=4, max_len=10), attnzoo.build("linformer", k=4, max_len=10)
    assert torch.equal(a.proj, b.proj) and not torch.equal(a.proj[0], a.proj[1])  # seeded; E != F


def test_linformer_refuses_long_inputs_and_wrong_heads():
    q, k, v = make_qkv(1, 2, 12, 12, 4, requires_grad=False)
    with pytest.raises(ValueError, match="max_len=10 but N_kv=12; build it with max_len >= 12"):
        attnzoo.build("linformer", k=4, max_len=10)(q, k, v)
    with pytest.raises(ValueError, match="max_len=10 but N_kv=12"):
        attnzoo.build("linformer", k=4, max_len=10).implied_attention(q, k)
    with pytest.raises(ValueError, match="heads=8 but q has H=2; build it with heads=2"):
        attnzoo.build("linformer", k=4, max_len=16, sharing="none")(q, k, v)


def test_nystrom_with_one_token_per_landmark_is_full_attention_within_the_pinv_tolerance():
    q, k, v = make_qkv(B, H, N, N, D)
    mask = _mask(True)
    nystrom = attnzoo.build("nystrom", landmarks=N, pinv_iters=30)
    q0, k0, v0 = nystrom.zero_padded(mask, q, k, v)  # what the forward attends over: padding zeroed
    full = reference_attention(q0, k0, v0, key_mask=mask)
    exact = nystrom_weights(q0, k0, landmarks=N, pinv_iters=None, key_mask=mask) @ v0
    assert_same(exact, full)
    # 30 steps of the iteration reach the exact pseudo-inverse here (measured error ~1e-13).
    out = nystrom(q, k, v, key_mask=mask)
    torch.testing.assert_close(out, full, atol=1e-9, rtol=0)
    for a, r, w in zip(grads(out, (q, k, v)), grads(full, (q, k, v)), "qkv"):
        torch.testing.assert_close(a, r, atol=1e-8, rtol=0, msg=lambda m, w=w: f"grad {w}: {m}")
    assert_same(attnzoo.build("nystrom", landmarks=N + 20, pinv_iters=30)(q, k, v, key_mask=mask), out)


def test_iterative_pinv_converges_to_the_exact_pseudo_inverse():
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    a = torch.softmax(q[..., :9, :] @ k[..., :9, :].transpose(-1, -2) / D**0.5, -1)
    exact = torch.linalg.pinv(a)
    # The iteration is slow until ||I - A Z|| becomes small, then converges fast (cond(A) ~ 300 here).
    errors = [float((iterative_pinv(a, it) - exact).abs().max()) for it in (0, 4, 8, 12, 30)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-9, errors
    assert torch.equal(iterative_pinv(torch.zeros(2, 3, 3), 4), torch.zeros(2, 3, 3))
    # The whole mechanism approaches its exact-pinv reference as the iterations grow.
    exact_out = nystrom_weights(q, k, landmarks=9, pinv_iters=None) @ v
    gaps = [
        float((attnzoo.build("nystrom", landmarks=9, pinv_iters=it)(q, k, v) - exact_out).abs().max())
        for it in (0, 12, 18, 30)
    ]
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 1e-9, gaps


def test_nystrom_segments_are_contiguous_and_near_equal():
    seg, m = landmark_segments(37, 8, torch.device("cpu"))
    sizes = torch.bincount(seg, minlength=m)
    assert m == 8 and bool((seg[1:] >= seg[:-1]).all()) and set(sizes.tolist()) == {4, 5} and sizes.sum() == 37
    seg, m = landmark_segments(32, 8, torch.device("cpu"))
    assert torch.equal(seg, torch.arange(8).repeat_interleave(4))  # the paper's equal segments
    assert landmark_segments(5, 64, torch.device("cpu"))[1] == 5


@pytest.mark.parametrize("n_q", [N, 23])
@pytest.mark.parametrize("causal", [False, True])
def test_compressed_with_kernel_and_stride_one_is_full_attention(n_q, causal):
    # Slots are the keys themselves; causal: slot j is visible iff j <= i and no raw tail remains.
    mask = _mask(True)
    q, k, v = make_qkv(B, H, n_q, N, D)
    full = attnzoo.build("softmax")(q, k, v, causal=causal, key_mask=mask)
    out = attnzoo.build("compressed", kernel=1, stride=1, chunk=10)(q, k, v, causal=causal, key_mask=mask)
    assert_same(out, full)
    for a, r, w in zip(grads(out, (q, k, v)), grads(full, (q, k, v)), "qkv"):
        assert_same(a, r, what=f"grad {w}")


@pytest.mark.parametrize("kernel, stride", [(2, 2), (3, 2), (2, 3), (4, 1)])
def test_compressed_causal_sees_whole_past_slots_plus_its_raw_tail(kernel, stride):
    q, k, _ = make_qkv(1, 1, 20, 20, D, requires_grad=False)
    module = attnzoo.build("compressed", kernel=kernel, stride=stride).double()
    module.taps.data.fill_(1 / kernel)  # exact in float64: each slot's taps sum to 1
    weights = module.implied_attention(q, k, causal=True)
    for t in range(20):
        starts = [s for s in range(0, 20, stride) if s + kernel - 1 <= t]
        covered = {j for s in starts for j in range(s, s + kernel)}
        last_end = max((s + kernel - 1 for s in starts), default=-1)
        expected = covered | set(range(last_end + 1, t + 1))
        assert set((weights[0, 0, t] > 0).nonzero().flatten().tolist()) == expected, t
    assert_same(weights.sum(-1), torch.ones(1, 1, 20, dtype=torch.float64))  # no empty row


def test_registry_entries():
    assert set(LOW_RANK) >= {"linformer", "compressed", "nystrom"} and "lama" not in attnzoo.names()
    for name, paper in (("linformer", "2006.04768"), ("compressed", "1801.10198"), ("nystrom", "2102.03902")):
        spec = attnzoo.describe(name)
        assert paper in spec.paper and spec.complexity.subquadratic_memory
        assert any("representative keys" in note for note in spec.notes)
    assert attnzoo.describe("compressed").capabilities.causal
    assert not attnzoo.describe("nystrom").capabilities.cross_attention


@pytest.mark.parametrize(
    "name, field, value",
    [
        ("linformer", "k", 0),
        ("linformer", "max_len", 0),
        ("linformer", "heads", 0),
        ("linformer", "seed", -1),
        ("compressed", "kernel", 0),
        ("compressed", "stride", 0),
        ("compressed", "heads", 0),
        ("compressed", "chunk", 0),
        ("nystrom", "landmarks", 0),
        ("nystrom", "pinv_iters", -1),
    ],
)
def test_bad_config_values_name_the_field(name, field, value):
    with pytest.raises(ValueError, match=f"^[A-Za-z]+Config: {field} must be >= "):
        attnzoo.build(name, **{field: value})


def test_bad_config_choices_and_per_head_mismatch():
    with pytest.raises(ValueError, match="'sharing' must be 'headwise' \\| 'kv' \\| 'layerwise' \\| 'none'"):
        attnzoo.build("linformer", sharing="all")
    with pytest.raises(ValueError, match="'init' must be"):
        attnzoo.build("linformer", init="zeros")
    q, k, v = make_qkv(1, 2, 8, 8, 4, requires_grad=False)
    with pytest.raises(ValueError, match="compressed was built for heads=8 but q has H=2"):
        attnzoo.build("compressed", per_head=True)(q, k, v)
    for field in ("dim", "heads", "rank"):
        with pytest.raises(ValueError, match=field):
            LAMAPooling(**{"dim": 4, "heads": 2, "rank": 2, field: 0})
    with pytest.raises(ValueError, match="context must be one of"):
        LAMAPooling(4, context="max")


def _lama_params(pool: LAMAPooling) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (pool.u, pool.v, pool.p, pool.c) if t is not None)


@pytest.mark.parametrize("context", ["learned", "mean"])
def test_lama_pooling_matches_the_oracle_forward_and_gradients(context):
    pool = LAMAPooling(6, heads=3, rank=4, context=context).double()
    x = torch.randn(3, 9, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(9)[None] < torch.tensor([[0], [5], [9]])
    for key_mask in (None, mask):
        expected = oracle_lama_weights(x, pool.u, pool.v, pool.p, pool.c, key_mask)
        assert_same(pool.weights(x, key_mask), expected, what="weights")
        out = pool(x, key_mask=key_mask)
        golden = torch.einsum("bhn,bnd->bhd", expected, x.double())
        assert_same(out, golden)
        inputs = (x, *_lama_params(pool))
        for got, want in zip(grads(out, inputs), grads(golden, inputs)):
            assert_same(got, want, what="gradient")


def test_lama_pooling_respects_padding():
    pool = LAMAPooling(6, heads=3, rank=4, context="mean").double()
    x = torch.randn(2, 11, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(11)[None] < torch.tensor([[0], [8]])
    out = pool(x, key_mask=mask)
    weights = pool.weights(x, mask)
    assert torch.equal(weights[:, :, 8:], torch.zeros_like(weights[:, :, 8:]))
    assert torch.equal(out[0], torch.zeros(3, 6, dtype=torch.float64)) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[0], torch.zeros_like(x.grad[0]))
    assert torch.equal(x.grad[1, 8:], torch.zeros_like(x.grad[1, 8:]))
    # Padded tokens change nothing, not even the data-derived context.
    x2 = x.detach().clone()
    x2[:, 8:] = 100 * torch.randn(2, 3, 6, dtype=torch.float64)
    assert_same(pool(x2, key_mask=mask), out)
    assert_same(pool(x.detach()[1:, :8]), out[1:])


def test_lama_weights_are_not_a_linear_probe():
    # Any linear probe alpha = softmax_i(x_i . w) gives log(alpha_3/alpha_2) = log(alpha_2/alpha_1)
    # for three evenly spaced tokens x_1, x_1 + d, x_1 + 2d, whatever w is; LAMA must not.
    pool = LAMAPooling(8, heads=4, rank=6).double()
    start, step = torch.randn(8, dtype=torch.float64), 2 * torch.randn(8, dtype=torch.float64)
    x = torch.stack([start, start + step, start + 2 * step])[None]
    log_alpha = pool.weights(x).log()[0]  # (heads, 3)
    gap = (log_alpha[:, 2] - log_alpha[:, 1]) - (log_alpha[:, 1] - log_alpha[:, 0])
    assert gap.abs().max() > 1e-2
    # Inputs that agree on x . w for every w in a fixed set of directions W get the same weights
    # from every probe built from W, but not from LAMA.
    directions = torch.randn(8, 5, dtype=torch.float64)
    x = torch.randn(1, 7, 8, dtype=torch.float64)
    basis, _ = torch.linalg.qr(directions, mode="complete")
    x_prime = x + 3 * torch.randn(1, 7, 3, dtype=torch.float64) @ basis[:, 5:].T  # moves off span(W)
    assert_same(x_prime @ directions, x @ directions)
    probe = directions @ torch.randn(5, dtype=torch.float64)
    assert_same(torch.softmax(x_prime @ probe, -1), torch.softmax(x @ probe, -1))
    assert (pool.weights(x_prime) - pool.weights(x)).abs().max() > 1e-2


@pytest.mark.parametrize("rank", [1, 3])
def test_lama_rank_bounds_the_heads_log_weights(rank):
    # log alpha_hi = s_hi - logsumexp_i(s_h) and s = P^T diag(tanh(V^T c)) tanh(U^T X): after
    # centring over tokens the (heads, N) matrix has rank <= rank, and a generic one reaches it.
    pool = LAMAPooling(8, heads=5, rank=rank).double()
    log_alpha = pool.weights(torch.randn(2, 12, 8, dtype=torch.float64)).log()
    centred = log_alpha - log_alpha.mean(-1, keepdim=True)
    assert torch.linalg.matrix_rank(centred, rtol=1e-9).tolist() == [rank, rank]


def test_lama_pooling_trains():
    torch.manual_seed(0)
    pool = LAMAPooling(8, heads=2, rank=3)
    x, target = torch.randn(4, 10, 8), torch.randn(4, 2, 8)
    optimizer = torch.optim.SGD(pool.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(pool(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[2] < losses[0] and all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in pool.parameters())
