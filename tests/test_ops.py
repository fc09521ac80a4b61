"""The shared small rules of ``mechanisms/_ops.py`` that fast paths use in place of the reference's."""

from __future__ import annotations

import torch

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import masked_softmax


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
