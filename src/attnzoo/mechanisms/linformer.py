"""Linformer (Wang et al. 2020, https://arxiv.org/abs/2006.04768): keys and values projected
along the sequence to k learned mixtures, ``head_h = softmax(Q_h (E_h K_h)^T / sqrt(d)) (F_h V_h)``.
``linformer_attention`` is the fast path (SDPA over the k slots), ``linformer_weights`` the dense
reference (the ``N_q x N_kv`` weights ``P_h F_h``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.mechanisms._ops import compute_dtype, real_tokens, zero_padding
from attnzoo.mechanisms.base import AttendArgs
from attnzoo.mechanisms.low_rank import LowRankAttention
from attnzoo.registry import Config, bounded, quarter, register
from attnzoo.spec import Capabilities, Complexity


def linformer_attention(
    q: Tensor, k: Tensor, v: Tensor, e: Tensor, f: Tensor, *, key_mask: Tensor | None = None
) -> Tensor:
    """Linformer, fast: SDPA over the k projected keys and values (shapes as ``linformer_weights``;
    v ``(B, H, N_kv, D_v)`` -> ``(B, H, N_q, D_v)``)."""
    ct, (heads, n) = compute_dtype(q), k.shape[1:3]
    kc, vc = (zero_padding(t.to(ct), key_mask) for t in (k, v))
    e_n, f_n = (p[:, :, :n].to(kc).expand(heads, -1, -1) for p in (e, f))  # (H, k, N)
    k_bar = torch.einsum("hcn,bhnd->bhcd", e_n, kc)  # (B, H, k, D)
    v_bar = torch.einsum("hcn,bhnd->bhcd", f_n, vc)  # (B, H, k, D_v)
    return F.scaled_dot_product_attention(q.to(ct), k_bar, v_bar).to(q.dtype)


def linformer_weights(q: Tensor, k: Tensor, e: Tensor, f: Tensor, *, key_mask: Tensor | None = None) -> Tensor:
    """Linformer head by head, eq. (7) of the paper: ``P_h = softmax(Q_h (E_h K_h)^T / sqrt(d))``,
    ``E_h = E[:, :N_kv]``; the output ``P_h (F_h V_h)`` is ``(P_h F_h) V_h``, these weights times V.

    Args:
        q, k: ``(B, H, N_q, D)``, ``(B, H, N_kv, D)``; N_kv <= max_len.
        e, f: ``(G, k, max_len)``, G = 1 (shared by the heads) or H (one per head).
        key_mask: ``(B, N_kv)``, True = real.

    Returns:
        ``(B, H, N_q, N_kv)`` in the compute dtype.

    Notes:
        Padded keys (and values) are set to 0 before the projection, so they add nothing to any
        slot; every slot still takes softmax mass (padding is not exact even at E = F = I).
    """
    ct, n = compute_dtype(q), k.shape[2]
    scale = q.shape[-1] ** -0.5
    keep = real_tokens(key_mask, q.shape[0], n, q.device).to(ct)  # (B, N)
    weights = []
    for h in range(q.shape[1]):
        e_h, f_h = e[h % e.shape[0], :, :n].to(ct), f[h % f.shape[0], :, :n].to(ct)  # (k, N)
        k_bar = e_h @ (k[:, h].to(ct) * keep[..., None])  # (B, k, D)
        p = torch.softmax(q[:, h].to(ct) @ k_bar.transpose(1, 2) * scale, dim=-1)  # (B, N_q, k)
        weights.append(p @ (f_h * keep[:, None, :]))  # (B, N_q, N)
    return torch.stack(weights, 1)


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

    # for_length: a quarter of the keys; k = 64 would project a short sequence to a longer one.
    k: int = bounded(64, ge=1, for_length=quarter)
    max_len: int = bounded(4096, ge=1)
    sharing: Literal["headwise", "kv", "layerwise", "none"] = "headwise"
    heads: int = bounded(8, ge=1)
    init: Literal["xavier", "identity"] = "xavier"
    seed: int = bounded(0, ge=0)


@register(
    "linformer",
    config=LinformerConfig,
    family="low_rank",
    summary="Linformer: keys and values projected along the sequence to k learned mixtures.",
    paper="Wang et al. 2020, Linformer: Self-Attention with Linear Complexity, https://arxiv.org/abs/2006.04768",
    capabilities=Capabilities(causal=False, key_mask=True, cross_attention=True),
    complexity=Complexity(time="O(N k D)", memory="O(N k)", subquadratic_memory=True),
    notes=(
        "swapped in untrained: projections E, F randomly initialised (xavier, seed 0), not trained",
        "representative keys: the k rows of E[:, :N] K, learned mixtures of all keys; values F[:, :N] V",
        "padded keys and values are set to 0 before the projection (their slots still take softmax mass)",
        "not causal: every projected slot mixes future keys",
    ),
)
class LinformerAttention(LowRankAttention):
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

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        self._check(q, k)
        return linformer_attention(q, k, v, self.proj[0], self.proj[-1], key_mask=args.key_mask)

    def _weights(self, q: Tensor, k: Tensor, args: AttendArgs) -> Tensor:
        self._check(q, k)
        return linformer_weights(q, k, self.proj[0], self.proj[-1], key_mask=args.key_mask)

    def _check(self, q: Tensor, k: Tensor) -> None:
        if k.shape[2] > self.config.max_len:
            raise ValueError(
                f"linformer was built with max_len={self.config.max_len} but N_kv={k.shape[2]}; "
                f"build it with max_len >= {k.shape[2]}"
            )
        self._check_heads(q, self.config.sharing == "none")
