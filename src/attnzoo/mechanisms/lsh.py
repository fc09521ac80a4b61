"""Reformer LSH attention (Kitaev et al. 2020, https://arxiv.org/abs/2001.04451).

Per hashing round, random rotations put each token in a bucket; tokens are sorted by (bucket,
position) and split into chunks; a query attends to the keys of its bucket in its own chunk and
the previous one. The rounds are combined into one softmax over the union of the keys they
found: a key found in ``N_ij`` rounds has ``log N_ij`` subtracted from its score in each
(Reformer, Appendix A), so it counts once.

Fast path: each round lays the tokens out in sorted order with every bucket starting on a chunk
boundary (filler slots pad the buckets), so a query's chunk sees exactly its own chunk of slots
and the one before: one CPU flash-kernel call per round over zero-copy windows of 2c keys, with
an additive mask (same bucket, real key, not self, causal, ``-log N_ij``). The backward runs the
flash kernel's backward per round with the union's output and log-sum-exp. O(N c) memory.
``reference_lsh`` computes the same buckets and chunk ranks by position, densely.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._compat import flash_attention_cpu, flash_attention_cpu_backward
from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms._ops import compute_dtype, default_scale, real_tokens
from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted
from attnzoo.registry import Config, bounded, eighth, register
from attnzoo.spec import Capabilities, Complexity


@dataclass(frozen=True, kw_only=True)
class LSHConfig(Config):
    """Config of ``lsh``.

    Args:
        n_hashes: hashing rounds. Default 2.
        n_buckets: buckets per round: even, or 1 (no hashing: every token in one bucket). Default 8.
        chunk: chunk size c (positions ranked within a bucket). Default 64.
        seed: seed of the rotations used in eval mode (and in training with ``resample=False``);
            None draws one seed per module from torch's global RNG at construction (every layer
            differs; reproducible after ``torch.manual_seed``; saved in the state dict as the
            ``rotation_seed`` buffer). Default None.
        resample: draw fresh rotations on every forward pass in training mode, from torch's
            global RNG (Reformer). Default True.
        dedupe: subtract ``log N_ij`` from the score of a key found in ``N_ij`` rounds, so the
            rounds give one softmax over the union of their keys (Reformer, Appendix A). With
            False a key found twice weighs twice. Default True.
        scale: score scale; default ``1 / sqrt(D)``.
    """

    n_hashes: int = bounded(2, ge=1)
    n_buckets: int = bounded(8, ge=1)
    chunk: int = bounded(64, ge=1)
    seed: int | None = None
    resample: bool = True
    dedupe: bool = True
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """Four buckets, chunks of an eighth: 8 buckets of 64 would put a short sequence in one chunk."""
        return dict(n_buckets=4, chunk=eighth(n))

    def validate(self) -> None:
        if self.n_buckets % 2 and self.n_buckets != 1:
            raise ValueError(f"n_buckets must be 1 or even (buckets come from argmax([xR; -xR])), got {self.n_buckets}")


def rotations(config: LSHConfig, heads: int, dim: int, seed: int | None, device: torch.device | None = None) -> Tensor:
    """``(n_hashes, H, D, n_buckets / 2)`` random rotations, one per round and head: from
    ``seed``, or from torch's global RNG when ``seed`` is None."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(config.n_hashes, heads, dim, config.n_buckets // 2, generator=g).to(device)


def buckets(keys: Tensor, rotation: Tensor, real: Tensor) -> Tensor:
    """``(B, H, N)`` buckets ``argmax([xR; -xR])`` of the unit keys ``(B, H, N, D)`` under the
    heads' rotations ``R (H, D, n_buckets / 2)``; padded
    tokens go to an extra last bucket ``n_buckets`` so they never shift real tokens' ranks."""
    n_buckets = max(2 * rotation.shape[-1], 1)
    if rotation.shape[-1]:
        projected = keys.float() @ rotation.float()[None]  # [B, H, N, n_buckets/2]
        bucket = torch.cat([projected, -projected], dim=-1).argmax(-1)
    else:
        bucket = torch.zeros(keys.shape[:3], dtype=torch.long, device=keys.device)
    return torch.where(real[:, None, :], bucket, n_buckets)


# --- the paper's rule, by position: the reference ------------------------------------------


def visible(bucket: Tensor, real: Tensor, chunk: int, causal: bool) -> Tensor:
    """``(B, H, N, N)``: query i sees key j in this round when they share a bucket, j is real,
    j's rank in the bucket falls in i's rank-chunk or the one before, j != i (and j <= i when
    causal). Ranks count the bucket's real tokens by position."""
    n = bucket.shape[-1]
    i, j = torch.arange(n, device=bucket.device)[:, None], torch.arange(n, device=bucket.device)[None, :]
    same = (bucket[..., :, None] == bucket[..., None, :]) & real[:, None, None, :]
    rank = (same & (j < i)).sum(-1)  # [B, H, N]: real tokens of my bucket before me
    group = torch.div(rank, chunk, rounding_mode="floor")[..., :, None]
    rank_k = rank[..., None, :]
    near = (rank_k >= (group - 1) * chunk) & (rank_k < (group + 1) * chunk)
    ok = same & near & (i != j)
    return ok & (j <= i) if causal else ok


def reference_lsh(
    q: Tensor,
    v: Tensor,
    config: LSHConfig,
    rotation: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """LSH attention as the paper reads, densely, under ``rotation (n_hashes, H, D, n_buckets
    / 2)`` (``LSHAttention.rotations`` gives a module's): per round, the N x N mask of ``visible``;
    each round's masked scores less ``log N_ij`` (``dedupe``), the rounds combined by their
    log-sum-exp. A row that sees nothing attends to itself (zero if it is padding). Keys are
    the unit-normalised queries (shared QK). ``return_weights`` also gives the combined
    ``(B, H, N, N)`` attention matrix."""
    real = (
        torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
        if key_padding_mask is None
        else key_padding_mask
    )
    keys = F.normalize(q, dim=-1)
    scale = default_scale(config.scale, q.shape[-1])
    compute = compute_dtype(q)
    scores = torch.einsum("bhid,bhjd->bhij", q.to(compute), keys.to(compute)) * scale
    masks = [visible(buckets(keys, rot, real), real, config.chunk, causal) for rot in rotation.to(q.device)]
    found = torch.stack(masks).sum(0).clamp(min=1).to(compute)  # N_ij
    if config.dedupe:
        scores = scores - found.log()
    lses = torch.stack([torch.logsumexp(scores.masked_fill(~m, float("-inf")), dim=-1) for m in masks], -1)
    total = torch.logsumexp(lses, -1, keepdim=True)  # [B, H, N, 1]
    share = torch.nan_to_num(torch.exp(lses - total), nan=0.0)  # each round's share of the row
    weights = sum(normalize_scores(scores, m, "softmax") * share[..., r, None] for r, m in enumerate(masks))
    alone = torch.isinf(total) & real[:, None, :, None]  # sees nothing in any round
    weights = torch.where(alone, torch.eye(q.shape[2], dtype=compute, device=q.device), weights)
    out = (weights @ v.to(compute)).to(q.dtype)
    return (out, weights) if return_weights else out


# --- the fast path: chunk-aligned sorted layout --------------------------------------------


@dataclass(frozen=True)
class Round:
    """One hashing round laid out for the kernel. Real tokens are sorted by (bucket, position)
    into ``length`` slots per (batch, head) row, each bucket starting on a chunk boundary
    (filler slots pad it), so a bucket's rank-chunks are whole chunks of slots and chunk ``i``
    sees chunk ``i - 1`` (if the same bucket) and itself. Indices are flat over the ``B * H``
    rows: ``keys`` the token behind each slot with c leading dummies (the window before the
    first chunk), ``queries`` the same without them, ``slot`` each position's slot, ``own`` /
    ``prev`` the position's key entries in the kernel's ``(BH, chunks, 2c)`` windows, ``code``
    a number per position whose difference (query - key) is 0 or 1 exactly when this round
    shows the key to the query. ``mask (BH, chunks, c, 2c)`` is the additive mask, ``empty``
    the rows that see nothing."""

    length: int
    keys: Tensor
    queries: Tensor
    slot: Tensor
    own: Tensor
    prev: Tensor
    code: Tensor
    mask: Tensor | None = None
    empty: Tensor | None = None


def _windows(x: Tensor, chunk: int) -> Tensor:
    """``(BH, c + L, ...)`` -> zero-copy ``(BH, L / c, 2c, ...)``: chunk i's keys are slots
    ``(i - 1) c .. (i + 1) c`` (the leading c entries stand before slot 0)."""
    x = x.contiguous()
    chunks = x.shape[1] // chunk - 1
    return x.as_strided(
        (x.shape[0], chunks, 2 * chunk, *x.shape[2:]), (x.stride(0), chunk * x.stride(1), *x.stride()[1:])
    )


def layout(bucket: Tensor, n_buckets: int, chunk: int) -> tuple[Round, Tensor, Tensor, Tensor]:
    """The round's slots for ``bucket (B, H, N)`` (``n_buckets`` = padding), and per slot
    ``(BH, L)`` its position (0 in filler slots), whether it is filled, and its chunk's bucket."""
    (b, h, n), dev = bucket.shape, bucket.device
    order = torch.argsort(bucket * n + torch.arange(n, device=dev), dim=-1)  # by (bucket, position)
    bucket_s = bucket.gather(-1, order)
    counts = torch.zeros(b, h, n_buckets + 1, dtype=torch.long, device=dev).scatter_add_(
        -1, bucket, torch.ones_like(bucket)
    )
    rank = torch.arange(n, device=dev) - (counts.cumsum(-1) - counts).gather(-1, bucket_s)
    room = torch.div(counts + chunk - 1, chunk, rounding_mode="floor") * chunk
    room[..., -1] = 0  # padding tokens take no slots
    length = max(int(room.sum(-1).max()), chunk)
    slot_s = torch.where(bucket_s < n_buckets, (room.cumsum(-1) - room).gather(-1, bucket_s) + rank, length)
    position = torch.zeros(b, h, length + 1, dtype=torch.long, device=dev).scatter_(-1, slot_s, order)[..., :length]
    filled = torch.zeros(b, h, length + 1, dtype=torch.bool, device=dev).scatter_(-1, slot_s, True)[..., :length]
    slot_bucket = torch.full((b, h, length + 1), -1, dtype=torch.long, device=dev).scatter_(-1, slot_s, bucket_s)
    slot = torch.empty_like(order).scatter_(-1, order, slot_s).clamp_(max=length - 1)  # padding: fixed by the caller
    chunks, c, o = length // chunk, torch.div(slot, chunk, rounding_mode="floor"), slot % chunk
    rows = torch.arange(b * h, device=dev).view(b, h, 1)
    keys = F.pad(position + rows * n, (chunk, 0))  # [B, H, c + L]; dummies read position 0 of row 0
    r = Round(
        length=length,
        keys=keys.flatten(),
        queries=keys[..., chunk:].flatten(),
        slot=(rows * length + slot).flatten(),
        own=(((rows * chunks + c) * 2 + 1) * chunk + o).flatten(),
        # the next chunk's window holds the key in its first half; the last chunk has none
        # (it points at chunk 0's first dummy, whose gradient is zero: always masked)
        prev=torch.where(c + 1 < chunks, (rows * chunks + c + 1) * 2 * chunk + o, rows * chunks * 2 * chunk).flatten(),
        code=bucket * (chunks + 2) + c,
    )
    return r, position.flatten(0, 1), filled.flatten(0, 1), slot_bucket[..., :length:chunk].flatten(0, 1)


def round_mask(
    r: Round,
    position: Tensor,
    filled: Tensor,
    chunk_bucket: Tensor,
    others: list[Round],
    *,
    chunk: int,
    causal: bool,
    dedupe: bool,
    dtype: torch.dtype,
) -> Round:
    """``r`` with its additive mask (0, or ``-log N_ij`` with ``dedupe``, where visible; -inf
    elsewhere: other buckets, filler slots, self, the future) and its empty rows."""
    bh, chunks = position.shape[0], r.length // chunk
    same_prev = F.pad(chunk_bucket[:, 1:] == chunk_bucket[:, :-1], (1, 0), value=False)  # [BH, chunks]
    key_ok = _windows(F.pad(filled, (chunk, 0), value=False), chunk).clone()  # [BH, chunks, 2c]
    key_ok[..., :chunk] &= same_prev[..., None]
    inf = float("-inf")
    own = torch.ones(chunk, chunk, dtype=torch.bool, device=filled.device)
    own = own.tril(-1) if causal else own.fill_diagonal_(False)
    fixed = torch.zeros(chunk, 2 * chunk, dtype=dtype, device=filled.device)
    fixed[:, chunk:].masked_fill_(~own, inf)
    key_term = torch.zeros(bh, chunks, 1, 2 * chunk, dtype=dtype, device=filled.device)
    mask = key_term.masked_fill_(~key_ok[:, :, None], inf) + fixed
    mask.masked_fill_(~filled.view(bh, chunks, chunk, 1), inf)  # filler rows see nothing
    if dedupe and others:
        found = torch.zeros(mask.shape, dtype=torch.uint8, device=mask.device)
        key_pos = _windows(F.pad(position, (chunk, 0)), chunk)
        for o in others:
            code = o.code.flatten(0, 1)
            code_q = code.gather(1, position).view(bh, chunks, chunk, 1)
            code_k = code.gather(1, key_pos.flatten(1)).view(bh, chunks, 1, 2 * chunk)
            found += torch.bitwise_right_shift(code_q - code_k, 1) == 0  # difference 0 or 1
        mask -= torch.log1p(found.to(dtype))
    return dataclasses.replace(r, mask=mask, empty=mask.amax(-1) == inf)


def _rows(x: Tensor, index: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Rows ``index`` of ``x`` flattened to ``(-1, x.shape[-1])``, viewed as ``shape + (D,)``."""
    return x.reshape(-1, x.shape[-1]).index_select(0, index).view(*shape, x.shape[-1])


def _round_forward(q: Tensor, keys: Tensor, v: Tensor, r: Round, chunk: int, scale: float) -> tuple[Tensor, ...]:
    """One round's kernel inputs ``(qx, kx, vx)`` and its output and log-sum-exp by position."""
    bh, chunks, by_position = r.mask.shape[0], r.length // chunk, q.shape[:3]
    qx = _rows(q, r.queries, (bh, chunks, chunk))
    kx, vx = (_windows(_rows(x, r.keys, (bh, chunk + r.length)), chunk) for x in (keys, v))  # [BH, chunks, 2c, D]
    out, lse = flash_attention_cpu(qx, kx, vx, 0.0, False, attn_mask=r.mask, scale=scale)[:2]
    lse = lse.masked_fill(r.empty, float("-inf"))  # the kernel reports 0 for a row with no key
    return (qx, kx, vx), _rows(out, r.slot, by_position), _rows(lse[..., None], r.slot, by_position)[..., 0]


def _tensors(r: Round) -> tuple[Tensor | None, ...]:
    """The fields of ``r`` after ``length``, in order: ``Round(r.length, *_tensors(r))`` is ``r``."""
    return tuple(getattr(r, f.name) for f in dataclasses.fields(Round)[1:])


class _Rounds(torch.autograd.Function):
    """All rounds, combined into one softmax by log-sum-exp; returns ``(out, lse)``. Backward:
    each round's flash backward with the union's output and log-sum-exp."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        keys: Tensor,
        v: Tensor,
        rounds: list[Round],  # type: ignore[override]
        real: Tensor | None,
        chunk: int,
        scale: float,
    ) -> tuple[Tensor, Tensor]:
        kernel, outs, lses = [], [], []
        for r in rounds:
            inputs, out, lse = _round_forward(q, keys, v, r, chunk, scale)
            kernel.append(inputs)
            outs.append(out)
            lses.append(lse)
        stacked = torch.stack(lses)  # [rounds, B, H, N]
        total = torch.logsumexp(stacked, 0)
        share = torch.exp(stacked - torch.where(torch.isinf(total), 0.0, total))[..., None]
        out = (torch.stack(outs) * share.to(outs[0].dtype)).sum(0)
        if real is not None:  # padding tokens have no slot: they read another's, and see nothing
            real = real[:, None, :]
            out, total = out * real[..., None], total.masked_fill(~real, float("-inf"))
        # Every tensor backward reads goes through save_for_backward: freed once backward has run,
        # there again for a second backward of a retained graph (retain_graph=True, gradcheck).
        ctx.save_for_backward(out, total, *(x for r, inputs in zip(rounds, kernel) for x in (*inputs, *_tensors(r))))
        ctx.lengths, ctx.chunk, ctx.scale, ctx.real = [r.length for r in rounds], chunk, scale, real
        ctx.mark_non_differentiable(total)
        return out, total

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out, total, *per_round = ctx.saved_tensors
        # A row that sees nothing has p = 0 everywhere: exp(-inf - (+inf)), not exp(-inf + inf).
        total = torch.where(torch.isinf(total), float("inf"), total)[..., None]
        grad, dq, dk, dv = grad.contiguous(), 0, 0, 0
        size = len(per_round) // len(ctx.lengths)
        for length, start in zip(ctx.lengths, range(0, len(per_round), size)):
            qx, kx, vx, *fields = per_round[start : start + size]
            r = Round(length, *fields)
            rows = qx.shape[:3]
            g, o, lse = (_rows(x, r.queries, rows) for x in (grad, out, total))
            gq, gk, gv = flash_attention_cpu_backward(
                g, qx, kx, vx, o, lse[..., 0], 0.0, False, attn_mask=r.mask, scale=ctx.scale
            )
            dq = dq + _rows(gq, r.slot, grad.shape[:3])
            dk = dk + _rows(gk, r.own, grad.shape[:3]) + _rows(gk, r.prev, grad.shape[:3])
            dv = dv + _rows(gv, r.own, grad.shape[:3]) + _rows(gv, r.prev, grad.shape[:3])
        if ctx.real is not None:
            dq, dk, dv = (x * ctx.real[..., None] for x in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None


@register(
    "lsh",
    config=LSHConfig,
    family="content",
    summary="Reformer LSH attention: hash to buckets, sort, attend within chunks of a bucket.",
    paper="Kitaev et al. 2020, Reformer, https://arxiv.org/abs/2001.04451",
    capabilities=Capabilities(
        causal=True, key_padding=True, backends=("blocked", "reference"), independent_queries=False
    ),
    complexity=Complexity(time="O(n_hashes N c D)", memory="O(n_hashes N c)", subquadratic_memory=True),
    notes=(
        "swapped in untrained: shared-QK: keys are the unit-normalised queries, the model's keys are not used",
        "shared QK: keys are the unit-normalised queries; the k argument is not used",
        "chunks are taken within each bucket by position rank (Reformer chunks the whole sorted "
        "sequence, which lets future tokens move chunk boundaries); this makes routing causal",
        "a token attends to itself only when it sees nothing else in any round",
        "rounds are combined as one softmax over the union of their keys (log N_ij subtracted, "
        "Reformer Appendix A); dedupe=False weighs a key found in several rounds once per round",
        "rotations are drawn per round and head; fresh every forward pass in training (resample), "
        "fixed by the module's seed in eval mode",
    ),
)
class LSHAttention(Attention):
    """Reformer LSH attention; see the module docstring and ``reference_lsh``."""

    config: LSHConfig

    def __init__(self, config: LSHConfig) -> None:
        super().__init__(config)
        seed = int(torch.randint(0, 2**62, ())) if config.seed is None else config.seed
        self.register_buffer("rotation_seed", torch.tensor(seed, dtype=torch.long))

    def rotations(self, heads: int, dim: int, device: torch.device | None = None) -> Tensor:
        """The rotations of the next forward pass ``(n_hashes, H, D, n_buckets / 2)``: fresh
        from torch's global RNG in training with ``resample``, else from ``rotation_seed``."""
        fresh = self.training and self.config.resample
        return rotations(self.config, heads, dim, None if fresh else int(self.rotation_seed), device)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        cfg, (batch, _, n, dim) = self.config, q.shape
        real = real_tokens(args.key_padding_mask, batch, n, q.device)
        compute = compute_dtype(q)
        qc, vc = q.to(compute), v.to(compute)
        keys = F.normalize(qc, dim=-1)
        scale = default_scale(cfg.scale, dim)
        with torch.no_grad():
            rots = self.rotations(q.shape[1], dim, q.device)
            laid = [layout(buckets(keys, rot, real), cfg.n_buckets, cfg.chunk) for rot in rots]
            plain = [r for r, *_ in laid]
            rounds = [
                round_mask(
                    r,
                    *slots,
                    [o for o in plain if o is not r],
                    chunk=cfg.chunk,
                    causal=args.causal,
                    dedupe=cfg.dedupe,
                    dtype=compute,
                )
                for r, *slots in laid
            ]
        # The flash kernel needs one head size for q, k and v: zero columns change no score.
        width = max(dim, v.shape[-1])
        pad = lambda x: x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))  # noqa: E731
        out, total = _Rounds.apply(pad(qc), pad(keys), pad(vc), rounds, args.key_padding_mask, cfg.chunk, scale)
        out = out[..., : v.shape[-1]]
        alone = torch.isinf(total)[..., None] & real[:, None, :, None]  # sees nothing in any round
        return torch.where(alone, vc, out).to(q.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """``reference_lsh`` under this module's rotations. k is not read: LSH attention shares
        QK, its keys are the unit-normalised queries."""
        rotation = self.rotations(q.shape[1], q.shape[-1], q.device)
        return reference_lsh(
            q,
            v,
            self.config,
            rotation,
            causal=args.causal,
            key_padding_mask=args.key_padding_mask,
            return_weights=return_weights,
        )
