"""Hierarchical attention over a binary tree of span nodes: BP-Transformer (Ye et al. 2019).

The tree
--------
Level 0 holds the N tokens. A level-``l`` node ``j`` covers the ``2^l`` consecutive positions
``[j 2^l, min((j+1) 2^l, N))`` (the last node of a level may be partial); levels run up to
``L = ceil(log2 N)``, whose single node covers the whole sequence. A node's key and value are
the **mean** of the keys / values of the *real* tokens it covers (padding excluded); a node that
covers only padding is invisible. Nodes are stored level by level in one "extended" key set
``[tokens; level 1; level 2; ...]`` of ``T = sum_l ceil(N / 2^l) < 2N + L`` entries.

Which nodes a token attends to (the BPT rule, made exact)
---------------------------------------------------------
Token ``i`` attends to

* its nearby leaves: tokens ``j`` with ``|i - j| <= k`` (causal: ``i - k <= j <= i``);
* on each side, going outwards level by level, the ``k`` nearest level-``l`` nodes that do not
  overlap what the finer levels already cover. The region covered after level ``l-1`` ends at a
  multiple of ``2^(l-1)``; when that boundary is not a multiple of ``2^l`` (so the next level-``l``
  node would leave a gap), one extra level-``(l-1)`` node fills the gap first. This alignment node
  is our (documented) approximation of BPT's construction; it keeps the key set **gap-free and
  non-overlapping**: the spans a token attends to partition the whole sequence (causal: all of
  ``[0, i]``), each position covered exactly once.

So a token attends to at most ``2k + 1 + 2 (k + 1) L`` nodes, ``O(k log N)``; total work
``O(k N log N D)``. With ``k >= N - 1`` every token's leaves already cover the sequence and the
mechanism is exactly full softmax attention over tokens.

Causal is meant strongly: token ``i`` sees only spans made entirely of positions ``<= i`` (its
leaves ``i-k..i`` and the left-side spans, which all end before ``i - k``).

Paths
-----
* ``hierarchical_graph(n, k, causal)``: the graph, per token a list of ``(level, node)`` pairs.
* The fast path pools the tree by pairwise sums (``O(N D)``), gathers each token's selected node
  keys / values into ``(B, H, N, S, D)`` with ``S = O(k log N)`` and runs a masked softmax; never
  ``N x N``.
* ``reference_hierarchical`` (the oracle) builds everything densely and independently: a dense
  ``(T, N)`` membership matrix for pooling, and a dense ``(N, T)`` visibility mask computed by a
  vectorised form of the same rule, then plain masked softmax over the extended key set.
* ``implied_attention`` spreads each node's weight evenly over the real tokens it covers, so
  ``implied_attention(q, k) @ v == forward(q, k, v)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


@dataclass(frozen=True, kw_only=True)
class HierarchicalConfig(Config):
    """Config of ``hierarchical``.

    Args:
        k: neighbourhood size: leaves within distance ``k`` and ``k`` nodes per level per side.
        scale: score scale; default None means ``1 / sqrt(D)``.
    """

    k: int = bounded(4, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")


def num_levels(n: int) -> int:
    """``L = ceil(log2 n)``: the top level, whose single node covers all ``n`` positions."""
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def level_sizes(n: int) -> list[int]:
    """Number of nodes at each level 0..L: ``ceil(n / 2^level)``."""
    return [-(-n // (1 << level)) for level in range(num_levels(n) + 1)]


def level_offsets(n: int) -> list[int]:
    """Where each level starts in the extended key set ``[tokens; level 1; ...]``."""
    sizes = level_sizes(n)
    return [sum(sizes[:level]) for level in range(len(sizes))]


def hierarchical_graph(n: int, k: int, causal: bool) -> list[list[tuple[int, int]]]:
    """For each token ``i < n`` the ``(level, node index)`` pairs it attends to (module docstring)."""
    top = num_levels(n)
    graph = []
    for i in range(n):
        hi = i if causal else min(n - 1, i + k)
        nodes = [(0, j) for j in range(max(0, i - k), hi + 1)]
        # Left side: positions < q are still uncovered; q is a multiple of 2^(l-1) entering level l.
        q = i - k
        for level in range(1, top + 1):
            if q <= 0:
                break
            w = 1 << (level - 1)
            if q % (2 * w):
                nodes.append((level - 1, q // w - 1))
                q -= w
            for t in range(k):
                j = q // (2 * w) - 1 - t
                if j < 0:
                    break
                nodes.append((level, j))
            q -= k * 2 * w
        if not causal:
            # Right side: positions >= p are still uncovered.
            p = i + k + 1
            for level in range(1, top + 1):
                if p >= n:
                    break
                w = 1 << (level - 1)
                if p % (2 * w):
                    nodes.append((level - 1, p // w))
                    p += w
                for t in range(k):
                    j = p // (2 * w) + t
                    if j * 2 * w >= n:
                        break
                    nodes.append((level, j))
                p += k * 2 * w
        graph.append(nodes)
    return graph


@lru_cache(maxsize=64)
def _graph_index(n: int, k: int, causal: bool) -> tuple[Tensor, Tensor]:
    """The graph as padded flat indices into the extended key set: ``(index (N, S), valid (N, S))``."""
    offsets = level_offsets(n)
    graph = hierarchical_graph(n, k, causal)
    s = max(len(nodes) for nodes in graph)
    index = torch.zeros(n, s, dtype=torch.long)
    valid = torch.zeros(n, s, dtype=torch.bool)
    for i, nodes in enumerate(graph):
        flat = [offsets[level] + j for level, j in nodes]
        index[i, : len(flat)] = torch.tensor(flat, dtype=torch.long)
        valid[i, : len(flat)] = True
    return index, valid


def _pool_tree(x: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """Mean of real tokens per node, by pairwise sums: ``x (B, H, N, D)``, ``real (B, N)`` float
    -> ``(nodes (B, H, T, D), counts (B, T))``."""
    sums, counts = x * real[:, None, :, None], real
    all_sums, all_counts = [sums], [counts]
    for _ in range(num_levels(x.shape[2])):
        if sums.shape[2] % 2:
            sums = torch.cat([sums, sums.new_zeros(sums.shape[:2] + (1, sums.shape[3]))], dim=2)
            counts = torch.cat([counts, counts.new_zeros(counts.shape[0], 1)], dim=1)
        sums = sums.unflatten(2, (-1, 2)).sum(dim=3)
        counts = counts.unflatten(1, (-1, 2)).sum(dim=2)
        all_sums.append(sums)
        all_counts.append(counts)
    sums, counts = torch.cat(all_sums, dim=2), torch.cat(all_counts, dim=1)
    return sums / counts.clamp(min=1)[:, None, :, None], counts


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _real(key_padding_mask: Tensor | None, b: int, n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    if key_padding_mask is None:
        return torch.ones(b, n, device=device, dtype=dtype)
    return key_padding_mask.to(device=device, dtype=dtype)


def hierarchical_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    k_near: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """The fast path: gather ``S = O(k log N)`` node keys / values per token; never ``N x N``."""
    b, _, n, d = q.shape
    dt = _work_dtype(q)
    qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
    real = _real(key_padding_mask, b, n, q.device, dt)
    k_nodes, counts = _pool_tree(kc, real)
    v_nodes, _ = _pool_tree(vc, real)
    index, valid = _graph_index(n, k_near, causal)
    index, valid = index.to(q.device), valid.to(q.device)
    kg, vg = k_nodes[:, :, index], v_nodes[:, :, index]  # (B, H, N, S, D)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("bhnd,bhnsd->bhns", qc, kg) * scale
    visible = (valid[None] & (counts > 0)[:, index])[:, None]  # (B, 1, N, S)
    weights = normalize_scores(scores, visible, "softmax")
    return torch.einsum("bhns,bhnsd->bhnd", weights, vg).to(q.dtype)


def dense_membership(n: int, device: torch.device | None = None) -> Tensor:
    """``(T, N)`` bool: node ``t`` of the extended key set covers position ``j``."""
    pos = torch.arange(n, device=device)
    rows = [
        (pos[None, :] >> level) == torch.arange(size, device=device)[:, None]
        for level, size in enumerate(level_sizes(n))
    ]
    return torch.cat(rows, dim=0)


def dense_graph_mask(n: int, k: int, causal: bool, device: torch.device | None = None) -> Tensor:
    """``(N, T)`` bool: token ``i`` attends to node ``t``; the rule of ``hierarchical_graph``,
    computed independently (vectorised over all tokens at once)."""
    sizes = level_sizes(n)
    i = torch.arange(n, device=device)
    blocks = [torch.zeros(n, size, dtype=torch.bool, device=device) for size in sizes]
    j0 = torch.arange(n, device=device)
    dist = i[:, None] - j0[None, :]
    blocks[0] |= (dist >= 0) & (dist <= k) if causal else dist.abs() <= k
    q = i - k
    p = i + k + 1
    for level in range(1, len(sizes)):
        w, size = 1 << (level - 1), 1 << level
        starts = torch.arange(sizes[level], device=device) * size
        prev = torch.arange(sizes[level - 1], device=device)
        # left
        align = (q > 0) & (q % size != 0)
        blocks[level - 1] |= align[:, None] & (prev[None, :] == (q // w - 1)[:, None])
        q = torch.where(align, q - w, q)
        act = q > 0
        blocks[level] |= (
            act[:, None] & (starts[None, :] + size <= q[:, None]) & (starts[None, :] >= (q - k * size)[:, None])
        )
        q = torch.where(act, q - k * size, q)
        if not causal:
            align = (p < n) & (p % size != 0)
            blocks[level - 1] |= align[:, None] & (prev[None, :] == (p // w)[:, None])
            p = torch.where(align, p + w, p)
            act = p < n
            blocks[level] |= (
                act[:, None] & (starts[None, :] >= p[:, None]) & (starts[None, :] < (p + k * size)[:, None])
            )
            p = torch.where(act, p + k * size, p)
    return torch.cat(blocks, dim=1)


def reference_hierarchical(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    k_near: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The dense oracle: masked softmax over the whole extended key set ``[tokens; all nodes]``.

    With ``return_weights`` also returns the ``(B, H, N, N)`` implied attention matrix (each
    node's weight spread evenly over the real tokens it covers).
    """
    b, _, n, d = q.shape
    dt = _work_dtype(q)
    qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
    real = _real(key_padding_mask, b, n, q.device, dt)
    member = dense_membership(n, q.device).to(dt)[None] * real[:, None, :]  # (B, T, N)
    counts = member.sum(dim=-1)
    pool = member / counts.clamp(min=1)[..., None]
    k_nodes = torch.einsum("btn,bhnd->bhtd", pool, kc)
    v_nodes = torch.einsum("btn,bhnd->bhtd", pool, vc)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("bhnd,bhtd->bhnt", qc, k_nodes) * scale
    visible = (dense_graph_mask(n, k_near, causal, q.device)[None] & (counts > 0)[:, None, :])[:, None]
    weights = normalize_scores(scores, visible, "softmax")
    out = torch.einsum("bhnt,bhtd->bhnd", weights, v_nodes).to(q.dtype)
    if not return_weights:
        return out
    return out, torch.einsum("bhnt,btm->bhnm", weights, pool)


@register(
    "hierarchical",
    config=HierarchicalConfig,
    family="hierarchical",
    summary="BP-Transformer: tokens attend to nearby leaves and to mean-pooled spans of growing size further away.",
    paper="Ye et al. 2019, BP-Transformer: Modelling Long-Range Context via Binary Partitioning, https://arxiv.org/abs/1911.04070",
    capabilities=Capabilities(causal=True, key_padding=True, cross_attention=False, score_mod=False),
    complexity=Complexity(time="O(k N log N D)", memory="O(k N log N)", subquadratic_memory=True),
    notes=(
        "span node key/value = mean over the real (unpadded) tokens it covers; all-padding spans are invisible",
        "span nodes are recomputed in every layer from that layer's token keys/values: they have no hidden state "
        "of their own (in BPT they are graph nodes whose states each layer updates from the tokens they cover)",
        "per side, one extra finer node per level aligns span boundaries: a token's spans partition the sequence",
        "causal is strong: only spans made entirely of positions <= i",
        "k >= N - 1 is exactly full softmax attention",
        "a query with no visible key returns zeros; the graph is built in Python and cached per (N, k, causal)",
    ),
)
class HierarchicalAttention(Attention):
    """BP-Transformer attention (see the module docstring for the exact rule)."""

    config: HierarchicalConfig

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return hierarchical_attention(q, k, v, **self._settings(args))

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """The dense oracle with this module's config; its weights spread each node's weight
        evenly over the real tokens the node covers."""
        return reference_hierarchical(q, k, v, **self._settings(args), return_weights=return_weights)

    def _settings(self, args: AttendArgs) -> dict[str, Any]:
        """The keyword arguments the fast path and its dense twin share, written once."""
        cfg = self.config
        return dict(k_near=cfg.k, causal=args.causal, key_padding_mask=args.key_padding_mask, scale=cfg.scale)
