"""The span tree of ``hierarchical`` (BP-Transformer) seen from the left: the spans a token
attends to beyond its leaves, pairwise sums per level, and ``SpanTree``, the state of a causal
decode step.

Causal token i attends to its leaves ``i-k .. i`` and to spans that partition ``[0, i - k)``
(``left_nodes``), each one complete once token i is seen, so decoding keeps no token beyond
those spans. ``SpanTree`` keeps, per level l, the key and value sums (and real-token counts) of
the last ``2k + 1`` complete level-l spans (ring slot ``j mod (2k + 1)`` for span j) and of the
open span the next tokens add to. A token's spans at level l are always among the last 2k + 1
complete ones (``tests/test_hierarchical.py`` checks the bound over every position of long
sequences). A step adds the token to every level's open sum, closes the levels it completes,
and attends to its ``O(k log t)`` spans: O(k log t D) time and memory at position t.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype
from attnzoo.mechanisms.base import StateSpec


def left_nodes(i: int, k: int) -> list[tuple[int, int]]:
    """The ``(level, node index)`` pairs token ``i`` attends to on its left beyond its leaves:
    spans that partition ``[0, i - k)``, the same whatever the sequence's length."""
    nodes, q, level = [], i - k, 1
    # Positions < q are still uncovered; q is a multiple of 2^(l-1) entering level l.
    while q > 0:
        w = 1 << (level - 1)
        if q % (2 * w):  # one level-(l-1) span aligns q to a multiple of 2^l
            nodes.append((level - 1, q // w - 1))
            q -= w
        last = q // (2 * w) - 1
        nodes.extend((level, j) for j in range(last, max(last - k, -1), -1))
        q -= k * 2 * w
        level += 1
    return nodes


def level_sums(x: Tensor, real: Tensor, levels: int) -> list[tuple[Tensor, Tensor]]:
    """Per level ``0 .. levels-1``, by pairwise sums: the sum of each node's real tokens
    ``(B, H, ceil(N / 2^l), D)`` and their count ``(B, ceil(N / 2^l))``, for ``x (B, H, N, D)``
    and ``real (B, N)`` float (a last, partial node sums what it covers)."""
    sums, counts = x * real[:, None, :, None], real
    out = [(sums, counts)]
    for _ in range(levels - 1):
        if sums.shape[2] % 2:
            sums, counts = F.pad(sums, (0, 0, 0, 1)), F.pad(counts, (0, 1))
        sums, counts = sums.unflatten(2, (-1, 2)).sum(dim=3), counts.unflatten(1, (-1, 2)).sum(dim=2)
        out.append((sums, counts))
    return out


@dataclass(frozen=True)
class SpanTree:
    """The spans a causal ``hierarchical`` step can still attend to, after ``seen`` tokens.

    Attributes:
        seen: tokens so far; levels ``0 .. L-1`` with ``2^(L-1) > seen`` (the top one has no
            complete span yet).
        k: the neighbourhood ``k`` of the config; ``2k + 1`` ring slots per level.
        head_dim: D; a sum holds the key sum ``[..., :D]`` then the value sum ``[..., D:]``.
        sums: ``(B, H, L, 2k + 1, D + D_v)`` sums of the last complete spans of each level.
        counts: ``(B, L, 2k + 1)`` their real tokens (0: an invisible span, or an empty slot).
        open_sums, open_counts: ``(B, H, L, D + D_v)``, ``(B, L)``: the open span of each level.
    """

    seen: int
    k: int
    head_dim: int
    sums: Tensor
    counts: Tensor
    open_sums: Tensor
    open_counts: Tensor

    @classmethod
    def empty(cls, spec: StateSpec, k: int) -> SpanTree:
        """No token seen: one level, nothing in it; sums in the compute dtype of ``spec.dtype``."""
        dtype = compute_dtype(torch.empty(0, dtype=spec.dtype))
        width = spec.head_dim + spec.value_dim
        sums = torch.zeros(spec.batch, spec.heads, 1, 2 * k + 1, width, device=spec.device, dtype=dtype)
        return cls(
            0, k, spec.head_dim, sums, sums.new_zeros(spec.batch, 1, 2 * k + 1), sums[:, :, :, 0], sums[:, 0, :, 0]
        )

    def prefilled(self, k: Tensor, v: Tensor, real: Tensor) -> SpanTree:
        """The tree after the first tokens ``k (B, H, T, D)``, ``v (B, H, T, D_v)`` (``real
        (B, T)`` bool), built at once from their pairwise level sums."""
        n, slots = k.shape[2], 2 * self.k + 1
        x = torch.cat([k, v], dim=-1).to(self.sums.dtype)
        per_level = level_sums(x, real.to(x.dtype), n.bit_length() + 1)
        sums = x.new_zeros(*x.shape[:2], len(per_level), slots, x.shape[-1])
        counts, open_sums = sums.new_zeros(x.shape[0], len(per_level), slots), sums[:, :, :, 0].clone()
        open_counts = counts[:, :, 0].clone()
        for level, (s, c) in enumerate(per_level):
            complete = n >> level
            kept = torch.arange(max(0, complete - slots), complete, device=x.device)
            sums[:, :, level, kept % slots], counts[:, level, kept % slots] = s[:, :, kept], c[:, kept]
            if s.shape[2] > complete:  # a partial last span: the open one
                open_sums[:, :, level], open_counts[:, level] = s[:, :, complete], c[:, complete]
        return SpanTree(n, self.k, self.head_dim, sums, counts, open_sums, open_counts)

    def step(self, q: Tensor, k: Tensor, v: Tensor, real: Tensor, scale: float) -> tuple[Tensor, SpanTree]:
        """Rows ``seen .. seen + T - 1`` of the causal forward for ``q, k (B, H, T, D)``,
        ``v (B, H, T, D_v)``, ``real (B, T)`` bool, a token at a time; and the tree after them."""
        tree, outs, x = self, [], torch.cat([k, v], dim=-1).to(self.sums.dtype)
        for t in range(q.shape[2]):
            tree = tree._add(x[:, :, t], real[:, t].to(x.dtype))
            outs.append(tree._attend(q[:, :, t].to(x.dtype), scale))
        return torch.stack(outs, dim=2).to(q.dtype), tree

    def _add(self, x: Tensor, real: Tensor) -> SpanTree:
        """One more token, ``x (B, H, D + D_v)``, ``real (B,)`` 0 or 1: in every open span; the
        spans it completes move to their ring slot; a new top level opens when the top closes."""
        p, (levels, slots) = self.seen, self.counts.shape[1:]
        open_sums = self.open_sums + (x * real[:, None, None])[:, :, None]
        open_counts = self.open_counts + real[:, None]
        closes = torch.tensor([(p + 1) % (1 << lv) == 0 for lv in range(levels)], device=x.device)  # [L]
        slot = torch.tensor([(p >> lv) % slots for lv in range(levels)], device=x.device)
        write = closes[:, None] & (torch.arange(slots, device=x.device) == slot[:, None])  # [L, slots]
        sums = torch.where(write[:, :, None], open_sums[:, :, :, None], self.sums)
        counts = torch.where(write, open_counts[:, :, None], self.counts)
        open_sums, open_counts = open_sums.masked_fill(closes[:, None], 0), open_counts.masked_fill(closes, 0)
        if p + 1 == 1 << (levels - 1):  # the top span closed: a level above opens holding it
            open_sums = torch.cat([open_sums, sums[:, :, -1:, 0]], dim=2)
            open_counts = torch.cat([open_counts, counts[:, -1:, 0]], dim=1)
            sums, counts = F.pad(sums, (0, 0, 0, 0, 0, 1)), F.pad(counts, (0, 0, 0, 1))
        return dataclasses.replace(
            self, seen=p + 1, sums=sums, counts=counts, open_sums=open_sums, open_counts=open_counts
        )

    def _attend(self, q: Tensor, scale: float) -> Tensor:
        """Row ``seen - 1`` for its query ``q (B, H, D)``: softmax over its leaves and left spans
        (their means), the spans that cover no real token left out."""
        i, slots = self.seen - 1, self.counts.shape[2]
        nodes = [(0, j) for j in range(max(0, i - self.k), i + 1)] + left_nodes(i, self.k)
        index = torch.tensor([level * slots + j % slots for level, j in nodes], device=q.device)
        counts = self.counts.flatten(1, 2)[:, index]  # [B, S]
        means = self.sums.flatten(2, 3)[:, :, index] / counts.clamp(min=1)[:, None, :, None]  # [B, H, S, D + D_v]
        scores = torch.einsum("bhd,bhsd->bhs", q, means[..., : self.head_dim]) * scale
        weights = normalize_scores(scores, (counts > 0)[:, None], "softmax")
        return torch.einsum("bhs,bhsd->bhd", weights, means[..., self.head_dim :])
