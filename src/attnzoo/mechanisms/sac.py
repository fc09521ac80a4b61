"""Sparse Adaptive Connection (``sac``; Li et al. 2020, https://arxiv.org/abs/2003.09833).

Each node has a bounded set of candidate edges (a window of positions plus a few seeded random
ones); a learned edge predictor scores them, each node keeps its k best (``topk_mask``, as
``topk`` does, in ``topk.py``), and attention runs along the kept edges only. The fast path
runs blocks of nodes over the union of their candidates (``sac_attention``); the decode step
gathers each new node's own candidates; ``reference_sac`` builds the candidate graph as an N x N
mask. A causal node's candidates do not depend on the sequence length, so ``sac`` decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.backends.call import gather_rows, rows_at
from attnzoo.backends.reference import normalize_scores, visible_pairs
from attnzoo.mechanisms._ops import block_union, compute_dtype, default_scale, in_slabs, masked_softmax, mean_keys
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.mechanisms.cache import KVCache
from attnzoo.mechanisms.topk import kept_indices, register_selective, sparse_softmax, topk_keep, topk_mask
from attnzoo.registry import Config, bounded, eighth, quarter
from attnzoo.spec import Complexity


@dataclass(frozen=True, kw_only=True)
class SACConfig(Config):
    """Config of ``sac``.

    Args:
        topk: edges kept per node. Default 8.
        candidates: width of each node's window of candidate keys. Default 32.
        n_random: extra random candidate keys per node. Default 4.
        seed: seed of the random candidates. Default 0.
        head_dim: D, the size of the predictor's ``(D, D)`` matrix. Default 64.
        scale: score scale; default None means ``1 / sqrt(D)``.
    """

    topk: int = bounded(8, ge=1, for_length=eighth)
    candidates: int = bounded(32, ge=1, for_length=quarter)
    n_random: int = bounded(4, ge=0)
    seed: int = bounded(0, ge=0)
    head_dim: int = bounded(64, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")


def sac_candidates(n: int, cfg: SACConfig, causal: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """The candidate edges of every node: a window of positions plus ``cfg.n_random`` random ones.

    Shapes:
        -> ``cand (N, candidates + n_random)`` key positions, ascending per row, and ``valid``
        (same shape, bool): in range, not a repeat of the previous entry.

    Notes:
        Not causal: the window is ``candidates`` consecutive positions centred on i, shifted to
        stay inside ``[0, N)``. Causal: the window is ``i - candidates + 1 .. i`` and the random
        positions are drawn from ``[0, i]``, so every candidate is ``<= i``. Row i's random
        numbers are row i of ``n_random`` uniform numbers per row drawn in row order from a CPU
        generator seeded with ``cfg.seed`` (the same for every batch, head and call); torch's CPU
        generator draws them one after another, so a causal row's candidates do not depend on N.
    """
    u = torch.rand(n, cfg.n_random, generator=torch.Generator().manual_seed(cfg.seed), dtype=torch.float64)
    cand, valid = _candidate_rows(torch.arange(n)[:, None], u, n, cfg.candidates, causal)
    return cand.to(device), valid.to(device)


def _candidate_rows(rows: Tensor, u: Tensor, n: int, width: int, causal: bool) -> tuple[Tensor, Tensor]:
    """``sac_candidates`` of the nodes at positions ``rows (R, 1)`` from their uniform numbers
    ``u (R, n_random)``, among ``n`` positions (causal: any ``n`` past the last row)."""
    offsets = torch.arange(width)[None, :]
    if causal:
        window = rows - offsets
    else:
        window = (rows - width // 2).clamp(0, max(n - width, 0)) + offsets
    random = (u * (rows + 1 if causal else n)).long()  # floor: in [0, i] or [0, N)
    cand = torch.cat([window, random], dim=1)
    cand = torch.where((cand >= 0) & (cand < n), cand, n).sort(dim=1).values  # n marks "none"
    valid = cand < n
    valid[:, 1:] &= cand[:, 1:] != cand[:, :-1]
    return cand.clamp(max=n - 1), valid


def _edge_scores(q: Tensor, k_c: Tensor, weight: Tensor, scale: float) -> Tensor:
    """Predictor score ``(q_i W) . k_j * scale`` of each candidate edge. Shapes: q ``(B, H, N, D)``,
    k_c ``(B, H, N, C, D)`` (each node's candidate keys), W ``(D, D)`` -> ``(B, H, N, C)``."""
    return torch.einsum("bhne,bhnce->bhnc", q @ weight.to(q.dtype), k_c) * scale


def _attend_candidates(
    q: Tensor, k: Tensor, v: Tensor, weight: Tensor, cand: Tensor, visible: Tensor, cfg: SACConfig
) -> Tensor:
    """SAC for the nodes ``q (B, H, R, D)`` over keys ``k (B, H, N, D)``, ``v (B, H, N, D_v)``:
    node r's candidate edges are the key positions ``cand[r]`` (``cand (R, C)``), where
    ``visible (B or 1, R, C)``. The candidate keys are scored without gradient; the kept ``k`` of
    them are gathered, ``(B, H, R, k, D)``, and attended to with the straight-through term
    ``e - e.detach()`` (e on detached q, k: only W receives its gradient)."""
    scale = default_scale(cfg.scale, q.shape[-1])
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    kk = min(cfg.topk, cand.shape[1])
    with torch.no_grad():
        edges = _edge_scores(qc, kc[:, :, cand], weight, scale)  # (B, H, R, C)
        slot, ok = kept_indices(topk_mask(edges, visible[:, None], kk), kk)  # (B, H, R, kk)
        idx = cand.expand(slot.shape[:2] + cand.shape).gather(-1, slot)  # key positions (B, H, R, kk)
    k_sel, v_sel = gather_rows(kc, idx), gather_rows(vc, idx)
    edge = _edge_scores(qc.detach(), k_sel.detach(), weight, scale)
    return sparse_softmax(qc, k_sel, v_sel, ok, scale, bias=edge - edge.detach()).to(q.dtype)


#: Nodes per block of the forward's fast path (``_ops.block_union``): neighbours share most of
#: their window candidates but none of their random ones, so a block of b nodes attends about
#: ``candidates + b`` window keys plus ``b n_random`` random ones. 16 against 32 at the defaults:
#: fwd+bwd 1K 33.4 -> 30.1 ms, 4K 201 -> 188, causal 4K 184 -> 158 (8 at 1K: 45 ms;
#: ab-sac-block-cpu.txt).
BLOCK = 16


@lru_cache(maxsize=32)
def _candidate_blocks(n: int, cfg: SACConfig, causal: bool, block: int) -> tuple[Tensor, Tensor]:
    """``sac_candidates`` by blocks of ``block`` nodes: ``(cols (blocks, W), member (blocks,
    block, W))`` as ``_ops.block_union`` (cached per length, config, causality and block)."""
    return block_union(*sac_candidates(n, cfg, causal, torch.device("cpu")), block)


def sac_attention(q: Tensor, k: Tensor, v: Tensor, weight: Tensor, cfg: SACConfig, args: AttendArgs) -> Tensor:
    """SAC by blocks of nodes (Li et al. 2020, https://arxiv.org/abs/2003.09833).

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)`` (self-attention).
        weight: the predictor's ``(D, D)`` matrix W.
        cfg: ``topk``, ``candidates``, ``n_random``, ``seed``, ``scale`` (see ``SACConfig``).
        args: the checked ``causal`` and ``key_mask``.

    Shapes:
        -> ``(B, H, N, D_v)`` in the dtype of ``q``. Memory O(N W), never N x N; in slabs of heads
        whose gathered keys stay under ``_ops.SLAB_BYTES`` (``in_slabs``).

    Notes:
        Each block of ``BLOCK`` nodes gathers the union of its nodes' candidate keys once, ``W``
        of them (``_candidate_blocks``), and scores them with small GEMMs: the predictor's edges
        ``(q W) . k`` (gradient to W only), each node's top-k among its own candidates
        (``topk_mask``), then softmax over the kept ones with the straight-through term. The
        decode step attends each node's own gathered candidates (``_attend_candidates``).
    """
    cols, member = (x.to(q.device) for x in _candidate_blocks(q.shape[2], cfg, args.causal, BLOCK))
    row_bytes = cols.numel() * max(q.shape[-1], v.shape[-1]) * torch.finfo(compute_dtype(q)).bits // 8
    run = lambda q, k, v, mask: _sac_slab(q, k, v, weight, cfg, mask, cols, member)  # noqa: E731
    return in_slabs(run, q, k, v, args.key_mask, row_bytes)


def _sac_slab(
    q: Tensor, k: Tensor, v: Tensor, weight: Tensor, cfg: SACConfig, mask: Tensor | None, cols: Tensor, member: Tensor
) -> Tensor:
    """``sac_attention`` on one slab of heads (and batch rows, ``mask`` theirs), with the blocks'
    candidate unions ``cols`` and ``member`` (``_candidate_blocks``)."""
    (b, h, n, d), (blocks, width), block = q.shape, cols.shape, member.shape[1]
    visible = member[None] if mask is None else member[None] & mask[:, cols][:, :, None, :]  # (B|1, blocks, block, W)
    scale = default_scale(cfg.scale, d)
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))

    def gathered(x: Tensor) -> Tensor:  # (B, H, N, e) -> (B, H, blocks, W, e): each block's union
        return rows_at(x, cols.flatten()).view(b, h, blocks, width, -1)

    qb = F.pad(qc * scale, (0, 0, 0, blocks * block - n)).view(b, h, blocks, block, d)
    kg, vg = gathered(kc), gathered(vc)
    qw = qb.detach() @ weight.to(qc.dtype)  # edges are qw . k: the predictor's query side
    with torch.no_grad():
        keep = topk_keep(qw @ kg.transpose(-1, -2), visible[:, None], min(cfg.topk, cfg.candidates + cfg.n_random))
    # The straight-through term e - e.detach() with e = qw . k_detached is linear in qw, so it
    # rides on the query as qw - qw.detach() (zero in value): one GEMM gives the logits, q and k
    # their plain gradients and W the edges' gradient, with no extra pass over the score tile.
    logits = (qb + (qw - qw.detach())) @ kg.transpose(-1, -2)
    out = masked_softmax(logits, keep) @ vg
    return out.view(b, h, blocks * block, -1)[:, :, :n].to(q.dtype)


def reference_sac(
    q: Tensor, k: Tensor, v: Tensor, weight: Tensor, cfg: SACConfig, args: AttendArgs, return_weights: bool
) -> Weighted:
    """Dense SAC (Li et al. 2020, https://arxiv.org/abs/2003.09833): the candidate graph as an
    N x N mask, the predictor's dense scores ``E = s (Q W) K^T``, each row's top-k candidate
    edges (``topk_mask``), then softmax attention restricted to them.

    Args:
        As ``sac_attention``; return_weights also returns the ``(B, H, N, N)`` weights.

    Notes:
        The logits are ``S + E - E.detach()`` with E on detached q, k: equal to ``S = s Q K^T``
        in value, while W receives E's straight-through gradient. Allocates N x N by design.
    """
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    batch, heads, n, _ = q.shape
    scale = default_scale(cfg.scale, q.shape[-1])
    cand, valid = sac_candidates(n, cfg, args.causal, q.device)
    graph = torch.zeros(n, n, dtype=torch.bool, device=q.device)
    graph[torch.arange(n, device=q.device)[:, None].expand_as(cand)[valid], cand[valid]] = True
    mask_mod, mask = (lambda b, h, i, j: graph[i, j]), args.key_mask
    visible = visible_pairs(batch, heads, n, n, causal=args.causal, key_mask=mask, mask_mod=mask_mod, device=q.device)
    scores = torch.einsum("bhid,bhjd->bhij", qc, kc) * scale
    edges = torch.einsum("bhie,bhje->bhij", qc.detach() @ weight.to(qc.dtype), kc.detach()) * scale
    keep = topk_mask(edges.detach(), visible, cfg.topk)
    weights = normalize_scores(scores + edges - edges.detach(), keep, "softmax")
    out = torch.einsum("bhij,bhjd->bhid", weights, vc).to(q.dtype)
    return (out, weights) if return_weights else out


@dataclass(frozen=True)
class SACState:
    """``sac``'s decode state: every key and value so far (``cache``) and ``rng``, the state of
    the seeded candidate generator after the random numbers of the rows seen so far."""

    cache: KVCache
    rng: Tensor


@register_selective(
    "sac",
    SACConfig,
    "Sparse Adaptive Connection: a learned predictor keeps k of each node's candidate edges.",
    "Li et al. 2020, SAC: Accelerating and Structuring Self-Attention via Sparse Adaptive "
    "Connection, https://arxiv.org/abs/2003.09833",
    Complexity(
        time="O(N W D): W = the union of a block of 16 nodes' candidates (about c + 16 window + 16 r random)",
        memory="O(N W) scores, O(N W D / 16) gathered keys and values",
        subquadratic_memory=True,
    ),
    (
        "not a drop-in for pretrained attention: its edge predictor is a trained parameter: needs retraining",
        "candidates: a window of `candidates` positions (centred; causal: i - c + 1 .. i) plus "
        "`n_random` seeded random positions (causal: <= i); padded keys are never candidates",
        "predictor: score_ij = (q_i W) . k_j / sqrt(D), W (D, D) learned, initialised to identity; "
        "the top-k candidate edges of each node are kept (ties go to the lower key index)",
        "training: straight-through; kept logits get + e_ij - e_ij.detach() with e computed on "
        "detached q, k, so W gets the attention's logit gradient and q, k, v the plain one",
        "fast path by blocks of 16 nodes: a block scores the union of its nodes' candidates with small GEMMs, "
        "masked to each node's own (about 3x the c + r candidates per node at c = 32, r = 4), where gathering "
        "each node's candidates made (B, H, N, c + r, D) copies of K and V",
        "decode step: every key kept (a KV cache); causal row t's candidates (its window and row t of "
        "the seeded random numbers) do not depend on the final length, so the step scores them "
        "over the cache, O(c + r) per token",
    ),
    cross=False,
)
class SACAttention(Attention):
    """Sparse Adaptive Connection. ``predictor`` is the learned ``(D, D)`` matrix W."""

    config: SACConfig

    def __init__(self, config: SACConfig) -> None:
        super().__init__(config)
        self.predictor = nn.Parameter(torch.eye(config.head_dim))

    def keys_per_query(self, n: int, causal: bool) -> float:
        """The ``topk`` kept edges per node (all its candidates when fewer)."""
        valid = sac_candidates(n, self.config, causal, torch.device("cpu"))[1]
        return mean_keys(valid.sum(-1).clamp(max=self.config.topk))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return sac_attention(q, k, v, self.predictor, self._checked_config(q), args)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        return reference_sac(q, k, v, self.predictor, self._checked_config(q), args, return_weights)

    def _checked_config(self, q: Tensor) -> SACConfig:
        """The config, after checking that q has the head size the predictor was built for."""
        if q.shape[-1] != self.config.head_dim:
            raise ValueError(
                f"sac was built with head_dim={self.config.head_dim} but q has D={q.shape[-1]}; "
                f"build it with head_dim={q.shape[-1]}"
            )
        return self.config

    def _init_state(self, spec: StateSpec) -> SACState:
        """An empty ``KVCache`` and the candidate generator freshly seeded."""
        return SACState(KVCache.for_state(spec), torch.Generator().manual_seed(self.config.seed).get_state())

    def _step(self, state: SACState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, SACState]:
        """The new tokens' rows of the causal forward: their candidates (positions ``t .. t + T
        - 1`` with the generator's next ``T`` rows of random numbers) over the cached keys."""
        cfg, start = self._checked_config(q), state.cache.length
        cache = state.cache.append(k, v, args.key_mask)
        generator = torch.Generator()
        generator.set_state(state.rng)
        u = torch.rand(q.shape[2], cfg.n_random, generator=generator, dtype=torch.float64)
        rows = torch.arange(start, cache.length)[:, None]
        cand, valid = (x.to(q.device) for x in _candidate_rows(rows, u, cache.length, cfg.candidates, True))
        mask = cache.key_mask
        visible = valid[None] if mask is None else valid & mask[:, cand]
        out = _attend_candidates(q, cache.k, cache.v, self.predictor, cand, visible, cfg)
        return nan_rows_of_non_finite_queries(out, q), SACState(cache, generator.get_state())
