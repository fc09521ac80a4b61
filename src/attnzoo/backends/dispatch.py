"""``attend``: exact softmax attention over a pattern, on a chosen backend.

All backends compute the same function and differ only in cost. Each is an object with the
protocol of ``call.Backend`` — ``NAME``, ``not_supported_reasons(call)``, ``run(call)``:

- ``reference``: dense N x N scores under the pattern's mask (the oracle; O(N^2) memory).
- ``blocked``: only the listed tiles, eager PyTorch with a recomputing backward (CPU).
- ``flex``: ``torch.nn.attention.flex_attention`` compiled, with a ``BlockMask`` built from
  ``Pattern.blocks()`` (forward only on CPU).

An explicitly requested backend that cannot run raises a ``ValueError`` with its reasons;
``backend="auto"`` walks the device's ``PRIORITY`` list, runs the first backend with no reason
to refuse, and records the choice and every skipped backend's reasons (``last_choice()``).
Nothing falls back silently. Adding a backend is one class and one entry per device here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from torch import Tensor

from attnzoo._checks import check_causal, check_choice, check_key_mask, check_positive_int, check_qkv, renamed_key_mask
from attnzoo.backends.blocked import Blocked
from attnzoo.backends.call import Backend, BackendUnavailable, Call, repeated_kv, resolve_pattern
from attnzoo.backends.flex import Flex
from attnzoo.backends.reference import Reference
from attnzoo.patterns import Pattern, full
from attnzoo.spec import ScoreMod

#: Every backend, by name.
REGISTRY: dict[str, Backend] = {backend.NAME: backend for backend in (Reference(), Blocked(), Flex())}
BACKENDS = ("auto", *REGISTRY)
#: ``auto``'s order per device type. Flex first only on GPUs: on CPU it compiles for ~20 s per
#: new shape and has no backward. ``reference`` runs everything, so it ends every list.
PRIORITY: dict[str, tuple[str, ...]] = {"cuda": ("flex", "blocked", "reference")}
DEFAULT_PRIORITY = ("blocked", "flex", "reference")


@dataclass(frozen=True)
class Choice:
    """What ``backend="auto"`` (or an explicit backend) ran, and why the others did not."""

    backend: str
    skipped: dict[str, list[str]]
    #: For ``blocked``: ``"structured"`` (windows / sub-sequences, see ``backends.structured``),
    #: ``"key_sets"`` (query groups sharing their keys, ``backends.key_sets``), ``"gathered"``
    #: (a few keys listed per row, ``backends.gathered``) or ``"tiles"`` (the generic tile plan).
    path: str | None = None


_LAST = threading.local()


def last_choice() -> Choice | None:
    """The backend the most recent ``attend`` in this thread ran on."""
    return getattr(_LAST, "choice", None)


@renamed_key_mask
def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    pattern: Pattern | None = None,
    causal: bool = False,
    key_mask: Tensor | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    backend: str = "auto",
    block: int = 128,
) -> Tensor:
    """Exact softmax attention restricted to ``pattern`` (default: every pair).

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H_kv, N_kv, D)``, ``(B, H_kv, N_kv, D_v)``; ``H_kv``
            divides ``H`` (grouped-query attention; repeated only for a backend that cannot
            index K/V heads itself, see ``Backend.grouped_kv``).
        pattern: an ``attnzoo.patterns.Pattern``; per-head patterns are resolved for H heads.
        causal: and-ed with the pattern (queries end-aligned, see ``attnzoo.spec``).
        key_mask: bool ``(B, N_kv)``, True = real token.
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
    key_mask = check_key_mask(key_mask, q.shape[0], k.shape[2], q.device)
    check_choice(backend, "backend", BACKENDS)
    check_positive_int(block, "block")
    pattern = full() if pattern is None else pattern
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be an attnzoo.patterns.Pattern, got {type(pattern).__name__}")
    pattern = resolve_pattern(pattern, q.shape[1], causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return attend_call(Call(q, k, v, pattern, key_mask, score_mod, scale, block), backend)


def attend_call(call: Call, backend: str = "auto") -> Tensor:
    """Run a resolved ``call`` on ``backend`` and record the choice (``last_choice()``). What
    ``attend`` does after its checks; a pattern mechanism, whose ``forward`` has checked the
    inputs and whose config the backend and block, calls it directly."""
    chosen, skipped = choose(backend, call)
    prepared = chosen.prepare(call)
    _LAST.choice = Choice(chosen.NAME, skipped, chosen.path(prepared))
    same_heads = call.k.shape[1] == call.q.shape[1]
    ready = prepared if same_heads or chosen.grouped_kv(prepared) else repeated_kv(prepared)
    try:
        return chosen.run(ready).to(call.q.dtype)
    except BackendUnavailable:
        if backend != "auto":
            raise
        # The backend now refuses this call in not_supported_reasons: auto walks on, and
        # last_choice() names it with the reason among the skipped.
        return attend_call(call, backend)


def not_supported_reasons(backend: str, call: Call) -> list[str]:
    """Why ``backend`` (a name) cannot run ``call``; empty when it can."""
    return REGISTRY[backend].not_supported_reasons(call)


def choose(backend: str, call: Call) -> tuple[Backend, dict[str, list[str]]]:
    """The backend to run and the reasons of every backend passed over for it. An explicit
    backend either runs or raises with its reasons; ``auto`` walks the device's priority list."""
    if backend != "auto":
        reasons = REGISTRY[backend].not_supported_reasons(call)
        if reasons:
            raise ValueError(f"backend {backend!r} cannot run this call: " + "; ".join(reasons))
        return REGISTRY[backend], {}
    skipped: dict[str, list[str]] = {}
    for name in PRIORITY.get(call.q.device.type, DEFAULT_PRIORITY):
        reasons = REGISTRY[name].not_supported_reasons(call)
        if not reasons:
            return REGISTRY[name], skipped
        skipped[name] = reasons
    raise AssertionError("the reference backend supports every call")
