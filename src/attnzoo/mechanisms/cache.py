"""Decode caches of keys and values that never copy themselves per token.

``KVCache`` keeps every key and value seen so far in buffers with spare room: appending writes
into the room (no ``torch.cat`` of the whole cache per token, which made a step at position
16384 cost 8x a step over a preallocated cache) and, when the room runs out, the buffers grow
geometrically (doubling), so a token costs O(1) copies amortised. ``capacity`` preallocates
the lot when the final length is known.

A cache is a value as far as its user can tell: ``append`` returns a new ``KVCache`` and the
old one still reads the same keys. The new one shares the old one's buffers; the positions
past the old length are written only by the first ``append`` from a given state. Appending
to the same state twice (two continuations of one prefix, as a beam search does) finds its
room already taken and copies the prefix into new buffers first (copy on write).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnzoo.mechanisms.base import AttendArgs, StateSpec

#: Room of a cache grown from empty: enough for short prompts without a reallocation.
MIN_CAPACITY = 16


@dataclass(frozen=True)
class KVCache:
    """Keys ``(B, H, T, D)`` and values ``(B, H, T, D_v)`` of the ``T`` tokens seen so far.

    Attributes:
        k_buffer, v_buffer: ``(B, H, capacity, D)``, ``(B, H, capacity, D_v)``; positions
            ``>= length`` are spare room.
        length: T.
        _written: shared by every cache on these buffers: how far they hold data. A cache whose
            ``length`` is behind it has been appended to already, so it copies before writing.
        real_buffer: ``(B, 1, capacity, 1)`` bool, True = a real token; None until the first
            padded token is appended (every token before it was real).
    """

    k_buffer: Tensor
    v_buffer: Tensor
    length: int = 0
    _written: list[int] = field(default_factory=lambda: [0], repr=False, compare=False)
    real_buffer: Tensor | None = None

    @classmethod
    def empty(
        cls, batch: int, heads: int, head_dim: int, value_dim: int, *, capacity: int = 0, device=None, dtype=None
    ) -> KVCache:
        """A cache with room for ``capacity`` tokens (0: grown on demand)."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        k = torch.empty(batch, heads, capacity, head_dim, device=device, dtype=dtype)
        return cls(k, torch.empty(batch, heads, capacity, value_dim, device=device, dtype=dtype))

    @classmethod
    def for_state(cls, spec: StateSpec) -> KVCache:
        """The empty cache ``Attention.init_state`` asked for."""
        size = (spec.batch, spec.kv_heads, spec.head_dim, spec.value_dim)
        return cls.empty(*size, capacity=spec.capacity, device=spec.device, dtype=spec.dtype)

    @property
    def k(self) -> Tensor:
        """``(B, H, T, D)``: a view of the buffer, no copy."""
        return self.k_buffer[:, :, : self.length]

    @property
    def v(self) -> Tensor:
        """``(B, H, T, D_v)``: a view of the buffer, no copy."""
        return self.v_buffer[:, :, : self.length]

    @property
    def key_mask(self) -> Tensor | None:
        """``(B, T)`` bool, True = a real token; None while no padded token has been appended."""
        return None if self.real_buffer is None else self.real_buffer[:, 0, : self.length, 0]

    @property
    def capacity(self) -> int:
        return self.k_buffer.shape[2]

    def append(self, k: Tensor, v: Tensor, key_mask: Tensor | None = None) -> KVCache:
        """This cache followed by ``k (B, H, T', D)``, ``v (B, H, T', D_v)``, whose real tokens
        ``key_mask (B, T')`` marks (None: all real).

        With gradients flowing into ``k`` or ``v`` (training through decode steps) it
        concatenates instead: writing into shared buffers would modify tensors that earlier
        steps saved for backward."""
        real_buffer = self.real_buffer
        if key_mask is not None and real_buffer is None:  # the first padded token: all real before it
            real_buffer = torch.ones(k.shape[0], 1, self.capacity, 1, dtype=torch.bool, device=k.device)
        real = None
        if real_buffer is not None:  # (B, 1, T', 1), like the buffer
            real = key_mask if key_mask is not None else k.new_ones(k.shape[0], k.shape[2], dtype=torch.bool)
            real = real[:, None, :, None]
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            kc, vc = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            rc = None if real is None else torch.cat([real_buffer[:, :, : self.length], real], dim=2)  # type: ignore[index]
            return KVCache(kc, vc, kc.shape[2], [kc.shape[2]], rc)
        end = self.length + k.shape[2]
        buffers, written = [self.k_buffer, self.v_buffer, real_buffer], self._written
        branched = written[0] != self.length  # this state was appended to already
        if branched or end > self.capacity:
            room = max(end, self.capacity) if branched else max(end, 2 * self.capacity, MIN_CAPACITY)
            buffers = [None if b is None else _grown(b, self.length, room) for b in buffers]
            written = [self.length]
        for buffer, new in zip(buffers, (k, v, real), strict=True):
            if buffer is not None:
                buffer[:, :, self.length : end] = new
        written[0] = end
        return KVCache(buffers[0], buffers[1], end, written, buffers[2])  # type: ignore[arg-type]


def _grown(buffer: Tensor, length: int, capacity: int) -> Tensor:
    """A new buffer of ``capacity`` positions holding ``buffer``'s first ``length``."""
    new = buffer.new_empty(*buffer.shape[:2], capacity, buffer.shape[3])
    new[:, :, :length] = buffer[:, :, :length]
    return new


class KVCacheDecode:
    """Decoding by keeping every key and value (a ``KVCache``) and running the mechanism's own
    causal forward for the new queries over them, end-aligned. Exact for a mechanism whose
    causal row t depends on query t and the keys ``<= t`` alone (exact softmax, a top-k
    selection, a compressed memory: ``tests/test_contracts.py`` checks step == forward); O(t) per
    token. Mixed into an ``Attention`` subclass that declares ``decode_step`` and
    ``cross_attention`` (the step's N_q < N_kv)."""

    def _init_state(self, spec: StateSpec) -> KVCache:
        """An empty ``KVCache`` with room for ``spec.capacity`` tokens (0: grown by doubling)."""
        return KVCache.for_state(spec)

    def _step(self, state: KVCache, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, KVCache]:
        """The new queries are the last T positions of the cache: causal (end-aligned) lets each
        see the whole past and the new tokens up to itself; padded tokens are never seen."""
        state = state.append(k, v, args.key_mask)
        mask = state.key_mask
        out = self(q, state.k, state.v, causal=True, key_mask=mask, score_mod=args.score_mod)  # type: ignore[operator]
        return out, state
