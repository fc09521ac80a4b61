"""Memory-compressed attention (Liu et al. 2018, https://arxiv.org/abs/1801.10198, §4.2.4): a
strided convolution shortens keys and values to ``ceil(N / stride)`` slots, softmax attention
runs over the slots. ``compressed_attention`` is the fast path (SDPA over the slots; causal in
checkpointed chunks of query rows), ``compressed_weights`` the dense reference (the convolution
as an explicit ``(M, N)`` matrix)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, real_tokens, zero_padding
from attnzoo.mechanisms.base import AttendArgs
from attnzoo.mechanisms.cache import KVCacheDecode
from attnzoo.mechanisms.low_rank import LowRankAttention
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


@dataclass(frozen=True, kw_only=True)
class CompressedConfig(Config):
    """Config of ``compressed``.

    Args:
        kernel: keys per slot. Default 4. stride: positions between slots. Default 4.
        per_head: one set of taps per head (needs ``heads``); default False: shared by the heads.
        heads: number of heads H, used only when ``per_head``. Default 8.
        chunk: query rows scored at once by the causal path. Default 256.
    """

    kernel: int = bounded(4, ge=1)
    stride: int = bounded(4, ge=1)
    per_head: bool = False
    heads: int = bounded(8, ge=1)
    chunk: int = bounded(256, ge=1)


def compress(x: Tensor, taps: Tensor, *, kernel: int, stride: int) -> Tensor:
    """The strided convolution: slot ``s = sum_t taps[h, t] x[s * stride + t]``, x zero-padded at
    the end so that the last slot is whole. Shapes: x ``(B, H, N, D)``, taps ``(G, kernel)``, G = 1
    or H -> ``(B, H, ceil(N / stride), D)``."""
    n, slots = x.shape[2], -(-x.shape[2] // stride)
    length = (slots - 1) * stride + kernel
    windows = F.pad(x[:, :, :length], (0, 0, 0, max(length - n, 0))).unfold(2, kernel, stride)  # (B, H, M, D, kernel)
    return torch.einsum("bhmdt,ht->bhmd", windows, taps.to(x).expand(x.shape[1], -1))


class _Memory(NamedTuple):
    """What every causal chunk attends over: the slots ``(B, H, M, D)`` and which of them hold a
    real key ``(B, M)``; the raw keys and values ``(B, H, N, D)`` and which are real ``(B, N)``."""

    k_slot: Tensor
    v_slot: Tensor
    slot_ok: Tensor
    k: Tensor
    v: Tensor
    real: Tensor


def _causal_chunk(
    q_c: Tensor, start: int, offset: int, memory: _Memory, kernel: int, stride: int, scale: float
) -> Tensor:
    """Causal query rows ``start ..`` (aligned positions ``t = row + offset``), ``q_c (B, H, c, D)``:
    SDPA over the slots that end within the chunk's reach and the raw keys from ``t_first -
    max(kernel, stride) + 1``, masked to the whole slots ending <= t and the raw keys after the
    last of them, up to t."""
    t = torch.arange(start, start + q_c.shape[2], device=q_c.device) + offset
    first, stop = start + offset, start + offset + q_c.shape[2]
    n_slots = min(max((stop - kernel) // stride + 1, 0), memory.k_slot.shape[2])
    lo = max(first - max(kernel, stride) + 1, 0)
    ends = torch.arange(n_slots, device=t.device) * stride + kernel - 1
    last = torch.div(t - kernel + 1, stride, rounding_mode="floor")
    end = torch.where(t >= kernel - 1, last * stride + kernel - 1, -1)[:, None]  # last key of the last whole slot
    raw = torch.arange(lo, stop, device=t.device)
    see = torch.cat(
        [
            (ends <= t[:, None]) & memory.slot_ok[:, None, None, :n_slots],
            (raw > end) & (raw <= t[:, None]) & memory.real[:, None, None, lo:stop],
        ],
        -1,
    )  # (B, 1, c, S)
    keys = torch.cat([memory.k_slot[:, :, :n_slots], memory.k[:, :, lo:stop]], 2)  # (B, H, S, D)
    values = torch.cat([memory.v_slot[:, :, :n_slots], memory.v[:, :, lo:stop]], 2)
    return F.scaled_dot_product_attention(q_c, keys, values, attn_mask=see, scale=scale)


def compressed_attention(
    q: Tensor, k: Tensor, v: Tensor, taps: Tensor, cfg: CompressedConfig, args: AttendArgs
) -> Tensor:
    """Memory-compressed attention, fast (arguments as ``compressed_weights``; v
    ``(B, H, N_kv, D_v)`` -> ``(B, H, N_q, D_v)``). Not causal: SDPA over the slots. Causal: SDPA
    per ``cfg.chunk`` query rows with a ``chunk x (N / stride + chunk)`` mask, checkpointed
    (recomputed in backward), so nothing of size N x N / stride is ever kept."""
    ct, (b, _, n_q, dim), n = compute_dtype(q), q.shape, k.shape[2]
    kernel, stride, scale, qc = cfg.kernel, cfg.stride, dim**-0.5, q.to(ct)
    kc, vc = (zero_padding(t.to(ct), args.key_mask) for t in (k, v))
    k_slot, v_slot = (compress(x, w, kernel=kernel, stride=stride) for x, w in zip((kc, vc), taps))
    real = real_tokens(args.key_mask, b, n, q.device)
    # a slot is visible if it holds a real key: the real-token mask through all-ones taps
    real_count = compress(real[:, None, :, None].to(ct), torch.ones(1, kernel), kernel=kernel, stride=stride)
    slot_ok = real_count[:, 0, :, 0] > 0  # (B, M)
    if not args.causal:
        mask = None if args.key_mask is None else slot_ok[:, None, None, :]
        return F.scaled_dot_product_attention(qc, k_slot, v_slot, attn_mask=mask, scale=scale).to(q.dtype)
    memory = _Memory(k_slot, v_slot, slot_ok, kc, vc, real)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (qc, k_slot, v_slot, kc, vc))
    outs = []
    for start in range(0, n_q, cfg.chunk):
        rows = (qc[:, :, start : start + cfg.chunk], start, n - n_q, memory, kernel, stride, scale)
        outs.append(checkpoint(_causal_chunk, *rows, use_reentrant=False) if grad else _causal_chunk(*rows))
    return torch.cat(outs, dim=2).to(q.dtype)


def compressed_weights(q: Tensor, k: Tensor, taps: Tensor, cfg: CompressedConfig, args: AttendArgs) -> Tensor:
    """Memory-compressed attention, dense: ``K' = C_k K``, ``V' = C_v V`` with the strided
    convolution as explicit ``(M, N)`` matrices, ``M = ceil(N / stride)``, then softmax attention
    over the M slots; the weights on the original values are ``P_slot C_v (+ P_raw)``.

    Args:
        q, k: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``.
        taps: ``(2, G, kernel)``: key taps [0] and value taps [1], G = 1 or H.
        cfg: ``kernel``, ``stride``: slot s holds keys ``s * stride .. s * stride + kernel - 1``
            (and ``chunk``, for the fast path).
        args: ``causal``: a query at aligned position t sees slot s iff ``s * stride + kernel - 1
            <= t``, and in the same softmax the raw keys (values) after the last slot it sees, up
            to t. ``key_mask``: padded keys are zeroed before the convolution; a slot with
            no real key is masked, and so are padded raw keys.

    Returns:
        ``(B, H, N_q, N_kv)`` in the compute dtype.
    """
    ct, (b, heads, n_q, dim), n = compute_dtype(q), q.shape, k.shape[2]
    kernel, stride, causal = cfg.kernel, cfg.stride, args.causal
    real = real_tokens(args.key_mask, b, n, q.device)
    slots, j = -(-n // stride), torch.arange(n, device=q.device)
    offset = j - torch.arange(slots, device=q.device)[:, None] * stride  # (M, N): tap of key j in slot s
    inside = (offset >= 0) & (offset < kernel)
    # (B, H, M, N), padded keys zeroed
    conv = [w.to(ct)[:, offset.clamp(0, kernel - 1)].expand(heads, -1, -1) * inside * real[:, None, None] for w in taps]
    t = torch.arange(n_q, device=q.device) + (n - n_q)
    ends = torch.arange(slots, device=q.device) * stride + kernel - 1
    see_slot = (inside & real[:, None, :]).any(-1)[:, None, None, :] & ((ends <= t[:, None]) | (not causal))
    last_end = torch.where(ends <= t[:, None], ends, -1).amax(-1, keepdim=True)  # (N_q, 1)
    see_raw = (j > last_end) & (j <= t[:, None]) & real[:, None, None, :] & causal  # (B, 1, N_q, N)
    qc, kc = q.to(ct), k.to(ct)
    scores = torch.cat([qc @ (conv[0] @ kc).transpose(-1, -2), qc @ kc.transpose(-1, -2)], -1) * dim**-0.5
    weights = normalize_scores(scores, torch.cat([see_slot.expand(-1, -1, n_q, -1), see_raw], -1), "softmax")
    w_slot, w_raw = weights.split([slots, n], -1)
    return w_slot @ conv[1] + w_raw


@register(
    "compressed",
    config=CompressedConfig,
    family="low_rank",
    summary="Memory-compressed attention: a strided convolution shortens keys and values by `stride`.",
    paper="Liu et al. 2018, Generating Wikipedia by Summarizing Long Sequences, https://arxiv.org/abs/1801.10198",
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True, cross_attention=True),
    complexity=Complexity(
        time="O(N^2 D / stride)", memory="O(N D) SDPA; causal O(chunk N / stride)", subquadratic_memory=True
    ),
    notes=(
        "swapped in untrained: convolution taps at their initial value 1/kernel (mean pooling), not trained",
        "representative keys: slot s = sum_t w_t k_(s*stride + t), one per stride; the taps w (per head or "
        "shared, separate for keys and values) are scalars shared by the D channels, initialised to 1/kernel",
        "causal: a query sees the slots made entirely of keys <= its position, plus the raw keys after the "
        "last of those, up to itself, in one softmax (no empty rows; kernel = stride = 1 is exact attention)",
        "padding: padded keys are zeroed before the convolution; a slot of padding only is masked",
        "decode step: every key kept (a KV cache) and the causal forward run for the new queries, O(t) per token",
    ),
)
class CompressedAttention(KVCacheDecode, LowRankAttention):
    """Memory-compressed attention. ``taps`` is ``(2, G, kernel)``: key taps [0], value taps [1].

    Notes: the paper's convolution also mixes channels; a tap here is one scalar per head, so the
    output weighs the original values (``implied_attention`` is exact); mixing is left to W_K, W_V.
    """

    config: CompressedConfig

    def __init__(self, config: CompressedConfig) -> None:
        super().__init__(config)
        groups = config.heads if config.per_head else 1
        self.taps = nn.Parameter(torch.full((2, groups, config.kernel), 1.0 / config.kernel))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        self._check_heads(q, self.config.per_head)
        return compressed_attention(q, k, v, self.taps, self.config, args)

    def _weights(self, q: Tensor, k: Tensor, args: AttendArgs) -> Tensor:
        self._check_heads(q, self.config.per_head)
        return compressed_weights(q, k, self.taps, self.config, args)
