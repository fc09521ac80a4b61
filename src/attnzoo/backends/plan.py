"""Plans of the ``blocked`` backend — which tiles to compute and how — and the caches that
make a repeated call skip ``Pattern.blocks()``.

Two kinds of plan: the *structured* plan (``structured.structure``: windows and sub-sequences,
run by ``windowed.py``) for patterns with window structure, else the generic *tile plan*
(``make_plan``: pieces of tiles, run by ``blocked.py``). Both are cached by the pattern's
*value* and the sizes, so ``local(64) & causal()`` rebuilt on every call reuses its plan;
``PLANS.cache_info()`` and ``STRUCTURES.cache_info()`` count hits and misses.

Under ``torch.compile`` the lookups (``_structure``, ``_plan``) are ``assume_constant_result``
functions of Python values: dynamo calls them once per compilation and bakes the plan into the
graph, so no plan building (host reads, data-dependent shapes) is ever traced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnzoo.backends import structured
from attnzoo.backends.call import Call, PlanCache, head_groups, masked_key_blocks
from attnzoo.patterns.algebra import BlockList, Pattern, TileGrid, evaluate_tiles
from attnzoo.score_mods import plain_bias

#: How each tile is computed: no mask, causal, causal on reversed rows, or an explicit mask.
KINDS = ("full", "tril", "triu", "mask")
#: Pairs of partial tiles ``make_plan`` may evaluate once to find the triangular ones.
CLASSIFY_BUDGET = 1 << 26


@dataclass(frozen=True)
class Piece:
    heads: Tensor  # (Hg,) the heads this piece serves
    qb: Tensor  # (Q',) query blocks
    kb: Tensor  # (Q', c) key blocks of each query block
    kind: str  # one of KINDS (triangular kinds have c == 1)


@dataclass(frozen=True)
class Plan(TileGrid):
    n_q: int
    n_kv: int
    block: int
    heads: int
    pieces: tuple[Piece, ...]


def make_plan(
    tiles: BlockList,
    head_groups: Tensor,
    *,
    pattern: Pattern | None = None,
    masked_blocks: Tensor | None = None,
    max_kv_blocks: int = 32,
) -> Plan:
    """Group tiles into pieces. ``head_groups (H,)`` maps heads to tile groups; ``masked_blocks``
    (bool per key block, ``call.masked_key_blocks``; default: the ragged last block only) forces
    tiles of those key blocks to use an explicit mask. Given the ``pattern``, partial tiles are
    classified once (within ``CLASSIFY_BUDGET``) so triangles run without a mask."""
    forced = masked_key_blocks(tiles.n_kv, tiles.block) if masked_blocks is None else masked_blocks
    kinds = tile_kinds(tiles, forced, pattern)
    pieces = []
    for group in range(tiles.n_groups):
        heads = (head_groups == group).nonzero().flatten()
        if heads.numel() == 0:
            continue
        for index, kind in enumerate(KINDS):
            keep = (tiles.group == group) & (kinds == index)
            width = max_kv_blocks if kind in ("full", "mask") else 1
            pieces += _pieces_of(heads, tiles.qb[keep], tiles.kb[keep], kind, tiles.n_q_blocks, width)
    return Plan(tiles.n_q, tiles.n_kv, tiles.block, int(head_groups.numel()), tuple(pieces))


def tile_kinds(tiles: BlockList, forced: Tensor, pattern: Pattern | None) -> Tensor:
    """Index into ``KINDS`` per tile. Partial tiles are evaluated (once per plan, partial tiles
    only) to find exact lower/upper triangles; above ``CLASSIFY_BUDGET`` they keep a mask."""
    masked = ~tiles.full | forced[tiles.kb]
    kinds = torch.where(masked, KINDS.index("mask"), KINDS.index("full"))
    candidates = (~tiles.full & ~forced[tiles.kb]).nonzero().flatten()
    if pattern is None or candidates.numel() * tiles.block**2 > CLASSIFY_BUDGET:
        return kinds
    lower = torch.ones(tiles.block, tiles.block, dtype=torch.bool).tril()
    for chunk in candidates.split(1024):
        masks = evaluate_tiles(pattern, tiles.select(chunk))
        kinds[chunk[(masks == lower).flatten(1).all(1)]] = KINDS.index("tril")
        kinds[chunk[(masks == lower.T).flatten(1).all(1)]] = KINDS.index("triu")
    return kinds


def _pieces_of(heads: Tensor, qb: Tensor, kb: Tensor, kind: str, n_qb: int, max_kv: int) -> list[Piece]:
    # Entries arrive sorted by (qb, kb). Query blocks with the same count form one piece.
    counts = torch.bincount(qb, minlength=n_qb)
    pieces = []
    for c in torch.unique(counts[counts > 0]).tolist():
        rows = (counts == c).nonzero().flatten()
        cols = kb[(counts[qb] == c)].view(rows.numel(), c)
        for start in range(0, c, max_kv):
            pieces.append(Piece(heads, rows, cols[:, start : start + max_kv], kind))
    return pieces


#: dtypes PyTorch's CPU flash kernel runs (the structured path needs it).
FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
PLANS: PlanCache[tuple, Plan] = PlanCache(maxsize=64)
STRUCTURES: PlanCache[tuple, structured.Structure | None] = PlanCache(maxsize=64)


def structure_for(call: Call) -> structured.Structure | None:
    """The structured plan for this call (cached by the pattern's value and the sizes), or None
    where the call needs the generic tile plan: a pattern without window structure, a
    ``score_mod`` other than an additive bias on window parts (``_takes_bias``), attention
    dropout (the flash kernel cannot take its seeded mask), value and key head sizes that differ,
    or a dtype the CPU flash kernel does not run (cross-attention of unequal lengths:
    ``structure`` returns None)."""
    q, v = call.q, call.v
    if q.shape[-1] != v.shape[-1] or q.dtype not in FLASH_DTYPES or call.dropout is not None:
        return None
    if call.score_mod is not None and plain_bias(call.score_mod, q.device) is None:
        return None
    # A forward that no backward will follow runs on the blocks that suit the forward.
    train = torch.is_grad_enabled() and any(x.requires_grad for x in (q, call.k, v))
    plan = _structure(call.pattern, *call.sizes(), train)
    if call.score_mod is not None and not _takes_bias(plan, q.shape[1] == call.k.shape[1]):
        return None
    return plan


def _takes_bias(plan: structured.Structure | None, one_kv_head_each: bool) -> bool:
    """Whether the structured path adds an additive bias to ``plan``: parts (one per head group,
    ``windowed._group_opts``) of windows (``local``, ``sliding_window``, ``block_local``,
    ``dilated`` on its sub-sequences: ``window_parts._with_bias``) or of such windows (or none)
    united with global tokens (``longformer``, ``etc``, ``sinks``, ``star``, ``global``,
    ``sparse_transformer_fixed``: ``windowed._bias_at`` on the columns and rows), with a K/V head
    per query head, and of dense sub-sequences (``strided``, ``sparse_transformer_strided``'s strided
    heads: ``window_parts._dense_with_bias``), and merged parts of those (``axial``'s row windows
    and column sub-sequences: each part's mask holds the bias); plans with a dense stride-1 part
    take the tile path with it."""
    return plan is not None and one_kv_head_each and all(_part_takes_bias(part) for _, part in plan.parts)


def _part_takes_bias(part: structured.Windows | structured.WithGlobals | structured.Merged) -> bool:
    if isinstance(part, structured.Merged):
        return all(_part_takes_bias(w) for w in part.parts)
    windows = part.windows if isinstance(part, structured.WithGlobals) else part
    if windows is None:
        return isinstance(part, structured.WithGlobals)
    # dense parts on sub-sequences only: a dense stride-1 part's bias would be N x N
    return isinstance(windows, structured.Windows) and (windows.width > 0 or windows.stride > 1)


@torch.compiler.assume_constant_result
def _structure(pattern: Pattern, n_q: int, n_kv: int, heads: int, train: bool) -> structured.Structure | None:
    # A constant under torch.compile: dynamo calls it once while tracing and bakes the plan in
    # (its tensors become constants of the graph), so plan building never enters the graph.
    key = (pattern, n_q, n_kv, heads, train)
    return STRUCTURES.get(key, lambda: structured.structure(pattern, n_q, n_kv, heads, train=train))


def plan_for(call: Call) -> Plan:
    """The tile plan for this call, cached by the pattern's value, the sizes, the block and the
    masked key blocks (``masked_key_blocks``) so repeated calls skip ``blocks()``. Under
    ``torch.compile`` the padded key blocks are data a graph cannot read: with a ``key_mask``,
    every key block runs under an explicit mask (exact, slower)."""
    n_q, n_kv, heads = call.sizes()
    if torch.compiler.is_compiling():
        n_kb = -(-n_kv // call.block)
        masked = None if call.key_mask is None else (True,) * n_kb
    else:
        masked = tuple(masked_key_blocks(n_kv, call.block, call.key_mask).tolist())
    return _plan(call.pattern, n_q, n_kv, heads, call.block, masked)


@torch.compiler.assume_constant_result
def _plan(pattern: Pattern, n_q: int, n_kv: int, heads: int, block: int, masked: tuple[bool, ...] | None) -> Plan:
    # A constant under torch.compile, like ``_structure``. ``masked`` None: the ragged block only.
    def build() -> Plan:
        forced = masked_key_blocks(n_kv, block) if masked is None else torch.tensor(masked)
        tiles = pattern.blocks(n_q, n_kv, block)
        return make_plan(tiles, head_groups(pattern, heads), pattern=pattern, masked_blocks=forced)

    key = (pattern, n_q, n_kv, heads, block, masked or tuple(masked_key_blocks(n_kv, block).tolist()))
    return PLANS.get(key, build)
