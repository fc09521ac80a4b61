"""The dense reference backend: ``softmax(s * Q K^T + bias) V`` over an explicit N_q x N_kv
score matrix. It is the semantics every other backend and mechanism is tested against, so it
is written for clarity, not speed; it allocates the full score matrix by design.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo._checks import check_causal, check_choice, check_key_mask, check_qkv
from attnzoo.backends.call import Backend, Call
from attnzoo.mechanisms._ops import dense_dropout
from attnzoo.spec import MaskMod, ScoreMod

NORMALIZERS = ("softmax", "relu")


def pair_indices(batch: int, heads: int, n_q: int, n_kv: int, device: torch.device) -> tuple[Tensor, ...]:
    """Broadcastable ``(b, h, q_idx, kv_idx)`` index tensors for every pair, shaped to
    broadcast to ``(B, H, N_q, N_kv)``. ``q_idx`` is aligned to the end of the keys (see
    ``attnzoo.spec``)."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q_idx = (torch.arange(n_q, device=device) + (n_kv - n_q)).view(1, 1, -1, 1)
    kv_idx = torch.arange(n_kv, device=device).view(1, 1, 1, -1)
    return b, h, q_idx, kv_idx


def visible_pairs(
    batch: int,
    heads: int,
    n_q: int,
    n_kv: int,
    *,
    causal: bool,
    key_mask: Tensor | None,
    mask_mod: MaskMod | None,
    device: torch.device,
) -> Tensor | None:
    """The bool matrix of pairs a query may attend to, broadcastable to ``(B, H, N_q, N_kv)``,
    or None when every pair is visible."""
    b, h, q_idx, kv_idx = pair_indices(batch, heads, n_q, n_kv, device)
    visible = None
    if causal:
        visible = kv_idx <= q_idx
    if key_mask is not None:
        padded = key_mask[:, None, None, :]
        visible = padded if visible is None else visible & padded
    if mask_mod is not None:
        allowed = mask_mod(b, h, q_idx, kv_idx)
        visible = allowed if visible is None else visible & allowed
    return visible


def normalize_scores(scores: Tensor, visible: Tensor | None, normalizer: str) -> Tensor:
    """Turn scores into attention weights over the visible keys of each row.

    A row with no visible key gets all-zero weights, and (because the zeros come from a
    multiplication, not from a NaN that is patched afterwards) passes zero gradient.
    """
    if normalizer == "relu":
        # ReLU attention, normalised by the row sum (a row whose ReLU scores are all 0 -> 0).
        r = torch.relu(scores)
        if visible is not None:
            r = r * visible
        total = r.sum(dim=-1, keepdim=True)
        return r / torch.where(total > 0, total, torch.ones_like(total))
    if visible is None:
        return torch.softmax(scores, dim=-1)
    has_key = visible.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf"))
    # Rows with nothing visible would be softmax(-inf, ..., -inf) = NaN; give them finite scores
    # and zero the result, so neither the output nor the gradient sees a NaN.
    scores = scores.masked_fill(~has_key, 0.0)
    return torch.softmax(scores, dim=-1) * has_key


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    normalizer: str = "softmax",
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact dense attention, ``O = normalize(s * Q K^T + bias) V`` (Vaswani et al. 2017,
    https://arxiv.org/abs/1706.03762).

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)``.
        causal: query ``i`` sees keys ``j <= i + (N_kv - N_q)`` (queries aligned to the end).
        key_mask: bool ``(B, N_kv)``, True = a real token. Default None.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``; only True pairs are visible.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled
            scores before masking (an additive position bias, for instance).
        scale: score scale ``s``; default ``1 / sqrt(D)``.
        normalizer: ``"softmax"`` or ``"relu"`` (ReLU scores divided by their row sum over
            visible keys; a row whose ReLU scores sum to 0 gives zeros).
        return_weights: also return the ``(B, H, N_q, N_kv)`` weight matrix (float32, or
            float64 for float64 inputs).

    Returns:
        ``(B, H, N_q, D_v)`` in the dtype of ``q`` (and the weights when asked).

    Notes:
        Low-precision inputs are computed in float32 and the output cast back, so bf16 and fp16
        results carry only the rounding of the final cast. A query row with no visible key
        returns zeros and passes zero gradient.
    """
    check_qkv(q, k, v)
    batch, heads, n_q, dim = q.shape
    n_kv = k.shape[2]
    check_causal(causal, n_q, n_kv)
    key_mask = check_key_mask(key_mask, batch, n_kv, q.device)
    check_choice(normalizer, "normalizer", NORMALIZERS)
    scale = dim**-0.5 if scale is None else scale

    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    scores = torch.einsum("bhid,bhjd->bhij", qc, kc) * scale
    if score_mod is not None:
        scores = score_mod(scores, *pair_indices(batch, heads, n_q, n_kv, q.device))
    visible = visible_pairs(
        batch,
        heads,
        n_q,
        n_kv,
        causal=causal,
        key_mask=key_mask,
        mask_mod=mask_mod,
        device=q.device,
    )
    weights = normalize_scores(scores, visible, normalizer)
    out = torch.einsum("bhij,bhjd->bhid", weights, vc).to(q.dtype)
    return (out, weights) if return_weights else out


def reference_call(call: Call, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``reference_attention`` over a resolved ``Call``: its pattern (causal already and-ed in),
    padding, ``score_mod``, scale and dropout (the weights returned are those applied)."""
    weighted = reference_attention(
        call.q,
        call.k,
        call.v,
        key_mask=call.key_mask,
        mask_mod=call.mask_mod(),
        score_mod=call.score_mod,
        scale=call.scale,
        return_weights=return_weights or call.dropout is not None,
    )
    if call.dropout is None:
        return weighted
    # Dropout on the normalised weights (Vaswani et al. 2017, 5.4): the seeded mask, rescaled.
    weights = dense_dropout(weighted[1], call.dropout.seed, call.dropout.p)
    out = torch.einsum("bhij,bhjd->bhid", weights, call.v.to(weights.dtype)).to(call.q.dtype)
    return (out, weights) if return_weights else out


class Reference(Backend):
    """The oracle as a backend: runs every call (it is last in every priority list), at
    O(N_q x N_kv) memory."""

    NAME = "reference"

    def run(self, call: Call) -> Tensor:
        return reference_call(call)
