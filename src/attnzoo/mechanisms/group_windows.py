"""Keys gathered per query: the masked softmax over them, and the decode state that keeps the
most recent keys of each group (a cluster of ``routing``, a hash bucket of ``lsh``).

``attend_gathered`` is the one attention both mechanisms run over keys picked per query (the
fast paths' tiles and the decode steps' candidates). ``GroupWindows`` keeps, per batch row,
head and group, the last ``keep`` entries appended to the group and their ranks (how many
entries the group had before each): O(groups keep) memory whatever the length decoded, and an
append costs O(1) per entry, amortised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.backends.call import gather_rows
from attnzoo.mechanisms._ops import compute_dtype
from attnzoo.mechanisms.base import StateSpec

#: Room per group of windows made without a known capacity: grown by doubling when it runs out.
MIN_ROOM = 16


def attend_gathered(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    """Softmax attention of ``q (..., M, D)`` over the ``visible`` (bool, broadcasting to ``(..., M, L)``)
    keys of ``k, v (..., L, D)``, fused by SDPA; a row with no visible key gives 0 and zero gradient."""
    has_key = visible.any(-1, keepdim=True)  # rows without: shown every key (finite), then times 0
    mask = None if bool(visible.all()) else (visible | ~has_key).expand(*q.shape[:-2], -1, -1)
    # SDPA's fused CPU kernel takes 4-D inputs [(...), 1, M, D]; 5-D ones fall back to M x L scores.
    flat = [None if x is None else rearrange(x, "... m d -> (...) 1 m d") for x in (q, k, v, mask)]
    out = F.scaled_dot_product_attention(*flat[:3], attn_mask=flat[3], scale=scale)
    return out.reshape(*q.shape[:-1], v.shape[-1]) * has_key


def state_dtype(spec: StateSpec) -> torch.dtype:
    """The dtype a decode state made for ``spec`` holds and computes in: ``compute_dtype``'s rule
    for ``spec.dtype`` (None: torch's default), as the forward computes."""
    return compute_dtype(torch.empty(0, dtype=spec.dtype))


def counts(group: Tensor, bins: int) -> Tensor:
    """``(B, H, bins)`` counts of the values of ``group (B, H, L)`` (each in ``[0, bins)``)."""
    return group.new_zeros(group.shape[:2] + (bins,)).scatter_add_(-1, group, torch.ones_like(group))


def earlier_of_same_group(group: Tensor, groups: int) -> Tensor:
    """``(B, H, L)``: for each entry of ``group (B, H, L)`` (values in ``[0, groups]``), how many
    entries before it along L have its value. One stable sort, never L x L."""
    ordered, order = torch.sort(group, dim=-1, stable=True)
    size = counts(group, groups + 1)
    first = (size.cumsum(-1) - size).gather(-1, ordered)
    within = torch.arange(group.shape[-1], device=group.device) - first
    return torch.empty_like(group).scatter_(-1, order, within)


@dataclass(frozen=True)
class GroupWindows:
    """Per row ``(b, h)`` and group ``g < G``: the last ``keep`` entries appended to the group.

    Attributes:
        buffers: one per kind of entry, ``(B, H, G room + 1, E)``: group g's entry of rank r at
            index ``g room + r - base[b, h, g]``; the last index takes the writes of entries that
            join no group.
        base: ``(B, H, G)``, the rank at a group's first index; count: ``(B, H, G)``, entries so far.
        keep: how many recent entries of each group must stay readable.
        serial, _written: ``serial`` appends led to this state; ``_written`` (shared by every state
            on these buffers) says how many led to the newest one, so an append from an older
            state (a second continuation of one prefix) copies before writing, as ``KVCache`` does.

    An append writes past each group's newest entry while every group has room; when one has
    none, every group is rewritten to its last ``keep`` entries, in a room grown by doubling up
    to 2 keep (O(G room), at most once per room / 2 appends: O(G) per append, amortised). The
    state is a value: ``append`` returns a new one and the old one still reads the same entries.
    """

    buffers: tuple[Tensor, ...]
    base: Tensor
    count: Tensor
    keep: int
    serial: int = 0
    _written: list[int] = field(default_factory=lambda: [0], repr=False, compare=False)

    @classmethod
    def empty(
        cls,
        batch: int,
        heads: int,
        groups: int,
        keep: int,
        kinds: tuple[tuple[int, torch.dtype], ...],
        *,
        capacity: int = 0,
        device: torch.device | None = None,
    ) -> GroupWindows:
        """No entries yet; ``kinds`` gives each kind of entry's ``(width E, dtype)``. The room per
        group starts at ``min(2 keep, capacity or MIN_ROOM)`` (``capacity``: the most entries a
        group can get, when known) and grows by doubling up to 2 keep."""
        room = max(1, min(2 * keep, capacity or MIN_ROOM))
        buffers = tuple(
            torch.zeros(batch, heads, groups * room + 1, e, dtype=dtype, device=device) for e, dtype in kinds
        )
        zeros = torch.zeros(batch, heads, groups, dtype=torch.long, device=device)
        return cls(buffers, zeros, zeros, keep)

    @classmethod
    def for_state(
        cls, spec: StateSpec, groups: int, keep: int, kinds: tuple[tuple[int, torch.dtype], ...]
    ) -> GroupWindows:
        """The empty windows ``Attention.init_state`` asked for (``spec.capacity``: the most
        entries a group can get)."""
        return cls.empty(spec.batch, spec.heads, groups, keep, kinds, capacity=spec.capacity, device=spec.device)

    @property
    def groups(self) -> int:
        return self.count.shape[-1]

    @property
    def room(self) -> int:
        return (self.buffers[0].shape[2] - 1) // self.groups

    def ranks(self, group: Tensor) -> Tensor:
        """``(B, H, L)``: the rank each entry of ``group (B, H, L)`` would get appended in order
        (the group's count plus the entries of the group before it); values ``>= G`` join none."""
        size = self.count.gather(-1, group.clamp(max=self.groups - 1))
        return size + earlier_of_same_group(group.clamp(max=self.groups), self.groups)

    def recent(self, group: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
        """The last ``keep`` entries of the groups ``group (B, H, ...)``: per kind ``(B, H, ...,
        keep, E)``, oldest first, and their ranks ``(B, H, ..., keep)``; a rank < 0 marks an empty
        slot (a group with fewer entries), which reads zeros."""
        flat = rearrange(group, "b h ... -> b h (...)")
        count, base = (x.gather(-1, flat).view_as(group)[..., None] for x in (self.count, self.base))
        rank = count - self.keep + torch.arange(self.keep, device=group.device)  # [B, H, ..., keep]
        index = group[..., None] * self.room + (rank - base).clamp(min=0)
        read = tuple(torch.where(rank[..., None] >= 0, gather_rows(x, index), 0) for x in self.buffers)
        return read, rank

    def append(self, group: Tensor, entries: tuple[Tensor, ...]) -> GroupWindows:
        """These windows after appending ``entries`` (per kind ``(B, H, L, E)``) to the groups
        ``group (B, H, L)`` in order along L; a value ``>= G`` joins no group."""
        group = group.clamp(max=self.groups)
        rank = self.ranks(group)
        count = self.count + counts(group, self.groups + 1)[..., :-1]
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (*entries, *self.buffers))
        full = bool((count - self.base).max() > self.room)
        if grad or full or self._written[0] != self.serial:
            return self._rewritten(group, rank, entries, count)
        base = self.base.gather(-1, group.clamp(max=self.groups - 1))
        index = torch.where(group < self.groups, group * self.room + rank - base, self.buffers[0].shape[2] - 1)
        for buffer, new in zip(self.buffers, entries, strict=True):
            buffer.scatter_(2, index[..., None].expand(-1, -1, -1, new.shape[-1]), new.to(buffer.dtype))
        self._written[0] = self.serial + 1
        return GroupWindows(self.buffers, self.base, count, self.keep, self.serial + 1, self._written)

    def _rewritten(self, group: Tensor, rank: Tensor, entries: tuple[Tensor, ...], count: Tensor) -> GroupWindows:
        """New buffers holding each group's last ``keep`` entries, old and new (out of place, so
        gradients flow through them)."""
        groups, base = self.groups, (count - self.keep).clamp(min=0)  # [B, H, G]
        room = min(2 * self.keep, max(self.room, 2 * int((count - base).max())))
        kept = base[..., None] + torch.arange(room, device=base.device)  # [B, H, G, room]: rank per slot
        old = kept < self.count[..., None]  # and kept >= the old base: fill >= min(count, keep) holds
        slot_g = torch.arange(groups, device=base.device)[:, None]
        source = torch.where(old, slot_g * self.room + kept - self.base[..., None], 0)
        source = rearrange(source, "b h g r -> b h (g r)")
        new_base = base.gather(-1, group.clamp(max=groups - 1))
        write = (group < groups) & (rank >= new_base)
        target = torch.where(write, group * room + rank - new_base, groups * room)
        buffers = []
        for buffer, new in zip(self.buffers, entries, strict=True):
            moved = gather_rows(buffer, source)  # [B, H, G room, E]
            moved = torch.where(rearrange(old, "b h g r -> b h (g r) 1"), moved, 0)
            moved = F.pad(moved, (0, 0, 0, 1))
            index = target[..., None].expand(-1, -1, -1, new.shape[-1])
            buffers.append(moved.scatter(2, index, new.to(buffer.dtype)))
        return GroupWindows(tuple(buffers), base, count, self.keep)
