"""Content-chosen sparse attention (MECHANISMS.md §C): ``topk`` here, ``sac`` in ``sac.py``.

``topk`` (explicit sparse attention, Zhao et al. 2019, https://arxiv.org/abs/1912.11637) keeps
each query's k largest scores and runs softmax over those alone. ``sac`` (Sparse Adaptive
Connection, Li et al. 2020, https://arxiv.org/abs/2003.09833) lets a learned edge predictor pick
k keys per node out of a bounded candidate set, and attends along those edges only.

One selection rule serves both (``topk_mask``): keep a row's k largest visible scores, the lower
key index winning ties, or all visible entries if fewer. ``topk`` attends through
``selected.selected_softmax`` (the selection from one score GEMM per query chunk, the attention
over the kept pairs as a sparse CSR matrix); ``sac``, whose candidates are a few per node,
through ``sparse_softmax`` over gathered keys. Each fast path has a dense ``reference_*`` beside
it that makes the same selection on the full N x N matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.backends.reference import normalize_scores, visible_pairs
from attnzoo.mechanisms._ops import compute_dtype, default_scale, mean_keys, visible_counts
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted
from attnzoo.mechanisms.cache import KVCacheDecode
from attnzoo.mechanisms.selected import select_in_chunks, selected_softmax
from attnzoo.registry import Config, bounded, quarter, register
from attnzoo.spec import Capabilities, Complexity

#: ``largest`` takes two stages from rows of this many times k on: the crossover on 1M scores
#: (``benchmarks/largest-crossover-cpu.txt``, ``scripts/largest_crossover.py``): k = 33 of 480
#: keys 5.9 -> 5.0 ms, of 1K 5.1 -> 3.4; k = 257 of 4K 6.3 -> 4.8; k = 8 of 128 keys 5.7 ->
#: 4.8, but of 110 keys 5.8 -> 6.5 and k = 33 of 352 keys 6.3 -> 6.3 (not used there).
TWO_STAGES_FROM = 14


def largest(s: Tensor, k: int, *, ordered: bool = True) -> tuple[Tensor, Tensor]:
    """``s.topk(k, dim=-1, sorted=ordered)`` (each row's k largest values, in descending order
    with ``ordered``, and their indices) in two stages on long rows, where one ``torch.topk``
    over the whole row costs most.

    The columns are dealt into ``G`` groups of ``g ~ sqrt(N / k)`` (column ``r G + j`` in group
    ``j``, so a group's maximum is ``g - 1`` elementwise maxima of contiguous slices); top-k
    picks the k groups with the largest maxima, then the k largest of their ``g k`` members.
    Exact, ties included: with ``v`` the k-th largest value, every group holding a value above
    ``v`` has its maximum among the k picked, and each picked group holds a value ``>= v`` (or
    every group with one is picked), so the members, with the ``N mod g`` columns left over,
    hold every value above ``v`` and at least k values ``>= v``. Indices of equal
    values may come in another order than ``torch.topk``'s (which leaves it unspecified). Used
    where ``N >= TWO_STAGES_FROM * k``.
    """
    n = s.shape[-1]
    if k < 1 or n < TWO_STAGES_FROM * k:  # shorter rows: two calls' overhead outweighs the pass they save
        return s.topk(k, dim=-1, sorted=ordered)
    g = 2 ** round(math.log2(math.sqrt(n / k)))  # from 14 k on: >= 4, and G >= sqrt(n k / 2) > 2.6 k
    main = n - n % g  # the last n % g columns are members whatever the groups
    groups = s[..., :main].unflatten(-1, (g, -1))  # [..., g, G]
    picked = groups.amax(-2).topk(k, dim=-1, sorted=False).indices  # [..., k] groups
    members = groups.gather(-1, picked[..., None, :].expand(*picked.shape[:-1], g, k)).flatten(-2)  # [..., g k]
    if main < n:
        members = torch.cat([members, s[..., main:]], dim=-1)
    values, at = members.topk(k, dim=-1, sorted=ordered)
    grouped = picked.gather(-1, at % k) + (at // k) * groups.shape[-1]
    return values, grouped if main == n else torch.where(at < g * k, grouped, at - g * k + main)


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
    # The k-th largest score of each row (-inf when fewer than k entries are visible), by
    # torch.topk itself: the references use this rule, and stay apart from ``largest``.
    tau = s.topk(kk, dim=-1).values[..., -1:]
    above = s > tau
    tied = s == tau
    room = kk - above.sum(-1, keepdim=True, dtype=torch.int32)
    keep = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room))
    return keep if visible is None else keep & visible


def topk_keep(scores: Tensor, visible: Tensor | None, k: int) -> Tensor:
    """``topk_mask(scores, visible, k)`` in fewer passes over the scores, for fast paths: each
    row keeps the entries at or above its k-th largest score, which is the rule's answer
    whenever that makes exactly k entries; only the other rows (a tie across the cut, fewer
    than k visible entries) go through ``topk_mask`` (``sac`` at 1K: 5 passes over its score
    tile where the rule makes 11)."""
    s = scores if visible is None else scores.masked_fill(~visible, float("-inf"))
    s = s.masked_fill(s.isnan(), float("inf"))  # as topk_mask: NaN ranks above everything
    kk = min(k, s.shape[-1])
    tau = largest(s, kk, ordered=False)[0].amin(-1, keepdim=True)  # s holds no NaN
    keep = s >= tau
    odd = (keep.sum(-1, keepdim=True, dtype=torch.int32) != kk) | (tau == float("-inf"))
    if odd.device.type != "meta" and bool(odd.any()):  # meta tensors hold no values
        rows = odd[..., 0].nonzero(as_tuple=True)
        keep[rows] = topk_mask(scores[rows], None if visible is None else visible.expand_as(scores)[rows], k)
    return keep


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
    """``kept_indices(topk_mask(scores, visible, k), k)``, fast: top-k (``largest``) picks the same set
    whenever a row's k-th score is not tied with an entry it left out; only rows with such a tie
    (rare, except rows with fewer than k visible keys) go through the exact rule."""
    s = scores if visible is None else scores.masked_fill(~visible, float("-inf"))
    if k < s.shape[-1]:
        values, idx, ambiguous = _cut(*largest(s, k + 1, ordered=False))
    else:  # every entry kept
        values, idx = s.topk(k, dim=-1, sorted=False)
        ambiguous = torch.zeros(s.shape[:-1], dtype=torch.bool, device=s.device)
    valid = values != float("-inf")  # NaN (a NaN query's scores) is kept: its row comes out NaN
    if ambiguous.device.type != "meta" and bool(ambiguous.any()):  # meta tensors hold no values
        rows = ambiguous.nonzero(as_tuple=True)
        keep = topk_mask(scores[rows], None if visible is None else visible.expand_as(scores)[rows], k)
        idx[rows], valid[rows] = kept_indices(keep, k)
    return idx, valid


def _cut(top: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A row's ``k + 1`` largest values ``top`` (any order) and their ``idx`` -> the k largest,
    their indices, and whether the cut splits a tie: the (k+1)-th value (the smallest; NaN ranks
    above everything, as in ``torch.topk``) equals the k-th exactly when it occurs twice. The
    one dropped is swapped with the last slot. Counting ties over the whole row took longer
    than top-k itself; the ordered top-(k+1) this replaced sorted them (``topk`` fwd+bwd 1-3%
    faster at 512-2K, within noise at 4K: ``benchmarks/ab-unordered-cut-cpu.txt``)."""
    ranked = top.nan_to_num(nan=math.inf)
    low, drop = ranked.min(-1, keepdim=True)
    ambiguous = (ranked == low).sum(-1) > 1
    last = top.shape[-1] - 1
    values = top.scatter(-1, drop, top[..., last:])[..., :last]
    return values, idx.scatter(-1, drop, idx[..., last:])[..., :last], ambiguous


def sparse_softmax(
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


def _chunk_visible(
    start: int, stop: int, n_q: int, n_kv: int, causal: bool, key_mask: Tensor | None, device: torch.device
) -> Tensor | None:
    """Visible pairs of query rows ``start:stop``, broadcastable to ``(B, H, stop - start, N_kv)``."""
    visible = None
    if causal:
        q_idx = torch.arange(start, stop, device=device) + (n_kv - n_q)
        visible = torch.arange(n_kv, device=device) <= q_idx[:, None]  # (c, N_kv)
    if key_mask is not None:
        real = rearrange(key_mask, "b n -> b 1 1 n")
        visible = real if visible is None else visible & real
    return visible


@dataclass(frozen=True, kw_only=True)
class TopKConfig(Config):
    """Config of ``topk``.

    Args:
        topk: keys kept per query. Default 32.
        chunk: queries scored at once by the fast path (memory O(N chunk)). Default None:
            ``auto_chunk(N)`` (128 rows below 16K keys, 64 from there).
        scale: score scale; default None means ``1 / sqrt(D)``.
    """

    topk: int = bounded(32, ge=1, for_length=quarter)
    chunk: int | None = bounded(None, ge=1, none="128 query rows, 64 from 16K keys")
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")


def auto_chunk(n_kv: int) -> int:
    """Query rows scored at once for ``n_kv`` keys: smaller chunks keep a chunk's scores closer
    to the cache as N grows. Measured on a 2-core EPYC in one process: fwd+bwd at 4K, 128 rows
    20% faster than 256; forward at 16K, 64 rows 30% faster than 256 and 10% than 32; equal at 1K."""
    return 128 if n_kv < 16384 else 64


def topk_attention(q: Tensor, k: Tensor, v: Tensor, cfg: TopKConfig, args: AttendArgs) -> Tensor:
    """Explicit sparse attention in query chunks (Zhao et al. 2019, https://arxiv.org/abs/1912.11637).

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)``.
        cfg: ``topk``, ``chunk``, ``scale``. args: as in ``reference_topk``.

    Shapes:
        -> ``(B, H, N_q, D_v)`` in the dtype of ``q``.

    Notes:
        ``selected.select_in_chunks``: per chunk, the ``(B, H, chunk, N')`` scores are one GEMM
        (causal: only the keys the chunk can reach) and each row keeps its ``topk`` largest
        visible ones (``select_topk``, the same rule as the reference's ``topk_mask``); then
        ``selected.selected_softmax`` attends over the kept pairs as a sparse CSR matrix, forward
        and backward O(N_q topk D). No ``N_q x N_kv`` tensor exists; the time is the selection's
        GEMMs and top-k (``largest``; every pair is scored by definition) plus the sparse attention.
    """
    n_q, n_kv = q.shape[2], k.shape[2]
    kk = min(cfg.topk, n_kv)

    def keep(start: int, stop: int, reach: int, scores: Tensor) -> tuple[Tensor, Tensor]:
        visible = _chunk_visible(start, stop, n_q, n_kv, args.causal, args.key_mask, q.device)
        idx, valid = select_topk(scores, None if visible is None else visible[..., :reach], min(kk, reach))
        pad = kk - idx.shape[-1]  # causal chunks that reach fewer than k keys
        return F.pad(idx, (0, pad)), F.pad(valid, (0, pad))

    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    qc = qc * default_scale(cfg.scale, q.shape[-1])
    chunk = auto_chunk(n_kv) if cfg.chunk is None else cfg.chunk
    idx, valid = select_in_chunks(qc, kc, keep, chunk, args.causal)
    out, _ = selected_softmax(qc, kc, vc, idx, valid)
    return out.to(q.dtype)


def reference_topk(
    q: Tensor, k: Tensor, v: Tensor, cfg: TopKConfig, args: AttendArgs, return_weights: bool
) -> Weighted:
    """Dense explicit sparse attention (Zhao et al. 2019, https://arxiv.org/abs/1912.11637).

    ``S = s Q K^T``; each row keeps its ``topk`` largest visible entries (``topk_mask``: ties go
    to the lower key index; rows with fewer visible keys keep them all); ``O = softmax(S
    restricted to the kept entries) V``, zero elsewhere.

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)``.
        cfg: ``topk`` (keys kept per query) and ``scale`` (default ``1 / sqrt(D)``).
        args: the checked call options: ``causal`` (query i sees keys ``j <= i + N_kv - N_q``),
            ``key_mask`` ``(B, N_kv)``, True = real.
        return_weights: also return the ``(B, H, N_q, N_kv)`` weights.

    Notes:
        Gradients flow through the kept scores; the selection is a constant. A query with no
        visible key returns zeros and passes zero gradient. Allocates N_q x N_kv by design.
    """
    qc, kc, vc = (t.to(compute_dtype(q)) for t in (q, k, v))
    (batch, heads, n_q, _), n_kv = q.shape, k.shape[2]
    scores = torch.einsum("bhid,bhjd->bhij", qc, kc) * default_scale(cfg.scale, q.shape[-1])
    mask = args.key_mask
    visible = visible_pairs(batch, heads, n_q, n_kv, causal=args.causal, key_mask=mask, mask_mod=None, device=q.device)
    keep = topk_mask(scores.detach(), visible, cfg.topk)
    weights = normalize_scores(scores, keep, "softmax")
    out = torch.einsum("bhij,bhjd->bhid", weights, vc).to(q.dtype)
    return (out, weights) if return_weights else out


def register_selective(
    name: str, config: type, summary: str, paper: str, complexity: Complexity, notes: tuple[str, ...], *, cross: bool
) -> Callable[[type], type]:
    """Register a mechanism that attends each query over a selection of keys it keeps (``topk``,
    ``sac``): family "content"; causal, key padding and decoding; no ``score_mod``."""
    caps = Capabilities(causal=True, key_mask=True, decode_step=True, cross_attention=cross, scale=True)
    about = dict(family="content", summary=summary, paper=paper, notes=notes)
    return register(name, config=config, capabilities=caps, complexity=complexity, **about)


@register_selective(
    "topk",
    TopKConfig,
    "Explicit sparse attention: each query keeps its top-k scores, softmax over those only.",
    "Zhao et al. 2019, Explicit Sparse Transformer, https://arxiv.org/abs/1912.11637",
    Complexity(
        time="O(N^2 D): every pair is still scored",
        memory="O(B H chunk N) working, O(B H N k) weights kept for backward",
        subquadratic_memory=True,
    ),
    (
        "the k kept keys are chosen among visible keys (after causal and padding masks); ties go to "
        "the lower key index; a row with fewer than k visible keys keeps them all",
        "gradients flow through the kept scores; the selection itself is not differentiable",
        "the selection costs one score GEMM per query chunk plus a top-k in two stages (the k groups of columns "
        "with the largest maxima, then their members: exact; every pair is scored, O(N^2 D)); "
        "the attention over the kept pairs is sparse (CSR: sampled scores, CSR @ v; backward the same, O(N k D)); "
        "nothing holds more than a chunk x N tile",
        "decode step: every key kept (a KV cache) and the new row's top k chosen over it, O(t) per token",
    ),
    cross=True,
)
class TopKAttention(KVCacheDecode, Attention):
    """Explicit sparse attention; ``_attend`` runs ``topk_attention``, ``reference_topk`` the dense twin."""

    config: TopKConfig

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return topk_attention(q, k, v, self.config, args)

    def keys_per_query(self, n: int, causal: bool) -> float:
        """``topk`` keys per row (all it sees when fewer; every pair is still scored)."""
        return mean_keys(visible_counts(n, causal).clamp(max=self.config.topk))

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        return reference_topk(q, k, v, self.config, args, return_weights)
