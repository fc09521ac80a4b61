"""The blocked backend's structured path (windows of K/V, de-interleaved sub-sequences): exact
against independent oracles, forward and gradients, on awkward sizes; nothing N x N. (Plans
cached by the pattern's value: ``test_backends.py``.)"""

from __future__ import annotations

import pytest
import torch

import oracles as O
from attnzoo import patterns as P
from attnzoo.backends import window_parts
from attnzoo.backends.dispatch import attend, last_choice
from conftest import LargestTensor

# (pattern, its independent oracle (n) -> (n, n) or (heads, n, n) bool)
CASES = {
    "window": (P.sliding_window(8, 8), lambda n: O.sliding_window_oracle(n, n, 8, 8)),
    "causal_window": (P.sliding_window(16, 0), lambda n: O.sliding_window_oracle(n, n, 16, 0)),
    "ahead": (P.sliding_window(0, 40), lambda n: O.sliding_window_oracle(n, n, 0, 40)),
    "dilated": (P.dilated(4, 4, 2), lambda n: O.dilated_oracle(n, n, 4, 4, 2)),
    "strided": (P.strided(5), lambda n: O.strided_oracle(n, n, 5)),
    "block_local": (P.block_local(16), lambda n: O.block_local_oracle(n, n, 16)),
    "sparse_transformer_strided": (
        P.sparse_transformer_strided(8),
        lambda n: O.sparse_transformer_strided_oracle(n, 8, 4),
    ),
    # Unions with global tokens: window part + global columns + global rows.
    "longformer": (P.longformer(8, (0, 40)), lambda n: O.longformer_oracle(n, n, 8, (0, 40))),
    "longformer_dilated": (P.longformer(4, (3,), 2), lambda n: O.longformer_oracle(n, n, 4, (3,), 2)),
    "etc": (P.etc(8, 3), lambda n: O.etc_oracle(n, n, 8, 3)),
    "star": (P.star(0), lambda n: O.star_oracle(n, n, 0)),
    "global": (P.global_tokens([0, 5]), lambda n: O.global_tokens_oracle(n, n, [0, 5])),
    "sparse_transformer_fixed": (
        P.sparse_transformer_fixed(16, 4),
        lambda n: O.sparse_transformer_fixed_oracle(n, 16, 4, 4),
    ),
    # Row (windows) and column (de-interleaved, self removed) merged by log-sum-exp.
    "axial": (P.axial(15, 5), lambda n: O.axial_oracle(15, 5)),
}
#: Patterns defined on one length only (a grid): the gradient test runs them at that length.
GRID = {"axial": 75}


def _inputs(n: int, heads: int = 4, batch: int = 2, dim: int = 8, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(batch, heads, n, dim, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def _padding(n: int) -> torch.Tensor:
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, n - 7 :] = False  # right padding
    mask[1, :5] = False  # left padding
    return mask


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("causal", [False, True])
def test_structured_forward_equals_the_double_loop_oracle(name, causal):
    pattern, oracle = CASES[name]
    n = 75  # not a multiple of any window block, the stride or the block size
    q, k, v = _inputs(n)
    padding = _padding(n)
    out = attend(q, k, v, pattern=pattern, causal=causal, key_mask=padding, backend="blocked")
    assert last_choice().path == "structured"
    mask = oracle(n)
    mask = mask if mask.ndim == 3 else mask[None]
    if causal:
        mask = mask & O.causal_oracle(n, n)
    bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))[None]
    want = O.attention_oracle(q.detach(), k.detach(), v.detach(), key_mask=padding, score_bias=bias)
    # The oracle's -inf bias makes a row that sees no key 0/0; such rows must be zeros.
    sees_a_key = (mask[None] & padding[:, None, None, :]).any(-1, keepdim=True)
    want = torch.where(sees_a_key, want, 0.0)
    torch.testing.assert_close(out.detach(), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "name, n", [(name, n) for name in CASES if name not in GRID for n in (100, 257)] + list(GRID.items())
)  # grid patterns: at their one length
def test_structured_gradients_equal_the_dense_reference(name, n):
    _assert_blocked_equals_reference(CASES[name][0], n)


def _assert_blocked_equals_reference(pattern, n: int) -> None:
    """The blocked backend against the dense reference, forward and gradients, padded, causal and not."""
    for causal in (False, True):
        q, k, v = _inputs(n)
        padding = _padding(n)
        grad = torch.randn(2, 4, n, 8, dtype=torch.float64)
        outs = []
        for backend in ("blocked", "reference"):
            out = attend(q, k, v, pattern=pattern, causal=causal, key_mask=padding, backend=backend)
            outs.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
        for fast, ref in zip(*outs):
            torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)


UNIONS = ["longformer", "longformer_dilated", "etc", "star", "global", "sparse_transformer_fixed"]


@pytest.mark.parametrize("name", UNIONS)
def test_union_columns_on_the_flash_kernel_equal_the_dense_reference(name, monkeypatch):
    # Every union's global columns through the kernel on gathered keys (by default only from
    # windowed.KERNEL_COLUMNS keys on), forward and gradients, padded, causal and not.
    from attnzoo.backends import windowed

    monkeypatch.setattr(windowed, "KERNEL_COLUMNS", 1)
    _assert_blocked_equals_reference(CASES[name][0], 100)


@pytest.mark.parametrize("name", ["window", "causal_window", "dilated", "longformer", "axial"])
@pytest.mark.parametrize("budget", [1, 20_000])  # one query block per backward call; one or two
def test_window_backward_in_chunks_of_query_blocks_equals_the_dense_reference(name, budget, monkeypatch):
    # A window part's backward runs its query blocks in chunks (window_parts.BACKWARD_BYTES) and
    # adds each chunk's overlapping key gradients into the keys' at once; by default a test's
    # window part is one chunk.
    from attnzoo.backends import window_parts

    monkeypatch.setattr(window_parts, "BACKWARD_BYTES", budget)
    _assert_blocked_equals_reference(CASES[name][0], GRID.get(name, 100))


def test_fully_padded_rows_give_zeros_and_zero_gradients_in_float32_and_bfloat16():
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = _inputs(100, dtype=dtype)
        padding = torch.ones(2, 100, dtype=torch.bool)
        padding[1] = False
        for pattern in (P.local(8), P.strided(4)):
            out = attend(q, k, v, pattern=pattern, key_mask=padding, backend="blocked")
            assert last_choice().path == "structured"
            out.sum().backward()
            assert out[1].abs().max() == 0 and k.grad[1].abs().max() == 0 and q.grad[1].abs().max() == 0
            want = attend(
                *(x.detach().double() for x in (q, k, v)),
                pattern=pattern,
                key_mask=padding,
                backend="reference",
            )
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out.detach().double(), want, rtol=tol, atol=tol)
            q.grad = k.grad = v.grad = None


def test_patterns_without_window_structure_run_on_the_tile_plan():
    q, k, v = _inputs(64)
    attend(q, k, v, pattern=P.random(4), backend="blocked")
    assert last_choice().path == "gathered"  # keys named row by row: backends.gathered
    attend(q, k, v, pattern=P.block2d(8, 8, (4, 4), (2, 2)), backend="blocked")
    assert last_choice().path == "key_sets"  # query blocks sharing their keys: backends.key_sets
    for pattern in (
        P.bigbird(16, 3, 2, 1),
        P.sliding_window(40, 40),
    ):  # the last: all keys
        attend(q, k, v, pattern=pattern, backend="blocked")
        assert last_choice().path == "tiles"
    # A score_mod needs the tile plan's einsum path.
    attend(q, k, v, pattern=P.local(4), backend="blocked", score_mod=lambda s, b, h, i, j: s)
    assert last_choice().path == "tiles"


@pytest.mark.parametrize("causal", [False, True])
def test_structured_path_allocates_nothing_n_by_n(causal):
    n = 4096
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
    with LargestTensor() as probe:
        attend(q, k, v, pattern=P.local(64), causal=causal, backend="blocked").sum().backward()
    assert last_choice().path == "structured"
    # Windows hold N * width scores per head: far below one N x N matrix.
    assert probe.numel < n * n // 8, probe.numel


@pytest.mark.parametrize("pattern", [P.sliding_window(64, 64), P.longformer(64, (0, 150))], ids=["window", "union"])
def test_a_forward_without_backward_runs_smaller_blocks_with_the_same_result(pattern):
    # 129 keys per row: 64-row blocks where a backward follows, 32-row ones for a forward alone
    # (structured.choose_block); both equal the dense reference, padded, causal and not.
    from attnzoo.backends import structured

    train = structured.structure(pattern, 300, 300, 4, train=True).parts[0][1]
    alone = structured.structure(pattern, 300, 300, 4, train=False).parts[0][1]
    blocks = [getattr(p, "windows", p).block for p in (train, alone)]
    assert blocks == [64, 32]
    q, k, v = _inputs(300)
    padding = _padding(300)
    for causal in (False, True):
        want = attend(q, k, v, pattern=pattern, causal=causal, key_mask=padding, backend="reference")
        with torch.no_grad():
            alone_out = attend(q, k, v, pattern=pattern, causal=causal, key_mask=padding, backend="blocked")
        train_out = attend(q, k, v, pattern=pattern, causal=causal, key_mask=padding, backend="blocked")
        assert last_choice().path == "structured"
        torch.testing.assert_close(alone_out, want.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(train_out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_grouped_products_accumulate_in_place(layout):
    # grouped_matmul_add_ / grouped_outer_add_ (the union's in-place accumulations) against
    # out + grouped_matmul / grouped_outer, grouped-query (2 query heads per K/V head), on a
    # contiguous out (one baddbmm_ into its view) and on one whose rows allow no such view (the
    # temporary path): in place either way.
    from attnzoo.backends.grouped import grouped_matmul, grouped_matmul_add_, grouped_outer, grouped_outer_add_

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 4, 5, 3, generator=g), torch.randn(2, 2, 3, 6, generator=g)
    gx, gy = torch.randn(2, 4, 5, 7, generator=g), torch.randn(2, 4, 5, 6, generator=g)
    cases = (
        (grouped_matmul_add_, (2, 4, 5, 6), (x, y), grouped_matmul(x, y)),
        (grouped_outer_add_, (2, 2, 7, 6), (gx, gy), grouped_outer(gx, gy, 2)),
    )
    for add_, shape, (a, b), product in cases:
        base = torch.randn(shape[1], shape[0], *shape[2:], generator=g)  # heads first in memory
        out = base.transpose(0, 1) if layout == "strided" else base.transpose(0, 1).contiguous()
        want = out + product
        assert add_(out, a, b) is out
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize("name, n", [("strided", 100), ("axial", 75), ("sparse_transformer_strided", 96)])
@pytest.mark.parametrize("layout", ["contiguous", "heads_second"])
def test_dense_subsequences_without_padding_run_on_views_of_the_inputs(name, n, layout, monkeypatch):
    # With no padded key and N a multiple of the stride, a dense part takes its sub-sequences as
    # views of q, k, v (window_parts._deal: batch row b H + h, residue class as the head), and
    # its gradients go back the same way; a (B, N, H, D) layout transposed to (B, H, N, D) (a
    # layer's) has no such view and is copied. Both against the dense reference, causal and not.
    pattern = CASES[name][0]
    dealt = []
    deal = window_parts._deal
    monkeypatch.setattr(window_parts, "_deal", lambda x, stride: dealt.append(x.shape) or deal(x, stride))
    for causal in (False, True):
        leaves = [t.detach().requires_grad_() for t in _inputs(n)]
        if layout == "heads_second":
            leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves]
        q, k, v = (t.transpose(1, 2) for t in leaves) if layout == "heads_second" else leaves
        grad = torch.randn(2, 4, n, 8, dtype=torch.float64)
        outs = []
        for backend in ("blocked", "reference"):
            dealt.clear()
            out = attend(q, k, v, pattern=pattern, causal=causal, backend=backend)
            outs.append((out, *torch.autograd.grad(out, leaves, grad)))
            assert bool(dealt) == (backend == "blocked"), backend  # q, k, v forward, the gradient backward
        for fast, ref in zip(*outs):
            torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("block", "start", "width", "n"),
    [
        (4, -4, 12, 21),
        (4, -3, 12, 16),
        (4, 0, 8, 18),
        (4, 8, 8, 20),
        (8, -16, 24, 40),
        (4, -6, 16, 23),
        (4, -8, 8, 20),  # keys wholly before the block: the last blocks see no window's last part
        (4, -3, 4, 16),
    ],
)
@pytest.mark.parametrize("step", [1, 2, 100])
def test_overlap_sum_equals_the_windows_gradient_by_autograd(block, start, width, n, step):
    # The keys' gradient from overlapping windows, summed chunk by chunk of windows (the last
    # part of each window copied in, the others added), against autograd through the windows'
    # as_strided view itself: front padding in whole blocks or not, windows right of the row,
    # N not a multiple of the block, one chunk or many.
    from attnzoo.backends.structured import Windows

    w = Windows(1, block, start, width)
    blocks = -(-n // block)
    x = torch.randn(3, n, 5, requires_grad=True)
    windows = window_parts._key_windows(x, w, blocks)  # [3, blocks, width, 5]
    grads = torch.randn(windows.shape)
    (windows * grads).sum().backward()
    # Under deterministic algorithms torch.empty fills NaN: a block neither copied into nor
    # zero-filled fails (fresh memory is often zero by chance).
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        total = window_parts._OverlapSum(windows.detach(), w, blocks, n)
        for b0 in range(0, blocks, step):
            total.add(grads[:, b0 : b0 + step], b0)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    torch.testing.assert_close(total.result(), x.grad)
