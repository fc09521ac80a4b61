"""The shared small rules of ``mechanisms/_ops.py`` that fast paths use in place of the reference's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import masked_softmax, unit


def test_masked_softmax_equals_normalize_scores_forward_and_gradients():
    # Rows with every entry visible, some, none (zeros, zero gradient), and a NaN score (kept).
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 6, 7, dtype=torch.float64)
    visible = torch.rand(1, 3, 6, 7) < 0.5
    visible[0, 0, 0] = True
    visible[0, 1, 2] = False  # an empty row
    scores[1, 2, 3, 4] = float("nan")
    visible[0, 2, 3, 4] = True
    grad = torch.randn_like(scores)
    results = []
    for fn in (masked_softmax, lambda s, v: normalize_scores(s, v, "softmax")):
        x = scores.clone().requires_grad_()
        out = fn(x, visible)
        out.backward(grad)
        results.append((out, x.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)
    assert (results[0][0][:, 1, 2] == 0).all() and (results[0][1][:, 1, 2] == 0).all()
    finite = scores.nan_to_num(0.0).requires_grad_()
    torch.autograd.gradcheck(lambda s: masked_softmax(s, visible), (finite,))
    torch.autograd.gradgradcheck(lambda s: masked_softmax(s, visible), (finite,))


def test_masked_softmax_weights_below_eps4_are_zero_with_zero_gradient_and_the_rest_unchanged():
    # Peaky float32 scores (a trained model's large q, k): softmax leaves weights from 1 down to
    # denormals; below eps^4 they are 0 (no denormal reaches the products after them).
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 8, 40, generator=g) * 40
    visible = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    x = scores.clone().requires_grad_()
    got = masked_softmax(x, visible)
    want = torch.softmax(scores, -1)
    small = want < torch.finfo(torch.float32).eps ** 4
    assert small.any() and ((want > 0) & (want < torch.finfo(torch.float32).tiny)).any()  # denormals there
    assert (got[small] == 0).all() and torch.equal(got[~small], want[~small])
    grad = torch.randn(scores.shape, generator=g)
    (d,) = torch.autograd.grad(got, x, grad)
    s64 = scores.double().requires_grad_()
    (d_want,) = torch.autograd.grad(torch.softmax(s64, -1), s64, grad.double())
    assert (d[small] == 0).all()
    torch.testing.assert_close(d.double(), d_want, atol=1e-5, rtol=1e-4)  # what was flushed: below 1e-27


@pytest.mark.parametrize("eps", [1e-12, 1e-3])
def test_unit_equals_f_normalize_forward_and_gradients_with_zero_and_clamped_rows(eps):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    x[0, 0, 0] = 0.0  # a zero row
    x[0, 1, 1] = 1e-5  # norm below eps = 1e-3: the divisor is clamped
    x[1, 2, 4] *= 1e3
    grad = torch.randn_like(x)
    results = []
    for fn in (unit, lambda t, e: F.normalize(t, dim=-1, eps=e)):
        t = x.clone().requires_grad_()
        out = fn(t, eps)
        out.backward(grad)
        results.append((out, t.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)
    t = torch.randn(2, 3, 8, dtype=torch.float64).requires_grad_()  # away from the kink at |x| = eps
    torch.autograd.gradcheck(lambda s: unit(s, eps), (t,))
    torch.autograd.gradgradcheck(lambda s: unit(s, eps), (t,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lower_decay_exp_is_exp_below_the_diagonal_zero_above_and_never_denormal(dtype):
    # Differences of cumulative log decays, some below the decay floor: those are 0, everything
    # else is torch.exp's value (a normal number), and the upper triangle is 0.
    from attnzoo.mechanisms._ops import decay_floor, lower_decay_exp_

    g = torch.Generator().manual_seed(0)
    cum = (-torch.rand(2, 3, 40, generator=g, dtype=torch.float64) * 60).cumsum(-1)
    gap = (cum[..., :, None] - cum[..., None, :]).to(dtype)
    lower = torch.ones(40, 40, dtype=torch.bool).tril().expand(2, 3, 40, 40)
    want = gap.masked_fill(~lower, float("-inf")).exp()
    got = lower_decay_exp_(gap.clone())
    floor = decay_floor(dtype) + 0.5  # flushed_exp_'s margin
    deep = lower & (gap < floor)
    assert deep.any() and (lower & (gap >= floor)).any()  # both regimes present
    assert torch.equal(got[~deep], want[~deep]) and (got[deep] == 0).all()
    assert (got[lower & ~deep] >= torch.finfo(dtype).tiny).all() and (got.triu(1) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_floored_exp_is_exp_with_what_would_underflow_made_zero_and_twice_differentiable(dtype):
    from attnzoo.mechanisms._ops import exp_floor, floored_exp_

    floor = exp_floor(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4, 50, generator=g, dtype=torch.float64).mul(-6).to(dtype)
    deep = x.clone()
    deep[:, ::3] = floor - torch.rand(4, 17, generator=g, dtype=torch.float64).mul(500).to(dtype)
    deep[0, 0] = float("-inf")
    assert torch.equal(floored_exp_(x.clone()), x.exp())  # the usual case: exp itself
    got = floored_exp_(deep.clone())
    below = deep < floor
    assert torch.equal(got[~below], deep[~below].exp()) and (got[below] == 0).all()
    if dtype == torch.float64:  # the gradient grad * exp(x), and its own gradient
        t = deep.clone().requires_grad_()
        (grad,) = torch.autograd.grad(floored_exp_(t * 1.0).sum(), t)
        assert torch.equal(grad, got)
        torch.autograd.gradgradcheck(lambda s: floored_exp_(s * 1.0), (x.clone().requires_grad_(),))
        torch.autograd.gradgradcheck(lambda s: floored_exp_(s * 1.0), (t,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_chunkwise_cores_decay_factors_are_never_denormal(dtype):
    # Strong decays (a trained gate's) drive the factors far below float32's smallest normal:
    # every factor is 0 or at least eps^4, so a product of one with anything above 1e-10 (in
    # float32) stays normal (a BLAS product over denormals runs ~75x slower on CPU).
    from attnzoo.mechanisms import delta_chunks, kernel_chunks

    g = torch.Generator().manual_seed(2)
    log_decay = -torch.rand(2, 3, 4, 32, generator=g, dtype=torch.float64).mul(30).to(dtype)
    least = 0.99 * torch.finfo(dtype).eps ** 4
    factors = [*kernel_chunks._factors(log_decay, dtype), *delta_chunks._decays(log_decay.cumsum(-1))]
    for x in factors:
        assert x.dtype == dtype and ((x == 0) | (x >= least)).all()
    assert any((x == 0).any() for x in factors) and any(((x > 0) & (x < 1e-3)).any() for x in factors)


def test_floored_exp_with_a_floor_above_the_dtypes_zeroes_below_it_the_same_on_either_path():
    # A floor of its own (Performer's eps^2): results below exp(floor) are 0 (up to e^(1/2) times
    # it, the flush's margin) whether or not some exponent also falls below float32's -87 (the
    # clamped path), and everything above is exp itself.
    from attnzoo.mechanisms._ops import feature_floor, floored_exp_

    floor = feature_floor(torch.float32)
    assert -32 < floor < -31
    x = torch.linspace(-60, 0, 601)
    plain = floored_exp_(x.clone(), floor)
    with_deep = floored_exp_(torch.cat([x, torch.tensor([-200.0])]), floor)[:-1]  # the clamped path
    assert torch.equal(plain, with_deep)
    keep = x > floor + 0.5
    assert torch.equal(plain[keep], x[keep].exp()) and (plain[~keep] == 0).all()
    assert torch.equal(floored_exp_(x.clone(), -300.0), floored_exp_(x.clone()))  # below -87 counts as -87


def test_flush_tiny_zeroes_what_a_kept_feature_would_make_denormal_and_keeps_the_rest():
    from attnzoo.mechanisms._ops import flush_tiny_

    info = torch.finfo(torch.float32)
    cut = info.tiny / info.eps**3
    x = torch.tensor([0.0, 1e-40, -1e-30, 0.5 * cut, -0.99 * cut, 1.01 * cut, -2 * cut, 1e-10, -3.0])
    want = torch.where(x.abs() < cut, 0.0, x)
    assert torch.equal(flush_tiny_(x.clone()), want) and (want[5:] != 0).all()


@pytest.mark.parametrize("budget", [1, 2 * 40, 3 * 40, 7 * 40, 10**9])
def test_in_slabs_splits_heads_then_batch_rows_and_equals_one_run(budget, monkeypatch):
    # B = 3, H = 3, 40 bytes a (batch, head) row: a budget of 1 or 2 rows splits heads (and the
    # batch row by row), 3 rows takes whole batch rows one at a time, 7 two at a time (the last
    # alone), and a large one runs once. Each slab sees its own batch rows' mask.
    from attnzoo.mechanisms import _ops

    monkeypatch.setattr(_ops, "SLAB_BYTES", budget)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 3, 5, 2, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    shapes = []

    def run(q, k, v, m):
        shapes.append(tuple(q.shape[:2]))
        return q * k.sum(2, keepdim=True) + v * m[:, None, :, None]

    got = _ops.in_slabs(run, q, k, v, mask, 40)
    want = run(q, k, v, mask)
    assert torch.equal(got, want)
    expect = {1: [(1, 1)] * 9, 80: [(1, 2), (1, 1)] * 3, 120: [(1, 3)] * 3, 280: [(2, 3), (1, 3)]}
    assert shapes[:-1] == expect.get(budget, [(3, 3)])
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert torch.equal(a, b)
