"""Low rank and compression (MECHANISMS.md §D): each attends to a few *representative keys*
instead of all N (the seed notes' "pick K of N keys"). ``linformer``: k learned mixtures of all
keys; ``compressed``: ceil(N / stride) strided local mixtures; ``nystrom``: m segment means, the
N x N softmax rebuilt from three small ones through a pseudo-inverse. (LAMA pooling, which
pools N tokens to one vector per head, is a layer: ``attnzoo.nn.LAMAPooling``.) Each
mechanism's dense ``reference_*`` reads like its paper and returns the weights it applies
(``implied_attention``); its fast path never builds an N x N tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, default_scale, real_tokens
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted, zero_padding
from attnzoo.mechanisms.cache import KVCacheDecode
from attnzoo.registry import Config, bounded, eighth, quarter, register
from attnzoo.spec import Capabilities, Complexity


class _LowRank(Attention):
    """Shared by the family: the head-count check of configs with per-head parameters."""

    def _check_heads(self, q: Tensor, used: bool) -> None:
        if used and q.shape[1] != self.config.heads:
            raise ValueError(
                f"{self.spec.name} was built for heads={self.config.heads} but q has "
                f"H={q.shape[1]}; build it with heads={q.shape[1]}"
            )


def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    e: Tensor,
    f: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Linformer, fast: SDPA over the k projected keys and values (args as ``reference_linformer``)."""
    ct, (heads, n) = compute_dtype(q), k.shape[1:3]
    kc, vc = (zero_padding(t.to(ct), key_padding_mask) for t in (k, v))
    e_n, f_n = (p[:, :, :n].to(kc).expand(heads, -1, -1) for p in (e, f))  # (H, k, N)
    k_bar = torch.einsum("hcn,bhnd->bhcd", e_n, kc)  # (B, H, k, D)
    v_bar = torch.einsum("hcn,bhnd->bhcd", f_n, vc)  # (B, H, k, D_v)
    return F.scaled_dot_product_attention(q.to(ct), k_bar, v_bar, scale=scale).to(q.dtype)


def reference_linformer(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    e: Tensor,
    f: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Linformer head by head, eq. (7) of Wang et al. 2020 (https://arxiv.org/abs/2006.04768):
    ``head_h = softmax(Q_h (E_h K_h)^T / sqrt(d)) (F_h V_h)``, ``E_h = E[:, :N_kv]``.

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)``; N_kv <= max_len.
        e, f: ``(G, k, max_len)``, G = 1 (shared by the heads) or H (one per head).
        key_padding_mask: ``(B, N_kv)``, True = real. scale: default ``1 / sqrt(D)``.
        return_weights: also return the ``(B, H, N_q, N_kv)`` weights ``P_h F_h``.

    Notes:
        Padded key and value rows are set to 0 (a select) before the projection, so they add nothing
        to any slot; every slot still takes softmax mass (padding is not exact even at E = F = I).
    """
    ct, n = compute_dtype(q), k.shape[2]
    scale = default_scale(scale, q.shape[-1])
    keep = real_tokens(key_padding_mask, q.shape[0], n, q.device).to(ct)  # (B, N)
    outs, weights = [], []
    for h in range(q.shape[1]):
        e_h, f_h = e[h % e.shape[0], :, :n].to(ct), f[h % f.shape[0], :, :n].to(ct)  # (k, N)
        k_bar = e_h @ (k[:, h].to(ct) * keep[..., None])  # (B, k, D)
        v_bar = f_h @ (v[:, h].to(ct) * keep[..., None])  # (B, k, D_v)
        p = torch.softmax(q[:, h].to(ct) @ k_bar.transpose(1, 2) * scale, dim=-1)  # (B, N_q, k)
        outs.append(p @ v_bar)
        weights.append(p @ (f_h * keep[:, None, :]))  # (B, N_q, N)
    out = torch.stack(outs, 1).to(q.dtype)
    return (out, torch.stack(weights, 1)) if return_weights else out


@dataclass(frozen=True, kw_only=True)
class LinformerConfig(Config):
    """Config of ``linformer``.

    Args:
        k: projected length (64). max_len: E, F are ``(k, max_len)``; N_kv > max_len raises (4096).
        sharing: (paper §4) ``"headwise"`` (default): one E and one F shared by all heads; ``"kv"``:
            one E = F shared by all heads; ``"layerwise"``: one E = F for all heads and layers, in
            one module the same as ``"kv"`` (share across layers by assigning one module's ``proj``
            Parameter to the others); ``"none"``: a separate E and F per head (needs ``heads``).
        heads: number of heads H, used only by ``sharing="none"`` (8). seed: of the xavier init (0).
        init: ``"xavier"`` (default; uniform, gain 1/sqrt(2), as fairseq's Linformer) or
            ``"identity"`` (E = F = the first k rows of I; with k = N it is exact attention).
    """

    k: int = bounded(64, ge=1)
    max_len: int = bounded(4096, ge=1)
    sharing: Literal["headwise", "kv", "layerwise", "none"] = "headwise"
    heads: int = bounded(8, ge=1)
    init: Literal["xavier", "identity"] = "xavier"
    seed: int = bounded(0, ge=0)

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """A quarter of the keys: k = 64 would project a short sequence to a longer one."""
        return dict(k=quarter(n))


@register(
    "linformer",
    config=LinformerConfig,
    family="low_rank",
    summary="Linformer: keys and values projected along the sequence to k learned mixtures.",
    paper="Wang et al. 2020, Linformer: Self-Attention with Linear Complexity, https://arxiv.org/abs/2006.04768",
    capabilities=Capabilities(causal=False, key_padding=True, cross_attention=True),
    complexity=Complexity(time="O(N k D)", memory="O(N k)", subquadratic_memory=True),
    notes=(
        "swapped in untrained: projections E, F randomly initialised (xavier, seed 0), not trained",
        "representative keys: the k rows of E[:, :N] K, learned mixtures of all keys; values F[:, :N] V",
        "padded keys and values are set to 0 before the projection (their slots still take softmax mass)",
        "not causal: every projected slot mixes future keys",
    ),
)
class LinformerAttention(_LowRank):
    """Linformer. ``proj`` is ``(1 or 2, G, k, max_len)``; ``e = proj[0]``, ``f = proj[-1]`` (the
    same tensor when E = F). Set them with ``module.proj.data.copy_(...)``."""

    config: LinformerConfig

    def __init__(self, config: LinformerConfig) -> None:
        super().__init__(config)
        shape = (
            1 if config.sharing in ("kv", "layerwise") else 2,
            config.heads if config.sharing == "none" else 1,
            config.k,
            config.max_len,
        )
        if config.init == "identity":
            proj = torch.eye(config.k, config.max_len).expand(shape).clone()
        else:
            bound = 2**-0.5 * (6 / (config.k + config.max_len)) ** 0.5
            proj = (torch.rand(shape, generator=torch.Generator().manual_seed(config.seed)) * 2 - 1) * bound
        self.proj = nn.Parameter(proj)

    def _check(self, q: Tensor, k: Tensor) -> None:
        if k.shape[2] > self.config.max_len:
            raise ValueError(
                f"linformer was built with max_len={self.config.max_len} but N_kv={k.shape[2]}; "
                f"build it with max_len >= {k.shape[2]}"
            )
        self._check_heads(q, self.config.sharing == "none")

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        self._check(q, k)
        return linformer_attention(q, k, v, self.proj[0], self.proj[-1], key_padding_mask=args.key_padding_mask)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        self._check(q, k)
        return reference_linformer(
            q, k, v, self.proj[0], self.proj[-1], key_padding_mask=args.key_padding_mask, return_weights=return_weights
        )


def compress(x: Tensor, taps: Tensor, *, kernel: int, stride: int) -> Tensor:
    """The strided convolution: slot ``s = sum_t taps[h, t] x[s * stride + t]``, x zero-padded at
    the end so that the last slot is whole. Shapes: x ``(B, H, N, D)``, taps ``(G, kernel)``, G = 1
    or H -> ``(B, H, ceil(N / stride), D)``."""
    n, slots = x.shape[2], -(-x.shape[2] // stride)
    length = (slots - 1) * stride + kernel
    windows = F.pad(x[:, :, :length], (0, 0, 0, max(length - n, 0))).unfold(2, kernel, stride)  # (B, H, M, D, kernel)
    return torch.einsum("bhmdt,ht->bhmd", windows, taps.to(x).expand(x.shape[1], -1))


def _causal_chunk(
    q_c: Tensor,
    start: int,
    offset: int,
    k_slot: Tensor,
    v_slot: Tensor,
    slot_ok: Tensor,
    kc: Tensor,
    vc: Tensor,
    real: Tensor,
    kernel: int,
    stride: int,
    scale: float,
) -> Tensor:
    """Causal query rows ``start ..`` (aligned positions ``t = row + offset``): SDPA over the slots
    that end within the chunk's reach and the raw keys from ``t_first - max(kernel, stride) + 1``,
    masked to the whole slots ending <= t and the raw keys after the last of them, up to t.
    q_c ``(B, H, c, D)``, k_slot ``(B, H, M, D)``, slot_ok ``(B, M)``, kc ``(B, H, N, D)``, real ``(B, N)``."""
    t = torch.arange(start, start + q_c.shape[2], device=q_c.device) + offset
    first, stop = start + offset, start + offset + q_c.shape[2]
    n_slots = min(max((stop - kernel) // stride + 1, 0), k_slot.shape[2])
    lo = max(first - max(kernel, stride) + 1, 0)
    ends = torch.arange(n_slots, device=t.device) * stride + kernel - 1
    last = torch.div(t - kernel + 1, stride, rounding_mode="floor")
    end = torch.where(t >= kernel - 1, last * stride + kernel - 1, -1)[:, None]  # last key of the last whole slot
    raw = torch.arange(lo, stop, device=t.device)
    see = torch.cat(
        [
            (ends <= t[:, None]) & slot_ok[:, None, None, :n_slots],
            (raw > end) & (raw <= t[:, None]) & real[:, None, None, lo:stop],
        ],
        -1,
    )  # (B, 1, c, S)
    keys = torch.cat([k_slot[:, :, :n_slots], kc[:, :, lo:stop]], 2)  # (B, H, S, D)
    values = torch.cat([v_slot[:, :, :n_slots], vc[:, :, lo:stop]], 2)
    return F.scaled_dot_product_attention(q_c, keys, values, attn_mask=see, scale=scale)


def compressed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    taps: Tensor,
    *,
    kernel: int,
    stride: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    chunk: int = 256,
) -> Tensor:
    """Memory-compressed attention, fast (args as ``reference_compressed``). Not causal: SDPA over
    the slots. Causal: SDPA per ``chunk`` query rows with a ``chunk x (N / stride + chunk)`` mask,
    checkpointed (recomputed in backward), so nothing of size N x N / stride is ever kept."""
    ct, (b, _, n_q, dim), n = compute_dtype(q), q.shape, k.shape[2]
    scale = default_scale(scale, dim)
    qc = q.to(ct)
    kc, vc = (zero_padding(t.to(ct), key_padding_mask) for t in (k, v))
    k_slot, v_slot = (compress(x, w, kernel=kernel, stride=stride) for x, w in zip((kc, vc), taps))
    real = real_tokens(key_padding_mask, b, n, q.device)
    slot_ok = (
        compress(real[:, None, :, None].to(ct), torch.ones(1, kernel), kernel=kernel, stride=stride)[:, 0, :, 0] > 0
    )
    if not causal:
        mask = None if key_padding_mask is None else slot_ok[:, None, None, :]
        return F.scaled_dot_product_attention(qc, k_slot, v_slot, attn_mask=mask, scale=scale).to(q.dtype)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (qc, k_slot, v_slot, kc, vc))
    outs = []
    for start in range(0, n_q, chunk):
        args = (
            qc[:, :, start : start + chunk],
            start,
            n - n_q,
            k_slot,
            v_slot,
            slot_ok,
            kc,
            vc,
            real,
            kernel,
            stride,
            scale,
        )
        outs.append(checkpoint(_causal_chunk, *args, use_reentrant=False) if grad else _causal_chunk(*args))
    return torch.cat(outs, dim=2).to(q.dtype)


def reference_compressed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    taps: Tensor,
    *,
    kernel: int,
    stride: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Memory-compressed attention, dense (Liu et al. 2018, https://arxiv.org/abs/1801.10198,
    §4.2.4): ``K' = C K``, ``V' = C V`` with the strided convolution as an explicit ``(M, N)``
    matrix C, ``M = ceil(N / stride)``, then softmax attention over the M slots.

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``, ``(B, H, N_kv, D_v)``.
        taps: ``(2, G, kernel)``: key taps [0] and value taps [1], G = 1 or H.
        kernel, stride: slot s holds keys ``s * stride .. s * stride + kernel - 1``.
        causal: a query at aligned position t sees slot s iff ``s * stride + kernel - 1 <= t``, and
            in the same softmax the raw keys (values) after the last slot it sees, up to t.
        key_padding_mask: padded keys are zeroed before the convolution; a slot with no real key
            is masked, and so are padded raw keys.
        scale: default ``1 / sqrt(D)``. return_weights: also the ``(B, H, N_q, N_kv)`` weights.
    """
    ct, (b, heads, n_q, dim), n = compute_dtype(q), q.shape, k.shape[2]
    scale = default_scale(scale, dim)
    real = real_tokens(key_padding_mask, b, n, q.device)
    slots, j = -(-n // stride), torch.arange(n, device=q.device)
    offset = j - torch.arange(slots, device=q.device)[:, None] * stride  # (M, N): tap of key j in slot s
    inside = (offset >= 0) & (offset < kernel)
    conv = [w.to(ct)[:, offset.clamp(0, kernel - 1)].expand(heads, -1, -1) * inside for w in taps]  # (H, M, N)
    conv = [c * real[:, None, None, :] for c in conv]  # (B, H, M, N): padded keys zeroed
    k_slot, v_slot = conv[0] @ k.to(ct), conv[1] @ v.to(ct)
    t = torch.arange(n_q, device=q.device) + (n - n_q)
    ends = torch.arange(slots, device=q.device) * stride + kernel - 1
    see_slot = (inside & real[:, None, :]).any(-1)[:, None, None, :] & ((ends <= t[:, None]) | (not causal))
    last_end = torch.where(ends <= t[:, None], ends, -1).amax(-1, keepdim=True)  # (N_q, 1)
    see_raw = (j > last_end) & (j <= t[:, None]) & real[:, None, None, :] & causal  # (B, 1, N_q, N)
    scores = torch.cat([q.to(ct) @ k_slot.transpose(-1, -2), q.to(ct) @ k.to(ct).transpose(-1, -2)], -1)
    weights = normalize_scores(scores * scale, torch.cat([see_slot.expand(-1, -1, n_q, -1), see_raw], -1), "softmax")
    w_slot, w_raw = weights.split([slots, n], -1)
    out = (w_slot @ v_slot + w_raw @ v.to(ct)).to(q.dtype)
    return (out, w_slot @ conv[1] + w_raw) if return_weights else out


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


@register(
    "compressed",
    config=CompressedConfig,
    family="low_rank",
    summary="Memory-compressed attention: a strided convolution shortens keys and values by `stride`.",
    paper="Liu et al. 2018, Generating Wikipedia by Summarizing Long Sequences, https://arxiv.org/abs/1801.10198",
    capabilities=Capabilities(causal=True, key_padding=True, decode_step=True, cross_attention=True),
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
class CompressedAttention(KVCacheDecode, _LowRank):
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
        return compressed_attention(q, k, v, self.taps, **self._settings(q, args), chunk=self.config.chunk)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        return reference_compressed(q, k, v, self.taps, **self._settings(q, args), return_weights=return_weights)

    def _settings(self, q: Tensor, args: AttendArgs) -> dict[str, Any]:
        """The keyword arguments the fast path and its dense twin share, after the head check."""
        cfg = self.config
        self._check_heads(q, cfg.per_head)
        return dict(kernel=cfg.kernel, stride=cfg.stride, causal=args.causal, key_padding_mask=args.key_padding_mask)


def iterative_pinv(a: Tensor, iters: int) -> Tensor:
    """Moore-Penrose pseudo-inverse of ``a (..., m, m)`` by Nyströmformer's iteration (Xiong et al.
    2021, eq. 16): ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4`` from ``Z_0 = A^T /
    (||A||_1 ||A||_inf)``, norms per matrix (the official code takes the max over the whole batch,
    so one sequence's result depends on the others). An all-zero matrix gives zeros."""
    norm = a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1)  # (...,)
    z = a.transpose(-1, -2) / torch.where(norm > 0, norm, 1.0)[..., None, None]
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def landmark_segments(n: int, landmarks: int, device: torch.device) -> tuple[Tensor, int]:
    """Segment of each position ``(N,)`` and the count ``m = min(landmarks, N)``: position j is in
    segment ``floor(j m / N)``: contiguous, in order, floor(N/m) or ceil(N/m) positions each
    (equal when m divides N, the paper's case)."""
    m = min(landmarks, n)
    return torch.div(torch.arange(n, device=device) * m, n, rounding_mode="floor"), m


def _segment_means(x: Tensor, seg: Tensor, m: int, real: Tensor) -> tuple[Tensor, Tensor]:
    """Means of ``x (B, H, N, D)`` over each segment's real positions -> ``(B, H, m, D)`` (zeros for
    a segment with none), and ``(B, m)``: True where a segment holds a real position."""
    w = real.to(x.dtype)
    sums = x.new_zeros(x.shape[0], x.shape[1], m, x.shape[3]).index_add_(2, seg, x * w[:, None, :, None])
    counts = w.new_zeros(w.shape[0], m).index_add_(1, seg, w)
    return sums / counts.clamp(min=1)[:, None, :, None], counts > 0


def nystrom_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    landmarks: int,
    pinv_iters: int,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Nyströmformer, fast: ``F (Z (B V))`` by two SDPA calls (args as ``reference_nystrom``)."""
    ct, (b, _, n, dim) = compute_dtype(q), q.shape
    scale = default_scale(scale, dim)
    qc, kc, vc = (t.to(ct) for t in (q, k, v))
    seg, m = landmark_segments(n, landmarks, q.device)
    real = real_tokens(key_padding_mask, b, n, q.device)
    (q_l, ok), (k_l, _) = _segment_means(qc, seg, m, real), _segment_means(kc, seg, m, real)  # (B, H, m, D)
    a = normalize_scores(q_l @ k_l.transpose(-1, -2) * scale, ok[:, None, :, None] & ok[:, None, None, :], "softmax")
    padded = key_padding_mask is not None
    bv = F.scaled_dot_product_attention(  # softmax(Q~ K^T) V: (B, H, m, D_v)
        q_l, kc, vc, attn_mask=(ok[:, None, :, None] & real[:, None, None, :]) if padded else None, scale=scale
    )
    w = iterative_pinv(a, pinv_iters) @ bv
    f_mask = ok[:, None, None, :] if padded else None
    return F.scaled_dot_product_attention(qc, k_l, w, attn_mask=f_mask, scale=scale).to(q.dtype)


def reference_nystrom(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    landmarks: int,
    pinv_iters: int | None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Nyströmformer, dense (Xiong et al. 2021, https://arxiv.org/abs/2102.03902, eq. 15):
    ``S^ = softmax(Q K~^T s) A^+ softmax(Q~ K^T s)``, ``A = softmax(Q~ K~^T s)``, ``O = S^ V``.

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)``.
        landmarks: segments (``landmark_segments``); ``Q~, K~ = (m, N) averaging matrix @ Q, K``.
        pinv_iters: steps of ``iterative_pinv``; None: ``torch.linalg.pinv`` in float64, the exact
            pseudo-inverse (its gradient is not meant for rank-deficient A).
        key_padding_mask: padded positions are left out of the means and masked in the third
            softmax; a segment of padding only is an invalid landmark, masked everywhere (A is then
            block-diagonal with a zero block, whose pseudo-inverse is zero there).
        scale: default ``1 / sqrt(D)``. return_weights: also the ``(B, H, N, N)`` matrix S^.
    """
    ct, (b, _, n, dim) = compute_dtype(q), q.shape
    scale = default_scale(scale, dim)
    qc, kc, vc = (t.to(ct) for t in (q, k, v))
    seg, m = landmark_segments(n, landmarks, q.device)
    real = real_tokens(key_padding_mask, b, n, q.device)
    member = (seg == torch.arange(m, device=q.device)[:, None]) & real[:, None, :]  # (B, m, N)
    counts = member.sum(-1, keepdim=True)
    average = (member.to(ct) / counts.clamp(min=1).to(ct))[:, None]  # (B, 1, m, N)
    q_l, k_l, ok = average @ qc, average @ kc, (counts[..., 0] > 0)[:, None]  # ok (B, 1, m)
    kernel_f = normalize_scores(qc @ k_l.transpose(-1, -2) * scale, ok[..., None, :], "softmax")  # (B, H, N, m)
    kernel_a = normalize_scores(q_l @ k_l.transpose(-1, -2) * scale, ok[..., :, None] & ok[..., None, :], "softmax")
    kernel_b = normalize_scores(
        q_l @ kc.transpose(-1, -2) * scale, ok[..., :, None] & real[:, None, None, :], "softmax"
    )
    if pinv_iters is None:
        a_pinv = torch.linalg.pinv(kernel_a.double()).to(ct)
    else:
        a_pinv = iterative_pinv(kernel_a, pinv_iters)
    weights = kernel_f @ a_pinv @ kernel_b  # (B, H, N, N)
    out = (weights @ vc).to(q.dtype)
    return (out, weights) if return_weights else out


@dataclass(frozen=True, kw_only=True)
class NystromConfig(Config):
    """Config of ``nystrom``.

    Args:
        landmarks: number of landmarks m (segments); N < m uses m = N. Default 64.
        pinv_iters: steps of the pseudo-inverse iteration (0: its initial guess). Default 6.
    """

    landmarks: int = bounded(64, ge=1)
    pinv_iters: int = bounded(6, ge=0)

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Landmarks of an eighth of the sequence (segments of 8 tokens)."""
        return dict(landmarks=eighth(n))


@register(
    "nystrom",
    config=NystromConfig,
    family="low_rank",
    summary="Nyströmformer: softmax attention rebuilt from segment-mean landmarks and a pseudo-inverse.",
    paper="Xiong et al. 2021, Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention, "
    "https://arxiv.org/abs/2102.03902",
    capabilities=Capabilities(causal=False, key_padding=True, cross_attention=False, independent_queries=False),
    complexity=Complexity(time="O(N m D + iters m^3)", memory="O(N m + m^2)", subquadratic_memory=True),
    notes=(
        "representative keys: m landmarks, means of m contiguous segments of floor(N/m) or ceil(N/m) keys "
        "(queries likewise); padded positions are left out of the means",
        "iterative pseudo-inverse (pinv_iters steps, Z0 = A^T / (|A|_1 |A|_inf) per matrix); with m = N "
        "and enough steps it is exact attention; rows of the implied matrix need not be >= 0 or sum to 1",
        "not causal: landmarks average future keys; self-attention only (queries and keys share segments)",
        "the paper's depthwise convolution skip on V belongs to the layer and is not included",
    ),
)
class NystromAttention(_LowRank):
    """Nyströmformer attention: ``nystrom_attention``, with ``reference_nystrom`` as its dense twin."""

    config: NystromConfig

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        cfg = self.config
        return nystrom_attention(
            q, k, v, landmarks=cfg.landmarks, pinv_iters=cfg.pinv_iters, key_padding_mask=args.key_padding_mask
        )

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        cfg = self.config
        return reference_nystrom(
            q,
            k,
            v,
            landmarks=cfg.landmarks,
            pinv_iters=cfg.pinv_iters,
            key_padding_mask=args.key_padding_mask,
            return_weights=return_weights,
        )
