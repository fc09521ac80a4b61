"""``attend``: exact softmax attention over a pattern, on a chosen backend.

All backends compute the same function and differ only in cost:

- ``reference``: dense N x N scores under the pattern's mask (the oracle; O(N^2) memory).
- ``blocked``: only the listed tiles, eager PyTorch with a recomputing backward (CPU).
- ``flex``: ``torch.nn.attention.flex_attention`` compiled, with a ``BlockMask`` built from
  ``Pattern.blocks()`` (forward only on CPU).

Each backend states ``not_supported_reasons``. An explicitly requested backend that cannot run
raises a ``ValueError`` with its reasons; ``backend="auto"`` picks the first that can (flex on
CUDA, else blocked, else reference) and records the choice and every skipped backend's reasons
(``last_choice()``). Nothing falls back silently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from attnzoo._checks import check_causal, check_choice, check_key_padding_mask, check_positive_int, check_qkv
from attnzoo.backends import blocked as blocked_backend
from attnzoo.backends import flex as flex_backend
from attnzoo.backends import structured as structured_backend
from attnzoo.backends.reference import reference_attention
from attnzoo.backends.windowed import structured_attention
from attnzoo.patterns import Pattern, full
from attnzoo.patterns import causal as causal_pattern
from attnzoo.spec import ScoreMod

BACKENDS = ("auto", "reference", "blocked", "flex")


@dataclass(frozen=True)
class Call:
    """One resolved ``attend`` call, as the backends see it."""

    q: Tensor
    k: Tensor
    v: Tensor
    pattern: Pattern
    key_padding_mask: Tensor | None
    score_mod: ScoreMod | None
    scale: float
    block: int

    @property
    def head_groups(self) -> Tensor:
        return self.pattern.head_groups() if self.pattern.per_head else torch.zeros(self.q.shape[1], dtype=torch.long)


@dataclass(frozen=True)
class Choice:
    """What ``backend="auto"`` (or an explicit backend) ran, and why the others did not."""

    backend: str
    skipped: dict[str, list[str]]
    #: For ``blocked``: ``"structured"`` (windows / sub-sequences, see ``backends.structured``)
    #: or ``"tiles"`` (the generic tile plan).
    path: str | None = None


_LAST = threading.local()


def last_choice() -> Choice | None:
    """The backend the most recent ``attend`` in this thread ran on."""
    return getattr(_LAST, "choice", None)


def not_supported_reasons(backend: str, call: Call) -> list[str]:
    if backend == "reference":
        return []
    if backend == "blocked":
        reasons = []
        if call.q.device.type != "cpu":
            reasons.append(f"blocked runs PyTorch's CPU flash kernel; inputs are on {call.q.device.type} (use flex)")
        return reasons
    return flex_backend.not_supported_reasons(call)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    pattern: Pattern | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    backend: str = "auto",
    block: int = 128,
) -> Tensor:
    """Exact softmax attention restricted to ``pattern`` (default: every pair).

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)``.
        pattern: an ``attnzoo.patterns.Pattern``; per-head patterns are resolved for H heads.
        causal: and-ed with the pattern (queries end-aligned, see ``attnzoo.spec``).
        key_padding_mask: bool ``(B, N_kv)``, True = real token.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` on the scaled scores.
        scale: default ``1 / sqrt(D)``.
        backend: ``"auto"``, ``"reference"``, ``"blocked"`` or ``"flex"``.
        block: tile size of the blocked backend's tile plan and of flex. Default 128. The
            blocked backend's structured path (windows, sub-sequences) picks its own block per
            window width (``structured.choose_block``).

    Returns:
        ``(B, H, N_q, D_v)``; rows with no visible key are zeros.
    """
    check_qkv(q, k, v)
    check_causal(causal, q.shape[2], k.shape[2])
    key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    check_choice(backend, "backend", BACKENDS)
    check_positive_int(block, "block")
    pattern = full() if pattern is None else pattern
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be an attnzoo.patterns.Pattern, got {type(pattern).__name__}")
    pattern = pattern.resolve_heads(q.shape[1])
    if causal:
        pattern = pattern & causal_pattern()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    call = Call(q, k, v, pattern, key_padding_mask, score_mod, scale, block)
    name = _choose(backend, call)
    if name == "reference":
        mask_mod = pattern.mask_mod_for(q.shape[2], k.shape[2])
        return reference_attention(
            q, k, v, key_padding_mask=key_padding_mask, mask_mod=mask_mod, score_mod=score_mod, scale=scale
        )
    if name == "flex":
        return flex_backend.flex_attend(call)
    structure = structure_for(call)
    if structure is not None:
        _LAST.choice = Choice(_LAST.choice.backend, _LAST.choice.skipped, "structured")
        return structured_attention(q, k, v, structure, scale=scale, key_padding_mask=key_padding_mask)
    _LAST.choice = Choice(_LAST.choice.backend, _LAST.choice.skipped, "tiles")
    plan = plan_for(call)
    return blocked_backend.blocked_attention(
        q,
        k,
        v,
        plan,
        mask_mod=pattern.mask_mod_for(q.shape[2], k.shape[2]),
        scale=scale,
        score_mod=score_mod,
        key_padding_mask=key_padding_mask,
    )


def _choose(backend: str, call: Call) -> str:
    if backend != "auto":
        reasons = not_supported_reasons(backend, call)
        if reasons:
            raise ValueError(f"backend {backend!r} cannot run this call: " + "; ".join(reasons))
        _LAST.choice = Choice(backend, {})
        return backend
    # flex first only on GPUs: on CPU it compiles for ~20 s per new shape and has no backward.
    order = ("flex", "blocked", "reference") if call.q.device.type == "cuda" else ("blocked", "flex", "reference")
    skipped: dict[str, list[str]] = {}
    for name in order:
        reasons = not_supported_reasons(name, call)
        if not reasons:
            _LAST.choice = Choice(name, skipped)
            return name
        skipped[name] = reasons
    raise AssertionError("the reference backend supports every call")


_PLANS: OrderedDict[tuple, blocked_backend.Plan] = OrderedDict()
_STRUCTURES: OrderedDict[tuple, structured_backend.Structure | None] = OrderedDict()
#: dtypes PyTorch's CPU flash kernel runs.
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def structure_for(call: Call) -> structured_backend.Structure | None:
    """The structured plan for this call (cached by the pattern's value and the sizes), or None
    where the call needs the generic tile plan: a pattern without window structure, a
    ``score_mod``, cross-attention of unequal lengths, value and key head sizes that differ,
    or a dtype the CPU flash kernel does not run."""
    q, v = call.q, call.v
    if call.score_mod is not None or q.shape[-1] != v.shape[-1] or q.dtype not in _FLASH_DTYPES:
        return None
    key = (call.pattern, q.shape[2], call.k.shape[2], q.shape[1])
    if key not in _STRUCTURES:
        _STRUCTURES[key] = structured_backend.structure(call.pattern, q.shape[2], call.k.shape[2], q.shape[1])
        if len(_STRUCTURES) > 64:
            _STRUCTURES.popitem(last=False)
    _STRUCTURES.move_to_end(key)
    return _STRUCTURES[key]


def plan_for(call: Call) -> blocked_backend.Plan:
    """The blocked plan for this call, cached per (pattern, sizes, block, heads, padded blocks)
    so repeated calls skip ``blocks()``."""
    n_q, n_kv = call.q.shape[2], call.k.shape[2]
    mask_blocks = padded_blocks(call.key_padding_mask, n_kv, call.block)
    key = (
        call.pattern,
        n_q,
        n_kv,
        call.block,
        call.q.shape[1],
        None if mask_blocks is None else bytes(mask_blocks.numpy()),
    )
    if key in _PLANS:
        _PLANS.move_to_end(key)
        return _PLANS[key]
    tiles = call.pattern.blocks(n_q, n_kv, call.block)
    plan = blocked_backend.make_plan(tiles, call.head_groups, pattern=call.pattern, mask_blocks=mask_blocks)
    _PLANS[key] = plan
    if len(_PLANS) > 64:
        _PLANS.popitem(last=False)
    return plan


def padded_blocks(key_padding_mask: Tensor | None, n_kv: int, block: int) -> Tensor | None:
    """Bool per key block: True where any batch row pads a key of that block."""
    if key_padding_mask is None or bool(key_padding_mask.all()):
        return None
    n_kb = -(-n_kv // block)
    padded = torch.zeros(n_kb * block, dtype=torch.bool)
    padded[:n_kv] = ~key_padding_mask.all(dim=0).cpu()
    return padded.view(n_kb, block).any(dim=1)
