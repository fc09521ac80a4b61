"""The ``routing`` mechanism (Routing Transformer), beyond ``tests/test_contracts.py``: fast paths
equal ``reference_routing`` on configs the contract does not build (default window, windows
past the real tokens, tiles, ties, share_qk, low precision), limit laws, no silently dropped
queries, EMA centroids, approximation, no N x N at N = 32K, and the decode step's state."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.mechanisms._ops import argmax_over
from attnzoo.mechanisms.routing import reference_routing
from conftest import grads, make_qkv, padding_mask
from tolerances import assert_close_to_golden, assert_same

B, H, N, D, DV = 3, 2, 37, 8, 5


def routing(**config):
    return attnzoo.build("routing", **{"n_clusters": 3, **config}).eval()


def reference(attn, q, k, v, **kwargs):
    return reference_routing(q, k, v, attn.centroids, attn.config, **kwargs)


def set_centroids(module, centroids):
    module.centroids_for(centroids.shape[0], centroids.shape[2])
    module.centroids.copy_(centroids)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("window", [None, 25])  # 25 > 18 real tokens of batch 1: padded queries get picked
def test_fast_path_equals_reference_float64(causal, padded, window):
    attn = routing(window=window)
    q, k, v = make_qkv(B, H, N, N, d=D, d_v=DV)
    mask = padding_mask(B, N) if padded else None
    fast = attn(q, k, v, causal=causal, key_mask=mask)
    ref = reference(attn, q, k, v, causal=causal, key_mask=mask)
    assert_same(fast, ref, what="forward")
    fast_grads = grads(fast, (q, k, v))
    for got, want, name in zip(fast_grads, grads(ref, (q, k, v)), "qkv"):
        assert_same(got, want, what=f"d{name}")
    if padded:  # batch 0 is all padding; padded rows of the others are 0 too
        assert torch.equal(fast[~mask[:, None, :].expand(-1, H, -1)], torch.zeros(int((~mask).sum()) * H, DV).double())
        assert torch.equal(fast_grads[0][0], torch.zeros_like(q[0]))


@pytest.mark.parametrize("causal", [False, True])
def test_narrow_tiles_and_one_tile_per_pass_change_nothing(causal, monkeypatch):
    # Groups of unpicked queries are cut into tiles of TILE queries, causal ones into tiles of
    # BAND over key blocks of min(BAND, w) ranks, attended PAIRS pairs at a time; make tiles of 3
    # (a group spans several, window 9: a tile's span several blocks), one tile per pass. SPARE = 0
    # sends every non-causal unpicked query to the tiles (by default they join their cluster's call).
    import attnzoo.mechanisms.routing_band as band
    import attnzoo.mechanisms.routing_tiles as module

    q, k, v = make_qkv(B, H, N, N, d=D, d_v=DV)
    mask = padding_mask(B, N)
    attn = routing(n_clusters=2, window=9)
    wide = attn(q, k, v, causal=causal, key_mask=mask)
    monkeypatch.setattr(module, "TILE", 3)
    monkeypatch.setattr(module, "PAIRS", 1)
    monkeypatch.setattr(module, "SPARE", 0.0)
    monkeypatch.setattr(band, "BAND", 3)
    monkeypatch.setattr(band, "PAIRS", 1)
    narrow = attn(q, k, v, causal=causal, key_mask=mask)
    ref = reference(attn, q, k, v, causal=causal, key_mask=mask)
    assert_same(narrow, ref)
    assert_same(wide, ref)
    for got, want in zip(grads(narrow, (q, k, v)), grads(ref, (q, k, v))):
        assert_same(got, want)


def test_unpicked_queries_become_rows_of_their_clusters_calls():
    from attnzoo.mechanisms.routing_tiles import _unpicked_rows

    # B=1, H=2, N=7, 3 clusters; -1: picked by some cluster (or padding), else the nearest centroid.
    group = torch.tensor([[[2, -1, 0, 2, -1, 2, 0], [-1, -1, -1, 1, -1, -1, -1]]])
    rows, slot = _unpicked_rows(group, 3, w=4)
    assert rows.shape == (1, 2, 3, 3)  # the largest group: 3 queries of cluster 2 in head 0
    assert rows[0, 0].tolist() == [[2, 6, 7], [7, 7, 7], [0, 3, 5]]  # position order; 7 = N: no query
    assert rows[0, 1].tolist() == [[7, 7, 7], [3, 7, 7], [7, 7, 7]]
    flat = rows.flatten(2)
    for h in range(2):
        for i in range(7):  # a query's slot holds it; a picked query's slot is past the rows
            assert flat[0, h, slot[0, h, i]] == i if group[0, h, i] >= 0 else slot[0, h, i] == 9
    assert _unpicked_rows(group, 3, w=2)[0] is None  # 3 > SPARE * w: tiles
    none, _ = _unpicked_rows(torch.full((1, 1, 5), -1), 3, w=2)
    assert none.shape == (1, 1, 3, 0)


@pytest.mark.parametrize("window", [None, 20, 70])
def test_causal_band_over_many_tiles_and_blocks_equals_reference(window):
    # N = 300, 2 clusters of ~150 queries: two tiles of BAND = 128 per cluster; window 20 or 70
    # makes blocks of 20 or 70 ranks, several per span, and the band's lower end cuts into them.
    attn = routing(n_clusters=2, window=window)
    q, k, v = make_qkv(3, 1, 300, 300, d=D, d_v=DV)
    mask = padding_mask(3, 300, empty_row=False)  # 1, 150 and 300 real tokens
    fast = attn(q, k, v, causal=True, key_mask=mask)
    ref = reference(attn, q, k, v, causal=True, key_mask=mask)
    assert_same(fast, ref, what="forward")
    for got, want, name in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_same(got, want, what=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 1, 2), (1, 3, 6)])
def test_tiny_shapes_and_exact_ties_match_the_reference(causal, shape):
    b, h, n = shape
    attn = routing(n_clusters=4)
    q, k, v = (t.detach() for t in make_qkv(b, h, 2 * n, 2 * n, d=D))
    q, k = (torch.cat([x[:, :, :n], x[:, :, :n]], dim=2).requires_grad_() for x in (q, k))  # duplicate tokens tie
    v.requires_grad_()
    fast = attn(q, k, v, causal=causal)
    ref = reference(attn, q, k, v, causal=causal)
    assert_same(fast, ref)
    for got, want in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v))):
        assert_same(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_within_golden_policy(dtype, causal):
    attn = routing(window=9)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in make_qkv(B, H, N, N, d=D, d_v=DV))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = padding_mask(B, N)
    fast = attn(q, k, v, causal=causal, key_mask=mask)
    ref = reference(attn, q, k, v, causal=causal, key_mask=mask)
    golden = reference(attn, q64, k64, v64, causal=causal, key_mask=mask)
    assert fast.dtype == dtype
    assert_close_to_golden(fast, ref, golden, what="forward")
    triples = zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), grads(golden, (q64, k64, v64)))
    for (got, want, gold), name in zip(triples, "qkv"):
        assert_close_to_golden(got, want, gold, what=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_one_cluster_equals_full_softmax(causal, padded):
    q, k, v = make_qkv(B, H, N, N, d=D, d_v=DV)
    mask = padding_mask(B, N, empty_row=False) if padded else None
    out = attnzoo.build("routing", n_clusters=1)(q, k, v, causal=causal, key_mask=mask)
    full = attnzoo.build("softmax")(q, k, v, causal=causal, key_mask=mask)
    real = slice(None) if mask is None else mask[:, None, :].expand(-1, H, -1)
    assert_same(out[real], full[real])


def expected_unpicked_rows(q, k, v, centroids, w):
    """Independent: top-w picks by torch.topk; unpicked queries attend to the keys their
    nearest centroid picked. Returns (unpicked (B, H, N) bool, expected outputs there)."""
    mu = F.normalize(centroids.double(), dim=-1)
    sim_q = torch.einsum("bhnd,hcd->bhcn", F.normalize(q, dim=-1), mu)
    sim_k = torch.einsum("bhnd,hcd->bhcn", F.normalize(k, dim=-1), mu)
    picked = torch.zeros_like(sim_q, dtype=torch.bool).scatter(-1, sim_q.topk(w, dim=-1).indices, True)
    unpicked = ~picked.any(2)
    keys_of = sim_k.topk(w, dim=-1).indices  # [B, H, C, w]
    expected = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)
    for b, h, i in unpicked.nonzero().tolist():
        js = keys_of[b, h, sim_q[b, h, :, i].argmax()]
        weights = torch.softmax(k[b, h, js] @ q[b, h, i] / q.shape[-1] ** 0.5, dim=0)
        expected[b, h, i] = weights @ v[b, h, js]
    return unpicked, expected


@pytest.mark.parametrize("window", [None, 3])
def test_no_real_query_is_dropped(window):
    # window 3 with 4 clusters covers at most 12 of 37 queries: most are picked by no cluster.
    attn = routing(n_clusters=4, window=window)
    q, k, v = (t.detach() for t in make_qkv(B, H, N, N, d=D, d_v=DV))
    out = attn(q, k, v)
    unpicked, expected = expected_unpicked_rows(q, k, v, attn.centroids, window or 10)
    assert unpicked.sum() > 0, "the inputs must leave some query unpicked"
    assert (out.abs().sum(-1) > 0).all()
    assert_same(out[unpicked], expected[unpicked])


@pytest.mark.parametrize("causal", [False, True])
def test_padded_content_changes_neither_real_outputs_nor_centroids(causal):
    q, k, v = (t.detach() for t in make_qkv(B, H, N, N, d=D, d_v=DV))
    mask = padding_mask(B, N)
    pad = ~mask[:, None, :, None]
    noisy = tuple(torch.where(pad, torch.randn_like(x) * 5, x) for x in (q, k, v))
    a, b = routing(window=5).train(), routing(window=5).train()
    out_a = a(q, k, v, causal=causal, key_mask=mask)
    out_b = b(*noisy, causal=causal, key_mask=mask)
    assert_same(out_a, out_b)
    assert_same(a.centroids, b.centroids)


def test_centroids_move_by_ema_in_training_only_and_are_saved():
    q, k, v = (t.detach() for t in make_qkv(B, H, N, N, d=D, d_v=DV))
    attn = routing(decay=0.9)
    first = attn(q, k, v)
    start = attn.centroids.clone()
    assert torch.equal(attn(q, k, v), first) and torch.equal(attn.centroids, start)  # eval: deterministic
    attn.train()(q, k, v)
    # Expected EMA step, written out: each centroid moves towards the unit mean direction of
    # the unit q and k nearest to it, summed over the batch.
    unit = [F.normalize(x, dim=-1) for x in (q, k)]
    mu = F.normalize(start.double(), dim=-1)
    nearest = [F.one_hot(torch.einsum("bhnd,hcd->bhnc", x, mu).argmax(-1), 3).double() for x in unit]
    total = sum(torch.einsum("bhnc,bhnd->hcd", a, x) for a, x in zip(nearest, unit))
    expected = F.normalize(0.9 * mu + 0.1 * F.normalize(total, dim=-1), dim=-1)
    assert_same(attn.centroids, expected.float(), dtype=torch.float32)
    state = attn.state_dict()
    assert torch.equal(state["centroids"], attn.centroids)
    fresh = routing(decay=0.9, shape=attnzoo.Shape(heads=q.shape[1], head_dim=q.shape[-1])).eval()
    fresh.load_state_dict(state)  # built with its shape: the centroids exist before any forward
    assert torch.equal(fresh(q, k, v), attn.eval()(q, k, v))


def test_centroids_refuse_another_head_shape():
    attn = routing()
    attn(*make_qkv(1, 2, 5, 5, d=4))
    with pytest.raises(ValueError, match="build a new module"):
        attn(*make_qkv(1, 3, 5, 5, d=4))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_share_qk_fast_path_equals_reference_and_ignores_k(causal, padded):
    attn = routing(window=5, share_qk=True)
    q, k, v = make_qkv(B, H, N, N, d=D, d_v=DV)
    mask = padding_mask(B, N) if padded else None
    fast = attn(q, k, v, causal=causal, key_mask=mask)
    ref = reference(attn, q, k, v, causal=causal, key_mask=mask)
    assert_same(fast, ref, what="forward")
    for got, want, name in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_same(got, want, what=f"d{name}")
    assert torch.count_nonzero(grads(fast, (k,))[0]) == 0  # keys are the queries: k is not used
    assert_same(attn(q, torch.randn_like(k), v, causal=causal, key_mask=mask), fast)
    # Independent of share_qk's code path: the plain mechanism fed the unit queries as both q
    # and k, with scale D, is the same function.
    unit = F.normalize(q.detach(), dim=-1)
    plain = routing(window=5, scale=float(D))
    set_centroids(plain, attn.centroids)
    assert_same(plain(unit, unit, v, causal=causal, key_mask=mask), fast)


@pytest.mark.parametrize("causal", [False, True])
def test_share_qk_with_one_cluster_is_softmax_over_unit_queries_scaled_by_d(causal):
    q, k, v = (t.detach() for t in make_qkv(B, H, N, N, d=D, d_v=DV))
    out = attnzoo.build("routing", n_clusters=1, share_qk=True)(q, k, v, causal=causal)
    unit = q / q.norm(dim=-1, keepdim=True)
    scores = unit @ unit.transpose(-1, -2) * D
    if causal:
        scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    assert_same(out, scores.softmax(-1) @ v)
    assert not torch.allclose(out, attnzoo.build("routing", n_clusters=1)(q, k, v, causal=causal))


def planted(n_true=4, n=64, d=16, noise=0.3):
    """q = k = one of ``n_true`` orthogonal centres (norm 4) + noise; the centres' directions."""
    g = torch.Generator().manual_seed(3)
    centres = torch.eye(d, dtype=torch.float64)[:n_true] * 4
    member = torch.arange(n) % n_true
    x = centres[member] + noise * torch.randn(2, 2, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, n, d, generator=g, dtype=torch.float64)
    return x, v, F.normalize(centres, dim=-1).expand(2, -1, -1)


def test_error_against_full_attention_shrinks_as_windows_cover_the_planted_clusters():
    x, v, centres = planted()
    full = attnzoo.build("softmax")(x, x, v)
    errors = []
    for window in (4, 8, 16):  # 16 = each planted cluster whole
        attn = attnzoo.build("routing", n_clusters=4, window=window).eval()
        set_centroids(attn, centres.float())
        errors.append(float((attn(x, x, v) - full).abs().mean()))
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.05 * errors[0], errors


@pytest.mark.parametrize(
    "config, field",
    [
        ({"n_clusters": 0}, "n_clusters"),
        ({"window": 0}, "window"),
        ({"decay": 1.5}, "decay"),
        ({"decay": -0.1}, "decay"),
        ({"scale": 0.0}, "scale"),
    ],
)
def test_bad_config_values_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        attnzoo.build("routing", **config)


def test_declares_capabilities_and_refuses_cross_attention():
    spec = attnzoo.describe("routing")
    caps = spec.capabilities
    assert spec.family == "content" and "2003.05997" in spec.paper and spec.complexity.subquadratic_memory
    assert caps.causal and caps.key_mask and caps.decode_step and not (caps.cross_attention or caps.score_mod)
    with pytest.raises(ValueError, match="self-attention only"):
        routing()(*make_qkv(1, 1, 5, 7))


def test_no_n_by_n_allocation():
    # N = 32768: one N x N float32 matrix is 4 GiB. Forward + backward, balanced and causal,
    # must peak far below that (the whole process, torch included, under 1.5 GiB).
    script = textwrap.dedent("""
        import resource, torch, attnzoo
        torch.set_num_threads(2)
        n = 32768
        attn = attnzoo.build("routing", n_clusters=256)
        q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
        for causal in (False, True):
            attn(q, k, v, causal=causal).square().sum().backward()
        assert torch.isfinite(q.grad).all()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peak_gib = int(result.stdout.strip().splitlines()[-1]) / 2**20
    assert peak_gib < 1.5, f"peak RSS {peak_gib:.2f} GiB: something N x N was allocated"


# --- decode steps: the contract checks step == causal forward on the sized config ------------


def steps(attn, q, k, v, sizes, mask=None, state=None):
    """Decode ``q, k, v`` in steps of ``sizes`` tokens; the outputs and the state after each."""
    state = state or attn.init_state(q.shape[0], q.shape[1], q.shape[3], v.shape[3], dtype=q.dtype)
    outs, states, lo = [], [], 0
    for size in sizes:
        new = slice(lo, lo + size)
        kpm = None if mask is None else mask[:, new]
        out, state = attn.step(state, q[:, :, new], k[:, :, new], v[:, :, new], key_mask=kpm)
        outs.append(out)
        states.append(state)
        lo += size
    return torch.cat(outs, 2), states


def test_step_state_holds_each_clusters_last_w_keys_whatever_the_length():
    # A padded prefix, a prompt, steps longer than a block and single tokens, share_qk: equal to
    # the forward, and the state never outgrows B H (n_clusters 2w + 1) (D + D_v) numbers.
    attn = routing(window=5, share_qk=True)
    n = 200
    q, k, v = (t.detach() for t in make_qkv(2, H, n, n, d=D, d_v=DV))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :30] = False
    sizes = [40, 1, 37, 1, 1, *[1] * 60, 60]
    got, states = steps(attn, q, k, v, sizes, mask)
    assert_same(got, attn(q, k, v, causal=True, key_mask=mask))
    held = [sum(x.numel() for x in s.windows.buffers) for s in states]
    assert max(held) <= 2 * H * (3 * 2 * 5 + 1) * (D + DV), held
    assert held[-1] == held[len(sizes) // 2]  # no growth once every window has filled


def test_two_continuations_of_one_state_are_independent():
    attn = routing(window=4)
    q, k, v = (t.detach() for t in make_qkv(1, H, 30, 30, d=D))
    other = tuple(torch.cat([x[:, :, :20], torch.randn_like(x[:, :, 20:])], 2) for x in (q, k, v))
    _, (prefix,) = steps(attn, q[:, :, :20], k[:, :, :20], v[:, :, :20], [20])
    first, second, outs = prefix, prefix, ([], [])
    for t in range(20, 30):  # interleaved: each continuation appends after the other did
        out, first = attn.step(first, *(x[:, :, t : t + 1] for x in (q, k, v)))
        outs[0].append(out)
        out, second = attn.step(second, *(x[:, :, t : t + 1] for x in other))
        outs[1].append(out)
    assert_same(torch.cat(outs[0], 2), attn(q, k, v, causal=True)[:, :, 20:])
    assert_same(torch.cat(outs[1], 2), attn(*other, causal=True)[:, :, 20:])


def test_step_refuses_an_unknown_window_and_training_mode():
    with pytest.raises(ValueError, match=r"window=.*ceil\(N / n_clusters\)"):
        routing().init_state(1, H, D, D)
    attn = routing(window=4)
    state = attn.init_state(1, H, D, D)  # makes the centroids of a module that has not run
    assert attn.centroids.shape == (H, 3, D)
    attn.train()
    with pytest.raises(ValueError, match=r"eval mode only.*\.eval\(\)"):
        attn.init_state(1, H, D, D)
    with pytest.raises(ValueError, match="eval mode only"):
        attn.step(state, *make_qkv(1, H, 1, 1, d=D, requires_grad=False))


def test_nearest_centroids_by_max_equal_argmax_with_ties_and_nan():
    # _ops.argmax_over replaces argmax over the cluster dimension (not the last one, where CPU's
    # argmax is slow): the same first index on ties, and NaN counted as the largest.
    sims = torch.randint(0, 3, (2, 4, 16, 300)).float()  # many exact ties
    sims[1, 2, 7, 11] = float("nan")
    for dim in (1, 2, 3):
        assert torch.equal(argmax_over(sims, dim), sims.argmax(dim))
