"""``torch.compile(fullgraph=True)`` of ``attnzoo.nn.MultiHeadAttention`` on CPU: no graph break
(``fullgraph=True`` raises on the first one, input checks included) and compiled == eager,
output and every gradient.

One small shape per mechanism, compiled once per module (a compile costs ~10-30 s on CPU). The
default run covers softmax, local on the blocked backend's structured (window) path, linear and
performer, each with a padding mask; causal calls and local's generic tile plan are ``slow``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnzoo.backends.dispatch import last_choice
from attnzoo.nn import MultiHeadAttention
from tolerances import assert_same

B, N, DIM, HEADS = 2, 64, 32, 4

#: name -> (mechanism, its config). local(8, 8) runs on the structured path, local(64, 64) at
#: N = 64 (a band as wide as the sequence) on the tile plan.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "softmax": ("softmax", {}),
    "local": ("local", {"left": 8, "right": 8}),
    "local_tiles": ("local", {"left": 64, "right": 64}),
    "linear": ("linear", {}),
    "performer": ("performer", {}),
}


def _key_mask() -> torch.Tensor:
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, N - 13 :] = False  # the second row padded, across a window and a tile boundary
    return mask


def _loss_and_grads(module: torch.nn.Module, x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    out = module(x, **kwargs)
    params = [p for p in module.parameters() if p.requires_grad]
    return (out, *torch.autograd.grad(out.square().sum(), [x, *params]))


def _check_compiled_equals_eager(case: str, **kwargs: Any) -> None:
    name, config = CASES[case]
    torch.manual_seed(0)
    module = MultiHeadAttention(DIM, HEADS, name, **config)
    x = torch.randn(B, N, DIM, requires_grad=True)
    compiled = torch.compile(module, fullgraph=True)
    actual = _loss_and_grads(compiled, x, **kwargs)
    expected = _loss_and_grads(module, x, **kwargs)
    for what, a, e in zip(("output", "dx", *(n for n, _ in module.named_parameters())), actual, expected):
        assert_same(a, e, what=f"{case} {what}")


@pytest.mark.parametrize("case", ["softmax", "local", "linear", "performer"])
def test_compiled_fullgraph_equals_eager_with_padding(case: str) -> None:
    torch._dynamo.reset()
    _check_compiled_equals_eager(case, key_mask=_key_mask())


def test_local_runs_its_structured_path_and_the_tile_plan() -> None:
    """The cases above and below cover both paths of the blocked backend (eager check, cheap)."""
    x = torch.randn(B, N, DIM)
    for case, path in (("local", "structured"), ("local_tiles", "tiles")):
        name, config = CASES[case]
        MultiHeadAttention(DIM, HEADS, name, **config)(x)
        choice = last_choice()
        assert choice is not None and (choice.backend, choice.path) == ("blocked", path)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_fullgraph_equals_eager_causal_with_padding(case: str) -> None:
    torch._dynamo.reset()
    _check_compiled_equals_eager(case, causal=True, key_mask=_key_mask())


@pytest.mark.slow
def test_compiled_local_tile_plan_equals_eager() -> None:
    torch._dynamo.reset()
    _check_compiled_equals_eager("local_tiles", key_mask=_key_mask())


@pytest.mark.slow
def test_compiled_local_at_a_second_length_specialises_its_plan() -> None:
    """A second length makes dynamo's sizes symbolic (automatic dynamic shapes); the plan is
    still built from Python ints (``Call.sizes`` specialises them) and matches eager."""
    torch._dynamo.reset()
    module = MultiHeadAttention(DIM, HEADS, "local", left=8, right=8)
    compiled = torch.compile(module, fullgraph=True)
    for n in (N, N - 16, N + 16):
        x = torch.randn(B, n, DIM)
        assert_same(compiled(x), module(x), what=f"N={n}")


@pytest.mark.slow
def test_compiled_stack_of_local_layers_resolves_each_pattern() -> None:
    """Two layers with different windows in one graph, causal and not: every (pattern, causal)
    is resolved once at compile time, and a later compilation does not disturb earlier graphs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(MultiHeadAttention(DIM, HEADS, "local", left=w, right=w) for w in (4, 12))

    def stack(x: torch.Tensor, causal: bool) -> torch.Tensor:
        for layer in layers:
            x = layer(x, causal=causal)
        return x

    compiled = torch.compile(stack, fullgraph=True)
    x = torch.randn(B, N, DIM)
    for _ in range(2):
        for causal in (False, True):
            assert_same(compiled(x, causal), stack(x, causal), what=f"causal={causal}")
