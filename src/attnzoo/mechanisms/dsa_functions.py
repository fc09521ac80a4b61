"""DeepSeek Sparse Attention as plain functions: the lightning indexer (``index_scores``), the
top-k selection (``select_keys``), the fast path (``dsa_attention``), its dense form
(``reference_dsa``) and the indexer's training loss (``indexer_kl``). The mechanism that wraps
them is in ``dsa.py``.

The indexer is O(N^2 d_I H_I) by design; the fast path scores it in query chunks, so at most a
``(B, chunk, H_I, N)`` score tensor exists, picks the keys with ``select_topk`` (``topk.py``) and
attends over them in ``selected.selected_softmax``, which keeps only the ``(B, H, N, top_k)``
weights for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo._checks import check_causal, check_key_mask, check_positive_int, check_qkv, check_tensor
from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, default_scale
from attnzoo.mechanisms.selected import row_chunks, selected_softmax
from attnzoo.mechanisms.topk import select_topk, topk_mask

PAPER = (
    "DeepSeek-AI 2025, DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek Sparse Attention, "
    "https://github.com/deepseek-ai/DeepSeek-V3.2-Exp/blob/main/DeepSeek_V3_2.pdf"
)


def index_scores(index_q: Tensor, index_k: Tensor, index_w: Tensor) -> Tensor:
    """The lightning indexer, ``I[b, t, s] = sum_j w[b, t, j] ReLU(q^I[b, t, j] . k^I[b, s])``.

    Shapes:
        index_q ``(B, M, H_I, d_I)``, index_k ``(B, N, d_I)``, index_w ``(B, M, H_I)`` -> ``(B, M, N)``.

    Notes:
        Two GEMMs: every indexer head's scores at once, ``(B, M H_I, N)``, then their weighted
        sum as ``(B M, 1, H_I) @ (B M, H_I, N)``; 4x faster on CPU than a loop over the heads.
        The fast path calls it on chunks of M rows; the reference on all rows, for the same
        rounded numbers per row, so both rank the keys alike.
    """
    b, m, heads_i, _ = index_q.shape
    per_head = torch.bmm(rearrange(index_q, "b m j e -> b (m j) e"), index_k.transpose(1, 2))  # (B, M H_I, N)
    per_head = per_head.relu() if per_head.requires_grad else per_head.relu_()
    weights = rearrange(index_w, "b m j -> (b m) 1 j")
    return torch.bmm(weights, per_head.view(b * m, heads_i, -1)).view(b, m, -1)


def _candidates(start: int, stop: int, m: int, n: int, causal: bool, key_mask: Tensor | None, device) -> Tensor | None:
    """Which keys query rows ``start:stop`` of ``m`` (end-aligned to ``n`` keys) may select,
    broadcastable to ``(B, stop - start, n)``; None = all."""
    visible = None
    if causal:
        rows = torch.arange(start, stop, device=device) + (n - m)
        visible = (torch.arange(n, device=device) <= rows[:, None])[None]  # (1, c, n)
    if key_mask is not None:
        visible = key_mask[:, None] if visible is None else visible & key_mask[:, None]
    return visible


def select_keys(
    index_q: Tensor, index_k: Tensor, index_w: Tensor, top_k: int, causal: bool, key_mask: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor]:
    """Each query's selected keys, ``idx (B, M, k)`` and ``valid (B, M, k)``, ``k = min(top_k, N)``:
    the indexer scored ``chunk`` query rows at a time (end-aligned when ``M < N``), the top k
    candidates kept, ties to the lower key index; unused slots (fewer candidates) are invalid."""
    (_, m), n = index_q.shape[:2], index_k.shape[1]
    kk = min(top_k, n)
    idx, valid = [], []
    with torch.no_grad():
        for start in range(0, m, chunk):
            stop = min(start + chunk, m)
            reach = stop + n - m if causal else n  # later keys are never candidates of these rows
            scores = index_scores(index_q[:, start:stop], index_k[:, :reach], index_w[:, start:stop])  # (B, c, reach)
            visible = _candidates(start, stop, m, n, causal, key_mask, index_q.device)
            visible = None if visible is None else visible[..., :reach]
            chosen, ok = select_topk(scores, visible, min(kk, reach))  # (B, c, <= kk)
            idx.append(F.pad(chosen, (0, kk - chosen.shape[-1])))
            valid.append(F.pad(ok, (0, kk - ok.shape[-1])))
    return torch.cat(idx, 1), torch.cat(valid, 1)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, index_q: Tensor, index_k: Tensor, index_w: Tensor) -> None:
    check_qkv(q, k, v, cross_attention=False)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k and v must have q's {q.shape[1]} heads (repeat grouped K/V first), got {k.shape[1]}")
    check_tensor(index_q, "index_q", 4, "(B, N, H_I, d_I)")
    check_tensor(index_k, "index_k", 3, "(B, N, d_I)")
    check_tensor(index_w, "index_w", 3, "(B, N, H_I)")
    (batch, _, n, _), (heads_i, d_i) = q.shape, index_q.shape[2:]
    want = {"index_q": (batch, n), "index_k": (batch, n, d_i), "index_w": (batch, n, heads_i)}
    for name, x in (("index_q", index_q), ("index_k", index_k), ("index_w", index_w)):
        if tuple(x.shape[: len(want[name])]) != want[name]:
            raise ValueError(
                f"{name} must start with shape {want[name]} (B, N from q; d_I, H_I from index_q), got {tuple(x.shape)}"
            )


def dsa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index_q: Tensor,
    index_k: Tensor,
    index_w: Tensor,
    *,
    top_k: int,
    causal: bool,
    key_mask: Tensor | None = None,
    scale: float | None = None,
    chunk: int = 128,
) -> Tensor:
    """DeepSeek Sparse Attention, the fast path (DeepSeek-V3.2-Exp, section 2.1).

    Args:
        q, k: ``(B, H, N, D)``; v: ``(B, H, N, D_v)`` (self-attention: one sequence).
        index_q: ``(B, N, H_I, d_I)`` indexer queries; index_k: ``(B, N, d_I)``, one indexer key
            per token shared by the indexer heads; index_w: ``(B, N, H_I)`` per-query head weights.
        top_k: keys kept per query (all its candidates when it has fewer).
        causal: query t's candidates are keys ``s <= t``. key_mask: ``(B, N)`` bool, True =
            real; padded keys are never candidates.
        scale: of the attention scores; None means ``1 / sqrt(D)`` (the indexer is unscaled).
        chunk: query rows scored at once (memory ``O(B H chunk N)``). Default 128.

    Returns:
        ``(B, H, N, D_v)`` in q's dtype; a query with no candidate gets zeros. Gradients reach
        q, k, v through the attention; the selection (so ``index_*``) gets none from the output.
    """
    _check_inputs(q, k, v, index_q, index_k, index_w)
    causal = check_causal(causal, q.shape[2], k.shape[2])
    check_positive_int(top_k, "top_k")
    check_positive_int(chunk, "chunk")
    key_mask = check_key_mask(key_mask, q.shape[0], k.shape[2], q.device)
    if q.shape[0] == 0 or q.shape[2] == 0:
        return (q @ k.transpose(-1, -2)) @ v  # empty, on the graph
    return _dsa_rows(q, k, v, index_q, index_k, index_w, top_k, causal, key_mask, scale, chunk)


def _dsa_rows(
    q: Tensor, k: Tensor, v: Tensor, iq: Tensor, ik: Tensor, iw: Tensor, top_k: int, causal: bool, mask, scale, chunk
) -> Tensor:
    """``dsa_attention`` for the ``M`` query rows at the last M of ``N`` key positions (M = N:
    a forward; M < N: decode steps over a cache), unchecked."""
    wide = compute_dtype(q)
    selection = select_keys(*(x.to(wide) for x in (iq, ik, iw)), top_k, causal, mask, chunk)
    return attend_selected(q, k, v, selection, scale)[0]


def attend_selected(q: Tensor, k: Tensor, v: Tensor, selection: tuple[Tensor, Tensor], scale) -> tuple[Tensor, Tensor]:
    """The attention of ``_dsa_rows`` over a given ``select_keys`` selection (which holds the
    causal rule and the padding): ``(out (B, H, M, D_v)`` in q's dtype, ``weights (B, H, M, k)``
    without gradient), through ``selected_softmax`` (``selected.py``: the selected pairs as a
    sparse CSR matrix; O(M k D) forward and backward)."""
    idx, valid = (x[:, None] for x in selection)  # (B, 1, M, k): shared by the heads
    wide = compute_dtype(q)
    qc, kc, vc = (x.to(wide) for x in (q, k, v))
    out, weights = selected_softmax(qc * default_scale(scale, q.shape[-1]), kc, vc, idx, valid)
    return out.to(q.dtype), weights


def reference_dsa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index_q: Tensor,
    index_k: Tensor,
    index_w: Tensor,
    *,
    top_k: int,
    causal: bool,
    key_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Dense DSA, as the paper writes it: index scores ``I (B, N, N)`` (``index_scores``) ->
    candidates (causal ``s <= t``, real keys) -> each row's top_k by I (``topk_mask``, ties to the
    lower key index) -> per head ``softmax(scale q k^T)`` over the kept keys only -> ``@ v``.

    Returns:
        ``(out (B, H, N, D_v), weights (B, H, N, N))``. Allocates N x N by design.
    """
    wide = compute_dtype(q)
    qc, kc, vc = (x.to(wide) for x in (q, k, v))
    n = q.shape[2]
    with torch.no_grad():
        scores = index_scores(*(x.to(wide) for x in (index_q, index_k, index_w)))  # (B, N, N)
        keep = topk_mask(scores, _candidates(0, n, n, n, causal, key_mask, q.device), top_k)
    logits = torch.einsum("bhtd,bhsd->bhts", qc, kc) * default_scale(scale, q.shape[-1])
    weights = normalize_scores(logits, keep[:, None], "softmax")
    return torch.einsum("bhts,bhsd->bhtd", weights, vc).to(q.dtype), weights


def indexer_kl(
    q: Tensor, k: Tensor, iq: Tensor, ik: Tensor, iw: Tensor, top_k: int, causal: bool, mask, scale, chunk: int
) -> Tensor:
    """The indexer's training loss (DeepSeek-V3.2-Exp, section 2.1.2): for each query t with a
    candidate, ``KL(p_t || softmax(I_t))`` over its selected set S_t, where ``p_t`` is the main
    attention over S_t summed over heads and L1-normalised (the mean of the heads' softmaxes) and
    ``I_t`` the index scores of S_t; averaged over those queries.

    Shapes:
        q, k ``(B, H, N, D)`` (no gradient is taken through them: ``p`` is a fixed target);
        iq, ik, iw as ``dsa_attention``'s ``index_*``, carrying the gradient -> a scalar.
    """
    wide = compute_dtype(q)
    selection = select_keys(*(x.detach().to(wide) for x in (iq, ik, iw)), top_k, causal, mask, chunk)
    idx, valid = selection
    idx = idx.masked_fill(~valid, 0)
    qc, kc, scale = q.detach().to(wide), k.detach().to(wide), default_scale(scale, q.shape[-1])
    p = []
    with torch.no_grad():
        for start, stop, reach in row_chunks(qc.shape[2], kc.shape[2], chunk, causal):
            idx_h, ok_h = (x[:, None, start:stop].expand(-1, qc.shape[1], -1, -1) for x in (idx, valid))
            logits = torch.matmul(qc[:, :, start:stop], kc[:, :, :reach].transpose(-1, -2)).gather(-1, idx_h)
            p.append(normalize_scores(logits * scale, ok_h, "softmax").mean(1))  # (B, c, k): rows sum to 1 or 0
    return kl_on_selection(iq, ik, iw, selection, torch.cat(p, 1), chunk)


def kl_on_selection(
    iq: Tensor, ik: Tensor, iw: Tensor, selection: tuple[Tensor, Tensor], p: Tensor, chunk: int
) -> Tensor:
    """``indexer_kl`` given the selection and its target ``p (B, M, k)`` (the main attention's
    weights over the selected keys, averaged over the heads: a training forward has them)."""
    idx, valid = selection
    idx = idx.masked_fill(~valid, 0)
    (b, m), n, wide = idx.shape[:2], ik.shape[1], p.dtype
    ik_rows = rearrange(ik.to(wide), "b n e -> (b n) e")
    total = p.new_zeros(())
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        ok, idx_c = valid[:, start:stop], idx[:, start:stop]
        rows = (idx_c + torch.arange(b, device=idx.device).view(b, 1, 1) * n).flatten()
        ik_sel = ik_rows[rows].view(*idx_c.shape, -1)  # (B, c, k, d_I)
        heads_i = torch.relu(torch.einsum("bmje,bmke->bmjk", iq[:, start:stop].to(wide), ik_sel))
        scores = torch.einsum("bmjk,bmj->bmk", heads_i, iw[:, start:stop].to(wide))
        log_q = torch.log_softmax(scores.masked_fill(~ok, float("-inf")).masked_fill(~ok.any(-1, keepdim=True), 0), -1)
        p_c = p[:, start:stop]
        total = total + (torch.xlogy(p_c, p_c) - p_c * log_q.masked_fill(~ok, 0.0)).sum()
    return total / valid.any(-1).sum().clamp(min=1)
