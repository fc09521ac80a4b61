"""Every pattern equals its independent double-loop oracle, and its blocks() are exact."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import oracles as O
from attnzoo import describe
from attnzoo import patterns as P
from attnzoo.patterns.algebra import Pattern

SIZES = [(1, 1), (5, 5), (64, 64), (100, 100), (257, 257), (5, 64), (64, 100)]
SQUARE = [s for s in SIZES if s[0] == s[1]]

# name -> (pattern factory, oracle(n_q, n_kv), sizes, blocks flag full tiles exactly)
CASES = {
    "full": (P.full, O.full_oracle, SIZES, True),
    "causal": (P.causal, O.causal_oracle, SIZES, True),
    "sliding_window(3,1)": (
        lambda: P.sliding_window(3, 1),
        lambda a, b: O.sliding_window_oracle(a, b, 3, 1),
        SIZES,
        True,
    ),
    "sliding_window(0,0)": (
        lambda: P.sliding_window(0, 0),
        lambda a, b: O.sliding_window_oracle(a, b, 0, 0),
        SIZES,
        True,
    ),
    "local(17)": (lambda: P.local(17), lambda a, b: O.sliding_window_oracle(a, b, 17, 17), SIZES, True),
    "dilated(2,3,4)": (lambda: P.dilated(2, 3, 4), lambda a, b: O.dilated_oracle(a, b, 2, 3, 4), SIZES, True),
    "strided(7)": (lambda: P.strided(7), lambda a, b: O.strided_oracle(a, b, 7), SIZES, True),
    "global_tokens": (
        lambda: P.global_tokens([0, 3, 60, 99]),
        lambda a, b: O.global_tokens_oracle(a, b, [0, 3, 60, 99]),
        SIZES,
        True,
    ),
    "block_local(6)": (lambda: P.block_local(6), lambda a, b: O.block_local_oracle(a, b, 6), SIZES, True),
    "random(3)": (
        lambda: P.random(3, seed=5),
        lambda a, b: O.random_oracle(a, b, P.random(3, seed=5).table(a, b)),
        SIZES,
        True,
    ),
    "random_blocks(2,8)": (
        lambda: P.random_blocks(2, 8, seed=1),
        lambda a, b: O.random_blocks_oracle(a, b, 8, P.random_blocks(2, 8, seed=1).table(b)),
        SIZES,
        True,
    ),
    "longformer": (lambda: P.longformer(4, [0, 9]), lambda a, b: O.longformer_oracle(a, b, 4, [0, 9]), SIZES, False),
    "longformer dilated": (
        lambda: P.longformer(3, [1], dilation=2),
        lambda a, b: O.longformer_oracle(a, b, 3, [1], 2),
        SIZES,
        False,
    ),
    "bigbird": (
        lambda: P.bigbird(8, 3, 2, 2, seed=3),
        lambda a, b: O.bigbird_oracle(a, b, 8, 3, 2, P.random_blocks(2, 8, seed=3).table(b)),
        SIZES,
        False,
    ),
    "star": (P.star, lambda a, b: O.star_oracle(a, b, 0), SIZES, False),
    "etc": (lambda: P.etc(3, 2), lambda a, b: O.etc_oracle(a, b, 3, 2), SIZES, False),
    "sinks": (lambda: P.sinks(3, 4, 1), lambda a, b: O.sinks_oracle(a, b, 3, 4, 1), SIZES, True),
    "causal sinks": (
        lambda: P.sinks(2, 5, 5) & P.causal(),
        lambda a, b: O.sinks_oracle(a, b, 2, 5, 0) & O.causal_oracle(a, b),
        SIZES,
        True,
    ),
    "logsparse": (lambda: P.logsparse(3), lambda a, b: O.logsparse_oracle(a, b, 3), SIZES, True),
    "causal logsparse": (
        lambda: P.logsparse(6) & P.causal(),
        lambda a, b: O.logsparse_oracle(a, b, 6) & O.causal_oracle(a, b),
        SIZES,
        True,
    ),
    "causal local": (lambda: P.local(5) & P.causal(), lambda a, b: O.sliding_window_oracle(a, b, 5, 0), SIZES, True),
}


def check_blocks(pattern: Pattern, n_q: int, n_kv: int, block: int, dense: torch.Tensor, exact_full: bool) -> None:
    """Listed tiles are exactly the tiles holding a pair; full flags never lie (and, for
    patterns that promise it, every complete tile is flagged full)."""
    tiles = pattern.blocks(n_q, n_kv, block)
    dense = dense.reshape(-1, n_q, n_kv)
    groups, n_qb, n_kb = dense.shape[0], -(-n_q // block), -(-n_kv // block)
    padded = torch.zeros(groups, n_qb * block, n_kb * block, dtype=torch.bool)
    padded[:, :n_q, :n_kv] = dense
    outside = torch.ones_like(padded)
    outside[:, :n_q, :n_kv] = False
    any_pair = padded.view(groups, n_qb, block, n_kb, block).any(4).any(2)
    complete = (padded | outside).view(groups, n_qb, block, n_kb, block).all(4).all(2)
    grid = tiles.to_dense()
    assert grid.shape == (groups, n_qb, n_kb)
    assert torch.equal(grid > 0, any_pair), f"{pattern}: listed tiles != tiles with pairs (block {block})"
    assert not ((grid == 2) & ~complete).any(), f"{pattern}: a tile flagged full is missing pairs (block {block})"
    if exact_full:
        assert torch.equal(grid == 2, complete & any_pair), f"{pattern}: a complete tile is not flagged full"


@pytest.mark.parametrize("name", CASES)
def test_pattern_equals_oracle_and_blocks_are_exact(name):
    factory, oracle, sizes, exact_full = CASES[name]
    pattern = factory()
    for n_q, n_kv in sizes:
        dense = pattern.dense(n_q, n_kv)
        assert torch.equal(dense, oracle(n_q, n_kv)), f"{name} at {(n_q, n_kv)}"
        for block in (3, 16, 64):
            check_blocks(pattern, n_q, n_kv, block, dense, exact_full)


GRID_CASES = {
    "block2d": (lambda: P.block2d(6, 10, (2, 4), (1, 2)), lambda: O.block2d_oracle(6, 10, (2, 4), (1, 2)), 60),
    "block2d no margin": (
        lambda: P.block2d(16, 16, (4, 4), (0, 0)),
        lambda: O.block2d_oracle(16, 16, (4, 4), (0, 0)),
        256,
    ),
    "axial": (lambda: P.axial(7, 9), lambda: O.axial_oracle(7, 9), 63),
    "graph ring with chords": (
        lambda: P.graph(ring_with_chords(100), 100),
        lambda: O.graph_oracle(100, ring_with_chords(100)),
        100,
    ),
    "graph no self loops": (
        lambda: P.graph(ring_with_chords(37), 37, self_loops=False),
        lambda: O.graph_oracle(37, ring_with_chords(37), self_loops=False),
        37,
    ),
}


def ring_with_chords(n: int) -> torch.Tensor:
    i = torch.arange(n)
    src = torch.cat([i, i, i])
    dst = torch.cat([(i + 1) % n, (i - 1) % n, (i * 7 + 3) % n])
    return torch.stack([src, dst])


@pytest.mark.parametrize("name", GRID_CASES)
def test_grid_and_graph_patterns(name):
    factory, oracle, n = GRID_CASES[name]
    pattern = factory()
    dense = pattern.dense(n)
    assert torch.equal(dense, oracle())
    for block in (3, 16, 64):
        check_blocks(pattern, n, n, block, dense, exact_full=name.startswith("graph"))
    if isinstance(pattern, P.GroupKeyed):  # every query in one group; a group's rows see its keys
        sets = pattern.key_sets(n, n)
        assert sorted(sets.rows[sets.rows_valid].tolist()) == list(range(n))
        pairs = sets.rows_valid[:, :, None] & sets.keys_valid[:, None, :]
        rows = sets.rows[:, :, None].expand(pairs.shape)[pairs]
        keys = sets.keys[:, None, :].expand(pairs.shape)[pairs]
        assert torch.equal(torch.zeros(n, n, dtype=torch.bool).index_put_((rows, keys), torch.tensor(True)), oracle())
    if isinstance(pattern, P.RowKeyed):  # each row's listed keys, where valid, are its keys
        keys, valid = pattern.row_table(n, n)
        rows = torch.arange(n)[:, None].expand_as(keys)
        listed = torch.zeros(n, n, dtype=torch.bool).index_put_((rows[valid], keys[valid]), torch.tensor(True))
        assert torch.equal(listed, oracle()) and int(valid.sum()) == int(oracle().sum())  # no key listed twice
    with pytest.raises(ValueError, match="exactly"):
        pattern.dense(n + 1)


class _Devices(TorchDispatchMode):
    """Records the device of every tensor an op reads or writes."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for x in torch.utils._pytree.tree_leaves((args, kwargs, out)):
            if isinstance(x, torch.Tensor):
                self.seen.add(x.device.type)
        return out


@pytest.mark.parametrize(
    "pattern",
    [*(CASES[name][0]() for name in CASES), *(GRID_CASES[name][0]() for name in GRID_CASES)]
    + [P.sparse_transformer_fixed(8, 2).resolve_heads(4), P.per_head([P.local(1), P.strided(3)]).resolve_heads(2)],
    ids=[*CASES, *GRID_CASES, "sparse_transformer_fixed", "per_head"],
)
def test_mask_mods_keep_their_tables_on_the_given_device(pattern):
    # A compiled FlexAttention mask may not copy between devices (inductor refuses buffers in the
    # mask's pointwise code on CUDA): every lookup table must already sit where the indices are.
    # The meta device stands in for a GPU; an op that touches a CPU tensor shows up here.
    n = {GRID_CASES[k][0]().name: GRID_CASES[k][2] for k in GRID_CASES}.get(pattern.name, 100)
    mask_mod = pattern.mask_mod_for(n, n, "meta")
    index = {"device": "meta", "dtype": torch.long}
    with _Devices() as mode:
        got = mask_mod(
            torch.zeros((), **index),
            torch.arange(getattr(pattern, "heads", None) or 1, **index).view(-1, 1, 1),
            torch.arange(n, **index).view(1, -1, 1),
            torch.arange(n, **index).view(1, 1, -1),
        )
    assert got.dtype == torch.bool and got.shape[-2:] == (n, n)
    assert mode.seen == {"meta"}


@pytest.mark.parametrize("n", [1, 5, 64, 100, 257])
def test_sparse_transformer_heads(n):
    for heads in (2, 4):
        strided = P.sparse_transformer_strided(8).resolve_heads(heads)
        fixed = P.sparse_transformer_fixed(8, 2).resolve_heads(heads)
        for pattern, want in (
            (strided, O.sparse_transformer_strided_oracle(n, 8, heads)),
            (fixed, O.sparse_transformer_fixed_oracle(n, 8, 2, heads)),
        ):
            h = torch.arange(heads).view(-1, 1, 1)
            got = pattern.mask_mod_for(n, n)(
                torch.zeros(()), h, torch.arange(n).view(1, -1, 1), torch.arange(n).view(1, 1, -1)
            )
            assert torch.equal(got, want)
            groups = pattern.dense(n)
            for block in (3, 16):
                check_blocks(pattern, n, n, block, groups, exact_full=True)


def test_per_head_groups_and_errors():
    a, b = P.local(1), P.strided(3)
    pattern = P.per_head([a, b]).resolve_heads(4)
    assert pattern.head_groups().tolist() == [0, 0, 1, 1]
    want = O.per_head_oracle([a.dense(9), b.dense(9)], 4)
    h = torch.arange(4).view(-1, 1, 1)
    got = pattern.mask_mod_for(9, 9)(torch.zeros(()), h, torch.arange(9).view(1, -1, 1), torch.arange(9).view(1, 1, -1))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="multiple of 2"):
        P.per_head([a, b]).resolve_heads(3)
    with pytest.raises(ValueError, match="resolve_heads"):
        P.per_head([a, b]).head_groups()
    combined = P.per_head([a, b]) & P.causal()
    assert torch.equal(combined.dense(9), torch.stack([(a & P.causal()).dense(9), (b & P.causal()).dense(9)]))


@pytest.mark.parametrize("name", [n for n in CASES if n != "full"])
def test_algebra_laws(name):
    pattern = CASES[name][0]()
    n = 40
    assert torch.equal((pattern | P.full()).dense(n), torch.ones(n, n, dtype=torch.bool))
    assert torch.equal((pattern & P.full()).dense(n), pattern.dense(n))
    assert torch.equal((pattern & P.causal()).dense(n), pattern.dense(n) & O.causal_oracle(n, n))
    assert torch.equal((pattern | P.causal()).dense(n), pattern.dense(n) | O.causal_oracle(n, n))
    full_tiles = (pattern | P.full()).blocks(n, n, 8)
    assert bool(full_tiles.full.all()) and len(full_tiles) == 25
    check_blocks(pattern & P.causal(), n, n, 8, pattern.dense(n) & O.causal_oracle(n, n), exact_full=CASES[name][3])


def test_random_tables_are_deterministic_distinct_and_in_range():
    pattern = P.random(5, seed=11)
    table = pattern.table(300, 200)
    assert table.shape == (300, 5) and int(table.min()) >= 0 and int(table.max()) < 200
    assert all(len(set(row)) == 5 for row in table.tolist())
    assert torch.equal(table, P.random(5, seed=11).table(300, 200))
    assert not torch.equal(table, P.random(5, seed=12).table(300, 200))
    assert P.random(9).table(4, 3).shape == (4, 3)  # r > N_kv: every key once
    blocks_table = P.random_blocks(3, 4, seed=2).table(64)
    assert blocks_table.shape == (16, 3) and all(len(set(r)) == 3 for r in blocks_table.tolist())


def test_blocks_never_evaluate_all_pairs(monkeypatch):
    # At N = 2**20 an N x N evaluation would need a terabyte; structural blocks() lists O(N) tiles.
    n = 2**20
    tiles = P.local(256).blocks(n, n, 128)
    assert len(tiles) == 5 * (n // 128) - 6  # two fewer tiles at each of the first/last two rows
    evaluated = []
    original = Pattern.mask_mod_for
    monkeypatch.setattr(P.Band, "mask_mod_for", lambda self, *a: evaluated.append(self) or original(self, *a))
    big = P.bigbird(64).blocks(2**18, 2**18, 64)
    assert len(big) < 2**18 // 64 * 12 + 2 * 2 * 2**18 // 64
    assert not evaluated


def test_names_and_argument_errors():
    assert repr(P.local(3) | P.global_tokens([0])) == "local(3) | global_tokens([0])"
    assert repr(P.sliding_window(2, 0) & P.causal()) == "sliding_window(2, 0) & causal"
    with pytest.raises(ValueError, match="dilation"):
        P.dilated(1, 1, 0)
    with pytest.raises(ValueError, match="non-negative"):
        P.global_tokens([-1])
    with pytest.raises(ValueError, match="edge_index"):
        P.graph(torch.zeros(3, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="sequence length"):
        P.random(2).mask_mod(torch.zeros(()), torch.zeros(()), torch.zeros(()), torch.zeros(()))
    with pytest.raises(TypeError, match="patterns combine"):
        P.local(1) | 3


def test_resolved_per_head_patterns_evaluate_each_group_with_its_own_heads():
    pattern = P.sparse_transformer_strided(4)
    resolved = pattern.resolve_heads(6)
    assert resolved.group_heads().tolist() == [0, 3]
    assert resolved.density(40, 8) == pytest.approx(pattern.dense(40).float().mean().item())
    check_blocks(resolved & P.local(6), 40, 40, 8, (pattern & P.local(6)).dense(40), exact_full=True)


def test_star_pattern_is_a_band_without_wrap_and_says_so():
    n = 8  # relay 0, satellites 1..7
    dense = P.star(0).dense(n)
    assert not dense[1, n - 1] and not dense[n - 1, 1] and dense[1, 2] and dense[n - 1, 0]
    spec = describe("star")
    assert "no wrap" in spec.summary and any("not linked" in note for note in spec.notes)


def test_patterns_are_immutable_values():
    # Plans are cached by pattern value: equal patterns built apart must hash alike.
    a, b = P.local(4) & P.causal(), P.local(4) & P.causal()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError, match="immutable"):
        a.lo = 3
    assert P.bigbird(16, 3, 2, 1, seed=3) == P.bigbird(16, 3, 2, 1, seed=3)
    assert P.bigbird(16, 3, 2, 1, seed=3) != P.bigbird(16, 3, 2, 1, seed=4)
    assert P.local(4) != P.local(5) and P.local(4) != P.sliding_window(4, 3)
    assert P.per_head([P.local(2), P.strided(3)]) == P.per_head([P.local(2), P.strided(3)])
    assert P.global_tokens([0, 3]) == P.global_tokens([3, 0])
    assert P.random(4, seed=1) != P.random(4, seed=2)


@pytest.mark.parametrize(
    "pattern",
    [
        P.sliding_window(3, 0),
        P.local(8) & P.causal(),
        P.local(2) | P.global_tokens([0, 5]),
        P.random(4, seed=3) & P.causal(),
        P.longformer(32, [0], dilation=(1, 2)),
        P.per_head([P.sliding_window(7, 0), P.strided(8) & P.causal()]),
    ],
    ids=repr,
)
def test_parse_reads_back_what_a_pattern_prints(pattern):
    assert P.parse(repr(pattern)) == pattern


def test_parse_builds_calls_and_refuses_everything_else():
    assert P.parse("axial(4, 4)") == P.axial(4, 4)  # display forms such as axial(4x4) do not read back
    assert P.parse("full") == P.full()
    for text, error, match in [
        ("__import__('os')", ValueError, "unknown builder '__import__'"),
        ("os.system(1)", ValueError, "cannot read 'os.system"),
        ("local(8) + causal", ValueError, "joined by | and &"),
        ("3", ValueError, "not a pattern"),
        ("local(", ValueError, "not an expression"),
        ("local", TypeError, "missing 1 required positional argument"),
    ]:
        with pytest.raises(error, match=match):
            P.parse(text)
