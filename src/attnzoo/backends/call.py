"""What every backend shares: the resolved ``Call``, the ``Backend`` protocol, the rule for
which key blocks must run under an explicit mask, the bounded plan cache, and the row layouts
(gathered rows, sub-sequences of a stride).

It lives apart from ``dispatch`` so that backends import it and ``dispatch`` imports the
backends, never the other way round (no import cycle).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Generic, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.patterns import Pattern
from attnzoo.patterns import causal as causal_pattern
from attnzoo.score_mods import plain_bias
from attnzoo.spec import MaskMod, ScoreMod

if TYPE_CHECKING:  # a type only: mechanisms import the backends, never the other way round
    from attnzoo.mechanisms.base import Dropout


@dataclass(frozen=True)
class Call:
    """One resolved ``attend`` call, as the backends see it: the pattern already has its heads
    resolved and ``causal`` and-ed in, the scale is a number, the padding mask is checked."""

    q: Tensor
    k: Tensor
    v: Tensor
    pattern: Pattern
    key_mask: Tensor | None
    score_mod: ScoreMod | None
    scale: float
    block: int
    #: Attention-probability dropout (a pattern mechanism's ``dropout_p``): the seeded mask of
    #: ``_ops.dropout_keep``, applied after normalisation. Only the reference and the blocked
    #: tile plan's explicit path apply it; the flash-kernel paths and flex decline such calls.
    dropout: Dropout | None = None

    @property
    def head_groups(self) -> Tensor:
        """``(H,)``: the tile group of every head (all zeros unless the pattern is per head)."""
        return head_groups(self.pattern, self.q.shape[1])

    def sizes(self) -> tuple[int, int, int]:
        """``(n_q, n_kv, heads)``: with the pattern and the block, what a plan depends on."""
        sizes = self.q.shape[2], self.k.shape[2], self.q.shape[1]
        if torch.compiler.is_compiling():
            # Plans are built from Python ints: a size dynamo made symbolic (automatic dynamic
            # shapes, after a second length) is specialised to its value by len(range(.)),
            # under a guard (another length recompiles); int(.) would stay symbolic.
            return len(range(sizes[0])), len(range(sizes[1])), len(range(sizes[2]))
        return sizes

    def mask_mod(self) -> MaskMod:
        """The pattern's pair predicate at this call's lengths (queries end-aligned)."""
        return self.pattern.mask_mod_for(self.q.shape[2], self.k.shape[2], self.q.device)


def head_groups(pattern: Pattern, heads: int) -> Tensor:
    """``(H,)``: the tile group of every head of a resolved ``pattern``."""
    return pattern.head_groups() if pattern.per_head else torch.zeros(heads, dtype=torch.long)


def resolve_pattern(pattern: Pattern, heads: int, causal: bool) -> Pattern:
    """The pattern a ``Call`` holds: ``pattern`` for ``heads`` heads, and-ed with ``causal()``
    when ``causal``."""
    if torch.compiler.is_compiling():
        # The pattern algebra is plain Python that dynamo cannot trace: it runs once per
        # compilation instead (``_resolved_name``), and the graph reads the result as an
        # attribute of ``_RESOLVED``, a source dynamo can guard on and pass on to the plan
        # caches' constant functions (the constant itself it cannot).
        return getattr(_RESOLVED, _resolved_name(pattern, heads, causal))
    pattern = pattern.resolve_heads(heads)
    return pattern & causal_pattern() if causal else pattern


class _Resolved:
    """Patterns resolved under ``torch.compile``, one attribute per (pattern, heads, causal)."""

    names: ClassVar[dict[tuple[Pattern, int, bool], str]] = {}


_RESOLVED = _Resolved()


@torch.compiler.assume_constant_result
def _resolved_name(pattern: Pattern, heads: int, causal: bool) -> str:
    key = (pattern, heads, causal)
    if key not in _Resolved.names:
        name = _Resolved.names[key] = f"pattern_{len(_Resolved.names)}"
        resolved = pattern.resolve_heads(heads)
        setattr(_RESOLVED, name, resolved & causal_pattern() if causal else resolved)
    return _Resolved.names[key]


class BackendUnavailable(RuntimeError):
    """A backend found at run time that it cannot run a call (flex: its ``mask_mod`` does not
    compile on this device). ``backend="auto"`` records the reason and runs the next backend of
    its priority list; an explicitly requested backend raises it."""


class Backend:
    """The protocol every backend follows. ``dispatch`` asks ``not_supported_reasons`` (empty
    means the backend can run the call) and then ``run``s; the reasons are shown to the user,
    so each says what is wrong and what to do instead."""

    NAME: ClassVar[str]

    def not_supported_reasons(self, call: Call) -> list[str]:
        return []

    def prepare(self, call: Call) -> Call:
        """``call`` as this backend computes it (``dispatch`` asks once, before ``path``,
        ``grouped_kv`` and ``run``, and casts the output back to q's dtype): the blocked backend
        takes half precision in float32. Default: ``call`` itself."""
        return call

    def run(self, call: Call) -> Tensor:
        raise NotImplementedError

    def path(self, call: Call) -> str | None:
        """Which of its own strategies the backend will take for ``call`` (recorded in
        ``last_choice()``); None for backends with one strategy."""
        return None

    def grouped_kv(self, call: Call) -> bool:
        """Whether ``run`` takes ``call``'s grouped-query K/V (``H_kv`` heads dividing ``H``) as
        they are; where not, ``dispatch`` hands it ``repeated_kv(call)``."""
        return False


def repeated_kv(call: Call) -> Call:
    """``call`` with each K/V head repeated for the ``H / H_kv`` query heads it serves (SDPA's
    ``enable_gqa`` semantics), for a backend that indexes K/V by query head."""
    groups = call.q.shape[1] // call.k.shape[1]
    if groups == 1:
        return call
    return replace(call, k=call.k.repeat_interleave(groups, dim=1), v=call.v.repeat_interleave(groups, dim=1))


def plain_softmax_reasons(call: Call, path: str, *, bias: bool = False) -> list[str]:
    """Why a path that runs plain softmax attention (no score function, no dropout; with
    ``bias``, an additive bias: ``score_mods.plain_bias``) cannot take ``call``: ``path`` names it
    in the reasons, and says why it has no score_mod."""
    reasons = []
    if call.score_mod is not None and not (bias and plain_bias(call.score_mod, call.q.device) is not None):
        reasons.append(f"a score_mod ({path})")
    if call.dropout is not None:
        reasons.append("attention dropout")
    return reasons


def compute_dtype(x: Tensor) -> torch.dtype:
    """Backends accumulate in float32, or float64 for float64 inputs (the golden tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def additive_mask(allowed: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A bool mask as the additive one the flash kernel takes: 0 where allowed, ``-inf`` elsewhere
    (None stays None: every pair allowed)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def cut_far(total: Tensor, q: Tensor, k: Tensor, scale: float) -> Tensor:
    """An additive mask plus bias ``total (..., S_k)`` for the CPU flash kernel, with every entry
    more than ``2 R + 64`` under its row's largest at ``-inf`` (``R`` bounds ``|scale q . k|``):
    such a key weighs under ``e^-64`` of the row's best whatever q and k are, so the result moves
    by less than float32 holds; kept, ALiBi's far pairs (-1000) leave exponents below -87 that
    take ``exp``'s slow path in the kernel's backward (6x slower: ``window_parts._with_bias``)."""
    reach = 2 * float(q.detach().norm(dim=-1).amax() * k.detach().norm(dim=-1).amax()) * scale + 64.0
    top = total.amax(-1, keepdim=True)
    return total.masked_fill(total < torch.where(torch.isinf(top), 0.0, top) - reach, float("-inf"))


def gather_rows(x: Tensor, index: Tensor, *, zero_row: bool = False) -> Tensor:
    """``x[b, h, index[b, h, ...]]`` for ``x (B, H, M, D)`` and an integer ``index (B, H, ...)``
    -> ``(B, H, ..., D)``: each query's own selection of keys or values, as one ``index_select``
    over the flattened rows (never an ``(B, H, M, M)`` one-hot product; on CPU about twice as fast
    forward as ``gather`` with an index expanded over D, and 1.3x with backward).

    With ``zero_row``, index ``M`` (one past the end) reads a row of zeros: the slot a selection
    fills when a query has fewer candidates than slots.
    """
    if zero_row:
        x = F.pad(x, (0, 0, 0, 1))
    b, h, m, d = x.shape
    offset = torch.arange(b * h, device=x.device).view(b, h, *(1,) * (index.dim() - 2)) * m
    return x.reshape(b * h * m, d).index_select(0, (index + offset).flatten()).view(*index.shape, d)


def rows_at(x: Tensor, positions: Tensor) -> Tensor:
    """``x[:, :, positions]`` for ``x (B, H, M, D)`` and ``positions (P,)`` shared by every batch
    row and head -> ``(B, H, P, D)``, through ``gather_rows``: one ``index_select`` over the
    flattened rows, whose backward adds whole rows. ``index_select`` along dim 2 of the 4-D
    tensor took 0.94 ms forward, 3.2 with backward, where this takes 0.45 and 2.0 (``sac``'s two
    gathers at N = 1K: 7 040 rows of 64 per head; ``benchmarks/ab-rows-at-cpu.txt``)."""
    return gather_rows(x, positions.expand(*x.shape[:2], -1))


def merge_by_lse(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Outputs ``(..., N, D)`` of softmaxes over disjoint key sets and their log-sum-exps ``(...,
    N)`` (``-inf`` where a row saw none of its set) as one softmax over the union: ``(out,
    lse)``. A row that saw nothing anywhere comes out 0 with lse ``-inf``. The shares are
    accumulated into the first term's product in place, where stacking the terms copied every
    output once more and summed them in passes of their own (two of ``lsh``'s rounds at 1K: 0.69
    -> 0.22 ms; at 4K 2.35 -> 0.83). One term is its own answer: no work."""
    if len(outs) == 1:
        return outs[0], lses[0]
    total = lses[0]
    for lse in lses[1:]:
        total = torch.logaddexp(total, lse)
    finite_total = torch.where(torch.isinf(total), 0.0, total)  # a row that sees nothing: shares 0
    out = outs[0] * torch.exp(lses[0] - finite_total)[..., None].to(outs[0].dtype)
    for o, lse in zip(outs[1:], lses[1:]):
        out.addcmul_(o, torch.exp(lse - finite_total)[..., None].to(o.dtype))
    return out, total


def to_subsequences(x: Tensor, stride: int) -> Tensor:
    """``(B, H, N, D)`` -> ``(B stride, H, ceil(N / stride), D)``, contiguous: position ``i stride
    + r`` is row ``i`` of batch row ``b stride + r`` (its residue class), zero rows padding N to a
    multiple of the stride. A band of that stride then joins rows of one batch row only (the
    structured path's dense and window parts, flex's strided bands)."""
    if stride == 1:
        return x
    if x.shape[2] % stride:  # F.pad copies even when it adds nothing
        x = F.pad(x, (0, 0, 0, -x.shape[2] % stride))
    return rearrange(x, "b h (n m) d -> (b m) h n d", m=stride).contiguous()


def from_subsequences(x: Tensor, stride: int, n: int) -> Tensor:
    """Inverse of ``to_subsequences``: ``(B stride, H, sub, D)`` -> ``(B, H, n, D)``."""
    if stride == 1:
        return x
    return rearrange(x, "(b m) h n d -> b h (n m) d", m=stride)[:, :, :n]


def subsequence_keys(key_valid: Tensor | None, batch: int, n: int, stride: int, device: torch.device) -> Tensor | None:
    """Real keys ``(B, n)`` in ``to_subsequences``' layout, ``(B stride, ceil(n / stride))``, the
    padding rows False; None when every key is real and nothing is padded."""
    if key_valid is None and not n % stride:
        return None
    if key_valid is None:
        key_valid = torch.ones(batch, n, dtype=torch.bool, device=device)
    if n % stride:
        key_valid = F.pad(key_valid, (0, -n % stride), value=False)
    return rearrange(key_valid, "b (n m) -> (b m) n", m=stride)


def masked_key_blocks(n_kv: int, block: int, key_mask: Tensor | None = None) -> Tensor:
    """Bool per key block: True where tiles must run under an explicit mask whatever the pattern
    says, because the block holds keys that do not exist for some query — the ragged last
    block (keys past ``n_kv``) and blocks where any batch row pads a key. The blocked tile plan
    and flex's ``BlockMask`` both treat these tiles as partial; this is the one place the rule
    is written."""
    n_kb = -(-n_kv // block)
    masked = torch.zeros(n_kb * block, dtype=torch.bool)
    masked[n_kv:] = True
    if key_mask is not None:
        masked[:n_kv] = ~key_mask.all(dim=0).cpu()
    return masked.view(n_kb, block).any(dim=1)


def plan_key(call: Call) -> tuple[Hashable, ...]:
    """What a plan for ``call`` depends on: the pattern by value (``Pattern.__eq__``, so a
    pattern rebuilt per call hits the cache), the sizes, the block and the masked key blocks.
    Never the identity of a tensor."""
    masked = masked_key_blocks(call.k.shape[2], call.block, call.key_mask)
    return (call.pattern, *call.sizes(), call.block, bytes(masked.numpy()))


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    maxsize: int


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PlanCache(Generic[K, V]):
    """A least-recently-used dict of plans with ``functools.lru_cache``-style counters, so tests
    (and users profiling a loop) can see that repeated calls reuse their plan."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: K, build: Callable[[], V]) -> V:
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        value = self._entries[key] = build()
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return value

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, len(self._entries), self.maxsize)

    def clear(self) -> None:
        """Drop the entries and reset the counters."""
        self._entries.clear()
        self.hits = self.misses = 0
