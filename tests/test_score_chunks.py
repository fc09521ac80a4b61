"""``score_chunks.softmax_chunks`` under the ``softmax`` mechanism with an additive bias (ALiBi,
``score_mods.bias_mod``): against the dense reference on awkward sizes, forward and gradients;
which score_mods count as a bias; a learned bias keeps its gradient (the reference path); and
weights too small for the dtype are 0, not denormals. ``softcap``'s own cases are in
``test_softmax_variants.py``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnzoo
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms import score_chunks
from attnzoo.mechanisms._ops import decay_floor
from attnzoo.score_mods import bias_mod, bias_of, chain, plain_bias, softcap
from attnzoo.spec import ScoreMod
from conftest import grads, make_qkv, padding_mask, refused
from tolerances import assert_same

B, H, N, D = 2, 3, 37, 8


def _alibi(q: torch.Tensor, n_kv: int):
    return attnzoo.positional.ALiBi(H).score_mod(q, n_kv)


_refused = refused("softmax with an additive bias went to the dense reference")


@pytest.mark.parametrize(("n_q", "causal"), [(N, False), (5, False), (45, False), (N, True), (5, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_softmax_with_alibi_in_chunks_equals_the_reference(n_q, causal, padded, monkeypatch):
    # 16-row chunks over N = 37 keys (not a multiple), fewer and more queries than keys, batch
    # row 0 all padding (rows that see nothing: 0, no gradient), grouped K/V (one K/V head for
    # three query heads), slopes 0.5 down to ~0.06 over distances up to 44: forward and gradients.
    monkeypatch.setattr(score_chunks, "CHUNK_SCORES", 1)
    attn = attnzoo.build("softmax")
    monkeypatch.setattr(attn, "_reference", _refused)
    q = make_qkv(B, H, n_q, N)[0]
    k, v = make_qkv(B, 1, N, N)[1:]
    mask = padding_mask(B, N) if padded else None
    alibi = _alibi(q, N)
    got = attn(q, k, v, causal=causal, key_mask=mask, score_mod=alibi)
    kr, vr = (x.expand(B, H, N, D) for x in (k, v))
    want = reference_attention(q, kr, vr, causal=causal, key_mask=mask, score_mod=alibi)
    assert_same(got, want, what=f"n_q={n_q} causal={causal} padded={padded}")
    for i, (a, b) in enumerate(zip(grads(got, (q, k, v)), grads(want, (q, k, v)))):
        assert_same(a, b, what=f"n_q={n_q} causal={causal} padded={padded}: gradient {i}")


def test_softcap_with_alibi_takes_the_chunks_and_caps_the_biased_score(monkeypatch):
    # chain(alibi, softcap): the bias goes in before the cap, on the hand-written chunks.
    monkeypatch.setattr(score_chunks, "CHUNK_SCORES", 1)
    from attnzoo.mechanisms import softmax_variants as sv

    monkeypatch.setattr(sv, "chunked_attention", _refused)
    q, k, v = make_qkv(B, H, N, N)
    alibi = _alibi(q, N)
    got = attnzoo.build("softcap", cap=2.0)(q, k, v, causal=True, score_mod=alibi)
    want = reference_attention(q, k, v, causal=True, score_mod=chain(alibi, softcap(2.0)))
    assert_same(got, want)
    for a, b in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        assert_same(a, b, what="gradient")


def test_which_score_mods_are_a_bias():
    q = torch.zeros(1, H, 4, D)
    alibi = _alibi(q, 4)
    assert bias_of(alibi) is not None
    assert bias_of(softcap(2.0)) is None and bias_of(None) is None
    assert bias_of(chain(alibi, softcap(2.0))) is None  # a cap is not a bias
    ramp = bias_mod(lambda b, h, i, j: 0.25 * j.float(), "ramp")
    both = chain(alibi, ramp)
    index = (torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(H).view(1, -1, 1, 1))
    i, j = torch.arange(4).view(1, 1, -1, 1), torch.arange(4).view(1, 1, 1, -1)
    scores = torch.randn(1, H, 4, 4)
    assert_same(bias_of(both)(*index, i, j), both(scores, *index, i, j) - scores)


def test_a_learned_bias_takes_the_reference_and_gets_its_gradient():
    # A bias that needs a gradient cannot go through the chunks (they pass it none): the
    # reference runs and the parameter's gradient is the reference's.
    weight = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    learned = bias_mod(lambda b, h, i, j: -weight * (i - j).abs(), "learned")
    q, k, v = make_qkv(B, H, N, N)
    assert plain_bias(learned, q.device) is None
    with torch.no_grad():  # nothing to pass a gradient to: the chunks may run
        assert plain_bias(learned, q.device) is not None
    out = attnzoo.build("softmax")(q, k, v, score_mod=learned)
    (got,) = torch.autograd.grad(out.sum(), weight)
    want_out = reference_attention(q, k, v, score_mod=learned)
    (want,) = torch.autograd.grad(want_out.sum(), weight)
    assert got.abs() > 0
    assert_same(got, want)


def test_weights_too_small_for_the_dtype_are_zero_not_denormal():
    # ALiBi's far pairs sit ~1000 below the row's maximum: their softmax weights would be
    # denormal (or just above), which slows every product after them. Below eps^4 they are 0;
    # the rest are the softmax's.
    q, k = (torch.randn(1, 1, 2048, 8) for _ in range(2))
    cfg = score_chunks._Scores(
        scale=8**-0.5, cap=None, bias=lambda b, h, i, j: -0.5 * (i - j).abs(), causal=False, rows=2048
    )
    _, weights = score_chunks._weights(q, k, None, cfg, 0, 0)
    plain = torch.softmax(q @ k.mT * 8**-0.5 - 0.5 * (torch.arange(2048)[:, None] - torch.arange(2048)).abs(), -1)
    floor = math.exp(decay_floor(torch.float32))
    assert bool(((plain > 0) & (plain < torch.finfo(torch.float32).tiny)).any())  # the case is real
    assert not bool(((weights > 0) & (weights <= floor)).any())
    torch.testing.assert_close(weights[plain > floor], plain[plain > floor], rtol=1e-5, atol=0)


def test_the_tile_path_softmax_flushes_what_the_dtype_cannot_hold():
    # blocked's einsum path (a score_mod, dropout): softmax and log-sum-exp without exp's slow
    # path; -inf rows give weights 0 and lse -inf; weights below eps^4 are 0, the rest softmax's.
    from attnzoo.backends.blocked import _softmax_lse

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 5, 40, generator=g) * 4
    scores[..., 30:35] -= 1000.0  # far pairs (ALiBi at a distance): exp underflows to 0 anyway
    scores[..., 35:] -= 80.0  # weights from ~1e-44 to ~1e-27: denormal or under eps^4
    scores[0, 1, 2] = -math.inf  # a row that sees nothing
    scores[1, 0, :, ::3] = -math.inf  # masked keys
    probs, lse = _softmax_lse(scores.clone())
    want, want_lse = torch.softmax(scores, -1).nan_to_num(0.0), torch.logsumexp(scores, -1)
    floor = math.exp(decay_floor(torch.float32))
    torch.testing.assert_close(probs[want > floor], want[want > floor], rtol=1e-6, atol=0)
    assert bool(((want > 0) & (want <= floor)).any())  # the case is real
    assert torch.equal(probs[want <= floor], torch.zeros_like(probs[want <= floor]))
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert lse[0, 1, 2] == -math.inf


def test_a_learned_bias_on_a_pattern_mechanism_gets_its_gradient_from_the_reference():
    # blocked differentiates the scores only: a score_mod reading a tensor that needs a
    # gradient is refused there (named in last_choice), and auto runs the reference.
    weight = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    learned = bias_mod(lambda b, h, i, j: -weight * (i - j).abs(), "learned")
    q, k, v = make_qkv(B, H, 64, 64)
    out = attnzoo.build("local", left=8, right=8).double()(q, k, v, score_mod=learned)
    choice = attnzoo.last_choice()
    assert choice.backend == "reference" and "gradient" in " ".join(choice.skipped["blocked"])
    (got,) = torch.autograd.grad(out.sum(), weight)
    mask = (torch.arange(64)[:, None] - torch.arange(64)).abs() <= 8
    want_out = reference_attention(q, k, v, score_mod=learned, mask_mod=lambda b, h, i, j: mask[i, j])
    (want,) = torch.autograd.grad(want_out.sum(), weight)
    assert got.abs() > 0
    assert_same(got, want)
    with pytest.raises(Exception, match="gradient"):
        attnzoo.attend(q, k, v, pattern=attnzoo.patterns.sliding_window(8, 8), score_mod=learned, backend="blocked")


def _path_equals_reference(attn, q, k, v, path: str = "structured", **options) -> None:
    """``attn`` on the ``path`` of the blocked backend equals its reference, forward and gradients."""
    got = attn(q, k, v, **options)
    assert attnzoo.last_choice().path == path
    want = attn.reference(q, k, v, **options)
    assert_same(got, want)
    for a, b in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        assert_same(a, b, what="gradient")


@pytest.mark.parametrize(
    ("name", "config", "causal"),
    [
        ("local", {"left": 20, "right": 10}, False),
        ("local", {"left": 20, "right": 0}, True),
        ("block_local", {"block": 16}, False),
        ("dilated", {"left": 8, "right": 8, "dilation": 3}, False),
        ("dilated", {"left": 8, "right": 0, "dilation": 3}, True),
        ("longformer", {}, False),
        ("etc", {}, True),
        ("sinks", {}, True),
        ("star", {}, False),
        ("strided", {"stride": 6}, False),
        ("strided", {"stride": 6}, True),
        ("axial", {"h": 10, "w": 15}, False),
        ("axial", {"h": 10, "w": 15}, True),
    ],
)
def test_windows_take_an_additive_bias_on_the_structured_path(name, config, causal):
    # Window parts add the bias to their window mask (window_parts._with_bias), dilated ones on
    # their 3 sub-sequences, unions with global tokens to their columns and rows too
    # (windowed._bias_at), dense sub-sequences (strided) to theirs (_dense_with_bias), merged parts
    # (axial's rows and columns) to each part's: N = 150
    # (not a multiple of the block), batch row 0 padded from 130 on, against the reference with
    # the same biases, forward and gradients.
    q, k, v = make_qkv(B, H, 150, 150)
    mask = torch.ones(B, 150, dtype=torch.bool)
    mask[0, 130:] = False
    # ALiBi reads only i - j; the second bias reads absolute positions and the batch row
    absolute = bias_mod(lambda b, h, i, j: -0.02 * j - 0.3 * b - 0.1 * (i % 7), "absolute")
    mod = chain(_alibi(q, 150), absolute)
    attn = attnzoo.build(name, **config).double()
    _path_equals_reference(attn, q, k, v, causal=causal, key_mask=mask, score_mod=mod)


@pytest.mark.parametrize("n", [150, 144])
def test_causal_dense_sub_sequences_with_a_bias_and_no_padding(n):
    # Without padding the causal rule of a dense part is is_causal, which a bias mask replaces:
    # _dense_with_bias writes the triangle in (N = 144 divides by the stride, 150 does not).
    q, k, v = make_qkv(B, H, n, n)
    attn = attnzoo.build("strided", stride=6).double()
    mod = _alibi(q, n)
    _path_equals_reference(attn, q, k, v, causal=True, score_mod=mod)


def _padded_and_biased() -> tuple[Tensor, Tensor, Tensor, Tensor, ScoreMod]:
    """q, k, v at N = 150, a key mask padding batch row 0 from 130 on, and ALiBi chained with a
    bias of absolute positions, batch row and head (ALiBi alone reads only i - j)."""
    q, k, v = make_qkv(B, H, 150, 150)
    mask = torch.ones(B, 150, dtype=torch.bool)
    mask[0, 130:] = False
    absolute = bias_mod(lambda b, h, i, j: -0.02 * j - 0.3 * b - 0.2 * h - 0.1 * (i % 7), "absolute")
    return q, k, v, mask, chain(_alibi(q, 150), absolute)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("name", "config"), [("random", {"r": 12}), ("logsparse", {"levels": 6})])
def test_keys_named_row_by_row_take_an_additive_bias_on_the_gathered_path(name, config, causal):
    # The CSR path adds the bias at each listed pair (sparse_rows.pair_bias): N = 150, batch row
    # 0 padded from 130 on, ALiBi and a bias of absolute positions, batch row and head, against
    # the reference, forward and gradients.
    q, k, v, mask, mod = _padded_and_biased()
    attn = attnzoo.build(name, **config).double()
    _path_equals_reference(attn, q, k, v, "gathered", causal=causal, key_mask=mask, score_mod=mod)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("slab_bytes", [None, 100_000], ids=["one-slab", "slabs-of-2-rows"])
def test_query_groups_take_an_additive_bias_on_the_key_sets_path(causal, slab_bytes, monkeypatch):
    # block2d on a 10 x 15 image (groups at the edges, N = 150), batch row 0 padded from 130 on:
    # the bias joins each group's mask (key_sets._bias_values), forward and gradients; in slabs
    # of 2 (batch, head) rows (49 KB of float64 keys a row) that cut batch rows of 3 heads apart,
    # each slab's bias and padding at its own rows.
    from attnzoo.backends import key_sets

    if slab_bytes is not None:
        monkeypatch.setattr(key_sets, "SLAB_BYTES", slab_bytes)
    q, k, v, mask, mod = _padded_and_biased()
    attn = attnzoo.build("block2d", h=10, w=15, query_block=(4, 4), memory_margin=(2, 2)).double()
    for key_mask in (mask, None):  # one kernel call per batch row with padding, one without
        _path_equals_reference(attn, q, k, v, "key_sets", causal=causal, key_mask=key_mask, score_mod=mod)


@pytest.mark.parametrize("causal", [False, True])
def test_tiles_take_an_additive_bias_on_their_explicit_scores(causal):
    # bigbird's tile plan (full tiles, partial ones, causal triangles; N = 150 not a multiple of
    # its 16-blocks) with ALiBi and a bias of absolute positions, batch row and head on each
    # piece's explicit scores (blocked.piece_forward's einsum path), batch row 0 padded: forward
    # and gradients. (The bias in the flash kernel's mask instead ran 1.6-1.9x slower here.)
    q, k, v, mask, mod = _padded_and_biased()
    attn = attnzoo.build("bigbird", block=16, seed=1).double()
    for key_mask in (mask, None):
        _path_equals_reference(attn, q, k, v, "tiles", causal=causal, key_mask=key_mask, score_mod=mod)


def test_the_gathered_bias_sees_queries_end_aligned_to_the_keys():
    # 40 queries over 150 keys: query row i is position i + 110 for the bias (spec's convention).
    q = make_qkv(B, H, 40, 150)[0]
    k, v = make_qkv(B, H, 150, 150)[1:]
    mod = chain(_alibi(q, 150), bias_mod(lambda b, h, i, j: -0.05 * i, "rows"))
    options = {"pattern": attnzoo.patterns.random(12) & attnzoo.patterns.causal(), "score_mod": mod}
    got = attnzoo.attend(q, k, v, **options)
    assert attnzoo.last_choice().path == "gathered"
    assert_same(got, attnzoo.attend(q, k, v, backend="reference", **options))


def test_plans_that_cannot_take_a_bias_run_the_tiles_with_it():
    # grouped K/V on a window plan, a general score_mod: the tile path, still equal to the
    # reference.
    q = make_qkv(B, H, 64, 64)[0]
    k, v = make_qkv(B, 1, 64, 64)[1:]
    alibi = _alibi(q, 64)
    general = lambda s, b, h, i, j: s - 0.1 * (i - j).abs()  # noqa: E731
    cases = [
        ("local", {"left": 8, "right": 8}, q, k, v, alibi),
        ("random", {}, q, k.expand(B, H, 64, D), v.expand(B, H, 64, D), general),
        ("local", {"left": 8, "right": 8}, q, k.expand(B, H, 64, D), v.expand(B, H, 64, D), general),
    ]
    for name, config, qq, kk, vv, mod in cases:
        attn = attnzoo.build(name, **config).double()
        got = attn(qq, kk, vv, score_mod=mod)
        assert attnzoo.last_choice().path == "tiles", name
        kr, vr = kk.expand(B, H, 64, D), vv.expand(B, H, 64, D)
        assert_same(got, attn.reference(qq, kr, vr, score_mod=mod), what=name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("columns", ["global_tokens", "key_columns"])
def test_many_global_columns_take_the_bias_in_the_kernel_union(columns, causal):
    # 38-40 global keys (>= windowed.KERNEL_COLUMNS): the columns run through the flash kernel
    # with the bias in their mask; rows of global tokens with it too.
    q, k, v = make_qkv(B, H, 150, 150)
    mask = torch.ones(B, 150, dtype=torch.bool)
    mask[0, 130:] = False
    tokens = tuple(range(0, 120, 3)) if columns == "global_tokens" else tuple(range(0, 150, 4))
    pattern = getattr(attnzoo.patterns, columns)(tokens) | attnzoo.patterns.sliding_window(8, 8)
    mod = chain(_alibi(q, 150), bias_mod(lambda b, h, i, j: -0.02 * j - 0.3 * b - 0.1 * (i % 7), "absolute"))
    options = {"pattern": pattern, "causal": causal, "key_mask": mask, "score_mod": mod}
    got = attnzoo.attend(q, k, v, **options)
    assert attnzoo.last_choice().path == "structured"
    want = attnzoo.attend(q, k, v, backend="reference", **options)
    assert_same(got, want)
    for a, b in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        assert_same(a, b, what="gradient")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["sparse_transformer_fixed", "sparse_transformer_strided", "pattern"])
def test_head_groups_read_their_heads_in_the_bias(name, causal):
    # One part per head group (per_head): each part's bias sees the heads by their index in the
    # call, which the second bias reads (-0.2 h) beside ALiBi's slopes; six heads.
    q, k, v = make_qkv(B, 6, 150, 150)
    mask = torch.ones(B, 150, dtype=torch.bool)
    mask[0, 130:] = False
    groups = [
        attnzoo.patterns.sliding_window(8, 8),
        attnzoo.patterns.global_tokens((0, 5)) | attnzoo.patterns.sliding_window(4, 0),
        attnzoo.patterns.block_local(16),
    ]
    config = {"pattern": attnzoo.patterns.per_head(groups)} if name == "pattern" else {}
    absolute = bias_mod(lambda b, h, i, j: -0.02 * j - 0.3 * b - 0.2 * h, "absolute")
    mod = chain(attnzoo.positional.ALiBi(6).score_mod(q, 150), absolute)
    attn = attnzoo.build(name, **config).double()
    _path_equals_reference(attn, q, k, v, causal=causal, key_mask=mask, score_mod=mod)


def test_a_window_bias_cuts_only_pairs_too_far_below_their_row():
    # Pairs whose bias lies more than 2 R + 64 under the row's largest become -inf (the kernel's
    # backward would take exp's slow path on them); a bias within reach is added as it is.
    from attnzoo.backends.structured import Windows
    from attnzoo.backends.window_parts import _with_bias

    q = k = torch.full((1, 1, 32, 4), 0.5)  # |q| = |k| = 1: R = scale = 1, reach = 66
    w = Windows(stride=1, block=8, start=-8, width=24)
    steep = _with_bias(None, w, lambda b, h, i, j: -10.0 * (i - j).abs().double(), q, k, 1.0, 4)
    gentle = _with_bias(None, w, lambda b, h, i, j: -1.0 * (i - j).abs().double(), q, k, 1.0, 4)
    assert steep.shape == (1, 4, 8, 24)
    assert bool(torch.isinf(steep).any()) and not bool(torch.isinf(gentle).any())
    keys = (torch.arange(4).view(4, 1, 1) * 8 - 8 + torch.arange(24)).clamp(0, 31)  # ends clamped (masked in use)
    distance = (torch.arange(32).view(4, 8, 1) - keys).abs()
    assert torch.equal(torch.isinf(steep[0]), 10.0 * distance > 66 + 10.0 * distance.amin(-1, keepdim=True))


@pytest.mark.parametrize(
    ("name", "config"), [("softcap", {"cap": 2.0}), ("softmax", {}), ("local", {"left": 20, "right": 0})]
)
def test_heads_as_a_transposed_view_get_their_gradients(name, config):
    # A layer's heads are often a view of (B, N, H D) transposed: gradient buffers built like
    # such inputs would be written through flattened copies and lost. Gradients of the packed x.
    x = torch.randn(B, 150, 3 * H * D, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.reshape(B, 150, H, D).transpose(1, 2) for t in x.split(H * D, -1))
    attn = attnzoo.build(name, **config).double()
    mod = None if name == "softcap" else _alibi(q, 150)
    got = attn(q, k, v, causal=True, score_mod=mod)
    want = attn.reference(q, k, v, causal=True, score_mod=mod)
    assert_same(got, want)
    assert_same(*(grads(out, (x,))[0] for out in (got, want)), what="gradient of x")
