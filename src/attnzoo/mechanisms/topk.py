"""Content-chosen sparse attention (MECHANISMS.md §C): ``topk`` and ``sac``.

``topk`` (explicit sparse attention, Zhao et al. 2019, https://arxiv.org/abs/1912.11637) keeps
each query's k largest scores and runs softmax over those alone. ``sac`` (Sparse Adaptive
Connection, Li et al. 2020, https://arxiv.org/abs/2003.09833) lets a learned edge predictor pick
k keys per node out of a bounded candidate set, and attends along those edges only.

One selection rule serves both (``topk_mask``): keep a row's k largest visible scores, the lower
key index winning ties, or all visible entries if fewer. Each fast path has a dense
``reference_*`` beside it that makes the same selection on the full N x N matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from attnzoo._checks import check_causal, check_key_padding_mask, check_qkv
from attnzoo.backends.reference import normalize_scores, visible_pairs
from attnzoo.mechanisms._ops import compute_dtype, default_scale, gather_rows
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted
from attnzoo.mechanisms.cache import KVCacheDecode
from attnzoo.registry import Config, bounded, eighth, quarter, register
from attnzoo.spec import Capabilities, Complexity


def topk_mask(scores: Tensor, visible: Tensor | None, k: int) -> Tensor:
    """The entries each row keeps, bool ``(..., N)``: its ``k`` largest visible scores (all of
    its visible entries when it has fewer than ``k``).

    Args:
        scores: ``(..., N)`` scores (no gradient needed: the selection is not differentiable).
        visible: bool broadcastable to ``scores``, True where an entry may be kept; None = all.
        k: how many to keep per row.

    Notes:
        Ties are broken by position: of equal scores, the lower index is kept first. This is
        independent of the row length and of ``torch.topk``'s (unspecified) order of ties, so a
        chunked fast path and a dense reference make the identical selection.
    """
    s = scores if visible is None else scores.masked_fill(~visible, float("-inf"))
    # NaN ranks above everything, as in torch.topk: a NaN query keeps keys and its row is NaN.
    s = s.masked_fill(s.isnan(), float("inf"))
    kk = min(k, s.shape[-1])
    # The k-th largest score of each row (-inf when fewer than k entries are visible).
    tau = s.topk(kk, dim=-1).values[..., -1:]
    above = s > tau
    tied = s == tau
    room = kk - above.sum(-1, keepdim=True, dtype=torch.int32)
    keep = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room))
    return keep if visible is None else keep & visible


def kept_indices(keep: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Compact a keep mask ``(..., N)`` with at most ``k`` True per row into ``idx (..., k)``
    (ascending positions of the kept entries, 0 in unused slots) and ``valid (..., k)`` bool."""
    n = keep.shape[-1]
    # Slot of each kept entry in its row; entries not kept all go to a spare slot k, dropped.
    slot = torch.where(keep, keep.cumsum(-1) - 1, k)
    positions = torch.arange(n, device=keep.device).expand_as(slot)
    idx = slot.new_zeros(keep.shape[:-1] + (k + 1,)).scatter_(-1, slot, positions)[..., :k]
    valid = torch.arange(k, device=keep.device) < keep.sum(-1, keepdim=True)
    return idx, valid


def select_topk(scores: Tensor, visible: Tensor | None, k: int) -> tuple[Tensor, Tensor]:
    """``kept_indices(topk_mask(scores, visible, k), k)``, fast: ``torch.topk`` picks the same set
    whenever a row's k-th score is not tied with an entry it left out; only rows with such a tie
    (rare, except rows with fewer than k visible keys) go through the exact rule."""
    s = scores if visible is None else scores.masked_fill(~visible, float("-inf"))
    values, idx = s.topk(k, dim=-1, sorted=False)
    tau = values.min(-1, keepdim=True).values
    ambiguous = (s == tau).sum(-1) > (values == tau).sum(-1)  # (...,) rows with a tie at the cut
    valid = values != float("-inf")  # NaN (a NaN query's scores) is kept: its row comes out NaN
    if ambiguous.device.type != "meta" and bool(ambiguous.any()):  # meta tensors hold no values
        rows = ambiguous.nonzero(as_tuple=True)
        keep = topk_mask(scores[rows], None if visible is None else visible.expand_as(scores)[rows], k)
        idx[rows], valid[rows] = kept_indices(keep, k)
    return idx, valid


def _sparse_softmax(
    q: Tensor, k_sel: Tensor, v_sel: Tensor, valid: Tensor, scale: float, bias: Tensor | None = None
) -> Tensor:
    """Softmax attention of each query over its own gathered keys: q ``(B, H, M, D)``, k_sel
    ``(B, H, M, K, D)``, v_sel ``(B, H, M, K, D_v)``, valid and bias ``(B, H, M, K)`` -> ``(B, H,
    M, D_v)``. A row with no valid slot gives zeros and passes zero gradient."""
    logits = torch.einsum("bhmd,bhmkd->bhmk", q, k_sel) * scale
    if bias is not None:
        logits = logits + bias
    weights = normalize_scores(logits, valid, "softmax")
    return torch.einsum("bhmk,bhmkd->bhmd", weights, v_sel)


def _dense_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    key_padding_mask: Tensor | None,
    scale: float | None,
    cross_attention: bool,
) -> tuple:
    """Checked inputs of a dense reference: ``(qc, kc, vc)`` in the compute dtype, mask, scale."""
    check_qkv(q, k, v, cross_attention=cross_attention)
    check_causal(causal, q.shape[2], k.shape[2])
    key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    scale = default_scale(scale, q.shape[-1])
    return tuple(t.to(compute_dtype(q)) for t in (q, k, v)), key_padding_mask, scale


def _chunk_visible(
    start: int, stop: int, n_q: int, n_kv: int, causal: bool, key_padding_mask: Tensor | None, device: torch.device
) -> Tensor | None:
    """Visible pairs of query rows ``start:stop``, broadcastable to ``(B, H, stop - start, N_kv)``."""
    visible = None
    if causal:
        q_idx = torch.arange(start, stop, device=device) + (n_kv - n_q)
        visible = torch.arange(n_kv, device=device) <= q_idx[:, None]  # (c, N_kv)
    if key_padding_mask is not None:
        real = rearrange(key_padding_mask, "b n -> b 1 1 n")
        visible = real if visible is None else visible & real
    return visible


def topk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    topk: int,
    chunk: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Explicit sparse attention in query chunks (Zhao et al. 2019, https://arxiv.org/abs/1912.11637).

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)``.
        topk, chunk, scale: see ``TopKConfig``; the rest as in ``reference_topk``.

    Shapes:
        -> ``(B, H, N_q, D_v)`` in the dtype of ``q``.

    Notes:
        Per chunk, the ``(B, H, chunk, N_kv)`` scores are computed without gradient, masked, and
        reduced to ``topk`` key indices (``topk_mask``); only then are the kept keys and values
        gathered, ``(B, H, chunk, k, D)``, and their scores recomputed with gradient. So no
        ``N_q x N_kv`` tensor exists at any time, and what autograd keeps is ``O(N k D)``.
    """
    n_q, n_kv = q.shape[2], k.shape[2]
    scale = default_scale(scale, q.shape[-1])
    kk = min(topk, n_kv)
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    outs = []
    for start in range(0, n_q, chunk):
        stop = min(start + chunk, n_q)
        q_c = qc[:, :, start:stop]  # (B, H, c, D)
        visible = _chunk_visible(start, stop, n_q, n_kv, causal, key_padding_mask, q.device)
        with torch.no_grad():
            scores = torch.matmul(q_c * scale, kc.transpose(-1, -2))  # (B, H, c, N_kv)
            idx, valid = select_topk(scores, visible, kk)  # (B, H, c, kk)
            del scores
        outs.append(_sparse_softmax(q_c, gather_rows(kc, idx), gather_rows(vc, idx), valid, scale))
    return torch.cat(outs, dim=2).to(q.dtype)


def reference_topk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    topk: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Dense explicit sparse attention (Zhao et al. 2019, https://arxiv.org/abs/1912.11637).

    ``S = s Q K^T``; each row keeps its ``topk`` largest visible entries (``topk_mask``: ties go
    to the lower key index; rows with fewer visible keys keep them all); ``O = softmax(S
    restricted to the kept entries) V``, zero elsewhere.

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)``.
        topk: keys kept per query (>= 1).
        causal: query i sees keys ``j <= i + N_kv - N_q``. key_padding_mask: ``(B, N_kv)``, True = real.
        scale: score scale; default ``1 / sqrt(D)``.
        return_weights: also return the ``(B, H, N_q, N_kv)`` weights.

    Notes:
        Gradients flow through the kept scores; the selection is a constant. A query with no
        visible key returns zeros and passes zero gradient. Allocates N_q x N_kv by design.
    """
    (qc, kc, vc), key_padding_mask, scale = _dense_inputs(q, k, v, causal, key_padding_mask, scale, True)
    (batch, heads, n_q, _), n_kv = q.shape, k.shape[2]
    scores = torch.einsum("bhid,bhjd->bhij", qc, kc) * scale
    visible = visible_pairs(
        batch, heads, n_q, n_kv, causal=causal, key_padding_mask=key_padding_mask, mask_mod=None, device=q.device
    )
    keep = topk_mask(scores.detach(), visible, topk)
    weights = normalize_scores(scores, keep, "softmax")
    out = torch.einsum("bhij,bhjd->bhid", weights, vc).to(q.dtype)
    return (out, weights) if return_weights else out


@dataclass(frozen=True, kw_only=True)
class TopKConfig(Config):
    """Config of ``topk``.

    Args:
        topk: keys kept per query. Default 32.
        chunk: queries scored at once by the fast path (memory O(N chunk)). Default 256.
        scale: score scale; default None means ``1 / sqrt(D)``.
    """

    topk: int = bounded(32, ge=1)
    chunk: int = bounded(256, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A quarter of the keys per query."""
        return dict(topk=quarter(n))


@register(
    "topk",
    config=TopKConfig,
    family="content",
    summary="Explicit sparse attention: each query keeps its top-k scores, softmax over those only.",
    paper="Zhao et al. 2019, Explicit Sparse Transformer, https://arxiv.org/abs/1912.11637",
    capabilities=Capabilities(causal=True, key_padding=True, decode_step=True, cross_attention=True, score_mod=False),
    complexity=Complexity(
        time="O(N^2 D): every pair is still scored",
        memory="O(N chunk) working, O(N k D) kept for backward",
        subquadratic_memory=True,
    ),
    notes=(
        "the k kept keys are chosen among visible keys (after causal and padding masks); ties go to "
        "the lower key index; a row with fewer than k visible keys keeps them all",
        "gradients flow through the kept scores; the selection itself is not differentiable",
        "decode step: every key kept (a KV cache) and the new row's top k chosen over it, O(t) per token",
    ),
)
class TopKAttention(KVCacheDecode, Attention):
    """Explicit sparse attention; ``_attend`` runs ``topk_attention``, ``reference_topk`` the dense twin."""

    config: TopKConfig

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return topk_attention(q, k, v, **self._settings(args), chunk=self.config.chunk)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        return reference_topk(q, k, v, **self._settings(args), return_weights=return_weights)

    def _settings(self, args: AttendArgs) -> dict[str, Any]:
        """The keyword arguments ``topk_attention`` and ``reference_topk`` share, written once."""
        cfg = self.config
        return dict(topk=cfg.topk, causal=args.causal, key_padding_mask=args.key_padding_mask, scale=cfg.scale)


def sac_candidates(
    n: int, *, candidates: int, n_random: int, seed: int, causal: bool, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The candidate edges of every node: a window of positions plus ``n_random`` random ones.

    Shapes:
        -> ``cand (N, candidates + n_random)`` key positions, ascending per row, and ``valid``
        (same shape, bool): in range, not a repeat of the previous entry.

    Notes:
        Not causal: the window is ``candidates`` consecutive positions centred on i, shifted to
        stay inside ``[0, N)``. Causal: the window is ``i - candidates + 1 .. i`` and the random
        positions are drawn from ``[0, i]``, so every candidate is ``<= i``. Random positions come
        from a CPU generator seeded with ``seed`` (the same for every batch, head and call).
    """
    i = torch.arange(n)[:, None]
    offsets = torch.arange(candidates)[None, :]
    if causal:
        window = i - offsets
    else:
        window = (i - candidates // 2).clamp(0, max(n - candidates, 0)) + offsets
    u = torch.rand(n, n_random, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    random = (u * (i + 1 if causal else n)).long()  # floor: in [0, i] or [0, N)
    cand = torch.cat([window, random], dim=1)
    cand = torch.where((cand >= 0) & (cand < n), cand, n).sort(dim=1).values  # n marks "none"
    valid = cand < n
    valid[:, 1:] &= cand[:, 1:] != cand[:, :-1]
    return cand.clamp(max=n - 1).to(device), valid.to(device)


def _edge_scores(q: Tensor, k_c: Tensor, weight: Tensor, scale: float) -> Tensor:
    """Predictor score ``(q_i W) . k_j * scale`` of each candidate edge. Shapes: q ``(B, H, N, D)``,
    k_c ``(B, H, N, C, D)`` (each node's candidate keys), W ``(D, D)`` -> ``(B, H, N, C)``."""
    return torch.einsum("bhne,bhnce->bhnc", q @ weight.to(q.dtype), k_c) * scale


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

    topk: int = bounded(8, ge=1)
    candidates: int = bounded(32, ge=1)
    n_random: int = bounded(4, ge=0)
    seed: int = bounded(0, ge=0)
    head_dim: int = bounded(64, ge=1)
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Candidate windows of a quarter of the keys, an eighth of them kept."""
        return dict(topk=eighth(n), candidates=quarter(n))


@register(
    "sac",
    config=SACConfig,
    family="content",
    summary="Sparse Adaptive Connection: a learned predictor keeps k of each node's candidate edges.",
    paper="Li et al. 2020, SAC: Accelerating and Structuring Self-Attention via Sparse Adaptive "
    "Connection, https://arxiv.org/abs/2003.09833",
    capabilities=Capabilities(causal=True, key_padding=True, cross_attention=False, score_mod=False),
    complexity=Complexity(
        time="O(N (c + r) D), c window + r random candidates per node",
        memory="O(N (c + r) D) working, O(N k D) kept for backward",
        subquadratic_memory=True,
    ),
    notes=(
        "not a drop-in for pretrained attention: its edge predictor is a trained parameter: needs retraining",
        "candidates: a window of `candidates` positions (centred; causal: i - c + 1 .. i) plus "
        "`n_random` seeded random positions (causal: <= i); padded keys are never candidates",
        "predictor: score_ij = (q_i W) . k_j / sqrt(D), W (D, D) learned, initialised to identity; "
        "the top-k candidate edges of each node are kept (ties go to the lower key index)",
        "training: straight-through; kept logits get + e_ij - e_ij.detach() with e computed on "
        "detached q, k, so W gets the attention's logit gradient and q, k, v the plain one",
    ),
)
class SACAttention(Attention):
    """Sparse Adaptive Connection. ``predictor`` is the learned ``(D, D)`` matrix W."""

    config: SACConfig

    def __init__(self, config: SACConfig) -> None:
        super().__init__(config)
        self.predictor = nn.Parameter(torch.eye(config.head_dim))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return sac_attention(q, k, v, self.predictor, **self._settings(q, args.causal, args.key_padding_mask))

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        settings = self._settings(q, args.causal, args.key_padding_mask)
        return reference_sac(q, k, v, self.predictor, **settings, return_weights=return_weights)

    def _settings(self, q: Tensor, causal: bool, key_padding_mask: Tensor | None) -> dict[str, Any]:
        """The keyword arguments ``sac_attention`` and ``reference_sac`` share, after checking
        that q has the head size the predictor was built for."""
        cfg = self.config
        if q.shape[-1] != cfg.head_dim:
            raise ValueError(
                f"sac was built with head_dim={cfg.head_dim} but q has D={q.shape[-1]}; "
                f"build it with head_dim={q.shape[-1]}"
            )
        return dict(
            topk=cfg.topk,
            candidates=cfg.candidates,
            n_random=cfg.n_random,
            seed=cfg.seed,
            causal=causal,
            key_padding_mask=key_padding_mask,
            scale=cfg.scale,
        )


def sac_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weight: Tensor,
    *,
    topk: int,
    candidates: int,
    n_random: int,
    seed: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """SAC by gathering each node's chosen keys (Li et al. 2020, https://arxiv.org/abs/2003.09833).

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)`` (self-attention).
        weight: the predictor's ``(D, D)`` matrix W.
        topk, candidates, n_random, seed: see ``SACConfig``.
        causal, key_padding_mask, scale: as in ``reference_attention``.

    Shapes:
        -> ``(B, H, N, D_v)`` in the dtype of ``q``.

    Notes:
        The candidate keys ``(B, H, N, C, D)`` are scored without gradient; the kept ``k`` of
        them are gathered, ``(B, H, N, k, D)``, and attended to with the straight-through term
        ``e - e.detach()`` (e on detached q, k: only W receives its gradient).
    """
    n = q.shape[2]
    scale = default_scale(scale, q.shape[-1])
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    cand, valid = sac_candidates(n, candidates=candidates, n_random=n_random, seed=seed, causal=causal, device=q.device)
    kk = min(topk, cand.shape[1])
    with torch.no_grad():
        visible = valid[None] if key_padding_mask is None else valid & key_padding_mask[:, cand]  # (B or 1, N, C)
        edges = _edge_scores(qc, kc[:, :, cand], weight, scale)  # (B, H, N, C)
        slot, ok = kept_indices(topk_mask(edges, visible[:, None], kk), kk)  # (B, H, N, kk)
        idx = cand.expand(slot.shape[:2] + cand.shape).gather(-1, slot)  # key positions (B, H, N, kk)
    k_sel, v_sel = gather_rows(kc, idx), gather_rows(vc, idx)
    edge = _edge_scores(qc.detach(), k_sel.detach(), weight, scale)
    return _sparse_softmax(qc, k_sel, v_sel, ok, scale, bias=edge - edge.detach()).to(q.dtype)


def reference_sac(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weight: Tensor,
    *,
    topk: int,
    candidates: int,
    n_random: int,
    seed: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Dense SAC (Li et al. 2020, https://arxiv.org/abs/2003.09833): the candidate graph as an
    N x N mask, the predictor's dense scores ``E = s (Q W) K^T``, each row's top-k candidate
    edges (``topk_mask``), then softmax attention restricted to them.

    Args:
        As ``sac_attention``; return_weights also returns the ``(B, H, N, N)`` weights.

    Notes:
        The logits are ``S + E - E.detach()`` with E on detached q, k: equal to ``S = s Q K^T``
        in value, while W receives E's straight-through gradient. Allocates N x N by design.
    """
    (qc, kc, vc), key_padding_mask, scale = _dense_inputs(q, k, v, causal, key_padding_mask, scale, False)
    batch, heads, n, _ = q.shape
    cand, valid = sac_candidates(n, candidates=candidates, n_random=n_random, seed=seed, causal=causal, device=q.device)
    graph = torch.zeros(n, n, dtype=torch.bool, device=q.device)
    graph[torch.arange(n, device=q.device)[:, None].expand_as(cand)[valid], cand[valid]] = True
    visible = visible_pairs(
        batch,
        heads,
        n,
        n,
        causal=causal,
        key_padding_mask=key_padding_mask,
        mask_mod=lambda b, h, i, j: graph[i, j],
        device=q.device,
    )
    scores = torch.einsum("bhid,bhjd->bhij", qc, kc) * scale
    edges = torch.einsum("bhie,bhje->bhij", qc.detach() @ weight.to(qc.dtype), kc.detach()) * scale
    keep = topk_mask(edges.detach(), visible, topk)
    weights = normalize_scores(scores + edges - edges.detach(), keep, "softmax")
    out = torch.einsum("bhij,bhjd->bhid", weights, vc).to(q.dtype)
    return (out, weights) if return_weights else out
