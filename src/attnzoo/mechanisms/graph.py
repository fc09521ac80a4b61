"""Graph attention: softmax attention only along the edges of a graph, through a CSR-style
gather (never a dense N x N mask), for any degree distribution.

With the dot score on the CPU, on a graph whose degrees are even enough for a table of each
node's neighbours (``patterns.Graph.row_table``), the attention runs as sparse CSR products over
the edges (the blocked backend's gathered path, ``backends.gathered``): O(E D) time, no copy of
the neighbours. Otherwise (a hub, the GAT score, other devices) nodes are bucketed by degree
(powers of two); each bucket gathers its nodes' neighbour keys and values into ``(B, H, nodes,
max degree of the bucket, D)``, so a hub does not pad every other node's neighbour list to its
own degree: memory is O(E * D) with at most 2x padding.

Two scores along an edge (i, j): ``score="dot"`` (default), the Transformer's ``q_i . k_j / sqrt(D)``
on the graph's neighbourhoods; ``score="gat"``, GAT's additive score (Velickovic et al. 2018, eq. 3)
``e_ij = LeakyReLU_0.2(a^T [W h_i || W h_j])`` with ``q_i, k_j`` as the projected features
``W h_i, W h_j``: ``a^T [q_i || k_j] = a_1 . q_i + a_2 . k_j``, one learned ``a`` per head. Both
terms are computed once per node and added per edge, so GAT is O(E) too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.backends.call import Call, rows_at
from attnzoo.backends.gathered import gathered_attention, not_gathered_reasons
from attnzoo.backends.reference import normalize_scores, visible_pairs
from attnzoo.mechanisms._ops import compute_dtype, default_scale, real_tokens
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.sparse_shaped import EdgeList
from attnzoo.patterns.atomic import Graph, causal
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


@dataclass(frozen=True, kw_only=True)
class GraphAttentionConfig(EdgeList, Config):
    """Config of ``graph_attention``.

    Args:
        edges: ``(query, key)`` pairs: node ``query`` attends to node ``key``. Default a 2-cycle.
        n: number of nodes; inputs must have N = n. Default 2.
        self_loops: add ``(i, i)`` for every node. Default True.
        scale: score scale of ``score="dot"``; default ``1 / sqrt(D)``.
        score: ``"dot"`` (default) or ``"gat"`` (see the module docstring).
        heads, head_dim: H and D of the inputs, the shape of GAT's per-head ``a`` (``"gat"``
            only; ``MultiHeadAttention`` fills them in). Defaults 8, 64.
    """

    scale: float | None = None
    score: Literal["dot", "gat"] = "dot"
    heads: int = bounded(8, ge=1)
    head_dim: int = bounded(64, ge=1)

    def validate(self) -> None:
        if self.score == "gat" and self.scale is not None:
            raise ValueError("scale applies to score='dot' only; GAT's additive score is not scaled, drop scale=")
        self.graph()


def degree_buckets(graph: Graph) -> list[tuple[Tensor, Tensor]]:
    """``[(nodes (Nb,), neighbours (Nb, d_b)), ...]``: nodes grouped by ``ceil(log2(degree))``,
    each with its neighbour keys padded by -1 to the bucket's largest degree."""
    table = graph.neighbours()  # (n, max degree), -1 padded, from the sorted edge list
    degree = (table >= 0).sum(1)
    bucket = torch.ceil(torch.log2(degree.clamp(min=1).double())).long()
    out = []
    for b in torch.unique(bucket[degree > 0]).tolist():
        nodes = ((bucket == b) & (degree > 0)).nonzero().flatten()
        width = int(degree[nodes].max())
        out.append((nodes, table[nodes, :width]))
    return out


NEGATIVE_SLOPE = 0.2  # GAT's LeakyReLU slope (Velickovic et al. 2018, section 2.1)


def gat_terms(q: Tensor, k: Tensor, attention_vector: Tensor) -> tuple[Tensor, Tensor]:
    """``(a_1 . q_i, a_2 . k_j)`` per node, each ``(B, H, N)``: GAT's score split in its two halves."""
    a = attention_vector.to(q.dtype)  # [H, 2, D]
    return torch.einsum("bhnd,hd->bhn", q, a[:, 0]), torch.einsum("bhnd,hd->bhn", k, a[:, 1])


@dataclass(frozen=True, slots=True)
class GraphArgs:
    """What ``graph_attention`` and its dense twin take besides q, k, v (one object, so the two
    cannot drift apart): the ``graph``; ``causal`` keeps edges with key <= query;
    ``key_mask (B, N)``, True = real; ``scale`` of ``q_i . k_j`` (default ``1 / sqrt(D)``);
    ``attention_vector``, GAT's ``a`` as ``(H, 2, D)``: when given, the score of edge (i, j) is
    ``LeakyReLU(a[h, 0] . q_i + a[h, 1] . k_j)`` instead of ``q_i . k_j * scale``."""

    graph: Graph
    causal: bool = False
    key_mask: Tensor | None = None
    scale: float | None = None
    attention_vector: Tensor | None = None


def graph_attention(q: Tensor, k: Tensor, v: Tensor, args: GraphArgs) -> Tensor:
    """Attention of each node over its neighbours only (``GraphArgs`` says how).

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)`` with N = ``args.graph.n`` -> ``(B, H, N, Dv)``.
    """
    scale, compute = default_scale(args.scale, q.shape[-1]), compute_dtype(q)
    a, mask = args.attention_vector, args.key_mask
    if a is not None:
        from_query, from_key = gat_terms(q.to(compute), k.to(compute), a)
    out = q.new_zeros(q.shape[:3] + (v.shape[-1],), dtype=compute)
    for nodes, neighbours in degree_buckets(args.graph):
        nodes, neighbours = nodes.to(q.device), neighbours.to(q.device)
        keys = neighbours.clamp(min=0)
        v_b = _neighbour_rows(v, keys).to(compute)  # [B, H, Nb, d, Dv]
        if a is None:
            q_b, k_b = (
                rows_at(q, nodes).to(compute),
                _neighbour_rows(k, keys).to(compute),
            )  # [B, H, Nb, D], [B, H, Nb, d, D]
            scores = torch.einsum("bhnd,bhnkd->bhnk", q_b, k_b) * scale
        else:
            scores = F.leaky_relu(from_query[:, :, nodes, None] + from_key[:, :, keys], NEGATIVE_SLOPE)  # [B, H, Nb, d]
        visible = (neighbours >= 0)[None, None]
        if args.causal:
            visible = visible & (neighbours <= nodes[:, None])[None, None]
        if mask is not None:
            visible = visible & mask[:, keys][:, None]
        weights = normalize_scores(scores, visible, "softmax")
        out = out.index_copy(2, nodes, torch.einsum("bhnk,bhnkd->bhnd", weights, v_b))
    return out.to(q.dtype)


def _neighbour_rows(x: Tensor, keys: Tensor) -> Tensor:
    """``x[:, :, keys]`` for ``x (B, H, N, e)`` and ``keys (Nb, d)`` -> ``(B, H, Nb, d, e)``, through
    ``rows_at``: advanced indexing's backward (an accumulating ``index_put_``) took 91 ms fwd+bwd
    for 262K rows of 64 where this takes 26."""
    return rows_at(x, keys.flatten()).view(*x.shape[:2], *keys.shape, x.shape[-1])


def reference_graph_attention(
    q: Tensor, k: Tensor, v: Tensor, args: GraphArgs, return_weights: bool = False
) -> Weighted:
    """Masked dense attention over the adjacency matrix (the oracle for ``graph_attention``): the
    ``(N, N)`` scores, ``q_i . k_j * scale`` or with ``args.attention_vector`` GAT's
    ``e_ij = LeakyReLU(a_1 . q_i + a_2 . k_j)``, masked to the edges, softmax per row."""
    compute, graph, mask = compute_dtype(q), args.graph, args.key_mask
    qc, kc = q.to(compute), k.to(compute)
    if args.attention_vector is None:
        scores = torch.einsum("bhid,bhjd->bhij", qc, kc) * default_scale(args.scale, q.shape[-1])
    else:
        from_query, from_key = gat_terms(qc, kc, args.attention_vector)
        scores = F.leaky_relu(from_query[..., :, None] + from_key[..., None, :], NEGATIVE_SLOPE)  # [B, H, N, N]
    batch, heads, n, _ = q.shape
    mask_mod = graph.mask_mod_for(graph.n, graph.n, q.device)
    visible = visible_pairs(batch, heads, n, n, causal=args.causal, key_mask=mask, mask_mod=mask_mod, device=q.device)
    weights = normalize_scores(scores, visible, "softmax")
    out = torch.einsum("bhij,bhjd->bhid", weights, v.to(compute)).to(q.dtype)
    return (out, weights) if return_weights else out


@register(
    "graph_attention",
    config=GraphAttentionConfig,
    family="graph",
    summary="Attention along the edges of a graph through a CSR-style gather (any degree).",
    paper="Velickovic et al. 2018 (GAT), https://arxiv.org/abs/1710.10903",
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True),
    complexity=Complexity(time="O(E D)", memory="O(E D)", subquadratic_memory=True),
    notes=(
        "not a drop-in for pretrained attention: needs a graph (edge list) as input",
        "edges are (query, key) pairs; causal keeps edges with key <= query",
        "score='dot' on the CPU with even degrees (patterns.Graph.row_table): CSR products over the edges "
        "(the blocked backend's gathered path); else nodes are bucketed by degree so a hub does not pad "
        "every neighbour list",
        "score='dot' (default): the scaled dot product q_i.k_j/sqrt(D) along the edges - Transformer "
        "scores on GAT's neighbourhoods, not GAT's score; score='gat': GAT's additive score "
        "LeakyReLU_0.2(a_1.q_i + a_2.k_j) with one learned a per head (needs heads, head_dim), "
        "q and k standing for GAT's shared projection W h (here they may differ), O(E)",
        "causal=True also takes the first N < n nodes (a prefix: its rows never see a later node; run over all n, "
        "the rest as padding)",
        "decode step: token t is node t (n at most); every key kept (a KV cache), node t attends over its "
        "edges (t, j <= t), found in the sorted edge list: O(deg(t) D + log E) per token, O(t D) memory",
    ),
)
class GraphAttention(Attention):
    """Graph attention; see the module docstring."""

    config: GraphAttentionConfig

    def __init__(self, config: GraphAttentionConfig) -> None:
        super().__init__(config)
        self.graph = config.graph()
        self.attention_vector = None
        if config.score == "gat":
            # GAT's a in R^{2D} per head: Glorot-uniform for a map from 2D inputs to 1 output.
            bound = math.sqrt(6.0 / (2 * config.head_dim + 1))
            self.attention_vector = nn.Parameter(torch.empty(config.heads, 2, config.head_dim).uniform_(-bound, bound))

    def _check_n(self, n: int, causal: bool) -> None:
        if n > self.graph.n or (n < self.graph.n and not causal):
            raise ValueError(
                f"graph_attention was built for n={self.graph.n} nodes, got N={n}; set n= in the config "
                "(causal=True also takes the first N < n nodes)"
            )

    def _check_heads(self, q: Tensor) -> None:
        if self.attention_vector is not None and q.shape[1::2] != self.attention_vector.shape[0::2]:
            heads, _, head_dim = self.attention_vector.shape
            raise ValueError(
                f"graph_attention (score='gat') was built for heads={heads}, head_dim={head_dim} but q has "
                f"H={q.shape[1]}, D={q.shape[3]}; build it with heads={q.shape[1]}, head_dim={q.shape[3]}"
            )

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        n, (q, k, v, args) = q.shape[2], self._on_all_nodes(q, k, v, args)
        call = self._sparse_rows_call(q, k, v, args)
        if call is not None:
            return gathered_attention(call)[:, :, :n]
        return graph_attention(q, k, v, self._graph_args(q, args))[:, :, :n]

    def _sparse_rows_call(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Call | None:
        """Dot scores on the CPU, on a graph whose degrees are even enough for a row table
        (``patterns.Graph.row_table``): the call of the blocked backend's gathered path (CSR
        products over each node's neighbours, never a gathered copy of them; ``backends.gathered``),
        else None (degree buckets, ``graph_attention``). 1K nodes of degree 32, fwd+bwd: 122 ->
        15 ms (``benchmarks/ab-graph-rows-cpu.txt``)."""
        if self.attention_vector is not None or q.device.type != "cpu":
            return None
        pattern = self.graph & causal() if args.causal else self.graph
        scale = default_scale(self.config.scale, q.shape[-1])
        call = Call(q, k, v, pattern, args.key_mask, None, scale, block=128)  # the gathered path has no tiles
        return None if not_gathered_reasons(call) else call

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        n, (q, k, v, args) = q.shape[2], self._on_all_nodes(q, k, v, args)
        out, weights = reference_graph_attention(q, k, v, self._graph_args(q, args), return_weights=True)
        return (out[:, :, :n], weights[:, :, :n, :n]) if return_weights else out[:, :, :n]

    def _on_all_nodes(
        self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs
    ) -> tuple[Tensor, Tensor, Tensor, AttendArgs]:
        """The inputs over all n nodes. Causal, the first N < n nodes are a prefix whose rows
        never see a later node (what a decode step has produced so far): the later nodes are
        added as padding, and their rows are dropped after."""
        self._check_n(q.shape[2], args.causal)
        missing = self.graph.n - q.shape[2]
        if not missing:
            return q, k, v, args
        real = real_tokens(args.key_mask, q.shape[0], q.shape[2], q.device)
        args = replace(args, key_mask=F.pad(real, (0, missing), value=False))
        return (*(F.pad(x, (0, 0, 0, missing)) for x in (q, k, v)), args)

    def _graph_args(self, q: Tensor, args: AttendArgs) -> GraphArgs:
        """What ``graph_attention`` and its dense twin share, once q is checked against the
        attention vector's shape."""
        self._check_heads(q)
        return GraphArgs(self.graph, args.causal, args.key_mask, self.config.scale, self.attention_vector)

    def _init_state(self, spec: StateSpec) -> KVCache:
        """Every key and value (a node's edges may reach any earlier node), room for n at most."""
        return KVCache.for_state(replace(spec, capacity=min(spec.capacity, self.graph.n)))

    def _step(self, state: KVCache, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, KVCache]:
        """Rows ``t .. t + T - 1`` of the causal forward: each new node over its edges to nodes
        up to itself."""
        start, end = state.length, state.length + q.shape[2]
        if end > self.graph.n:
            raise ValueError(
                f"graph_attention: step() would reach node {end - 1}, but the graph has n={self.graph.n} nodes "
                "(token t is node t); build it with a larger graph"
            )
        self._check_heads(q)
        state = state.append(k, v, args.key_mask)
        table = self._edges_of(start, end).to(q.device)  # [T, max degree], -1 padded
        visible = (table >= 0) & (table <= torch.arange(start, end, device=q.device)[:, None])
        keys = torch.where(visible, table, 0)  # future keys are not in the cache yet
        if state.key_mask is not None:
            visible = visible & state.key_mask[:, keys]
        out = self._over_edges(q, state.k[:, :, keys], state.v[:, :, keys], visible)
        return nan_rows_of_non_finite_queries(out, q), state

    def _edges_of(self, start: int, end: int) -> Tensor:
        """``(end - start, max degree)``: the keys nodes ``start .. end-1`` attend, padded with -1,
        from their slice of the sorted edge list (O(log E + their edges), not a table of all n)."""
        edges, n = self.graph.edge_keys, self.graph.n
        lo, hi = torch.searchsorted(edges, torch.tensor([start * n, end * n])).tolist()
        rows = edges[lo:hi] // n - start
        degree = torch.bincount(rows, minlength=end - start)
        table = torch.full((end - start, max(int(degree.max()), 1)), -1, dtype=torch.long)
        table[rows, torch.arange(rows.numel()) - (degree.cumsum(0) - degree)[rows]] = edges[lo:hi] % n
        return table

    def _over_edges(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
        """Each query of ``q (B, H, T, D)`` over its edges' keys ``k (B, H, T, E, D)`` and values
        ``v (B, H, T, E, D_v)``, where ``visible ((B,) T, E)``, with the module's score."""
        compute = compute_dtype(q)
        qc, k, v = q.to(compute), k.to(compute), v.to(compute)
        if self.attention_vector is None:
            scores = torch.einsum("bhtd,bhted->bhte", qc, k) * default_scale(self.config.scale, q.shape[-1])
        else:
            from_query, from_key = gat_terms(qc, k.flatten(2, 3), self.attention_vector)
            scores = F.leaky_relu(from_query[..., None] + from_key.unflatten(2, k.shape[2:4]), NEGATIVE_SLOPE)
        weights = normalize_scores(scores, visible.unsqueeze(-3), "softmax")  # [B, H, T, E]
        return torch.einsum("bhte,bhted->bhtd", weights, v).to(q.dtype)
