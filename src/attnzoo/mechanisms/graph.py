"""Graph attention: softmax attention only along the edges of a graph, through a CSR-style
gather (never a dense N x N mask), for any degree distribution.

Nodes are bucketed by degree (powers of two); each bucket gathers its nodes' neighbour keys and
values into ``(B, H, nodes, max degree of the bucket, D)``, so a hub does not pad every other
node's neighbour list to its own degree: memory is O(E * D) with at most 2x padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnzoo.backends.reference import normalize_scores, reference_attention
from attnzoo.mechanisms.base import Attention
from attnzoo.patterns.atomic import Graph
from attnzoo.registry import Config, register
from attnzoo.spec import Capabilities, Complexity, ScoreMod


@dataclass(frozen=True, kw_only=True)
class GraphAttentionConfig(Config):
    """Config of ``graph_attention``.

    Args:
        edges: ``(query, key)`` pairs: node ``query`` attends to node ``key``. Default a 2-cycle.
        n: number of nodes; inputs must have N = n. Default 2.
        self_loops: add ``(i, i)`` for every node. Default True.
        scale: score scale; default ``1 / sqrt(D)``.
    """

    edges: tuple[tuple[int, int], ...] = ((0, 1), (1, 0))
    n: int = 2
    self_loops: bool = True
    scale: float | None = None

    def validate(self) -> None:
        self.graph()

    def graph(self) -> Graph:
        index = torch.tensor(self.edges, dtype=torch.long).reshape(-1, 2).t()
        return Graph(index, self.n, self.self_loops)


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


def graph_attention(q: Tensor, k: Tensor, v: Tensor, graph: Graph, *, causal: bool = False,
                    key_padding_mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Attention of each node over its neighbours only.

    Shapes:
        q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)`` with N = ``graph.n`` -> ``(B, H, N, Dv)``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros(q.shape[:3] + (v.shape[-1],), dtype=compute)
    for nodes, neighbours in degree_buckets(graph):
        nodes, neighbours = nodes.to(q.device), neighbours.to(q.device)
        keys = neighbours.clamp(min=0)
        q_b = q[:, :, nodes].to(compute)  # [B, H, Nb, D]
        k_b, v_b = k[:, :, keys].to(compute), v[:, :, keys].to(compute)  # [B, H, Nb, d, D]
        scores = torch.einsum("bhnd,bhnkd->bhnk", q_b, k_b) * scale
        visible = (neighbours >= 0)[None, None]
        if causal:
            visible = visible & (neighbours <= nodes[:, None])[None, None]
        if key_padding_mask is not None:
            visible = visible & key_padding_mask[:, keys][:, None]
        weights = normalize_scores(scores, visible, "softmax")
        out = out.index_copy(2, nodes, torch.einsum("bhnk,bhnkd->bhnd", weights, v_b))
    return out.to(q.dtype)


def reference_graph_attention(q: Tensor, k: Tensor, v: Tensor, graph: Graph, *, causal: bool = False,
                              key_padding_mask: Tensor | None = None, scale: float | None = None,
                              return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Masked dense attention over the adjacency matrix (the oracle for ``graph_attention``)."""
    return reference_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                               mask_mod=graph.mask_mod_for(graph.n, graph.n), return_weights=return_weights)


@register(
    "graph_attention",
    config=GraphAttentionConfig,
    family="graph",
    summary="Attention along the edges of a graph through a CSR-style gather (any degree).",
    paper="Velickovic et al. 2018 (GAT), https://arxiv.org/abs/1710.10903",
    capabilities=Capabilities(causal=True, key_padding=True),
    complexity=Complexity(time="O(E D)", memory="O(E D)", subquadratic_memory=True),
    notes=("edges are (query, key) pairs; causal keeps edges with key <= query",
           "nodes are bucketed by degree so a hub does not pad every neighbour list"),
)
class GraphAttention(Attention):
    """Graph attention; see the module docstring."""

    config: GraphAttentionConfig

    def __init__(self, config: GraphAttentionConfig) -> None:
        super().__init__(config)
        self.graph = config.graph()

    def _check_n(self, n: int) -> None:
        if n != self.graph.n:
            raise ValueError(f"graph_attention was built for n={self.graph.n} nodes, got N={n}; set n= in the config")

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_padding_mask: Tensor | None,
                score_mod: ScoreMod | None) -> Tensor:
        self._check_n(q.shape[2])
        return graph_attention(q, k, v, self.graph, causal=causal, key_padding_mask=key_padding_mask,
                               scale=self.config.scale)

    def implied_attention(self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None) -> Tensor:
        self._check_n(q.shape[2])
        v = q.new_zeros(q.shape[:3] + (1,))
        return reference_graph_attention(q, k, v, self.graph, causal=causal, key_padding_mask=key_padding_mask,
                                         scale=self.config.scale, return_weights=True)[1]
