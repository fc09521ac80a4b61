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
* The fast path pools the tree by pairwise sums (``O(N D)``); each block of ``BLOCK`` tokens
  attends the union of its tokens' nodes (``block_plan``: about twice a token's own ``S = O(k
  log N)`` nodes), gathered once per block, under a membership mask: small dense GEMMs; never
  ``N x N``.
* ``reference_hierarchical`` (the oracle) builds everything densely and independently: a dense
  ``(T, N)`` membership matrix for pooling, and a dense ``(N, T)`` visibility mask computed by a
  vectorised form of the same rule, then plain masked softmax over the extended key set.
* ``implied_attention`` spreads each node's weight evenly over the real tokens it covers, so
  ``implied_attention(q, k) @ v == forward(q, k, v)``.
* ``step`` (causal decoding) keeps no token: per level, the sums of the last ``2k + 1`` complete
  spans and of the open one (``span_tree.SpanTree``), O(k log t D) per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from attnzoo.backends.call import rows_at
from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import (
    block_union,
    compute_dtype,
    default_scale,
    in_slabs,
    masked_softmax,
    mean_keys,
    real_tokens,
)
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.span_tree import SpanTree, left_nodes, level_sums
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
        nodes = [(0, j) for j in range(max(0, i - k), hi + 1)] + left_nodes(i, k)
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
    """Mean of real tokens per node: ``x (B, H, N, D)``, ``real (B, N)`` float -> ``(nodes
    (B, H, T, D), counts (B, T))``, levels in the order of the extended key set."""
    levels = level_sums(x, real, num_levels(x.shape[2]) + 1)
    sums, counts = torch.cat([s for s, _ in levels], dim=2), torch.cat([c for _, c in levels], dim=1)
    return sums / counts.clamp(min=1)[:, None, :, None], counts


#: Query rows per block of the fast path. Tokens of a block share most of their span nodes, so
#: a block attends the union of its tokens' nodes (about 4 k log N + 2 BLOCK at BLOCK = 32) with a
#: membership mask: dense GEMMs on small tiles, where gathering each token's own nodes made a
#: ``(B, H, N, S, D)`` copy of K and of V.
BLOCK = 32


@dataclass(frozen=True)
class BlockPlan:
    """The graph by query blocks: ``cols (blocks, W)`` the extended-key indices a block attends
    (the union of its tokens' nodes, padded with 0), ``member (blocks, BLOCK, W)`` which of them
    each token of the block attends (False in padding rows and padding columns)."""

    cols: Tensor
    member: Tensor


@lru_cache(maxsize=64)
def block_plan(n: int, k: int, causal: bool) -> BlockPlan:
    """``BlockPlan`` of ``hierarchical_graph(n, k, causal)`` (cached per ``(n, k, causal)``)."""
    return BlockPlan(*block_union(*_graph_index(n, k, causal), BLOCK))


def hierarchical_attention(q: Tensor, k: Tensor, v: Tensor, cfg: HierarchicalConfig, args: AttendArgs) -> Tensor:
    """The fast path, by query blocks (``block_plan``): each block of ``BLOCK`` tokens attends the
    union of its tokens' span nodes, gathered once per block, under the membership mask; never
    ``N x N`` (scores are ``(B, H, N, W)``, ``W = O(k log N + BLOCK)``), in slabs of heads whose
    gathered nodes stay under ``_ops.SLAB_BYTES`` (``in_slabs``).
    ``cfg.k`` and ``cfg.scale``, ``args.causal`` and ``args.key_mask`` are read."""
    plan = block_plan(q.shape[2], cfg.k, args.causal)
    row_bytes = plan.cols.numel() * max(q.shape[-1], v.shape[-1]) * torch.finfo(compute_dtype(q)).bits // 8
    run = lambda q, k, v, mask: _hierarchical_slab(q, k, v, cfg, mask, plan)  # noqa: E731
    return in_slabs(run, q, k, v, args.key_mask, row_bytes)


def _hierarchical_slab(
    q: Tensor, k: Tensor, v: Tensor, cfg: HierarchicalConfig, key_mask: Tensor | None, plan: BlockPlan
) -> Tensor:
    """``hierarchical_attention`` on one slab of heads (and batch rows, ``key_mask`` theirs)."""
    b, h, n, d = q.shape
    dt = compute_dtype(q)
    qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
    real = real_tokens(key_mask, b, n, q.device).to(dt)
    k_nodes, counts = _pool_tree(kc, real)
    v_nodes, _ = _pool_tree(vc, real)
    cols, member = plan.cols.to(q.device), plan.member.to(q.device)
    blocks, width = cols.shape

    def gathered(nodes: Tensor) -> Tensor:  # (B, H, T, e) -> (B, H, blocks, W, e)
        return rows_at(nodes, cols.flatten()).view(b, h, blocks, width, -1)

    qb = torch.nn.functional.pad(qc * default_scale(cfg.scale, d), (0, 0, 0, blocks * BLOCK - n))
    qb = qb.view(b, h, blocks, BLOCK, d)  # scaled here: no pass over the score tile
    scores = qb @ gathered(k_nodes).transpose(-1, -2)  # (B, H, blocks, BLOCK, W)
    visible = (member[None] & (counts > 0)[:, cols][:, :, None, :])[:, None]  # (B, 1, blocks, BLOCK, W)
    weights = masked_softmax(scores, visible)
    out = (weights @ gathered(v_nodes)).view(b, h, blocks * BLOCK, -1)[:, :, :n]
    return out.to(q.dtype)


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
    q: Tensor, k: Tensor, v: Tensor, cfg: HierarchicalConfig, args: AttendArgs, return_weights: bool = False
) -> Weighted:
    """The dense oracle: masked softmax over the whole extended key set ``[tokens; all nodes]``
    (``cfg.k``, ``cfg.scale``, ``args.causal``, ``args.key_mask`` read).

    With ``return_weights`` also returns the ``(B, H, N, N)`` implied attention matrix (each
    node's weight spread evenly over the real tokens it covers).
    """
    b, _, n, d = q.shape
    dt = compute_dtype(q)
    qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
    real = real_tokens(args.key_mask, b, n, q.device).to(dt)
    member = dense_membership(n, q.device).to(dt)[None] * real[:, None, :]  # (B, T, N)
    counts = member.sum(dim=-1)
    pool = member / counts.clamp(min=1)[..., None]
    k_nodes = torch.einsum("btn,bhnd->bhtd", pool, kc)
    v_nodes = torch.einsum("btn,bhnd->bhtd", pool, vc)
    scores = torch.einsum("bhnd,bhtd->bhnt", qc, k_nodes) * default_scale(cfg.scale, d)
    visible = (dense_graph_mask(n, cfg.k, args.causal, q.device)[None] & (counts > 0)[:, None, :])[:, None]
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
    paper="Ye et al. 2019, BP-Transformer: Modelling Long-Range Context via Binary Partitioning, "
    "https://arxiv.org/abs/1911.04070",
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True),
    complexity=Complexity(time="O(k N log N D)", memory="O(k N log N)", subquadratic_memory=True),
    notes=(
        "span node key/value = mean over the real (unpadded) tokens it covers; all-padding spans are invisible",
        "span nodes are recomputed in every layer from that layer's token keys/values: they have no hidden state "
        "of their own (in BPT they are graph nodes whose states each layer updates from the tokens they cover)",
        "per side, one extra finer node per level aligns span boundaries: a token's spans partition the sequence",
        "causal is strong: only spans made entirely of positions <= i",
        "k >= N - 1 is exactly full softmax attention",
        "a query with no visible key returns zeros; the graph is built in Python and cached per (N, k, causal)",
        "fast path by blocks of 32 queries: each block scores the union of its tokens' nodes (about twice a token's "
        "own), masked to each token's set, so it computes ~2x the useful pairs in exchange for dense small GEMMs",
        "decode step: per level, the sums of the last 2k + 1 complete spans and of the open one (no token kept "
        "beyond them): O(k log t D) memory and O(k log t D) time per token; the first step (a prompt) runs the "
        "forward, a later step of T tokens is T single-token steps",
    ),
)
class HierarchicalAttention(Attention):
    """BP-Transformer attention (see the module docstring for the exact rule)."""

    config: HierarchicalConfig

    def keys_per_query(self, n: int, causal: bool) -> float:
        """The span nodes of each token's graph row (``hierarchical_graph``)."""
        return mean_keys(_graph_index(n, self.config.k, causal)[1].sum(-1))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return hierarchical_attention(q, k, v, self.config, args)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """The dense oracle with this module's config; its weights spread each node's weight
        evenly over the real tokens the node covers."""
        return reference_hierarchical(q, k, v, self.config, args, return_weights)

    def _init_state(self, spec: StateSpec) -> SpanTree:
        """No span seen yet (``span_tree.SpanTree``)."""
        return SpanTree.empty(spec, self.config.k)

    def _step(self, state: SpanTree, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, SpanTree]:
        """The new tokens' rows of the causal forward from the spans seen so far; a first step
        (a prompt) runs the forward and keeps the spans it leaves."""
        real = real_tokens(args.key_mask, q.shape[0], q.shape[2], q.device)
        if state.seen == 0:
            out, state = hierarchical_attention(q, k, v, self.config, args), state.prefilled(k, v, real)
        else:
            out, state = state.step(q, k, v, real, default_scale(self.config.scale, q.shape[-1]))
        return nan_rows_of_non_finite_queries(out, q), state
