"""Grouped-query K/V attended natively: the mechanisms that declare ``Capabilities.gqa`` and
index K/V heads themselves give what the K/V repeated per query head give (outputs and
gradients w.r.t. q, k, v, causal and not, with padding; decode steps == the causal forward),
and never build the repeated K/V.

``tests/test_contracts.py`` checks grouped == repeated for every mechanism on a small case; here
the native ones get the larger one the issue asks for (B = 2, H = 6, H_kv = 2 and 1, N = 75,
float64) and the structural check: ``Attention._kv_heads`` and ``repeat_interleave`` raise if
anything repeats K/V on the way.
"""

from __future__ import annotations

import pytest
import torch

from attnzoo.backends import dispatch, grouped
from attnzoo.mechanisms.base import Attention
from conftest import grads, small_mechanism
from tolerances import assert_same

B, H, N, D = 2, 6, 75, 8
#: name -> the causal modes in which K/V reach the mechanism's kernel un-repeated.
NATIVE = {
    "linear": (False, True),
    "performer": (False, True),
    "efficient": (False,),
    "rfa": (False,),  # causal: the gate is per query head (gate_weight (H, D)): repeated, documented
    # pattern mechanisms whose blocked plan is bands of windows: group rows stacked per block
    "local": (False, True),
    "dilated": (False, True),
    "block_local": (False, True),
    "longformer": (False, True),  # + global tokens: rows and columns as grouped products
    "sinks": (False, True),  # + key columns
    "sparse_transformer_fixed": (False, True),  # per-head parts: whole K/V groups only (see below)
    "axial": (False, True),  # a union of windows and a dense, masked sub-sequence part
    "strided": (False,),  # causal: a dense part with the kernel's is_causal: repeated
    "bigbird": (),  # the tile plan: dispatch repeats K/V for the backend
}
#: Decode states kept at H_kv heads (kernel sums; pattern caches, attended by SDPA's enable_gqa).
DECODE = ["linear", "performer", "local", "dilated", "longformer", "sinks", "strided"]


def _inputs(kv_heads: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _mask() -> torch.Tensor:
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, :11] = False  # batch 0 left-padded (a decode prompt), batch 1 real
    mask[0, 40:43] = False
    return mask


def _modes(attn: Attention) -> tuple[bool, ...]:
    caps = attn.spec.capabilities
    return tuple(c for c in (False, True) if (caps.causal if c else caps.bidirectional))


class _NoRepeat:
    """Inside: repeating K/V heads raises (``Attention._kv_heads`` asked to repeat, dispatch's
    ``repeated_kv`` for a backend, or with ``any_repeat`` any ``repeat_interleave``), so a path
    that passes built no ``(B, H, N, D)`` repeated K/V."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, any_repeat: bool = True) -> None:
        self.mp, self.any_repeat = monkeypatch, any_repeat

    def __enter__(self) -> _NoRepeat:
        real = Attention._kv_heads

        def kv_heads(q, k, v, *, native):  # noqa: ANN001, ANN202
            if not native and k.shape[1] != q.shape[1]:
                raise AssertionError("K/V repeated to the query heads")
            return real(q, k, v, native=native)

        def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise AssertionError("repeat_interleave called")

        self.mp.setattr(Attention, "_kv_heads", staticmethod(kv_heads))
        self.mp.setattr(dispatch, "repeated_kv", refuse)
        if self.any_repeat:
            self.mp.setattr(torch.Tensor, "repeat_interleave", refuse)
            self.mp.setattr(torch, "repeat_interleave", refuse)
        return self

    def __exit__(self, *exc: object) -> None:
        self.mp.undo()


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("name", list(NATIVE))
def test_native_grouped_kv_equal_repeated_forward_and_gradients(name, kv_heads, monkeypatch):
    attn = small_mechanism(name, N, heads=H, head_dim=D)
    assert attn.spec.capabilities.gqa, f"{name} must declare gqa to get grouped K/V"
    q, k, v = (x.requires_grad_(True) for x in _inputs(kv_heads))
    groups = H // kv_heads
    for causal in _modes(attn):
        for mask in (None, _mask()):
            what = f"{name} H_kv={kv_heads} causal={causal} padded={mask is not None}"
            if causal in NATIVE[name]:
                with _NoRepeat(monkeypatch):
                    grouped = attn(q, k, v, causal=causal, key_mask=mask)
                    got = grads(grouped, (q, k, v))  # the backward repeats nothing either
            else:
                grouped = attn(q, k, v, causal=causal, key_mask=mask)
                got = grads(grouped, (q, k, v))
            kr, vr = (x.repeat_interleave(groups, dim=1) for x in (k, v))
            repeated = attn(q, kr, vr, causal=causal, key_mask=mask)
            assert_same(grouped, repeated, what=f"{what}: output, grouped vs repeated")
            for grad, want, of in zip(got, grads(repeated, (q, k, v)), "qkv"):
                assert_same(grad, want, what=f"{what}: d{of}, grouped vs repeated")


@pytest.mark.parametrize("name", ["local", "longformer"])
def test_grouped_window_backward_in_chunks_of_one_query_block(name, monkeypatch):
    # The window parts' backward in chunks of query blocks (window_parts.BACKWARD_BYTES), with a
    # group's query heads stacked as each block's rows: one block per chunk here.
    from attnzoo.backends import window_parts

    monkeypatch.setattr(window_parts, "BACKWARD_BYTES", 1)
    test_native_grouped_kv_equal_repeated_forward_and_gradients(name, 2, monkeypatch)


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("name", DECODE)
def test_native_grouped_decode_equals_forward(name, kv_heads, monkeypatch):
    attn = small_mechanism(name, N, heads=H, head_dim=D)
    q, k, v = _inputs(kv_heads, seed=1)
    mask = _mask()
    want = attn(q, k, v, causal=True, key_mask=mask)
    outs = []
    with torch.no_grad(), _NoRepeat(monkeypatch):
        state = attn.init_state(B, H, D, D, kv_heads=kv_heads, dtype=q.dtype)
        for lo, hi in [(0, 13), *((t, t + 1) for t in range(13, N))]:
            out, state = attn.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
            outs.append(out)
    assert_same(torch.cat(outs, 2), want, what=f"{name} H_kv={kv_heads}: prefill 13 then steps vs forward")


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_kernel_decode_state_is_per_kv_head(name):
    attn = small_mechanism(name, N, heads=H, head_dim=D)
    state = attn.init_state(B, H, D, D, kv_heads=2, dtype=torch.float64)
    q, k, v = _inputs(2)
    _, state = attn.step(state, q[:, :, :3], k[:, :, :3], v[:, :, :3])
    assert state.s.shape[:2] == (B, 2) and state.z.shape[:2] == (B, 2)


def test_rfa_causal_keeps_a_state_per_query_head():
    """rfa's gate reads k with per-query-head weights, so its causal sums cannot be shared."""
    attn = small_mechanism("rfa", N, heads=H, head_dim=D)
    state = attn.init_state(B, H, D, D, kv_heads=2, dtype=torch.float64)
    assert state.s.shape[:2] == (B, H)


@pytest.mark.parametrize("name", ["local", "longformer", "strided"])
def test_pattern_decode_cache_keeps_kv_heads(name):
    attn = small_mechanism(name, N, heads=H, head_dim=D)
    q, k, v = _inputs(2)
    state = attn.init_state(B, H, D, D, kv_heads=2, dtype=torch.float64)
    _, state = attn.step(state, q[:, :, :5], k[:, :, :5], v[:, :, :5])
    assert state.k.shape[:3] == (B, 2, 5) and state.v.shape[:3] == (B, 2, 5)


@pytest.mark.slow  # FlexAttention compiles on CPU (~15 s per shape)
def test_flex_takes_grouped_kv_as_they_are(monkeypatch):
    """flex runs grouped K/V with ``enable_gqa``: equal to the blocked backend on repeated K/V,
    also for a per-head pattern (its mask_mod sees query heads) and with padding."""
    from attnzoo import attend
    from attnzoo import patterns as P

    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, N, 16, generator=g)
    k, v = (torch.randn(B, 2, N, 16, generator=g) for _ in range(2))
    for pattern in (P.local(5), P.per_head([P.local(2), P.local(9), P.local(4)])):
        kw = dict(pattern=pattern, causal=True, key_mask=_mask())
        want = attend(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), backend="blocked", **kw)
        with _NoRepeat(monkeypatch, any_repeat=False):  # (block lists use repeat_interleave on indices)
            got = attend(q, k, v, backend="flex", **kw)
        assert_same(got, want, what=f"flex grouped vs blocked repeated, {pattern!r}")


def test_per_head_parts_take_grouped_kv_only_where_grouped_themselves():
    """H = 6 in two parts of 3 heads: H_kv = 2 gives each part one K/V head, H_kv = 1 both the
    same one; H_kv = 3 (pairs of heads) splits the pair (2, 3) across the parts: K/V repeated,
    and the output still equals the repeated run."""
    assert grouped.part_kv_heads(torch.tensor([3, 4, 5]), 3).tolist() == [1]
    assert grouped.part_kv_heads(torch.tensor([3, 4, 5]), 6).tolist() == [0]
    assert grouped.part_kv_heads(torch.tensor([0, 1, 2]), 2) is None
    attn = small_mechanism("sparse_transformer_fixed", N, heads=H, head_dim=D)
    q, k, v = _inputs(3)
    got = attn(q, k, v, causal=True)
    assert_same(got, attn(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True), what="H_kv = 3")
