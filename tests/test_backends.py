"""The backend protocol and dispatch: every backend is an object with ``NAME``,
``not_supported_reasons`` and ``run``; ``auto`` walks a per-device priority list and reports
every reason; plans are cached by the pattern's value (structured plans, tile plans, flex block
masks); private torch ops stay in ``_compat``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo import patterns as P
from attnzoo.backends import dispatch, flex, gathered, key_sets, plan
from attnzoo.backends.call import Backend, BackendUnavailable, Call, masked_key_blocks
from attnzoo.patterns.atomic import Band
from conftest import largest_tensor

SRC = Path(attnzoo.__file__).parent


def _qkv(n: int = 96, dim: int = 16, grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(2, 4, n, dim, generator=g, requires_grad=grad) for _ in range(3)]


def _call(q, k, v, pattern=None, mask=None, block=32) -> Call:
    return Call(q, k, v, (pattern or P.full()).resolve_heads(q.shape[1]), mask, None, q.shape[-1] ** -0.5, block)


def test_every_backend_follows_the_protocol():
    assert dispatch.BACKENDS == ("auto", *dispatch.REGISTRY)
    q, k, v = _qkv()
    for name, backend in dispatch.REGISTRY.items():
        assert isinstance(backend, Backend) and backend.NAME == name
        reasons = backend.not_supported_reasons(_call(q, k, v))
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons)
    assert dispatch.REGISTRY["reference"].not_supported_reasons(_call(q, k, v)) == []


def test_every_priority_list_ends_with_the_backend_that_runs_everything():
    for order in (*dispatch.PRIORITY.values(), dispatch.DEFAULT_PRIORITY):
        assert order[-1] == "reference" and set(order) <= set(dispatch.REGISTRY)


def test_explicit_backend_raises_with_every_reason():
    q, k, v = _qkv(dim=8, grad=True)  # flex on CPU: no backward, and D=8 is too small
    with pytest.raises(ValueError, match="backend 'flex' cannot run this call") as info:
        attnzoo.attend(q, k, v, pattern=P.local(3), backend="flex")
    call = _call(q, k, v, P.local(3))
    assert all(reason in str(info.value) for reason in dispatch.REGISTRY["flex"].not_supported_reasons(call))
    assert "D=8" in str(info.value) and "D_v=8" in str(info.value) and "require grad" in str(info.value)
    assert "power-of-two head dimension" in str(info.value) and "use backend='blocked' to train" in str(info.value)


def test_attend_rejects_unknown_backends_and_non_patterns():
    small = torch.randn(1, 1, 8, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        attnzoo.attend(small, small, small, backend="triton")
    with pytest.raises(TypeError, match="Pattern"):
        attnzoo.attend(small, small, small, pattern="local")


class _Refuses(Backend):
    NAME = "refuses"

    def not_supported_reasons(self, call: Call) -> list[str]:
        return ["first reason", "second reason"]


def test_auto_walks_the_priority_list_and_records_every_skipped_reason(monkeypatch):
    monkeypatch.setitem(dispatch.REGISTRY, "refuses", _Refuses())
    monkeypatch.setattr(dispatch, "DEFAULT_PRIORITY", ("refuses", "flex", "reference"))
    q, k, v = _qkv(dim=8, grad=True)
    out = attnzoo.attend(q, k, v, pattern=P.local(3))
    choice = attnzoo.last_choice()
    assert choice.backend == "reference" and list(choice.skipped) == ["refuses", "flex"]
    assert choice.skipped["refuses"] == ["first reason", "second reason"]
    assert len(choice.skipped["flex"]) == 3
    torch.testing.assert_close(out, attnzoo.attend(q, k, v, pattern=P.local(3), backend="reference"))


def test_a_flex_compile_failure_is_refused_from_then_on_and_never_silent(monkeypatch):
    # A mask_mod inductor cannot lower (bigbird's on an H100, torch 2.11): auto runs the next
    # backend and names the reason; an explicit flex raises it; dynamo's recompile limit raises.
    def fails(*args, **kwargs):
        raise torch._dynamo.exc.BackendCompilerFailed(fails, RuntimeError("cannot lower"), None)

    monkeypatch.setattr(flex, "_compiled", lambda: fails)
    monkeypatch.setattr(flex, "FAILED", {})
    monkeypatch.setattr(dispatch, "DEFAULT_PRIORITY", ("flex", "blocked", "reference"))
    q, k, v = _qkv()
    out = attnzoo.attend(q, k, v, pattern=P.local(8))
    choice = attnzoo.last_choice()
    assert choice.backend == "blocked" and "could not compile this pattern's mask_mod" in choice.skipped["flex"][0]
    torch.testing.assert_close(out, attnzoo.attend(q, k, v, pattern=P.local(8), backend="reference"))
    with pytest.raises(ValueError, match="could not compile"):  # refused up front now
        attnzoo.attend(q, k, v, pattern=P.local(8), backend="flex")
    with pytest.raises(BackendUnavailable, match="could not compile"):  # another pattern: found at run time
        attnzoo.attend(q, k, v, pattern=P.local(4), backend="flex")

    def limit(*args, **kwargs):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit")

    monkeypatch.setattr(flex, "_compiled", lambda: limit)
    with pytest.raises(RuntimeError, match="RECOMPILE_LIMIT"):
        attnzoo.attend(q, k, v, pattern=P.local(2), backend="flex")


def test_blocked_records_its_path():
    q, k, v = _qkv()
    attnzoo.attend(q, k, v, pattern=P.local(8), causal=True)
    assert attnzoo.last_choice() == dispatch.Choice("blocked", {}, "structured")
    attnzoo.attend(q, k, v, pattern=P.bigbird(16, 3, 2, 1), backend="blocked")
    assert attnzoo.last_choice() == dispatch.Choice("blocked", {}, "tiles")
    attnzoo.attend(q, k, v, pattern=P.random(4), causal=True)
    assert attnzoo.last_choice() == dispatch.Choice("blocked", {}, "gathered")
    attnzoo.attend(q, k, v, pattern=P.random(4), score_mod=lambda s, b, h, i, j: s, backend="blocked")
    assert attnzoo.last_choice() == dispatch.Choice("blocked", {}, "tiles")  # no score_mod when gathered
    attnzoo.attend(q, k, v, backend="reference")
    assert attnzoo.last_choice() == dispatch.Choice("reference", {}, None)


@pytest.mark.parametrize(
    "build, cache",
    [
        (lambda: P.local(8), plan.STRUCTURES),  # structured path
        (lambda: P.local(8) & P.random(2, seed=1), gathered.TABLES),  # gathered path
        (lambda: P.bigbird(16, 3, 2, 1), plan.PLANS),
    ],
)
def test_plan_cache_hits_for_a_pattern_rebuilt_per_call_with_causal(build, cache):
    cache.clear()
    q, k, v = _qkv()
    mask = torch.ones(2, 96, dtype=torch.bool)
    mask[0, 90:] = False
    for _ in range(3):
        attnzoo.attend(q, k, v, pattern=build(), causal=True, key_mask=mask.clone(), backend="blocked")
    info = cache.cache_info()
    assert info.misses == 1 and info.hits >= 2, info


def test_flex_tiles_on_cuda_are_multiples_of_the_kernel_tile():
    # The Triton kernel's tiles must divide the BlockMask's (bigbird's tiles follow its 64-key
    # blocks, and an H100 refused to compile them); the CPU kernel takes any tile. Coarser tiles
    # hold the same pairs: blocks() is exact at every tile size (test_patterns).
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [flex.kernel_block(b, cuda) for b in (25, 64, 128, 256, 200)] == [128, 128, 128, 256, 128]
    assert [flex.kernel_block(b, cpu) for b in (25, 64)] == [25, 64]


def test_flex_block_masks_are_cached_by_value_never_by_the_mask_object():
    flex.MASKS.clear()
    q, k, v = _qkv()
    mask = torch.ones(2, 96, dtype=torch.bool)
    mask[1, :5] = False
    for _ in range(3):  # a fresh pattern and a fresh (equal) mask every call
        flex.block_mask_for(_call(q, k, v, P.local(8) & P.causal(), mask.clone()))
    assert flex.MASKS.cache_info().misses == 1
    mask[1, :40] = False  # pads a second key block: another structure
    flex.block_mask_for(_call(q, k, v, P.local(8) & P.causal(), mask))
    assert flex.MASKS.cache_info().misses == 2


def _spy_flex_kernel(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of q that every flex kernel call gets from now on."""
    shapes, compiled = [], flex._compiled()

    def spy(q, *args, **kwargs):
        shapes.append(tuple(q.shape))
        return compiled(q, *args, **kwargs)

    monkeypatch.setitem(flex._COMPILED, "flex", spy)
    return shapes


@pytest.mark.parametrize(
    ("pattern", "causal", "padded", "kernel"),
    [
        (P.strided(8), True, False, None),  # every earlier pair of a sub-sequence: SDPA, no flex call
        (P.strided(8), True, True, (16, 4, 26, 16)),  # a key mask and a score_mod: flex
        (P.strided(8), False, False, (16, 4, 26, 16)),  # 203 = 25 * 8 + 3: padding rows masked
        (P.dilated(3, 2, 5), False, True, (10, 4, 41, 16)),  # a window of 6 on each sub-sequence
        (Band(-7, 9, 4), False, False, (8, 4, 51, 16)),  # ends that 4 does not divide: [-1, 2]
    ],
)
def test_flex_runs_strided_bands_on_their_subsequences(monkeypatch, pattern, causal, padded, kernel):
    # (Tiles of 4 rows: the bounded bands here span at least SUBSEQUENCE_SPAN_TILES of them.)
    # A band of stride m touches every tile; flex runs it on the m de-interleaved sub-sequences
    # (position i m + r is row i of sub-sequence r), as SDPA where the band there is every pair
    # or the causal ones, else as flex on ceil(N / m) rows with the band divided by m. Grouped
    # K/V, and with ``padded`` a key mask with a fully masked row and a score_mod that reads the
    # original batch row and positions.
    n, g = 203, torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, n, 16, generator=g)
    k, v = (torch.randn(2, 2, n, 16, generator=g) for _ in range(2))
    args = {"pattern": pattern, "causal": causal, "block": 4}
    if padded:
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, 150:] = False
        mask[1, :7] = False
        bias = torch.tensor([0.3, -0.2])
        # batch row, head and positions all change the softmax (a row constant would not)
        args |= {"key_mask": mask, "score_mod": lambda s, b, h, i, j: s - 0.05 * (1 + bias[b] + h) * (i - j).abs()}
    shapes = _spy_flex_kernel(monkeypatch)
    got = attnzoo.attend(q, k, v, backend="flex", **args)
    assert attnzoo.last_choice().path == "subsequences"
    want = attnzoo.attend(q.double(), k.double(), v.double(), backend="reference", **args)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert shapes == ([] if kernel is None else [kernel])


def test_flex_runs_per_head_groups_apart_when_one_has_subsequences(monkeypatch):
    # sparse_transformer_strided's shape: local heads and strided heads. The strided group runs
    # on its sub-sequences, the local one as a band, each on its own heads (and grouped K/V
    # heads); a score_mod still sees the original head index.
    n, g = 203, torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, n, 16, generator=g)
    k, v = (torch.randn(2, 2, n, 16, generator=g) for _ in range(2))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 150:] = False
    args = {
        "pattern": P.per_head([P.local(5), P.strided(8)]),
        "causal": True,
        "key_mask": mask,
        "score_mod": lambda s, b, h, i, j: s - 0.05 * (h + 1) * (i - j).abs(),  # per head: not a row constant
        "block": 4,
    }
    shapes = _spy_flex_kernel(monkeypatch)
    got = attnzoo.attend(q, k, v, backend="flex", **args)
    assert attnzoo.last_choice().path == "head groups (subsequences)"
    assert shapes == [(2, 2, n, 16), (16, 2, 26, 16)]
    want = attnzoo.attend(q.double(), k.double(), v.double(), backend="reference", **args)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert flex.head_group_calls(_call(q, k, v, P.per_head([P.local(5), P.local(7)]).resolve_heads(4))) is None


def test_flex_runs_a_narrow_strided_band_as_one_band(monkeypatch):
    # dilated(3, 2, 5) spans 25 positions, less than 4 tiles of 8: the reshapes would cost more
    # than the tiles they skip, so the band runs as it is, on the call's own rows.
    q, k, v = _qkv(96)
    shapes = _spy_flex_kernel(monkeypatch)
    got = attnzoo.attend(q, k, v, pattern=P.dilated(3, 2, 5), backend="flex", block=8)
    assert attnzoo.last_choice().path is None and shapes == [(2, 4, 96, 16)]
    want = attnzoo.attend(q, k, v, pattern=P.dilated(3, 2, 5), backend="reference")
    torch.testing.assert_close(got, want)


def test_masked_key_blocks_is_the_ragged_block_and_the_padded_ones():
    assert masked_key_blocks(64, 32).tolist() == [False, False]
    assert masked_key_blocks(70, 32).tolist() == [False, False, True]
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, 33] = False
    assert masked_key_blocks(70, 32, mask).tolist() == [False, True, True]


def test_backends_import_no_dispatch():
    # dispatch imports the backends; a backend importing dispatch would be a cycle.
    for path in (SRC / "backends").glob("*.py"):
        if path.name not in ("dispatch.py", "__init__.py"):
            assert "attnzoo.backends.dispatch" not in _imports(path), path.name


def test_private_torch_ops_only_through_compat():
    for path in SRC.rglob("*.py"):
        if path.name != "_compat.py":
            assert "torch.ops." not in path.read_text(), f"{path}: use attnzoo._compat"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def _matches_reference(q, k, v, path: str, g: torch.Generator, **kwargs) -> torch.Tensor:
    """``attnzoo.attend(q, k, v, **kwargs)`` runs on ``path`` and equals the reference backend's
    output and q, k, v gradients (float64 inputs); returns the output."""
    out = attnzoo.attend(q, k, v, **kwargs)
    assert attnzoo.last_choice().path == path
    want = attnzoo.attend(q, k, v, **kwargs, backend="reference")
    torch.testing.assert_close(out, want)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b)
    return out


def _random_graph(n: int, degree: int) -> P.Graph:
    """``degree`` random edges out of every node (repeats merge): degrees within a few of each other."""
    g = torch.Generator().manual_seed(n)
    return P.graph(
        torch.stack([torch.arange(n).repeat_interleave(degree), torch.randint(0, n, (n * degree,), generator=g)]), n
    )


@pytest.mark.parametrize("causal", [False, True])
def test_tiles_of_per_head_patterns_equal_the_reference_forward_and_gradients(causal):
    # Each head group's pieces gather and scatter the rows of its own heads only (B = 2, so a
    # batch row's heads are not the first H rows), with padding and a row count that does not
    # fill the last tile.
    pattern = P.per_head([P.local(3) | P.global_tokens([5]), P.random(4, seed=2) | P.global_tokens([0, 30])])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 37, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, -6:] = False
    _matches_reference(q, k, v, "tiles", g, pattern=pattern, causal=causal, key_mask=mask, block=8)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("other", [None, P.local(4)], ids=["alone", "and-local"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("slabs", [False, True], ids=["one-slab", "a-slab-per-row"])
def test_key_sets_path_equals_the_reference_forward_and_gradients(causal, other, padded, slabs, monkeypatch):
    # A 5 x 7 image in 2 x 3 query blocks with a margin of 1: blocks cut at the image's edges on
    # both sides; padded, batch row 1 keeps 5 real keys, so most of its groups see none of them.
    # With slabs, each (batch, head) row runs alone (key_sets.SLAB_BYTES): its batch row's padding.
    if slabs:
        monkeypatch.setattr(key_sets, "SLAB_BYTES", 1)
    pattern = P.block2d(5, 7, (2, 3), (1, 1)) if other is None else P.block2d(5, 7, (2, 3), (1, 1)) & other
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 35, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = None
    if padded:
        mask = torch.ones(2, 35, dtype=torch.bool)
        mask[1, 5:] = False
    out = _matches_reference(q, k, v, "key_sets", g, pattern=pattern, causal=causal, key_mask=mask)
    if padded:
        assert bool((out[1].abs().sum(-1) == 0).any())  # rows with no visible key give zeros


def test_key_sets_path_takes_grouped_query_kv_heads():
    # 6 query heads over 2 K/V heads: the call repeats K/V for this path; gradients sum back.
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 6, 35, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 35, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    _matches_reference(q, k, v, "key_sets", g, pattern=P.block2d(5, 7, (2, 3), (1, 1)), causal=True)


def test_key_sets_plan_is_cached_by_value_and_never_allocates_n_squared():
    key_sets.PLANS.clear()
    q, k, v = _qkv(n=48 * 48, grad=True)
    for _ in range(2):  # the pattern rebuilt per call: equal by value, one plan
        attnzoo.attend(q, k, v, pattern=P.block2d(48, 48, (8, 8), (2, 2)), causal=True)
    assert key_sets.PLANS.cache_info().hits >= 1 and key_sets.PLANS.cache_info().misses == 1
    run = lambda: attnzoo.attend(q, k, v, pattern=P.block2d(48, 48, (8, 8), (2, 2)), causal=True).sum().backward()  # noqa: E731
    # Each query's own 144 keys at most (B H N 144 = 2.7 M here), never a score per pair (B H N^2 = 42 M).
    assert largest_tensor(run) <= 2 * 4 * 2304 * 144 < 2 * 4 * 2304 * 2304


def test_a_graph_with_a_hub_runs_on_tiles_and_says_why():
    n = 64
    hub = torch.stack(
        [torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(n)]), torch.cat([torch.arange(n), torch.arange(n)])]
    )
    q, k, v = _qkv(n=n)
    attnzoo.attend(q, k, v, pattern=P.graph(hub, n))
    assert attnzoo.last_choice().path == "tiles"  # its row table would be n wide for about 2 edges a node
    reasons = gathered.not_gathered_reasons(Call(q, k, v, P.graph(hub, n), None, None, 1.0, 128))
    assert any("hub" in r for r in reasons), reasons
    big = 2048  # deciding so never builds the hub's n x n table
    hub_big = torch.stack([torch.zeros(big, dtype=torch.long), torch.arange(big)])
    assert largest_tensor(P.graph(hub_big, big).row_table, big, big) < big * big // 64
    attnzoo.attend(q, k, v, pattern=_random_graph(n, 4))
    assert attnzoo.last_choice().path == "gathered"


@pytest.mark.parametrize(
    "n_q, n_kv, causal, padded, pattern",
    [
        (37, 37, False, False, P.random(5, seed=1)),
        (37, 37, True, True, P.random(5, seed=1)),  # causal: early rows keep few keys (row 0 one at most)
        (20, 50, True, False, P.random(7, seed=2)),  # queries end-aligned to longer keys
        (50, 50, False, True, P.random(6) & P.sliding_window(8, 8)),  # another part filters the keys
        (37, 37, False, True, P.logsparse(4)),  # row-keyed too: distances 0, 1, 2, 4, 8
        (20, 50, True, False, P.logsparse(6)),
        (37, 37, False, True, _random_graph(37, 5)),  # a graph of even degrees is row-keyed too
        (37, 37, True, False, _random_graph(37, 5)),
    ],
)
def test_gathered_path_equals_the_reference_forward_and_gradients(n_q, n_kv, causal, padded, pattern):
    g = torch.Generator().manual_seed(n_q + n_kv)
    q = torch.randn(2, 3, n_q, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, n_kv, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, n_kv, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mask = None
    if padded:  # batch row 1 keeps 3 keys: most of its rows see none of their random keys
        mask = torch.ones(2, n_kv, dtype=torch.bool)
        mask[0, -10:], mask[1, 3:] = False, False
    out = _matches_reference(q, k, v, "gathered", g, pattern=pattern, causal=causal, key_mask=mask)
    if padded:
        assert bool((out[1].abs().sum(-1) == 0).any())  # rows with no visible key give zeros


@pytest.mark.parametrize("causal", [False, True])
def test_gathered_path_takes_grouped_kv_heads_as_they_are(causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 40, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 40, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 40, 5, dtype=torch.float64, generator=g, requires_grad=True)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 30:] = False
    out = attnzoo.attend(q, k, v, pattern=P.random(6, seed=2), causal=causal, key_mask=mask)
    assert attnzoo.last_choice().path == "gathered"
    want = attnzoo.attend(q, k, v, pattern=P.random(6, seed=2), causal=causal, key_mask=mask, backend="reference")
    torch.testing.assert_close(out, want)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("causal", [True, False], ids=["rows-keep-fewer", "every-slot-kept"])
def test_sparse_rows_are_the_kept_pairs_their_transpose_and_their_slots(causal):
    from attnzoo.backends.sparse_rows import csr, csr_index_dtype, slot_weights, sparse_rows_of_many

    # MKL's sparse kernels take int32 indices: int64 ones are converted on every product.
    assert csr_index_dtype(30, 30, 150) == torch.int32 and csr_index_dtype(30, 2**31, 150) == torch.int64

    pattern = P.random(5, seed=4) & P.causal() if causal else P.random(5, seed=4)
    table, valid = gathered._row_table(pattern, 30, 30)
    tables = torch.stack([table, table.flip(1)]), torch.stack([valid, valid.flip(1)])  # two slot orders
    for r, table, valid in zip(sparse_rows_of_many(*tables, 30), *tables):
        dense = torch.zeros(30, 30, dtype=torch.bool)
        dense[torch.arange(30)[:, None].expand_as(table)[valid], table[valid]] = True
        values = torch.arange(r.col.numel(), dtype=torch.float64) + 1
        as_rows = csr(r, values).to_dense()
        assert torch.equal(as_rows != 0, dense)  # exactly the kept pairs
        assert torch.equal(csr(r, values[r.perm], transposed=True).to_dense(), as_rows.t())
        assert r.full != causal  # causal: most rows keep fewer than 5
        assert {x.dtype for x in (r.crow, r.col, r.crow_t, r.col_t)} == {torch.int32}
        slots = slot_weights(r, values)  # each value back in its slot: at its key, zero where unused
        assert torch.equal(slots == 0, ~valid)
        assert torch.equal(as_rows.gather(1, table).masked_fill(~valid, 0), slots)


def test_key_order_is_a_stable_sort_of_each_row():
    from attnzoo.backends.sparse_rows import key_order

    gen = torch.Generator().manual_seed(0)
    # Ties everywhere: row order must stay. 36K entries take the flat sort, 12K the row-wise one.
    col = torch.randint(0, 7, (3, 12000), generator=gen)
    assert torch.equal(key_order(col, 7), torch.sort(col, dim=-1, stable=True).indices)
    assert torch.equal(key_order(col[:1], 7), torch.sort(col[:1], dim=-1, stable=True).indices)


def test_gathered_table_puts_each_rows_kept_keys_first_and_never_allocates_n_squared():
    table, valid = gathered._row_table(P.random(6, seed=3) & P.causal(), 40, 40)
    assert table.shape == valid.shape == (40, 6)
    assert bool((valid[:, :-1] >= valid[:, 1:]).all())  # kept keys first in every row
    full_table = P.random(6, seed=3).table(40, 40)
    for row in range(40):  # the same keys, reordered; kept exactly where causal allows
        assert sorted(table[row].tolist()) == sorted(full_table[row].tolist())
        assert valid[row].tolist() == [key <= row for key in table[row].tolist()]
    q, k, v = _qkv(n=2048, grad=True)
    run = lambda: attnzoo.attend(q, k, v, pattern=P.random(8), causal=True).sum().backward()  # noqa: E731
    biggest = largest_tensor(run)
    # Nothing bigger than the inputs (B H N D) or a weight per kept pair (B H N r); never a score
    # per pair (B H N^2 = 33.5 M here).
    assert biggest <= 2 * 4 * 2048 * 16 < 2 * 4 * 2048 * 2048, biggest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_the_blocked_backend_in_float32(dtype):
    # torch's CPU flash kernel runs bfloat16 several times slower than float32 on the backend's
    # short rows (with AMX tiles or without), and float16 not at all: the backend casts q, k, v up,
    # runs, and casts the output back, so its answer is the float32 run's, rounded once (the
    # bfloat16 kernel's own rounding differs), through the structured path for both.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 200, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    pattern = attnzoo.patterns.sliding_window(8, 8)
    out = attnzoo.attend(q, k, v, pattern=pattern, causal=True, backend="blocked")
    assert out.dtype == dtype and attnzoo.last_choice().path == "structured"
    want = attnzoo.attend(*(x.detach().float() for x in (q, k, v)), pattern=pattern, causal=True, backend="blocked")
    assert torch.equal(out, want.to(dtype))
    out.sum().backward()
    assert all(x.grad is not None and x.grad.dtype == dtype for x in (q, k, v))
