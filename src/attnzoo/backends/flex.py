"""The ``flex`` backend: ``torch.nn.attention.flex_attention``, compiled, with a ``BlockMask``
built directly from ``Pattern.blocks()`` (``create_block_mask`` would evaluate every pair).

The compiled function is created once per process; dynamo caches one graph per input shape,
so a second call with the same shapes does not recompile. Block masks are cached per pattern
and size. On CPU, FlexAttention has no backward: inputs that require grad are refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from attnzoo.backends.dispatch import Call

_COMPILED: dict[str, Callable[..., Tensor]] = {}
_MASKS: OrderedDict[tuple, Any] = OrderedDict()
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _flex_module() -> Any:
    try:
        from torch.nn.attention import flex_attention
    except ImportError:  # pragma: no cover - torch is pinned to a version that has it
        return None
    return flex_attention


def not_supported_reasons(call: Call) -> list[str]:
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
    for name, dim in (("D", q.shape[-1]), ("D_v", call.v.shape[-1])):
        if dim < 16 or dim & (dim - 1):
            reasons.append(f"flex needs a power-of-two head dimension >= 16, got {name}={dim}")
    return reasons


def _compiled() -> Callable[..., Tensor]:
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(_flex_module().flex_attention, dynamic=False)
    return _COMPILED["flex"]


def block_mask_for(call: Call) -> Any:
    """A ``BlockMask`` from ``Pattern.blocks()``: full tiles skip the mask, partial tiles run
    ``mask_mod``. Tiles with padded keys, and the ragged last key block, count as partial."""
    from attnzoo.backends.dispatch import padded_blocks

    n_q, n_kv, heads = call.q.shape[2], call.k.shape[2], call.q.shape[1]
    kpm = call.key_padding_mask
    mask_blocks = padded_blocks(kpm, n_kv, call.block)
    key = (
        call.pattern,
        n_q,
        n_kv,
        call.block,
        heads,
        str(call.q.device),
        None if mask_blocks is None else bytes(mask_blocks.numpy()),
        None if kpm is None else id(kpm),
    )
    if key in _MASKS:
        _MASKS.move_to_end(key)
        return _MASKS[key]
    tiles = call.pattern.blocks(n_q, n_kv, call.block)
    partial_kb = torch.zeros(tiles.n_kv_blocks, dtype=torch.bool)
    if n_kv % call.block:
        partial_kb[-1] = True
    if mask_blocks is not None:
        partial_kb |= mask_blocks
    full = tiles.full & ~partial_kb[tiles.kb]
    groups = call.head_groups
    device = call.q.device
    p_num, p_idx = _csr(tiles, ~full, groups, device)
    f_num, f_idx = _csr(tiles, full, groups, device)
    block_mask = _flex_module().BlockMask.from_kv_blocks(
        p_num, p_idx, f_num, f_idx, BLOCK_SIZE=call.block, mask_mod=_flex_mask_mod(call), seq_lengths=(n_q, n_kv)
    )
    _MASKS[key] = block_mask
    if len(_MASKS) > 32:
        _MASKS.popitem(last=False)
    return block_mask


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
    mask_mod = call.pattern.mask_mod_for(call.q.shape[2], call.k.shape[2])
    offset, kpm = call.k.shape[2] - call.q.shape[2], call.key_padding_mask
    if kpm is None:
        return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + offset, kv_idx)
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + offset, kv_idx) & kpm[b, kv_idx]


def flex_attend(call: Call) -> Tensor:
    block_mask = block_mask_for(call)
    score_mod = None
    if call.score_mod is not None:
        offset, user = call.k.shape[2] - call.q.shape[2], call.score_mod

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return user(score, b, h, q_idx + offset, kv_idx)

    out = _compiled()(call.q, call.k, call.v, score_mod=score_mod, block_mask=block_mask, scale=call.scale)
    return out
