"""moba and nsa (trainable block-sparse attention) beyond the contracts (tests/test_contracts.py):
the plain functions against the independent oracles of tests/oracles_modern.py (forward and
gradients, float64, a length the block does not divide, ties), the selection laws (every block
selected is causal softmax), the refusals, decode in chunks that straddle blocks, and no N x N
allocation at N = 4096 forward and backward; ``attend_blocks`` (``block_attend.py``) on any
selection against a dense softmax, and over several kernel calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms import nsa as nsa_module
from attnzoo.mechanisms.block_attend import _layout, attend_blocks
from attnzoo.mechanisms.block_select import _moba_gates, moba, moba_selection, reference_moba
from attnzoo.mechanisms.nsa import nsa
from conftest import grads, largest_tensor
from oracles_modern import oracle_moba, oracle_nsa
from tolerances import assert_same

B, H, N, D, BLOCK = 2, 3, 37, 8, 8


def _qkv(n: int = N, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3))


def _tied_qkv() -> tuple[torch.Tensor, ...]:
    """Small integers (exact sums and means) and repeated key blocks: equal gates everywhere."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-2, 3, (B, H, N, D), generator=g).double()
    k = torch.randint(-2, 3, (B, H, BLOCK, D), generator=g).double().repeat(1, 1, 5, 1)[:, :, :N]
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    return tuple(x.requires_grad_() for x in (q, k, v))


def _nsa_extras(n: int = N, seed: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k_cmp, v_cmp = (torch.randn(B, H, n // BLOCK, D, generator=g, dtype=torch.float64) for _ in range(2))
    gates = torch.rand(B, H, n, 3, generator=g, dtype=torch.float64)
    return k_cmp.requires_grad_(), v_cmp.requires_grad_(), gates


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("topk", [1, 3])
def test_moba_matches_the_oracle_forward_and_gradients(causal, topk, tied):
    inputs = _tied_qkv() if tied else _qkv()
    kw = dict(block=BLOCK, topk=topk, causal=causal, scale=D**-0.5)
    fast, want = moba(*inputs, **kw), oracle_moba(*inputs, **kw)
    assert_same(fast, want, what=f"moba causal={causal} topk={topk} tied={tied}")
    for got, ref, name in zip(grads(fast, inputs), grads(want, inputs), "qkv"):
        assert_same(got, ref, what=f"moba gradient {name}")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("n_select", "window"), [(2, 1), (3, 5), (6, 40)])
def test_nsa_matches_the_oracle_forward_and_gradients(n_select, window, tied):
    inputs = (*(_tied_qkv() if tied else _qkv()), *_nsa_extras())
    if tied:  # equal compressed keys: the compressed branch's probabilities tie
        inputs[3].data.copy_(inputs[3].data[:, :, :1].expand_as(inputs[3]))
    kw = dict(block=BLOCK, n_select=n_select, window=window, scale=D**-0.5)
    fast, want = nsa(*inputs, **kw), oracle_nsa(*inputs, **kw)
    assert_same(fast, want, what=f"nsa n_select={n_select} window={window} tied={tied}")
    wrt = inputs[:5]
    for got, ref, name in zip(grads(fast, wrt), grads(want, wrt), ("q", "k", "v", "k_cmp", "v_cmp")):
        assert_same(got, ref, what=f"nsa gradient {name}")


def test_nsa_window_in_head_chunks_matches_the_oracle(monkeypatch):
    """The window branch split into one call per head (the chunking that keeps its buffers
    small at long N) is the same forward and gradients."""
    inputs = (*_qkv(), *_nsa_extras())
    monkeypatch.setattr(nsa_module, "WINDOW_CHUNK_BYTES", 1)  # one head per call
    kw = dict(block=BLOCK, n_select=3, window=5, scale=D**-0.5)
    fast, want = nsa(*inputs, **kw), oracle_nsa(*inputs, **kw)
    assert_same(fast, want, what="nsa, window one head per call")
    for got, ref, name in zip(grads(fast, inputs[:3]), grads(want, inputs[:3]), "qkv"):
        assert_same(got, ref, what=f"nsa gradient {name}, window one head per call")


def test_moba_ties_go_to_the_lower_block():
    # Four whole blocks with the same keys, so every gate ties: non-causal top-2 keeps blocks 0 and 1.
    q, k, v = (x[:, :, : 4 * BLOCK] for x in _tied_qkv())
    got = moba(q, k, v, block=BLOCK, topk=2, causal=False, scale=0.5)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(torch.arange(4 * BLOCK) >= 2 * BLOCK, float("-inf"))
    assert_same(got, scores.softmax(-1) @ v)


@pytest.mark.parametrize("causal", [False, True])
def test_moba_selecting_every_block_is_softmax_attention(causal):
    q, k, v = _qkv()
    got = moba(q, k, v, block=BLOCK, topk=-(-N // BLOCK), causal=causal, scale=D**-0.5)
    assert_same(got, F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def test_nsa_branches_alone_are_causal_softmax_when_they_cover_the_past():
    q, k, v = _qkv()
    k_cmp, v_cmp, _ = _nsa_extras()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    every_block = dict(block=BLOCK, n_select=-(-N // BLOCK), window=1, scale=D**-0.5)
    selected_only = torch.tensor([0.0, 1.0, 0.0], dtype=q.dtype).expand(B, H, N, 3)
    assert_same(nsa(q, k, v, k_cmp, v_cmp, selected_only, **every_block), want)
    whole_window = dict(block=BLOCK, n_select=2, window=N, scale=D**-0.5)
    assert_same(nsa(q, k, v, k_cmp, v_cmp, selected_only.roll(1, -1), **whole_window), want)


def test_nsa_refuses_non_causal_attention_and_bad_sizes():
    attn = attnzoo.build("nsa", block=4, n_select=2, window=4, heads=H, head_dim=D).double()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="causal=False"):
        attn(q, k, v)
    with pytest.raises(ValueError, match="heads=3, head_dim=8"):
        attnzoo.build("nsa", heads=2, head_dim=D)(q, k, v, causal=True)
    with pytest.raises(ValueError, match="n_select must be"):
        nsa(q, k, v, *_nsa_extras(), block=BLOCK, n_select=1, window=2, scale=1.0)


@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_decode_in_chunks_that_straddle_blocks_equals_the_forward(name):
    config = dict(block=5, n_select=3, window=7, heads=H, head_dim=D) if name == "nsa" else dict(block=5, topk=3)
    attn = attnzoo.build(name, **config).double()
    q, k, v = (x.detach() for x in _qkv(seed=3))
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, :6] = False
    want = attn(q, k, v, causal=True, key_mask=mask)
    state, outs = attn.init_state(B, H, D, D, dtype=q.dtype), []
    for lo in range(0, N, 4):
        hi = min(lo + 4, N)
        out, state = attn.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
        outs.append(out)
    assert_same(torch.cat(outs, 2), want, what=f"{name}: chunks of 4 tokens, blocks of 5")


@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_no_n_by_n_tensor_forward_or_backward_at_4096(name):
    n, block = 4096, 64
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g).requires_grad_() for _ in range(3))
    if name == "moba":
        run = lambda: moba(q, k, v, block=block, topk=n // block // 8, causal=True, scale=0.3)  # noqa: E731
    else:
        k_cmp, v_cmp = (torch.randn(1, 1, n // block, 8, generator=g) for _ in range(2))
        gates = torch.rand(1, 1, n, 3, generator=g)
        kw = dict(block=block, n_select=n // block // 8, window=256, scale=0.3)
        run = lambda: nsa(q, k, v, k_cmp, v_cmp, gates, **kw)  # noqa: E731
    largest = largest_tensor(lambda: run().sum().backward())
    assert largest < n * n // 4, f"{name}: a tensor of {largest} elements at N = {n}"


def _dense_blocks(q, k, v, keep, block, causal, real):
    """``attend_blocks`` written densely: softmax over the keys of the kept blocks (N x N)."""
    n, rows = k.shape[2], q.shape[2]
    pos, key = torch.arange(rows) + n - rows, torch.arange(n)
    visible = keep[..., key // block]
    if causal:
        visible = visible & (key <= pos[:, None])
    if real is not None:
        visible = visible & real[:, None, None, :]
    return normalize_scores(q @ k.transpose(-1, -2) * 0.4, visible, "softmax") @ v


@pytest.mark.parametrize("rows", [N, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_attend_blocks_any_selection_equals_dense_softmax(causal, rows):
    # Random blocks per row, the own block not always among them (the kernel's top-left causal
    # mask cannot be used: every group gets its own mask), padded keys, fewer rows than keys.
    q, k, v = _qkv(seed=5)
    q = q.detach()[:, :, N - rows :].requires_grad_()
    g = torch.Generator().manual_seed(6)
    keep = torch.rand(B, H, rows, -(-N // BLOCK), generator=g) < 0.4
    real = torch.ones(B, N, dtype=torch.bool)
    real[0, :11] = False
    kw = dict(block=BLOCK, scale=0.4, causal=causal, real=real)
    fast, want = attend_blocks(q, k, v, keep, **kw), _dense_blocks(q, k, v, keep, BLOCK, causal, real)
    assert_same(fast, want, what=f"attend_blocks causal={causal} rows={rows}")
    for got, ref, name in zip(grads(fast, (q, k, v)), grads(want, (q, k, v)), "qkv"):
        assert_same(got, ref, what=f"attend_blocks gradient {name}")


@pytest.mark.parametrize("causal", [False, True])
def test_moba_over_many_buckets_and_a_wider_value_equals_the_reference(causal):
    # 256 keys in 32 blocks: groups of many lengths, so several kernel calls (buckets); values
    # wider than keys (the kernel takes one head size: q and k are zero-padded).
    q, k, _ = _qkv(n=256, seed=7)
    v = torch.randn(B, H, 256, D + 3, dtype=torch.float64, requires_grad=True)
    kw = dict(block=BLOCK, topk=5, causal=causal, scale=D**-0.5)
    with torch.no_grad():
        gates, has_real = _moba_gates(q, k, None, BLOCK)
        keep = moba_selection(gates, torch.arange(256), has_real, BLOCK, 5, causal)
    assert len(_layout(keep, BLOCK, causal, True).buckets) > 1
    fast, (want, _) = moba(q, k, v, **kw), reference_moba(q, k, v, key_mask=None, **kw)
    assert_same(fast, want, what=f"moba N=256 causal={causal}")
    for got, ref, name in zip(grads(fast, (q, k, v)), grads(want, (q, k, v)), "qkv"):
        assert_same(got, ref, what=f"moba N=256 gradient {name}")


def test_attend_blocks_with_no_block_selected_gives_zeros():
    q, k, v = _qkv()
    keep = torch.zeros(B, H, N, -(-N // BLOCK), dtype=torch.bool)
    out = attend_blocks(q, k, v, keep, block=BLOCK, scale=0.4, causal=True, real=None)
    assert out.shape == v.shape and not out.any()


@pytest.mark.parametrize("causal", [False, True])
def test_the_plain_kernel_for_other_devices_equals_the_reference(causal, monkeypatch):
    # Off the CPU the flash kernel's forward and backward run as plain tensor ops: run those here.
    import attnzoo.mechanisms.block_attend as module

    monkeypatch.setattr(module, "flash_attention_cpu", module._plain_forward)
    monkeypatch.setattr(module, "flash_attention_cpu_backward", module._plain_backward)
    q, k, v = _qkv(seed=8)
    real = torch.ones(B, N, dtype=torch.bool)
    real[1, :9] = False
    kw = dict(block=BLOCK, topk=3, causal=causal, scale=D**-0.5, key_mask=real)
    for mask in (None, real):
        kw["key_mask"] = mask
        fast, (want, _) = moba(q, k, v, **kw), reference_moba(q, k, v, **kw)
        assert_same(fast, want, what=f"plain kernel causal={causal} padded={mask is not None}")
        for got, ref, name in zip(grads(fast, (q, k, v)), grads(want, (q, k, v)), "qkv"):
            assert_same(got, ref, what=f"plain kernel gradient {name}")
