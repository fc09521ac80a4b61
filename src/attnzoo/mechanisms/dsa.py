"""DeepSeek Sparse Attention (``dsa``; DeepSeek-AI 2025, DeepSeek-V3.2-Exp,
https://github.com/deepseek-ai/DeepSeek-V3.2-Exp/blob/main/DeepSeek_V3_2.pdf).

A lightning indexer scores every (query, key) pair with a few small ReLU heads,
``I[t, s] = sum_j w[t, j] * ReLU(q^I[t, j] . k^I[s])``, each query keeps its ``top_k`` keys by
that score (ties to the lower key index, as ``topk_mask``), and softmax attention runs over the
kept keys only; the selection is shared by all heads (the paper runs MLA in MQA mode).

The plain functions (the indexer, the selection, the fast path ``dsa_attention``, the dense
``reference_dsa`` and the indexer's loss ``indexer_kl``) are in ``dsa_functions.py`` and
re-exported here; this module is the registered mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from attnzoo.mechanisms._ops import compute_dtype, mean_keys, visible_counts
from attnzoo.mechanisms.auxiliary import leave_auxiliary_loss
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.dsa_functions import (
    PAPER,
    _dsa_rows,
    attend_selected,
    dsa_attention,
    index_scores,
    indexer_kl,
    kl_on_selection,
    reference_dsa,
    select_keys,
)
from attnzoo.registry import Config, bounded, eighth, register
from attnzoo.spec import Capabilities, Complexity

__all__ = ["DSAAttention", "DSAConfig", "dsa_attention", "index_scores", "indexer_kl", "reference_dsa", "select_keys"]


def _nan_positions_of_non_finite_queries(out: Tensor, q: Tensor) -> Tensor:
    """NaN at every head of a position whose query holds a NaN or an infinity in any head: the
    indexer reads the head-mean of q, so such a query's key selection, shared by all its heads,
    is meaningless for all of them (loud, never a quiet finite row). One sum decides first."""
    if torch.isfinite(q.sum()):
        return out
    bad = ~torch.isfinite(q).all(-1).all(1)  # (B, N)
    return torch.where(bad[:, None, :, None], torch.nan, out)


@dataclass(frozen=True, kw_only=True)
class DSAConfig(Config):
    """Config of ``dsa``.

    Args:
        topk: keys each query keeps (the paper: 2048 of up to 128K). Default 256.
        index_heads: H_I, indexer heads (the paper: 64). Default 4.
        index_dim: d_I, width of an indexer head (the paper: 128). Default 32.
        head_dim: D, the input width of the indexer projections. Default 64.
        chunk: query rows scored at once (memory O(B H chunk N)). Default 128.
        scale: attention score scale; default None means ``1 / sqrt(D)``.
        indexer_weight: weight of the indexer's KL loss that a training-mode forward with
            gradients leaves for ``attnzoo.nn.auxiliary_loss`` (0: none is computed). Default 1.
    """

    topk: int = bounded(256, ge=1, for_length=eighth)
    index_heads: int = bounded(4, ge=1)
    index_dim: int = bounded(32, ge=1)
    head_dim: int = bounded(64, ge=1)
    chunk: int = bounded(128, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")
    indexer_weight: float = bounded(1.0, ge=0)


@dataclass(frozen=True)
class DSAState:
    """``dsa``'s decode state: every key and value (``cache``) and every indexer key
    (``index_keys``, a ``KVCache`` of one head, ``(B, 1, T, d_I)``, with no values)."""

    cache: KVCache
    index_keys: KVCache


@register(
    "dsa",
    config=DSAConfig,
    family="content",
    summary="DeepSeek Sparse Attention: a lightning indexer picks each query's top-k keys, shared by the heads.",
    paper=PAPER,
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True, independent_queries=False),
    complexity=Complexity(
        time="O(N^2 d_I H_I) indexer (every pair scored) + O(N k D H) attention over the selected pairs",
        memory="O(B H_I chunk N) indexer chunk; O(B H N k) weights kept for backward",
        subquadratic_memory=True,
    ),
    notes=(
        "swapped in untrained: the indexer's projections are random at init, so the top-k keys it picks are "
        "unrelated to the model's attention until its own loss trains it",
        "indexer: I[t, s] = sum_j w[t, j] ReLU(q^I[t, j] . k^I[s]), with q^I (D -> H_I d_I) and w (D -> H_I) "
        "learned projections of the head-mean of q, k^I (D -> d_I) of the head-mean of k; the paper projects "
        "the hidden state (q^I from the query latent), ropes part of q^I and k^I and runs the indexer in FP8: "
        "not done here",
        "sizes: H_I = 4 indexer heads of d_I = 32 by default, smaller than the paper's 64 heads of 128; topk "
        "256 by default (the paper: 2048), about N / 8 from for_length(N)",
        "selection: each query's topk candidates (causal: keys s <= t; padded keys never) by I, ties to the "
        "lower key index, all of them when fewer; shared by all heads (the paper's MQA mode), so a position's "
        "rows depend on its queries in every head (independent_queries=False); a NaN or infinite query in any "
        "head makes that position's rows NaN in every head",
        "training: the top-k is discrete, so the task loss gives the indexer no gradient; the indexer learns "
        "from the paper's KL from the main attention (heads summed, L1-normalised, over the selected set) to "
        "softmax(I), q and k detached (section 2.1.2): a training-mode forward with gradients leaves it, times "
        "indexer_weight, for attnzoo.nn.auxiliary_loss(model), which a training loop adds to its loss (attnzoo "
        "bench train does); indexer_loss(q, k, causal=...) computes it on its own. The paper's dense warm-up "
        "stage (indexer trained against full attention first) is not reproduced",
        "no per-call scale: q also feeds the indexer (set the config's scale instead)",
        "fast path: the selected pairs as a sparse CSR matrix per head (sampled scores, CSR @ v, and a "
        "backward of the same sparse products), so the attention costs O(N k D H); the indexer still scores "
        "every pair (small heads); never N x N in memory",
        "decode step: a KV cache and a cache of indexer keys (d_I numbers per token); per token the new "
        "query is scored against every cached indexer key, O(t d_I H_I), then its attention scores by one GEMM "
        "over the cache, O(t D H), of which its topk keys are used",
    ),
)
class DSAAttention(Attention):
    """DSA; ``index_q``, ``index_k``, ``index_w`` are the indexer's projections (no bias)."""

    config: DSAConfig

    def __init__(self, config: DSAConfig) -> None:
        super().__init__(config)
        d, heads_i, d_i = config.head_dim, config.index_heads, config.index_dim
        self.index_q = nn.Linear(d, heads_i * d_i, bias=False)
        self.index_k = nn.Linear(d, d_i, bias=False)
        self.index_w = nn.Linear(d, heads_i, bias=False)

    def indexer(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(index_q (B, N_q, H_I, d_I), index_k (B, N_kv, d_I), index_w (B, N_q, H_I))`` from
        q ``(B, H, N_q, D)`` and k ``(B, H, N_kv, D)``, in their compute dtype; the head-means
        of q and k stand in for the hidden state the paper projects."""
        cfg, wide = self.config, compute_dtype(q)
        if q.shape[-1] != cfg.head_dim:
            d = q.shape[-1]
            raise ValueError(f"dsa was built with head_dim={cfg.head_dim} but q has D={d}; build it with head_dim={d}")
        x_q, x_k = q.to(wide).mean(1), k.to(wide).mean(1)  # (B, N, D)
        index_q = rearrange(F.linear(x_q, self.index_q.weight.to(wide)), "b n (j e) -> b n j e", j=cfg.index_heads)
        return index_q, F.linear(x_k, self.index_k.weight.to(wide)), F.linear(x_q, self.index_w.weight.to(wide))

    def keys_per_query(self, n: int, causal: bool) -> float:
        """``topk`` keys per row (all it sees when fewer); the indexer scores every pair."""
        return mean_keys(visible_counts(n, causal).clamp(max=self.config.topk))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        cfg = self.config
        learn = self.training and torch.is_grad_enabled() and cfg.indexer_weight > 0
        with torch.set_grad_enabled(learn):
            index = self.indexer(q.detach(), k.detach())  # a graph to the indexer only when it learns
        wide = compute_dtype(q)
        selection = select_keys(*(x.detach().to(wide) for x in index), cfg.topk, args.causal, args.key_mask, cfg.chunk)
        out, weights = attend_selected(q, k, v, selection, cfg.scale)
        if learn:
            # the indexer's own loss (the task loss cannot reach it), left for auxiliary_loss(); its
            # target, the heads' mean attention over the selection, is the forward's own weights
            kl = kl_on_selection(*index, selection, weights.mean(1), cfg.chunk)
            leave_auxiliary_loss(self, cfg.indexer_weight * kl)
        return _nan_positions_of_non_finite_queries(out, q)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        with torch.no_grad():
            index = self.indexer(q, k)
        cfg = self.config
        out, weights = reference_dsa(
            q, k, v, *index, top_k=cfg.topk, causal=args.causal, key_mask=args.key_mask, scale=cfg.scale
        )
        return (out, weights) if return_weights else out

    def indexer_loss(self, q: Tensor, k: Tensor, *, causal: bool = False, key_mask: Tensor | None = None) -> Tensor:
        """The indexer's training loss on these q ``(B, H, N, D)`` and k (``indexer_kl``): a
        scalar whose gradient reaches only the indexer's projections. Add it to the task loss
        (the paper's section 2.1.2); the task loss alone leaves the indexer untrained."""
        args = self._checked(q, k, k, causal, key_mask, None)
        k, _ = self._kv_heads(q, k, k, native=False)
        q, k = self.zero_padded(args.key_mask, q.detach(), k.detach())
        if q.shape[0] == 0 or q.shape[2] == 0:
            return sum((p.sum() * 0 for p in self.parameters()), q.new_zeros(()))
        cfg = self.config
        return indexer_kl(q, k, *self.indexer(q, k), cfg.topk, args.causal, args.key_mask, cfg.scale, cfg.chunk)

    def _init_state(self, spec: StateSpec) -> DSAState:
        """An empty KV cache and an empty cache of indexer keys (in the compute dtype)."""
        wide = compute_dtype(torch.empty((), dtype=spec.dtype))
        index_keys = KVCache.empty(
            spec.batch, 1, self.config.index_dim, 0, capacity=spec.capacity, device=spec.device, dtype=wide
        )
        return DSAState(KVCache.for_state(spec), index_keys)

    def _step(self, state: DSAState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, DSAState]:
        """The new rows of the causal forward: the new tokens' indexer keys join the cache, the
        new queries are scored against all of them and attend over their topk keys."""
        cache = state.cache.append(k, v, args.key_mask)
        with torch.no_grad():
            index_q, index_k, index_w = self.indexer(q, k)
        new_keys = rearrange(index_k, "b t e -> b 1 t e").to(state.index_keys.k_buffer.dtype)
        index_keys = state.index_keys.append(new_keys, new_keys[..., :0])
        cfg, all_keys = self.config, index_keys.k[:, 0]  # (B, T, d_I)
        out = _dsa_rows(
            q, cache.k, cache.v, index_q, all_keys, index_w, cfg.topk, True, cache.key_mask, cfg.scale, cfg.chunk
        )
        return _nan_positions_of_non_finite_queries(out, q), DSAState(cache, index_keys)
