"""Every registered sparse mechanism on every backend equals the dense reference backend."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import attnzoo
from attnzoo import patterns as P
from conftest import grads, padding_mask
from tolerances import assert_close_to_golden, assert_same, max_abs_error

B, H, N, D = 2, 4, 75, 16  # N not a multiple of the 16-wide tiles
SPARSE = attnzoo.names(family="sparse")


def _inputs(dtype, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, N, D, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3))


def _build(name, backend):
    # Each mechanism sized for N by its own config (a quarter of the keys; grids and graphs
    # fitted to N = 75 = 5 x 15), so a new sparse mechanism is covered without editing this file.
    # Tiles of 16 leave a ragged last tile; on bigbird (blocks of 75 // 8 = 9) they cut its blocks.
    cfg = attnzoo.describe(name).config.length_values(N)
    return attnzoo.build(name, backend=backend, **{"tile": 16, **cfg})


@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("causal", [False, True])
def test_blocked_equals_reference_forward_and_gradients(name, causal):
    mask = padding_mask(B, N)  # batch 0 is all padding: fully masked rows
    mask[1, 70:] = False
    fast, ref = _build(name, "blocked"), _build(name, "reference")
    q, k, v = _inputs(torch.float32)
    golden_in = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    golden = ref(*golden_in, causal=causal, key_mask=mask)
    reference = ref(q, k, v, causal=causal, key_mask=mask)
    actual = fast(q, k, v, causal=causal, key_mask=mask)
    assert attnzoo.last_choice().backend == "blocked"
    assert torch.equal(actual[0], torch.zeros_like(actual[0]))
    assert_close_to_golden(actual, reference, golden.detach(), what=f"{name} forward")
    for a, r, g, w in zip(grads(actual, (q, k, v)), grads(reference, (q, k, v)), grads(golden, golden_in), "qkv"):
        assert torch.isfinite(a).all()
        if max_abs_error(r, g) == 0:
            # The dense reference is exact here (e.g. a causal row that sees only one global key:
            # its softmax gradient is 0), so "4 x the reference's error" is no allowance at all;
            # the fast path's rounding, summed over N query rows, is held to the atol table.
            assert_same(a, g, what=f"{name} d{w}")
        else:
            assert_close_to_golden(a, r, g, what=f"{name} d{w}")


@pytest.mark.parametrize("name", SPARSE)
def test_blocked_bf16_forward(name):
    mask = padding_mask(B, N)
    q, k, v = (t.detach().bfloat16() for t in _inputs(torch.float32))
    golden = _build(name, "reference")(*(t.double() for t in (q, k, v)), causal=True, key_mask=mask)
    reference = _build(name, "reference")(q, k, v, causal=True, key_mask=mask)
    actual = _build(name, "blocked")(q, k, v, causal=True, key_mask=mask)
    assert actual.dtype == torch.bfloat16
    assert_close_to_golden(actual, reference, golden, what=f"{name} bf16")


FLEX_QUICK = ["local", "bigbird", "sparse_transformer_strided"]


def _flex_case(name):
    mask = padding_mask(B, N)
    mask[1, 60:] = False
    q, k, v = _inputs(torch.float32, requires_grad=False)
    for causal in (False, True):
        want = _build(name, "reference")(q, k, v, causal=causal, key_mask=mask)
        got = _build(name, "flex")(q, k, v, causal=causal, key_mask=mask)
        golden = _build(name, "reference")(q.double(), k.double(), v.double(), causal=causal, key_mask=mask)
        assert_close_to_golden(got, want, golden, what=f"{name} flex causal={causal}")


@pytest.mark.parametrize("name", FLEX_QUICK)
def test_flex_equals_reference(name):
    _flex_case(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SPARSE if n not in FLEX_QUICK])
def test_flex_equals_reference_all(name):
    _flex_case(name)


def test_window_covering_the_sequence_equals_full_attention():
    q, k, v = _inputs(torch.float64, requires_grad=False)
    out = attnzoo.build("local", left=N, right=N, tile=16)(q, k, v, causal=True)
    full = attnzoo.build("softmax")(q, k, v, causal=True)
    torch.testing.assert_close(out, full)


def test_heads_use_different_patterns_inside_multi_head_attention():
    heads = P.per_head([P.local(1), P.global_tokens([0])])
    mha = attnzoo.nn.MultiHeadAttention(32, 4, "pattern", pattern=heads, tile=16)
    x = torch.randn(2, 30, 32, requires_grad=True)
    y = mha(x, causal=True)
    y.sum().backward()
    weights = mha.attn.implied_attention(torch.randn(1, 4, 30, 8), torch.randn(1, 4, 30, 8))
    assert torch.equal(weights[0, 0] > 0, P.local(1).dense(30))
    assert torch.equal(weights[0, 3] > 0, P.global_tokens([0]).dense(30))
    with pytest.raises(ValueError, match="multiple of 2 heads"):
        attnzoo.nn.MultiHeadAttention(30, 3, "pattern", pattern=heads)(torch.randn(1, 5, 30))


def test_global_tokens_prepend_and_strip_for_etc():
    tokens = attnzoo.nn.GlobalTokens(32, n=2)
    layer = attnzoo.nn.MultiHeadAttention(32, 4, "etc", left=2, right=2, n_global=2, tile=16)
    x = torch.randn(2, 20, 32)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 15:] = False
    xg, mask_g = tokens(x, mask)
    assert xg.shape == (2, 22, 32) and mask_g[:, :2].all() and torch.equal(mask_g[:, 2:], mask)
    y = tokens.strip(layer(xg, key_mask=mask_g))
    assert y.shape == x.shape


def test_no_n_by_n_allocation_on_the_blocked_path():
    # N = 32768: one N x N float32 matrix is 4 GiB. Forward + backward of a sliding window must
    # peak far below that (the whole process, torch included, under 1.5 GiB).
    script = textwrap.dedent("""
        import resource, torch, attnzoo
        from attnzoo import patterns as P
        torch.set_num_threads(2)
        n = 32768
        q, k, v = (torch.randn(1, 1, n, 32, requires_grad=True) for _ in range(3))
        out = attnzoo.attend(q, k, v, pattern=P.local(256), causal=True, backend="blocked")
        out.square().sum().backward()
        assert q.grad.shape == q.shape and torch.isfinite(q.grad).all()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peak_gib = int(result.stdout.strip().splitlines()[-1]) / 2**20
    assert peak_gib < 1.5, f"peak RSS {peak_gib:.2f} GiB: something N x N was allocated"


def test_alibi_score_mod_through_a_sparse_layer_equals_softmax_with_the_same_bias():
    torch.manual_seed(0)
    local = attnzoo.nn.MultiHeadAttention(32, 4, "local", left=N, right=N, tile=16, positional="alibi")
    torch.manual_seed(0)
    dense = attnzoo.nn.MultiHeadAttention(32, 4, "softmax", positional="alibi")
    x = torch.randn(2, N, 32, dtype=torch.float64)
    local, dense = local.double(), dense.double()
    torch.testing.assert_close(local(x, causal=True), dense(x, causal=True))
    with pytest.raises(ValueError, match="needs the attention weights"):
        attnzoo.nn.MultiHeadAttention(32, 4, "local", positional="relative")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triangular_tiles_run_unmasked_and_stay_exact(causal, dtype):
    # Windows that are multiples of the tile make the edge tiles (and the causal diagonal)
    # exact triangles: the plan must run them with is_causal, and stay equal to the reference.
    from attnzoo.backends.call import Call
    from attnzoo.backends.plan import plan_for

    pattern = P.sliding_window(32, 16)
    q, k, v = (t.detach().to(dtype).requires_grad_(dtype == torch.float32) for t in _inputs(torch.float32))
    mask = padding_mask(B, N)
    mask[1, 64:] = False
    call_pattern = pattern & P.causal() if causal else pattern
    # Without padding: window edges are triangles (and so is the causal diagonal); the ragged
    # last key block keeps a mask. With padding, tiles holding a padded key keep a mask.
    kinds = {p.kind for p in plan_for(Call(q, k, v, call_pattern, None, None, 0.25, 16)).pieces}
    assert kinds == {"full", "tril", "triu", "mask"}
    golden_in = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    golden = attnzoo.attend(*golden_in, pattern=pattern, causal=causal, key_mask=mask, backend="reference", block=16)
    reference = attnzoo.attend(q, k, v, pattern=pattern, causal=causal, key_mask=mask, backend="reference", block=16)
    actual = attnzoo.attend(q, k, v, pattern=pattern, causal=causal, key_mask=mask, backend="blocked", block=16)
    assert_close_to_golden(actual, reference, golden.detach(), what="triangles forward")
    if dtype == torch.float32:
        for a, r, g, w in zip(grads(actual, (q, k, v)), grads(reference, (q, k, v)), grads(golden, golden_in), "qkv"):
            assert_close_to_golden(a, r, g, what=f"triangles d{w}")


def test_value_head_size_may_differ():
    q, k = torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    v = torch.randn(2, 2, 50, 8, requires_grad=True)
    for pattern in (P.local(20), P.sliding_window(16, 0)):
        out = attnzoo.attend(q, k, v, pattern=pattern, causal=True, block=16, backend="blocked")
        ref = attnzoo.attend(q, k, v, pattern=pattern, causal=True, block=16, backend="reference")
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(*(torch.autograd.grad(o.sum(), v)[0] for o in (out, ref)))


def test_block2d_causal_is_raster_order_as_its_note_says():
    # 4 x 4 image, 2 x 2 query blocks, margin 1: block-raster generation order (the paper's)
    # makes all of block (0, 0) before (0, 2); raster order puts (0, 2) = 2 before (1, 0) = 4.
    attn = attnzoo.build("block2d", h=4, w=4, query_block=(2, 2), memory_margin=(1, 1), backend="reference")
    q = torch.randn(1, 1, 16, 8)
    weights = attn.implied_attention(q, q, causal=True)
    assert weights[0, 0, 4, 2] > 0 and weights[0, 0, 4].nonzero().max() <= 4  # sees (0, 2), nothing after it
    assert any("raster" in note for note in attnzoo.describe("block2d").notes)


def test_departures_are_stated_where_the_mechanisms_are_registered():
    notes = {name: " ".join(attnzoo.describe(name).notes) for name in ("longformer", "hierarchical")}
    assert "Q_g" in notes["longformer"] and "j <= i" in notes["longformer"]
    assert "no hidden state" in notes["hierarchical"]
