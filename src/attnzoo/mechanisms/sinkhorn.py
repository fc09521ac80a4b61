"""Sparse Sinkhorn attention (Tay et al. 2020, https://arxiv.org/abs/2002.11296).

The sequence is cut into blocks of ``block`` positions. A small sort network scores every
(query block, key block) pair from summaries of the key blocks; Sinkhorn normalisation turns
the scores into a soft permutation ``P`` (n_blocks x n_blocks). Query block ``i`` then attends
to its own block and to its *sorted* block, ``sum_j P[i, j] K_j`` with values
``sum_j P[i, j] V_j``: quasi-global attention at the cost of local attention. SortCut instead
attends every query to the first ``sortcut`` sorted blocks.

``permutation`` computes ``P`` from the module's sort network; ``sinkhorn_attention`` (the fast
path, vectorised over blocks, O(N * block) memory) and ``reference_sinkhorn`` (loops over blocks,
reads like the paper) compute the same output from the same ``P``. Causal decoding (a block's
sorted keys fixed when it starts) is in ``sinkhorn_decode``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms import sinkhorn_decode
from attnzoo.mechanisms._ops import compute_dtype, default_scale, real_tokens
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted, nan_rows_of_non_finite_queries
from attnzoo.registry import Config, bounded, eighth, register
from attnzoo.spec import Capabilities, Complexity


@dataclass(frozen=True, kw_only=True)
class SinkhornConfig(Config):
    """Config of ``sinkhorn``.

    Args:
        block: block size (positions per block); N is padded up to a multiple. Default 64.
        n_iters: Sinkhorn iterations (one row and one column normalisation each); non-causal
            only (causal mode normalises rows once, see ``sinkhorn``). Default 8.
        temperature: the sort logits are divided by it before balancing. Default 0.75.
        max_blocks: output size of the sort network, so N <= block * max_blocks. Default 256.
        head_dim: D the sort network reads (its weight is ``(head_dim, max_blocks)``). Default 64.
        sortcut: None (default) for own block + sorted block; an int s attends every query to
            the first s sorted blocks only (SortCut; non-causal).
        scale: score scale; default None means ``1 / sqrt(D)``.
        seed: seeds the sort network's initial weights (so two builds with one config are the
            same module) and the Gumbel noise of training (call t of a module uses seed + t).
            Default 0.
    """

    block: int = bounded(64, ge=1, for_length=eighth)  # eight blocks to sort
    n_iters: int = bounded(8, ge=1)
    temperature: float = bounded(0.75, gt=0)
    max_blocks: int = bounded(256, ge=1)
    head_dim: int = bounded(64, ge=1)
    sortcut: int | None = None
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")
    seed: int = 0

    def validate(self) -> None:
        if self.sortcut is not None and not 1 <= self.sortcut <= self.max_blocks:
            raise ValueError(f"sortcut must be None or in [1, max_blocks={self.max_blocks}], got {self.sortcut}")


def real_blocks(key_mask: Tensor | None, batch: int, n: int, block: int, device: torch.device) -> Tensor:
    """``(B, n_blocks, block)`` bool: True where a block slot holds a real token (not key
    padding, not the positions added to reach a multiple of ``block``)."""
    n_blocks = -(-n // block)
    real = real_tokens(key_mask, batch, n, device)
    real = F.pad(real, (0, n_blocks * block - n), value=False)
    return rearrange(real, "b (n w) -> b n w", w=block)


def to_blocks(x: Tensor, block: int) -> Tensor:
    """``(B, H, N, D)`` -> ``(B, H, n_blocks, block, D)``, zero-padded to a multiple of ``block``."""
    n_blocks = -(-x.shape[2] // block)
    x = F.pad(x, (0, 0, 0, n_blocks * block - x.shape[2]))
    return rearrange(x, "b h (n w) d -> b h n w d", w=block)


def sortable(real: Tensor, *, causal: bool) -> Tensor:
    """``(B, 1, n, n)`` bool: which key blocks ``j`` row ``i`` of ``P`` may use.

    Notes:
        Column ``j`` needs a real token. Non-causal, row ``i`` needs one too (a block of pure
        padding neither sorts nor is sorted, so P is square over the real blocks). Causal,
        only ``j < i``: blocks wholly in the past of every query of block ``i``.
    """
    has_real = real.any(-1)  # [B, n]
    allowed = has_real[:, None, None, :]
    n = real.shape[1]
    if causal:
        return allowed & torch.ones(n, n, dtype=torch.bool, device=real.device).tril(-1)
    return allowed & has_real[:, None, :, None]


def block_summaries(kb: Tensor, real: Tensor, *, causal: bool) -> Tensor:
    """Mean of the real keys of each block, ``(B, H, n, block, D)`` -> ``(B, H, n, D)``.

    Notes:
        Causal: row ``i`` is summarised by the mean of the real keys of blocks ``0 .. i-1``
        (the paper's cumulative summary, made exclusive so block ``i``'s own, partly future,
        tokens never steer its sort). A block with no real key summarises to zeros.
    """
    m = real[:, None, :, :, None]  # [B, 1, n, w, 1]
    sums = torch.where(m, kb, 0).sum(-2)  # [B, H, n, D]
    counts = m.sum(-2).to(kb.dtype)  # [B, 1, n, 1]
    if causal:
        sums = F.pad(sums.cumsum(2)[:, :, :-1], (0, 0, 1, 0))
        counts = F.pad(counts.cumsum(2)[:, :, :-1], (0, 0, 1, 0))
    return sums / counts.clamp(min=1)


def sinkhorn(logits: Tensor, allowed: Tensor, n_iters: int, *, causal: bool) -> Tensor:
    """Log-space Sinkhorn balancing of ``(..., n, n)`` logits over the ``allowed`` entries;
    returns ``P`` with zeros outside ``allowed``.

    Notes:
        Non-causal: ``n_iters`` x (row normalisation, then column normalisation), as in the
        paper; P is doubly stochastic over the real blocks in the limit.
        Causal: a column sum runs over all rows, so it would let row ``i`` see future rows.
        Dividing by the column sum over rows ``<= i`` only is causal but converges to the shift
        ``P[i, i-1] = 1`` (the only permutation of strictly past blocks) within a few
        iterations, so causal mode normalises rows only: row i is a softmax over its past
        blocks (as in lucidrains' causal sort net) and ``n_iters`` is unused.
    """
    neg = torch.finfo(logits.dtype).min
    log_p = logits.masked_fill(~allowed, neg)
    for _ in range(1 if causal else n_iters):
        log_p = (log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)).masked_fill(~allowed, neg)
        if not causal:
            log_p = (log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)).masked_fill(~allowed, neg)
    return log_p.exp() * allowed


def sinkhorn_attention(
    q: Tensor, k: Tensor, v: Tensor, P: Tensor, cfg: SinkhornConfig, args: AttendArgs, *, return_weights: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Fast path: block-local attention over [own block, sorted block] for a given ``P``.

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)``.
        P: ``(B, H, n_blocks, n_blocks)`` soft permutation; row i mixes the key blocks j.
        cfg, args: as in ``reference_sinkhorn``.
        return_weights: also return the weights ``(B, H, n, block, K)`` over the K slots
            (``2 * block``: own then sorted; SortCut: ``s * block`` sorted).

    Shapes:
        Every intermediate is ``(B, H, n, block, ...)`` or ``(B, H, n, n)``: O(N * block +
        n^2) memory (SortCut: O(N * s * block)); nothing N x N.
    """
    (b, h, n, d), block, causal, sortcut = q.shape, cfg.block, args.causal, cfg.sortcut
    compute, scale = compute_dtype(q), default_scale(cfg.scale, d)
    real = real_blocks(args.key_mask, b, n, block, q.device)  # [B, nb, w]
    qb = to_blocks(q.to(compute), block)  # [B, H, nb, w, D]
    kb, vb = (torch.where(real[:, None, :, :, None], to_blocks(x.to(compute), block), 0) for x in (k, v))
    P = P.to(compute).tril(-1) if causal else P.to(compute)
    ks = torch.einsum("bhij,bhjwd->bhiwd", P, kb)  # [B, H, nb, w, D]
    vs = torch.einsum("bhij,bhjwd->bhiwd", P, vb)
    sorted_real = torch.einsum("bhij,bjw->bhiw", P, real.to(compute)) > 0  # [B, H, nb, w]
    if sortcut is not None:
        s = min(sortcut, P.shape[-1])
        keys = rearrange(ks[:, :, :s], "b h s w d -> b h (s w) d")  # shared by every query block
        values = rearrange(vs[:, :, :s], "b h s w d -> b h (s w) d")
        visible = rearrange(sorted_real[:, :, :s], "b h s w -> b h 1 1 (s w)")
        slots = "bhkd"
    else:
        keys, values = torch.cat([kb, ks], dim=-2), torch.cat([vb, vs], dim=-2)  # [B, H, nb, 2w, D]
        local = real[:, None, :, None, :]  # [B, 1, nb, 1, w]
        if causal:
            local = local & torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
        local = local.expand(b, h, -1, block, -1)
        visible = torch.cat([local, sorted_real[:, :, :, None, :].expand_as(local)], dim=-1)
        slots = "bhikd"
    if not return_weights:
        out = _slot_attention(qb, keys, values, visible, scale)
        return rearrange(out, "b h n w d -> b h (n w) d")[:, :, :n].to(q.dtype)
    scores = torch.einsum(f"bhiqd,{slots}->bhiqk", qb, keys) * scale
    weights = normalize_scores(scores, visible, "softmax")  # [B, H, nb, w, K]
    out = torch.einsum(f"bhiqk,{slots}->bhiqd", weights, values)
    return rearrange(out, "b h n w d -> b h (n w) d")[:, :, :n].to(q.dtype), weights


def _slot_attention(qb: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float) -> Tensor:
    """Each query block's softmax over its visible slots as one SDPA call (on CPU the flash
    kernel, forward and backward, where the explicit scores cost several passes over a (w, K)
    tensor per block): ``qb (B, H, nb, w, D)`` against per-block ``keys, values (B, H, nb, K, D)``
    or, SortCut, slots shared by every block ``(B, H, K, D)``; a row that sees nothing -> zeros."""
    b, h, nb, w, _ = qb.shape
    shared = keys.dim() == 4
    q = rearrange(qb, "b h n w d -> b h (n w) d") if shared else qb.flatten(1, 2)  # 4-D for the kernel
    k, v = (keys, values) if shared else (keys.flatten(1, 2), values.flatten(1, 2))
    mask = visible[:, :, 0] if shared else visible.expand(b, h, nb, w, -1).flatten(1, 2)
    everything = bool(mask.all())  # the usual case (no padding, not causal): no mask at all
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if everything else mask, scale=scale)
    out = out if everything else torch.where(mask.any(-1, keepdim=True), out, 0.0)
    return out.view(b, h, nb, w, -1)


def _sorted_blocks(kb: Tensor, vb: Tensor, real: Tensor, P: Tensor, *, causal: bool) -> tuple[list[Tensor], ...]:
    """Per block i, by plain loops: sorted keys ``sum_j P[i, j] K_j`` ``(B, H, w, D)``, sorted
    values ``sum_j P[i, j] V_j``, and which slots have real mass > 0 ``(B, H, w)``; causal:
    ``j < i`` only."""
    n_blocks = real.shape[1]
    sorted_k, sorted_v, sorted_real = [], [], []
    for i in range(n_blocks):
        ks, vs = torch.zeros_like(kb[:, :, 0]), torch.zeros_like(vb[:, :, 0])
        mass = torch.zeros(kb.shape[:2] + real.shape[2:], dtype=P.dtype, device=P.device)  # [B, H, w]
        for j in range(i if causal else n_blocks):
            ks = ks + P[:, :, i, j, None, None] * kb[:, :, j]
            vs = vs + P[:, :, i, j, None, None] * vb[:, :, j]
            mass = mass + P[:, :, i, j, None] * real[:, None, j, :]
        sorted_k.append(ks), sorted_v.append(vs), sorted_real.append(mass > 0)
    return sorted_k, sorted_v, sorted_real


def reference_sinkhorn(q: Tensor, k: Tensor, v: Tensor, P: Tensor, cfg: SinkhornConfig, args: AttendArgs) -> Tensor:
    """Sparse Sinkhorn attention for a given soft permutation, written plainly (the oracle).

    For every query block ``i`` (Tay et al. 2020, https://arxiv.org/abs/2002.11296):
    sorted keys ``K^s_i = sum_j P[i, j] K_j`` and sorted values ``V^s_i = sum_j P[i, j] V_j``;
    each query of block i attends densely to ``[K_i, K^s_i]`` with values ``[V_i, V^s_i]``.

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, D_v)``; self-attention.
        P: ``(B, H, n_blocks, n_blocks)``, ``n_blocks = ceil(N / cfg.block)``.
        cfg: ``block`` (the block size), ``scale`` (default ``1 / sqrt(D)``) and ``sortcut``
            (None, or s: every query attends only to sorted blocks ``0 .. s-1``, ``min(s,
            n_blocks)`` of them, no own block) are read; the sort network's fields are not.
        args: ``causal``: own-block keys ``t <= s`` only, and the sort uses only blocks
            ``j < i`` (entries of P with ``j >= i`` are ignored); ``key_mask``: bool
            ``(B, N)``, True = real, or None.

    Returns:
        ``(B, H, N, D_v)`` in the dtype of ``q``.

    Notes:
        Padded keys (and the positions added to reach a multiple of ``block``) enter no sum:
        slot t of a sorted block mixes only real keys ``K_j[t]``, and is visible iff its real
        mass ``sum_j P[i, j] [K_j[t] is real]`` is > 0. A query with no visible key gives zeros.
    """
    (b, h, n, d), block, causal, sortcut = q.shape, cfg.block, args.causal, cfg.sortcut
    compute, scale = compute_dtype(q), default_scale(cfg.scale, d)
    real = real_blocks(args.key_mask, b, n, block, q.device)  # [B, nb, w]
    # Padded slots hold zeros: they add nothing to a sorted block, and are never visible.
    qb, kb, vb = (to_blocks(x.to(compute), block) for x in (q, k, v))
    kb, vb = (torch.where(real[:, None, :, :, None], x, 0) for x in (kb, vb))
    n_blocks = real.shape[1]
    sorted_k, sorted_v, sorted_real = _sorted_blocks(kb, vb, real, P.to(compute), causal=causal)
    outs = []
    for i in range(n_blocks):
        if sortcut is not None:
            s = min(sortcut, n_blocks)
            keys, values = torch.cat(sorted_k[:s], dim=2), torch.cat(sorted_v[:s], dim=2)
            visible = torch.cat(sorted_real[:s], dim=2)[:, :, None, :]  # [B, H, 1, s*w]
        else:
            keys, values = torch.cat([kb[:, :, i], sorted_k[i]], 2), torch.cat([vb[:, :, i], sorted_v[i]], 2)
            own = real[:, None, None, i, :].expand(b, h, block, block)  # [B, H, query, key]
            if causal:
                own = own & torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
            visible = torch.cat([own, sorted_real[i][:, :, None, :].expand(b, h, block, block)], dim=-1)
        scores = torch.einsum("bhqd,bhkd->bhqk", qb[:, :, i], keys) * scale
        outs.append(normalize_scores(scores, visible, "softmax") @ values)
    return torch.cat(outs, dim=2)[:, :, :n].to(q.dtype)


def implied_matrix(weights: Tensor, P: Tensor, real: Tensor, *, n: int, causal: bool, sortcut: int | None) -> Tensor:
    """Map the fast path's slot weights ``(B, H, nb, block, K)`` back to key positions:
    ``(B, H, N, N)``. A sorted slot t of block i is ``sum_j P[i, j] K_j[t]``, so its weight is
    shared among the real positions ``j * block + t`` in proportion ``P[i, j]``; then
    ``output == implied @ v`` exactly."""
    nb, w = real.shape[1:]
    P = P.to(weights.dtype)
    P = P.tril(-1) if causal else P
    realf = real.to(weights.dtype)
    if sortcut is not None:
        ws = rearrange(weights, "b h i q (s t) -> b h i q s t", t=w)
        dense = torch.einsum("bhiqrt,bhrj,bjt->bhiqjt", ws, P[:, :, : ws.shape[4]], realf)
    else:
        eye = torch.eye(nb, dtype=weights.dtype, device=weights.device)
        dense = torch.einsum("bhiqt,ij->bhiqjt", weights[..., :w], eye)
        dense = dense + torch.einsum("bhiqt,bhij,bjt->bhiqjt", weights[..., w:], P, realf)
    return rearrange(dense, "b h i q j t -> b h (i q) (j t)")[:, :, :n, :n]


@register(
    "sinkhorn",
    config=SinkhornConfig,
    family="content",
    summary="Sparse Sinkhorn attention: own block + a block softly sorted by a learned Sinkhorn permutation.",
    paper="Tay et al. 2020, Sparse Sinkhorn Attention, https://arxiv.org/abs/2002.11296",
    capabilities=Capabilities(causal=True, key_mask=True, decode_step=True),
    complexity=Complexity(
        time="O(N (block + n_blocks) D)",
        memory="O(N block + n_blocks^2); SortCut O(N sortcut block)",
        subquadratic_memory=True,
    ),
    notes=(
        "not a drop-in for pretrained attention: its sorting network is a trained parameter: needs retraining",
        "N is padded to a multiple of block; padded positions are never attended",
        "block summary: mean of the block's real keys; sort net: one (head_dim, max_blocks) linear map shared by heads",
        "sorted keys sum_j P[i,j] K_j, sorted values sum_j P[i,j] V_j",
        "causal: row i sorts only blocks j < i, summarised by blocks < i; rows normalised only (no column step)",
        "sortcut: every query attends to the first sortcut sorted blocks only; refuses causal=True",
        "Gumbel noise on the sort logits in training mode only",
        "decode step: eval mode only; every key and value kept (each block's sort mixes all earlier blocks); "
        "a block's sorted keys computed once, when it starts: O(block D) per token + O(t D / block) amortised, "
        "O(t D) memory",
    ),
)
class SinkhornAttention(Attention):
    """Sparse Sinkhorn attention (Tay et al. 2020, https://arxiv.org/abs/2002.11296).

    Shapes:
        q, k ``(B, H, N, head_dim)``, v ``(B, H, N, D_v)`` -> ``(B, H, N, D_v)``.

    Notes:
        The sort network is the parameter ``sort_weight (head_dim, max_blocks)``, shared by all
        heads (heads differ by their keys): logits ``R[i] = summary_i @ sort_weight[:, :n]``.
        The paper's ReLU is left out: R enters Sinkhorn as log-values, where ReLU would only
        create ties. In training, Gumbel noise is added: ``P = Sinkhorn((R + g) / temperature)``.
    """

    config: SinkhornConfig

    def __init__(self, config: SinkhornConfig) -> None:
        super().__init__(config)
        init = torch.randn(config.head_dim, config.max_blocks, generator=torch.Generator().manual_seed(config.seed))
        self.sort_weight = nn.Parameter(init * config.head_dim**-0.5)
        self._noise_calls = 0

    def _check(self, n: int, dim: int, causal: bool) -> None:
        cfg = self.config
        if dim != cfg.head_dim:
            raise ValueError(
                f"sinkhorn's sort network reads head_dim={cfg.head_dim} features, got keys with "
                f"D={dim}; build it with head_dim={dim}"
            )
        if n > cfg.block * cfg.max_blocks:
            raise ValueError(
                f"sinkhorn: N={n} exceeds block * max_blocks = {cfg.block} * {cfg.max_blocks} = "
                f"{cfg.block * cfg.max_blocks} (the sort network scores at most max_blocks blocks); "
                "raise max_blocks or block"
            )
        if causal and cfg.sortcut is not None:
            raise ValueError(
                "sinkhorn with sortcut does not support causal=True: every query attends to the "
                "first sorted blocks, which mix the whole sequence; use sortcut=None"
            )

    def _gumbel(self, like: Tensor) -> Tensor:
        generator = torch.Generator(device=like.device).manual_seed(self.config.seed + self._noise_calls)
        self._noise_calls += 1
        u = torch.rand(like.shape, generator=generator, device=like.device, dtype=like.dtype)
        return -torch.log(-torch.log(u.clamp(min=torch.finfo(like.dtype).tiny)))

    def permutation(self, k: Tensor, key_mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """The soft permutation ``P (B, H, n_blocks, n_blocks)`` the forward uses (Gumbel noise
        included in training mode): row i says how much of key block j is sorted to block i."""
        cfg = self.config
        b, _, n, d = k.shape
        self._check(n, d, causal)
        real = real_blocks(key_mask, b, n, cfg.block, k.device)  # [B, nb, w]
        summary = block_summaries(to_blocks(k.to(compute_dtype(k)), cfg.block), real, causal=causal)  # [B, H, nb, D]
        return self.sort(summary, sortable(real, causal=causal), causal=causal)

    def sort(self, summary: Tensor, allowed: Tensor, *, causal: bool) -> Tensor:
        """Rows of ``P`` from their block summaries ``(B, H, rows, D)``, over the key blocks
        ``allowed (B, 1, rows, n)``: the sort network's logits (plus Gumbel noise in training),
        balanced by ``sinkhorn``."""
        logits = summary @ self.sort_weight[:, : allowed.shape[-1]].to(summary.dtype)  # [B, H, rows, n]
        if self.training:
            logits = logits + self._gumbel(logits)
        return sinkhorn(logits / self.config.temperature, allowed, self.config.n_iters, causal=causal)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        return sinkhorn_attention(q, k, v, self.permutation(k, args.key_mask, args.causal), self.config, args)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """``reference_sinkhorn`` (block by block, as the paper reads) under one drawn
        permutation; the weights are the fast path's slot weights mapped back to key positions
        (``implied_matrix``), so ``output == weights @ v``. In training mode each call draws new
        Gumbel noise: compare with ``forward`` in eval mode."""
        cfg = self.config
        P = self.permutation(k, args.key_mask, args.causal)
        out = reference_sinkhorn(q, k, v, P, cfg, args)
        if not return_weights:
            return out
        _, slots = sinkhorn_attention(q, k, v, P, cfg, args, return_weights=True)
        real = real_blocks(args.key_mask, q.shape[0], q.shape[2], cfg.block, q.device)
        return out, implied_matrix(slots, P, real, n=q.shape[2], causal=args.causal, sortcut=cfg.sortcut)

    def _init_state(self, spec: StateSpec) -> sinkhorn_decode.SinkhornState:
        """Every key and value so far and the current block's sorted block (``sinkhorn_decode``)."""
        self._check(0, spec.head_dim, causal=True)
        return sinkhorn_decode.init_state(spec)

    def _step(
        self, state: sinkhorn_decode.SinkhornState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs
    ) -> tuple[Tensor, sinkhorn_decode.SinkhornState]:
        """The new tokens' rows of the causal forward (``sinkhorn_decode.step``), eval mode only."""
        if self.training:
            raise ValueError(
                "sinkhorn: step() in training mode: the forward draws Gumbel noise over the whole block sort "
                "per call, which steps cannot reproduce; decode in eval mode (module.eval())"
            )
        self._check(state.cache.length + q.shape[2], q.shape[-1], causal=True)
        out, state = sinkhorn_decode.step(self, state, q, k, v, args)
        return nan_rows_of_non_finite_queries(out, q), state
