"""Attention-probability dropout on the pattern (sparse) mechanisms.

``dropout_p > 0`` routes a pattern call to the blocked backend's tile plan, whose explicit
(einsum) path multiplies each tile's probabilities by the seeded mask of ``_ops.dropout_keep``
evaluated on that tile's (b, h, i, j) only; the reference applies the same mask to its dense
weights. Checked here: fast == reference in float64 (outputs and gradients) on ragged tiles with
padding, the mask's statistics read off the fast path itself, the routing (structured path at
p = 0, tile plan and no flash kernel with dropout, flex refusing), memory at N = 2048, and the
``MultiHeadAttention`` layer. The registry-driven contract (``test_contracts.py``) covers every
pattern mechanism at N = 16.
"""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.mechanisms._ops import dropout_flat_index, dropout_keep, dropout_keep_at
from conftest import grads, largest_tensor, small_mechanism
from tolerances import assert_same

B, H, N, D = 2, 3, 75, 8  # N = 75: not a multiple of the tile
TILE = 16
PATTERNS = ("local", "longformer", "bigbird", "strided")


def _qkv(seed: int = 0, n: int = N, d_v: int = D) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, n, D), (B, H, n, D), (B, H, n, d_v))
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes)


def _mask() -> torch.Tensor:
    """Batch 0 padded at the end; batch 1 at the start, so under causal its first rows see no key."""
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, 60:] = False
    mask[1, :7] = False
    return mask


def _pair(attn: torch.nn.Module, q, k, v, **kw) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """``forward`` and ``reference`` with the same dropout seed."""
    torch.manual_seed(11)
    fast = attn(q, k, v, **kw)
    torch.manual_seed(11)
    return fast, attn.reference(q, k, v, **kw)


def _keep_as_first_written(seed: int, flat: torch.Tensor, p: float) -> torch.Tensor:
    """The mask as softmax's dropout first drew it: the uniform as a double, compared with p."""
    offset = (seed * 0x9E3779B97F4A7C15) % 2**64
    x = flat + (offset - 2**64 if offset >= 2**63 else offset)
    for shift, mult in ((30, -4658895280553007687), (27, -7723592293110705685)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return ((x >> 11) & ((1 << 53) - 1)).double() * 2.0**-53 >= p


def test_dropout_keep_at_any_index_is_the_dense_mask_and_unchanged():
    shape = (2, 3, 5, 7)
    dense = dropout_keep(123, shape, 0.4, torch.device("cpu"))
    b, h, i, j = (torch.randint(0, s, (50,)) for s in shape)
    assert torch.equal(dropout_keep_at(123, dropout_flat_index(b, h, i, j, *shape[1:]), 0.4), dense[b, h, i, j])
    flat = torch.randint(-(2**62), 2**62, (20000,))
    for seed, p in ((0, 0.1), (5, 1 / 3), (2**61 + 7, 0.5), (9, 0.999)):
        assert torch.equal(dropout_keep_at(seed, flat, p), _keep_as_first_written(seed, flat, p)), (seed, p)
    # The bits of the mask before it could be evaluated per index (softmax's masks must not move).
    pinned = ((7, (1, 1, 4, 16), 0.5, 0x32C7723169B4A736), (2**62 - 1, (2, 1, 3, 5), 0.25, 0x15FF7CC6))
    for seed, shape, p, want in pinned:
        bits = dropout_keep(seed, shape, p, torch.device("cpu")).flatten().tolist()
        assert sum(1 << n for n, kept in enumerate(bits) if kept) == want


@pytest.mark.parametrize("name", PATTERNS)
def test_fast_equals_reference_with_dropout_on_ragged_tiles(name):
    attn = small_mechanism(name, N, heads=H, head_dim=D, tile=TILE)
    q, k, v = _qkv()
    for causal in (False, True):
        what = f"{name} causal={causal}"
        fast, ref = _pair(attn, q, k, v, causal=causal, key_mask=_mask(), dropout_p=0.3)
        choice = attnzoo.last_choice()
        assert (choice.backend, choice.path) == ("blocked", "tiles"), what
        assert_same(fast, ref, what=f"{what}: dropout output")
        for i, (got, want) in enumerate(zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)))):
            assert_same(got, want, what=f"{what}: dropout gradient {i}")
        torch.manual_seed(12)
        assert not torch.allclose(fast, attn(q, k, v, causal=causal, key_mask=_mask(), dropout_p=0.3)), what
        if causal:  # batch 1's first rows see no key: zeros, with dropout as without
            assert torch.equal(fast[1, :, :7], torch.zeros_like(fast[1, :, :7])), what


@pytest.mark.parametrize("name", ("local", "strided"))
def test_cross_attention_with_dropout_counts_queries_from_zero(name):
    """N_q < N_kv: the mask's i is the query's row, not its end-aligned position."""
    attn = small_mechanism(name, N, heads=H, head_dim=D, tile=TILE)
    k, v = _qkv(4)[1:]
    q = torch.randn(B, H, 40, D, dtype=torch.float64, requires_grad=True)
    for causal in (False, True):
        fast, ref = _pair(attn, q, k, v, causal=causal, key_mask=_mask(), dropout_p=0.3)
        assert_same(fast, ref, what=f"{name} causal={causal}: cross-attention dropout output")
        for i, (got, want) in enumerate(zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)))):
            assert_same(got, want, what=f"{name} causal={causal}: cross-attention dropout gradient {i}")


@pytest.mark.parametrize("name", ("local", "bigbird"))
def test_the_fast_path_drops_about_p_of_the_visible_weights_and_rescales_the_rest(name):
    """With v the identity over keys, the fast path's output *is* the weights it applied."""
    attn = small_mechanism(name, N, heads=H, head_dim=D, tile=TILE)
    q, k, _ = _qkv(1)
    eye = torch.eye(N, dtype=torch.float64).expand(B, H, N, N)
    p = 0.3
    with torch.no_grad():
        torch.manual_seed(5)
        applied = attn(q, k, eye, causal=True, key_mask=_mask(), dropout_p=p)
        plain = attn.reference(q, k, eye, causal=True, key_mask=_mask(), return_weights=True)[1]
    visible = plain > 0
    dropped = (applied == 0) & visible
    assert abs(dropped.sum() / visible.sum() - p) < 0.03, f"{name}: dropped {dropped.sum() / visible.sum():.3f}"
    assert torch.equal(applied[~visible], torch.zeros_like(applied[~visible])), "a weight outside the pattern"
    kept = visible & ~dropped
    torch.testing.assert_close(applied[kept], plain[kept] / (1 - p))
    # Not one mask broadcast over heads or batch rows: each (b, h) draws its own.
    assert not torch.equal(dropped[0, 0], dropped[0, 1]) and not torch.equal(dropped[0, 0], dropped[1, 0])


def test_p_zero_keeps_the_structured_path_and_dropout_leaves_it():
    attn = small_mechanism("local", N, heads=H, head_dim=D)
    q, k, v = _qkv(2)
    plain = attn(q, k, v, causal=True)
    assert attnzoo.last_choice().path == "structured"
    assert torch.equal(attn(q, k, v, causal=True, dropout_p=0.0), plain)
    assert attnzoo.last_choice().path == "structured"
    attn(q, k, v, causal=True, dropout_p=0.1)
    assert (attnzoo.last_choice().backend, attnzoo.last_choice().path) == ("blocked", "tiles")


def test_flex_and_mechanisms_without_dropout_refuse_it_clearly():
    flex = small_mechanism("local", N, heads=H, head_dim=D, backend="flex")
    q, k, v = (x.detach() for x in _qkv(3))
    with pytest.raises(ValueError, match="flex cannot apply attnzoo's seeded attention dropout"):
        flex(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"does not support attention dropout.*\blocal\b.*") as refused:
        small_mechanism("linformer", N, heads=H, head_dim=D)(q, k, v, dropout_p=0.1)
    assert "softmax" in str(refused.value) and "bigbird" in str(refused.value)


def test_no_n_by_n_tensor_with_dropout_forward_and_backward():
    n = 2048
    attn = attnzoo.build("local", left=64, right=64).double()
    q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.arange(n)[None] < n - 5

    def step() -> None:
        attn(q, k, v, causal=True, key_mask=mask, dropout_p=0.1).sum().backward()

    step()  # the plan is cached after this
    dense = 2 * n * n  # B * H * N * N: the dense mask or scores
    largest = largest_tensor(step)
    assert largest < dense // 4, f"a tensor of {largest} elements with dropout; dense scores are {dense}"


def test_layer_with_a_pattern_mechanism_trains_with_dropout_and_eval_ignores_it():
    torch.manual_seed(0)
    layer = attnzoo.nn.MultiHeadAttention(16, 2, "local", attn_dropout=0.1, left=4, right=4)
    plain = attnzoo.nn.MultiHeadAttention(16, 2, "local", left=4, right=4)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 40, 16)
    layer.eval(), plain.eval()
    assert torch.equal(layer(x, causal=True), plain(x, causal=True)), "eval mode: no dropout"
    layer.train()
    torch.manual_seed(1)
    first = layer(x, causal=True)
    torch.manual_seed(1)
    assert torch.equal(first, layer(x, causal=True)) and not torch.allclose(first, plain(x, causal=True))
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    first.square().mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in layer.parameters())
    optimiser.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, layer.parameters()) if a.ndim == 2)
