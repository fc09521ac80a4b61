"""The one tolerance policy of attnzoo's test-suite.

Golden-relative policy (``assert_close_to_golden``)
---------------------------------------------------
Low-precision results are never compared to each other with hand-picked
tolerances.  Instead, every check runs three versions of the same computation:

* ``golden``    - the computation in float64 (e.g. an oracle from ``oracles.py``,
                  or the reference implementation run in float64);
* ``reference`` - the reference implementation run in the low dtype X;
* ``actual``    - the path under test run in the same dtype X.

The path under test passes when

    max|actual - golden|  <=  factor * max|reference - golden|  +  floor[X]

with ``factor`` = 4 by default and a tiny absolute floor per dtype
(float64: 1e-12, float32: 1e-6, bfloat16: 1e-3, float16: 1e-4), so that a
reference whose error happens to be exactly zero does not demand bit-exactness.
In words: the path under test may be at most ``factor`` times as inaccurate as
the plain reference implementation in the same precision.

In addition, ``actual`` fails if it holds NaN or +-inf anywhere ``golden`` is
finite, and (where ``golden`` is itself non-finite) it must match ``golden``
there (NaN where NaN, the same infinity).  If ``reference`` is itself non-finite
where ``golden`` is finite, the comparison is meaningless and the check raises.

Direct comparison (``assert_same``)
-----------------------------------
For two results that should agree directly (typically two float64 results, or
two results in the same dtype), ``torch.testing.assert_close`` is used with a
per-dtype atol/rtol table:

    float64:  atol 1e-10, rtol 1e-8
    float32:  atol 1e-5,  rtol 1e-4
    bfloat16: atol 2e-2,  rtol 2e-2
    float16:  atol 2e-3,  rtol 2e-3

All numbers live in ``TOLERANCES``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TOLERANCES", "DEFAULT_FACTOR", "max_abs_error", "assert_close_to_golden", "assert_same"]

DEFAULT_FACTOR = 4.0

#: Per-dtype numbers: ``floor`` is the absolute floor of the golden-relative
#: policy; ``atol``/``rtol`` are used by :func:`assert_same`.
TOLERANCES = {
    torch.float64: {"floor": 1e-12, "atol": 1e-10, "rtol": 1e-8},
    torch.float32: {"floor": 1e-6, "atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"floor": 1e-3, "atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"floor": 1e-4, "atol": 2e-3, "rtol": 2e-3},
}


def _tol(dtype: torch.dtype) -> dict:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance entry for dtype {dtype}; known: {list(TOLERANCES)}") from None


def max_abs_error(x: Tensor, golden: Tensor) -> float:
    """max |x - golden| over the entries where golden is finite (0.0 if none)."""
    g = golden.detach().to(torch.float64)
    d = (x.detach().to(torch.float64) - g).abs()
    d = d[torch.isfinite(g)]
    return float(d.max()) if d.numel() else 0.0


def _check_nonfinite(x: Tensor, golden: Tensor, name: str, what: str) -> None:
    dtype = x.dtype
    x = x.detach().to(torch.float64)
    g = golden.detach().to(torch.float64)
    g_fin = torch.isfinite(g)
    bad = g_fin & ~torch.isfinite(x)
    if bool(bad.any()):
        raise AssertionError(
            f"{what}: {name} ({dtype}) has {int(bad.sum())} NaN/inf entries where golden is finite "
            f"(first at index {tuple(bad.nonzero()[0].tolist())})"
        )
    g_nf = ~g_fin
    if bool(g_nf.any()):
        mismatch = g_nf & ~((torch.isnan(g) & torch.isnan(x)) | (x == g))
        if bool(mismatch.any()):
            raise AssertionError(
                f"{what}: {name} does not reproduce golden's NaN/inf at {int(mismatch.sum())} entries "
                f"(first at index {tuple(mismatch.nonzero()[0].tolist())})"
            )


def assert_close_to_golden(
    actual: Tensor, reference: Tensor, golden: Tensor, *, factor: float = DEFAULT_FACTOR, what: str = "output"
) -> None:
    """Golden-relative check (see module docstring).

    ``actual`` and ``reference`` are computed in the same dtype X; ``golden`` is the
    float64 run.  Passes iff ``err(actual) <= factor * err(reference) + floor[X]``
    where ``err`` is the max-abs error vs golden.
    """
    if actual.dtype != reference.dtype:
        raise AssertionError(
            f"{what}: actual ({actual.dtype}) and reference ({reference.dtype}) must be computed in the same dtype"
        )
    if golden.dtype != torch.float64:
        raise AssertionError(f"{what}: golden must be float64, got {golden.dtype}")
    if actual.shape != golden.shape or reference.shape != golden.shape:
        raise AssertionError(
            f"{what}: shape mismatch: actual {tuple(actual.shape)}, "
            f"reference {tuple(reference.shape)}, golden {tuple(golden.shape)}"
        )
    dtype = actual.dtype
    floor = _tol(dtype)["floor"]

    _check_nonfinite(actual, golden, "actual", what)
    try:
        _check_nonfinite(reference, golden, "reference", what)
    except AssertionError as e:
        raise AssertionError(
            f"{e} -- the reference itself is broken in {dtype}, so the golden-relative comparison is meaningless"
        ) from None

    act_err = max_abs_error(actual, golden)
    ref_err = max_abs_error(reference, golden)
    bound = factor * ref_err + floor
    if not act_err <= bound:
        ratio = act_err / ref_err if ref_err > 0 else float("inf")
        raise AssertionError(
            f"{what} ({dtype}): max-abs error vs float64 golden is {act_err:.3e}, "
            f"reference's is {ref_err:.3e} (ratio {ratio:.2f}x); allowed "
            f"{factor:g} * {ref_err:.3e} + floor {floor:.0e} = {bound:.3e}"
        )


def _less_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    if a == b:
        return a
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def assert_same(actual: Tensor, expected: Tensor, *, dtype: torch.dtype | None = None, what: str = "output") -> None:
    """Direct comparison with the per-dtype atol/rtol table.

    ``dtype`` picks the table row; by default the tensors' dtype (or, if they
    differ, the less precise of the two).  Both tensors are compared in float64
    (an exact up-cast), so shapes must match but dtypes need not.
    """
    if dtype is None:
        dtype = _less_precise(actual.dtype, expected.dtype)
    tol = _tol(dtype)
    torch.testing.assert_close(
        actual.detach().to(torch.float64),
        expected.detach().to(torch.float64),
        atol=tol["atol"],
        rtol=tol["rtol"],
        msg=lambda m: f"{what} (tolerances of {dtype}: atol={tol['atol']:g}, rtol={tol['rtol']:g}):\n{m}",
    )


def assert_path_close_to_golden(fast, reference, inputs: tuple[Tensor, ...], *, what: str = "output") -> None:
    """The policy applied to a whole computation, forward and gradients: ``fast(*inputs)`` and
    ``reference(*inputs)`` run in the inputs' low dtype, the golden is ``reference`` in float64
    on the same (rounded) inputs. Gradients are of ``<out, g>`` for one fixed random ``g``."""
    golden_in = tuple(t.detach().double().requires_grad_() for t in inputs)
    golden = reference(*golden_in)
    actual, ref = fast(*inputs), reference(*inputs)
    assert_close_to_golden(actual, ref, golden.detach(), what=f"{what} forward")
    g = torch.randn(golden.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = [
        torch.autograd.grad(out, ins, g.to(out.dtype), allow_unused=True)
        for out, ins in ((actual, inputs), (ref, inputs), (golden, golden_in))
    ]
    for name, a, r, gold in zip(range(len(inputs)), *grads):
        zero = lambda x, like: torch.zeros_like(like) if x is None else x  # noqa: E731
        assert_close_to_golden(
            zero(a, inputs[name]),
            zero(r, inputs[name]),
            zero(gold, golden_in[name]),
            what=f"{what} grad of input {name}",
        )
