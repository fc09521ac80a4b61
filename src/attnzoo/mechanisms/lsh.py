"""Reformer LSH attention (Kitaev et al. 2020, https://arxiv.org/abs/2001.04451).

Per hashing round, random rotations put each token in a bucket; tokens are sorted by (bucket,
position) and split into chunks; a query attends to the keys of its bucket in its own chunk and
the previous one. The rounds are combined into one softmax over the union of the keys they
found: a key found in ``N_ij`` rounds has ``log N_ij`` subtracted from its score in each
(Reformer, Appendix A), so it counts once.

This file holds the config, the dense ``reference_lsh`` (buckets and chunk ranks by position)
and the registered module. The fast path (``lsh_chunks``) lays each round out in sorted order,
every bucket starting on a chunk boundary: O(N c) memory, one flash-kernel call per round. A
decode step (``lsh_decode``) keeps the last 2c tokens of every bucket and round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.backends.reference import normalize_scores
from attnzoo.mechanisms import lsh_decode
from attnzoo.mechanisms._ops import compute_dtype, default_scale, real_tokens, unit
from attnzoo.mechanisms.base import AttendArgs, Attention, StateSpec, Weighted
from attnzoo.mechanisms.lsh_chunks import buckets, chunked_lsh, round_buckets
from attnzoo.mechanisms.lsh_decode import LSHState
from attnzoo.registry import Config, bounded, eighth, register
from attnzoo.spec import Capabilities, Complexity


@dataclass(frozen=True, kw_only=True)
class LSHConfig(Config):
    """Config of ``lsh``.

    Args:
        n_hashes: hashing rounds. Default 2.
        n_buckets: buckets per round: even, or 1 (no hashing: every token in one bucket). Default 8.
        block: chunk size c, the Reformer's chunk (positions ranked within a bucket): it changes
            which keys a query sees, so it is a ``block`` here (``chunk`` elsewhere only sets how
            much is computed at once). Default 64.
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

    renamed = {"chunk": "block (the Reformer's chunk: it changes the result, so it is a block)"}

    n_hashes: int = bounded(2, ge=1)
    # for_length: 8 buckets of 64 would put a short sequence in one chunk.
    n_buckets: int = bounded(8, ge=1, for_length=4)
    block: int = bounded(64, ge=1, for_length=eighth)
    seed: int | None = None
    resample: bool = True
    dedupe: bool = True
    scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")

    def validate(self) -> None:
        if self.n_buckets % 2 and self.n_buckets != 1:
            raise ValueError(f"n_buckets must be 1 or even (buckets come from argmax([xR; -xR])), got {self.n_buckets}")


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
    key_mask: Tensor | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """LSH attention as the paper reads, densely, under ``rotation (n_hashes, H, D, n_buckets
    / 2)`` (``LSHAttention.rotations`` gives a module's): per round, the N x N mask of ``visible``;
    each round's masked scores less ``log N_ij`` (``dedupe``), the rounds combined by their
    log-sum-exp. A row that sees nothing attends to itself (zero if it is padding). Keys are
    the unit-normalised queries (shared QK). ``return_weights`` also gives the combined
    ``(B, H, N, N)`` attention matrix."""
    real = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    keys = F.normalize(q, dim=-1)
    scale = default_scale(config.scale, q.shape[-1])
    compute = compute_dtype(q)
    scores = torch.einsum("bhid,bhjd->bhij", q.to(compute), keys.to(compute)) * scale
    masks = [visible(buckets(keys, rot, real), real, config.block, causal) for rot in rotation.to(q.device)]
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


@register(
    "lsh",
    config=LSHConfig,
    family="content",
    summary="Reformer LSH attention: hash to buckets, sort, attend within chunks of a bucket.",
    paper="Kitaev et al. 2020, Reformer, https://arxiv.org/abs/2001.04451",
    capabilities=Capabilities(
        causal=True, key_mask=True, decode_step=True, backends=("blocked", "reference"), independent_queries=False
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
        "decode step: hashes each new token in every round and attends the < 2 block keys its bucket's rank-chunks "
        "show it, O(n_hashes block D) per token at any position; memory O(t (D + D_v)) (every unit key and value, "
        "a KV cache) plus the positions of each bucket's last 2 block tokens, O(n_hashes n_buckets block); "
        "refused in training mode with resample=True (fresh rotations every forward)",
    ),
)
class LSHAttention(Attention):
    """Reformer LSH attention; see the module docstring and ``reference_lsh``; decode steps in
    ``lsh_decode``."""

    config: LSHConfig

    def __init__(self, config: LSHConfig) -> None:
        super().__init__(config)
        seed = int(torch.randint(0, 2**62, ())) if config.seed is None else config.seed
        self.register_buffer("rotation_seed", torch.tensor(seed, dtype=torch.long))

    def rotations(self, heads: int, dim: int, device: torch.device | None = None) -> Tensor:
        """The rotations of the next forward pass ``(n_hashes, H, D, n_buckets / 2)``, one per
        round and head: fresh from torch's global RNG in training with ``resample``, else from
        ``rotation_seed``."""
        cfg = self.config
        g = None if self.training and cfg.resample else torch.Generator().manual_seed(int(self.rotation_seed))
        return torch.randn(cfg.n_hashes, heads, dim, cfg.n_buckets // 2, generator=g).to(device)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> Tensor:
        cfg, (batch, heads, n, dim) = self.config, q.shape
        real = real_tokens(args.key_mask, batch, n, q.device)
        qc, vc = q.to(compute_dtype(q)), v.to(compute_dtype(q))
        keys = unit(qc)
        with torch.no_grad():
            table = round_buckets(keys, self.rotations(heads, dim, q.device), real)
        out, total = chunked_lsh(
            qc,
            keys,
            vc,
            table,
            args.key_mask,
            n_buckets=cfg.n_buckets,
            chunk=cfg.block,
            causal=args.causal,
            dedupe=cfg.dedupe,
            scale=default_scale(cfg.scale, dim),
        )
        alone = torch.isinf(total)[..., None] & real[:, None, :, None]  # sees nothing in any round
        if alone.any():  # rare: skip a select over (B, H, N, D_v) and its backward's two
            out = torch.where(alone, vc, out)
        return out.to(q.dtype)

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        """``reference_lsh`` under this module's rotations. k is not read: LSH attention shares
        QK, its keys are the unit-normalised queries."""
        rotation = self.rotations(q.shape[1], q.shape[-1], q.device)
        kw = dict(causal=args.causal, key_mask=args.key_mask, return_weights=return_weights)
        return reference_lsh(q, v, self.config, rotation, **kw)

    def _init_state(self, spec: StateSpec) -> LSHState:
        return lsh_decode.init_state(self, spec)

    def _step(self, state: LSHState, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs) -> tuple[Tensor, LSHState]:
        """k is not read (shared QK), as in the forward."""
        return lsh_decode.step(self, state, q, v, args)
