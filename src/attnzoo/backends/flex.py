"""The ``flex`` backend: ``torch.nn.attention.flex_attention``, compiled, with a ``BlockMask``
built directly from ``Pattern.blocks()`` (``create_block_mask`` would evaluate every pair).

The compiled function is created once per process; dynamo caches one graph per input shape,
so a second call with the same shapes does not recompile. The block structure (which tiles are
full, which partial) is cached by the pattern's value, the sizes and the masked key blocks
(``call.plan_key``); a key padding mask only enters through ``mask_mod``, so it is never part of
a cache key (keying on ``id(mask)`` would miss on every fresh mask and pin old masks alive).
On CPU, FlexAttention has no backward: inputs that require grad are refused.

Compilation never degrades silently. Dynamo compiles one variant per pattern ``mask_mod`` and
shape and, past its recompile limit (8 by default), would run FlexAttention eagerly: the
unfused path that materializes the N x N scores. Calls here allow ``RECOMPILE_LIMIT`` variants
per process and raise past it. A ``mask_mod`` that does not compile on a device raises
``BackendUnavailable``, and the pattern is refused on that device from then on, so
``backend="auto"`` runs the next backend and ``last_choice()`` says why. Two such failures seen
on an H100 (torch 2.11) are fixed at their source: masks that copied a lookup table to the GPU
inside the mask (``Pattern.mask_mod_for`` now takes the device), and tiles that the Triton
kernel's own tiles do not divide (``kernel_block``).

A band of stride ``m > 1`` (``strided``, ``dilated``, and-ed with ``causal()`` too) puts a pair in
every tile, so flex would evaluate its mask on all N^2 pairs (0.15x dense SDPA on an H100). Its
pairs join positions of one residue class mod ``m``, so ``run`` de-interleaves the sequence into
``m`` sub-sequences (a reshape, ``subsequence_stride``) and runs the band divided by ``m`` on
them: dense SDPA where that band is every pair (or the causal ones), flex otherwise. A bounded
band does so only when it spans several tiles (``SUBSEQUENCE_SPAN_TILES``). A ``per_head``
pattern with such a band in one of its head groups runs one call per group
(``head_group_calls``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.backends.call import (
    Backend,
    BackendUnavailable,
    Call,
    PlanCache,
    from_subsequences,
    masked_key_blocks,
    plan_key,
    subsequence_keys,
    to_subsequences,
)
from attnzoo.patterns.algebra import PerHead
from attnzoo.patterns.atomic import Band
from attnzoo.spec import ScoreMod

_COMPILED: dict[str, Callable[..., Tensor]] = {}
#: Per plan key and device: the ``BlockMask`` (calls without padding) or its four CSR tensors
#: (calls with padding: the ``BlockMask`` is rebuilt around the call's own mask).
MASKS: PlanCache[tuple, Any] = PlanCache(maxsize=32)
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Compiled variants of FlexAttention (patterns x shapes) one process may build before calls
#: raise instead of compiling more (dynamo's own limit, 8, would fall back to the unfused path).
RECOMPILE_LIMIT = 64
#: (pattern, device type) -> why its mask_mod does not compile there; refused from then on.
FAILED: dict[tuple[Any, str], str] = {}
#: The tile a CUDA ``BlockMask`` is built on unless the call's own block is a multiple of it.
CUDA_BLOCK = 128
#: A bounded band of stride m > 1 runs on its sub-sequences from this many tiles wide.
SUBSEQUENCE_SPAN_TILES = 4


def _flex_module() -> Any:
    try:
        from torch.nn.attention import flex_attention
    except ImportError:  # pragma: no cover - torch is pinned to a version that has it
        return None
    return flex_attention


def _compiled() -> Callable[..., Tensor]:
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(_flex_module().flex_attention, dynamic=False)
    return _COMPILED["flex"]


def kernel_block(block: int, device: torch.device) -> int:
    """The ``BlockMask`` tile for a call whose plan asks for ``block``. On CUDA the Triton kernel's
    own tiles (64 or 128 rows) must divide the mask's, so a block that 128 does not divide
    (``bigbird``'s tiles follow its 64-key blocks; sized configs use any width) becomes 128 there:
    the mask is the same, only coarser. On the CPU any block runs."""
    return block if device.type != "cuda" or block % CUDA_BLOCK == 0 else CUDA_BLOCK


def block_mask_for(call: Call) -> Any:
    """A ``BlockMask`` from ``Pattern.blocks()``: full tiles skip the mask, partial tiles run
    ``mask_mod``. Tiles of ``masked_key_blocks`` (padded keys, the ragged last block) count as
    partial."""
    call = replace(call, block=kernel_block(call.block, call.q.device))
    key = (*plan_key(call), str(call.q.device), call.key_mask is None)
    if call.key_mask is None:
        return MASKS.get(key, lambda: _block_mask(call, _kv_blocks(call)))
    return _block_mask(call, MASKS.get(key, lambda: _kv_blocks(call)))


def _kv_blocks(call: Call) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The partial and full tiles of each (head, query block), as ``BlockMask.from_kv_blocks``
    takes them."""
    n_q, n_kv, _ = call.sizes()
    tiles = call.pattern.blocks(n_q, n_kv, call.block)
    full = tiles.full & ~masked_key_blocks(n_kv, call.block, call.key_mask)[tiles.kb]
    groups, device = call.head_groups, call.q.device
    return (*_csr(tiles, ~full, groups, device), *_csr(tiles, full, groups, device))


def _block_mask(call: Call, kv_blocks: tuple[Tensor, Tensor, Tensor, Tensor]) -> Any:
    seq_lengths = (call.q.shape[2], call.k.shape[2])
    return _flex_module().BlockMask.from_kv_blocks(
        *kv_blocks, BLOCK_SIZE=call.block, mask_mod=_flex_mask_mod(call), seq_lengths=seq_lengths
    )


def _csr(tiles: Any, keep: Tensor, head_groups: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per (head, query block): the count of kept tiles and their key blocks, left-aligned."""
    n_qb, n_kb = tiles.n_q_blocks, tiles.n_kv_blocks
    row = tiles.group[keep] * n_qb + tiles.qb[keep]  # entries are sorted by (group, qb, kb)
    counts = torch.bincount(row, minlength=tiles.n_groups * n_qb)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(row.numel()) - starts[row]
    indices = torch.zeros(tiles.n_groups * n_qb, n_kb, dtype=torch.int32)
    indices[row, position] = tiles.kb[keep].int()
    num = counts.view(tiles.n_groups, n_qb)[head_groups].int()
    indices = indices.view(tiles.n_groups, n_qb, n_kb)[head_groups]
    return num[None].to(device), indices[None].to(device)


def _flex_mask_mod(call: Call) -> Callable[..., Tensor]:
    # FlexAttention passes raw query rows; attnzoo's mask_mods take end-aligned positions.
    mask_mod = call.mask_mod()
    offset, kpm = call.k.shape[2] - call.q.shape[2], call.key_mask
    if kpm is None:
        return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + offset, kv_idx)
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + offset, kv_idx) & kpm[b, kv_idx]


def subsequence_stride(call: Call) -> int:
    """``m`` when ``call``'s pattern is a band of stride ``m > 1`` on a self-attention call (every
    pair joins positions ``i m + r`` and ``j m + r``: one residue class) that spans at least
    ``SUBSEQUENCE_SPAN_TILES`` tiles, else 1. A narrower band touches about as many tiles either
    way, and the reshapes' copies cost more than they save: on an H100 (different calls, so
    indicative), ``dilated(32, 32, 2)`` ran at 1.36x dense SDPA forward at 4K on its sub-sequences
    against 2.07x as one band (``benchmarks/gpu/README.md``)."""
    pattern, n = call.pattern, call.q.shape[2]
    if not isinstance(pattern, Band) or pattern.modulus == 1 or n != call.k.shape[2] or n <= pattern.modulus:
        return 1
    bounded = pattern.lo is not None and pattern.hi is not None
    if bounded and pattern.hi - pattern.lo < SUBSEQUENCE_SPAN_TILES * kernel_block(call.block, call.q.device):
        return 1
    return pattern.modulus


def _subsequence_call(call: Call, m: int) -> Call:
    """``call`` on its ``m`` sub-sequences: the band ``[lo, hi]`` of stride m becomes ``[ceil(lo /
    m), floor(hi / m)]`` of stride 1, the padding rows are masked keys, and a score_mod sees the
    original batch row and positions."""
    pattern, b, n = call.pattern, call.q.shape[0], call.q.shape[2]
    lo = None if pattern.lo is None else -(-pattern.lo // m)
    hi = None if pattern.hi is None else pattern.hi // m
    key_mask = call.key_mask
    if key_mask is not None or (hi is None or hi > 0):  # causal rows never see the padding
        key_mask = subsequence_keys(key_mask, b, n, m, call.q.device)
    score_mod, user = None, call.score_mod
    if user is not None:

        def score_mod(score: Tensor, bm: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            r = bm % m
            return user(score, bm // m, h, q_idx * m + r, kv_idx * m + r)

    q, k, v = (to_subsequences(x, m) for x in (call.q, call.k, call.v))
    return replace(call, q=q, k=k, v=v, pattern=Band(lo, hi, 1), key_mask=key_mask, score_mod=score_mod)


def head_group_calls(call: Call) -> list[Call] | None:
    """One call per head group of a ``per_head`` pattern (its groups are runs of consecutive
    heads) when some group's band runs on sub-sequences (``sparse_transformer_strided``'s strided
    heads), else None: flex's per-head ``BlockMask`` would evaluate such a group on every tile.
    Grouped-query K/V split with their query heads (a group must hold whole K/V heads)."""
    pattern, heads = call.pattern, call.q.shape[1]
    if not isinstance(pattern, PerHead):
        return None
    size, per_kv = heads // pattern.n_groups, heads // call.k.shape[1]
    if size % per_kv:
        return None
    calls = []
    for i, part in enumerate(pattern.patterns):
        rows, kv = slice(i * size, (i + 1) * size), slice(i * size // per_kv, (i + 1) * size // per_kv)
        score_mod = None if call.score_mod is None else _heads_from(call.score_mod, i * size)
        q, k, v = call.q[:, rows], call.k[:, kv], call.v[:, kv]
        calls.append(replace(call, q=q, k=k, v=v, pattern=part, score_mod=score_mod))
    return calls if any(subsequence_stride(c) > 1 for c in calls) else None


def _heads_from(user: ScoreMod, first: int) -> ScoreMod:
    """``user`` (a score_mod) for a call on the heads from ``first`` on: it sees the original head."""

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return user(score, b, h + first, q_idx, kv_idx)

    return score_mod


def _dense(call: Call) -> Tensor | None:
    """SDPA for a call whose band is every pair or the causal ones, with no mask or score_mod;
    None for any other call."""
    pattern = call.pattern
    if call.key_mask is not None or call.score_mod is not None or pattern.lo is not None or pattern.hi not in (None, 0):
        return None
    gqa = call.k.shape[1] != call.q.shape[1]
    return F.scaled_dot_product_attention(
        call.q, call.k, call.v, is_causal=pattern.hi == 0, scale=call.scale, enable_gqa=gqa
    )


class Flex(Backend):
    """The GPU backend (and a CPU inference one, after ~20 s of compilation per shape)."""

    NAME = "flex"

    def not_supported_reasons(self, call: Call) -> list[str]:
        reasons = []
        if _flex_module() is None:
            return ["torch.nn.attention.flex_attention is not available in this torch"]
        q = call.q
        if q.device.type == "cpu":
            if any(t.requires_grad for t in (call.q, call.k, call.v)):
                reasons.append(
                    "FlexAttention has no backward on CPU and refuses inputs that require grad; "
                    "use backend='blocked' to train, or pass detached tensors"
                )
            if q.dtype not in CPU_DTYPES:
                reasons.append(f"flex on CPU supports {', '.join(map(str, CPU_DTYPES))}, got {q.dtype}")
        elif q.device.type != "cuda":
            reasons.append(f"flex runs on CPU or CUDA, got {q.device.type}")
        if (call.pattern, q.device.type) in FAILED:
            reasons.append(FAILED[call.pattern, q.device.type])
        if call.dropout is not None:
            reasons.append("flex cannot apply attnzoo's seeded attention dropout; use backend='blocked' (CPU)")
        for name, dim in (("D", q.shape[-1]), ("D_v", call.v.shape[-1])):
            if dim < 16 or dim & (dim - 1):
                reasons.append(f"flex needs a power-of-two head dimension >= 16, got {name}={dim}")
        return reasons

    def path(self, call: Call) -> str | None:
        if subsequence_stride(call) > 1:
            return "subsequences"
        return "head groups (subsequences)" if head_group_calls(call) is not None else None

    def run(self, call: Call) -> Tensor:
        groups = head_group_calls(call)
        if groups is not None:
            return torch.cat([self.run(group) for group in groups], dim=1)
        m = subsequence_stride(call)
        if m > 1:
            sub = _subsequence_call(call, m)
            out = _dense(sub)
            out = self.run(sub) if out is None else out
            return from_subsequences(out, m, call.q.shape[2])
        block_mask = block_mask_for(call)
        score_mod = None
        if call.score_mod is not None:
            offset, user = call.k.shape[2] - call.q.shape[2], call.score_mod

            def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return user(score, b, h, q_idx + offset, kv_idx)

        # Grouped-query K/V (H_kv heads dividing H) as they are: FlexAttention indexes K/V head
        # h // G for query head h (the block mask, mask_mod and score_mod see query heads).
        gqa = call.k.shape[1] != call.q.shape[1]
        limits = {"recompile_limit": RECOMPILE_LIMIT, "fail_on_recompile_limit_hit": True}
        try:
            with torch._dynamo.config.patch(limits):
                return _compiled()(
                    call.q, call.k, call.v, score_mod=score_mod, block_mask=block_mask, scale=call.scale, enable_gqa=gqa
                )
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise RuntimeError(
                f"flex: this process has compiled {RECOMPILE_LIMIT} variants of FlexAttention (one per pattern "
                "and shape); raise attnzoo.backends.flex.RECOMPILE_LIMIT, call torch._dynamo.reset(), or use "
                "backend='blocked' (past the limit torch would run the unfused, N x N path)"
            ) from None
        except torch._dynamo.exc.BackendCompilerFailed as error:
            first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            FAILED[call.pattern, call.q.device.type] = (
                f"flex could not compile this pattern's mask_mod on {call.q.device.type} ({first}); "
                "use backend='blocked' or 'reference'"
            )
            raise BackendUnavailable(FAILED[call.pattern, call.q.device.type]) from error

    def grouped_kv(self, call: Call) -> bool:
        return True
