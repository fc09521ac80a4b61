"""The ``blocked`` backend: exact softmax attention over only the tiles a pattern lists, in
eager PyTorch, with a FlashAttention-style backward. Trains on CPU; memory O(N * keys per row).

How a call runs:

1. ``plan.make_plan`` turns ``Pattern.blocks()`` into *pieces*: query blocks that share a head group
   and a number of listed key blocks, each piece either all-full tiles or all-partial tiles,
   with at most ``max_kv_blocks`` key blocks (longer rows, e.g. global tokens, become several
   pieces).
2. Each piece gathers its query block rows and key/value blocks into ``(Q', B*Hg, rows, D)``
   tensors and computes a partial softmax through PyTorch's CPU flash kernel: full tiles with
   no mask; tiles whose mask is exactly a lower (upper) triangle — the edges of windows and the
   causal diagonal — with ``is_causal`` (on row-reversed tiles for the upper one); other partial
   tiles with an additive mask built from ``mask_mod`` on those tiles only. Each piece returns
   its output and the log-sum-exp of every row.
3. Pieces are merged with the log-sum-exp (the online softmax: running max and running sum).
4. Backward recomputes each piece's scores from q, k, v and the *total* output and
   log-sum-exp, so the gradient of each piece is exact and nothing N x N is ever stored.

A ``score_mod`` (ALiBi, ...) runs pieces through an einsum path instead of the flash kernel; its
softmax flushes weights below ``eps^4`` to 0 (``_softmax_lse``: ``exp`` over ``-inf`` and over a
bias's far pairs left its vector path), an additive bias (``score_mods.bias_mod``) skips autograd
in backward, and a ``score_mod`` that reads tensors needing a gradient is refused (the pieces
differentiate the scores only; ``auto`` runs the reference). So does attention dropout
(``Call.dropout``): dropout acts after normalisation and is linear, so a piece returns
``sum_j keep_ij / (1 - p) * exp(s_ij - lse) v_j`` with the log-sum-exp taken *without* dropout,
and pieces still merge exactly; ``keep`` (``_ops.dropout_keep_at``) is evaluated on each tile's
own (b, h, i, j) from the seed, forward and backward, never stored.
Rows that see no key give zeros and zero gradient.

``Blocked`` is the backend object ``dispatch`` runs: the structured path (``structured.py``,
``windowed.py``) where the pattern has window structure, the key-sets path (``key_sets.py``)
where its queries fall into groups that share their keys, the gathered path (``gathered.py``)
where it lists a few keys per row, else this module's tile plan; the plans and their caches
live in ``plan.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnzoo._compat import flash_attention_cpu, flash_attention_cpu_backward
from attnzoo.backends.call import Backend, Call, additive_mask, compute_dtype
from attnzoo.backends.gathered import gathered_attention, not_gathered_reasons
from attnzoo.backends.grouped import grouped_windows
from attnzoo.backends.key_sets import key_set_attention, not_key_set_reasons
from attnzoo.backends.plan import Piece, Plan, plan_for, structure_for
from attnzoo.backends.windowed import structured_attention
from attnzoo.mechanisms._ops import decay_floor, dropout_flat_index, dropout_keep_at, dropped, flushed_exp_
from attnzoo.score_mods import bias_of
from attnzoo.spec import MaskMod, ScoreMod

if TYPE_CHECKING:
    from attnzoo.mechanisms.base import Dropout

_flash = flash_attention_cpu
_flash_backward = flash_attention_cpu_backward

#: Elements of one piece's score matrix (batch x heads x rows x keys) above which its query
#: blocks are split further. 1M (4 MiB in float32): a chunk's gathered tiles then come from the
#: heap and are reused chunk after chunk; at 4M, ``bigbird`` at 4K page-faulted 28 000 times per
#: fwd+bwd, and 1M is 6-22% faster at 2K and 4K in one process (``benchmarks/ab-score-budget-cpu.txt``;
#: no change at 1K, where pieces are smaller than either).
SCORE_BUDGET = 1 << 20


@dataclass(frozen=True)
class Context:
    """Everything a piece needs besides q, k, v."""

    plan: Plan
    scale: float
    mask_mod: MaskMod
    score_mod: ScoreMod | None
    key_mask: Tensor | None
    #: PyTorch's CPU flash kernel needs one head size for q, k and v.
    same_head_dims: bool = True
    #: Attention dropout: pieces take the einsum path and apply ``_ops.dropped``.
    dropout: Dropout | None = None


def _positions(piece: Piece, ctx: Context, qx: Tensor) -> tuple[Tensor, ...]:
    """Index tensors for ``mask_mod``/``score_mod``, broadcastable to ``(Q', B*Hg, rows, keys)``."""
    block, device = ctx.plan.block, qx.device
    arange = torch.arange(block, device=device)
    q_pos = (piece.qb.to(device)[:, None] * block + arange + (ctx.plan.n_kv - ctx.plan.n_q))[:, None, :, None]
    kv_pos = (piece.kb.to(device)[:, :, None] * block + arange).flatten(1)[:, None, None, :]
    bh = torch.arange(qx.shape[1], device=device)
    hg = piece.heads.numel()
    b = (bh // hg).view(1, -1, 1, 1)
    h = piece.heads.to(device)[bh % hg].view(1, -1, 1, 1)
    return b, h, q_pos, kv_pos


def _visible(piece: Piece, ctx: Context, qx: Tensor) -> Tensor:
    b, h, q_pos, kv_pos = _positions(piece, ctx, qx)
    ok = ctx.mask_mod(b, h, q_pos, kv_pos) & (kv_pos < ctx.plan.n_kv)
    if ctx.key_mask is not None:
        ok = ok & ctx.key_mask[b, kv_pos.clamp(max=ctx.plan.n_kv - 1)]
    return ok


def _keep(piece: Piece, ctx: Context, qx: Tensor) -> Tensor:
    """Bool ``(Q', B*Hg, block, keys)``: which of the piece's weights survive dropout, the bits of
    the dense mask ``_ops.dropout_keep(seed, (B, H, N_q, N_kv))`` at this piece's (b, h, i, j)
    only. Padded rows and keys get bits too; their probabilities are 0 (masked) or cut off."""
    b, h, q_pos, kv_pos = _positions(piece, ctx, qx)
    plan = ctx.plan
    flat = dropout_flat_index(b, h, q_pos - (plan.n_kv - plan.n_q), kv_pos, plan.heads, plan.n_q, plan.n_kv)
    return dropout_keep_at(ctx.dropout.seed, flat, ctx.dropout.p)


def _block_index(x: Tensor, piece: Piece, blocks: Tensor, block: int) -> Tensor:
    """Where ``_take``'s blocks lie among the rows ``(B H Npad / block, block D)`` of ``x (B, H,
    Npad, D)``: ``(Q' B Hg c,)`` in the order ``(Q', B*Hg, c)``."""
    b, h, npad, _ = x.shape
    heads = piece.heads.to(x.device)
    bh = (torch.arange(b, device=x.device)[:, None] * h + heads[None, :]).flatten()  # [B*Hg]
    blocks = (blocks if blocks.ndim == 2 else blocks[:, None]).to(x.device)  # [Q', c]
    return (bh[None, :, None] * (npad // block) + blocks[:, None, :]).flatten()


def _take(x: Tensor, piece: Piece, blocks: Tensor, block: int) -> Tensor:
    """``(B, H, Npad, D)`` -> the rows of ``blocks`` for this piece's heads, ``(Q', B*Hg, rows,
    D)`` (rows = block, or c * block for a ``(Q', c)`` index), contiguous as the kernel reads
    it: one ``index_select`` of whole blocks (``block * D`` values each). Advanced indexing of
    the ``(B, H, blocks, block, D)`` view and a permuted copy took 34 of ``bigbird``'s 168 ms
    fwd+bwd at 4K (``benchmarks/ab-block-rows-cpu.txt``)."""
    rows = x.reshape(-1, block * x.shape[-1]).index_select(0, _block_index(x, piece, blocks, block))
    return rows.view(blocks.shape[0], x.shape[0] * piece.heads.numel(), -1, x.shape[-1])


def _gather(piece: Piece, q: Tensor, k: Tensor, v: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
    return _take(q, piece, piece.qb, block), _take(k, piece, piece.kb, block), _take(v, piece, piece.kb, block)


def _uses_flash(piece: Piece, ctx: Context) -> bool:
    # The flash kernel takes no score_mod nor a seeded dropout mask, and its mask cannot depend
    # on the batch row (tiles with padded keys are always of kind "mask").
    no_mods = ctx.score_mod is None and ctx.dropout is None
    return ctx.same_head_dims and no_mods and (piece.kind != "mask" or ctx.key_mask is None)


def _needs_mask(piece: Piece, ctx: Context) -> bool:
    return piece.kind == "mask" or (piece.kind != "full" and not _uses_flash(piece, ctx))


def _flip_rows(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Reverse the rows of each tile: an upper-triangular tile becomes a lower one."""
    return tuple(t.flip(-2) if t.ndim == 4 else t.flip(-1) for t in tensors)


def _softmax_lse(scores: Tensor) -> tuple[Tensor, Tensor]:
    """``softmax(scores)`` and its log-sum-exp ``(..., rows)`` (``-inf``, and weights 0, where a
    row is all ``-inf``), with every exponent below ``decay_floor`` flushed to 0
    (``_ops.flushed_exp_``): ``logsumexp`` and ``exp`` over the masked ``-inf`` and a bias's far
    pairs (ALiBi: -1000) left their vector path, and the weights they left were denormal."""
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isinf(peak), 0.0, peak)
    probs = flushed_exp_(scores - peak, decay_floor(scores.dtype))
    total = probs.sum(-1, keepdim=True)
    lse = (peak + total.log())[..., 0]
    return probs.div_(torch.where(total > 0, total, 1.0)), lse


def piece_forward(piece: Piece, ctx: Context, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Output ``(Q', B*Hg, block, Dv)`` (float32/64) and log-sum-exp ``(Q', B*Hg, block)`` of one
    piece; ``-inf`` where a row sees no key of this piece."""
    qx, kx, vx = _gather(piece, q, k, v, ctx.plan.block)
    visible = _visible(piece, ctx, qx) if _needs_mask(piece, ctx) else None
    cd = compute_dtype(q)
    if _uses_flash(piece, ctx):
        if piece.kind in ("tril", "triu"):
            flip = piece.kind == "triu"
            out, lse = _flash(*(_flip_rows(qx, kx, vx) if flip else (qx, kx, vx)), is_causal=True, scale=ctx.scale)
            out, lse = _flip_rows(out, lse) if flip else (out, lse)
            return out.to(cd), lse.to(cd)
        out, lse = _flash(qx, kx, vx, attn_mask=additive_mask(visible, q.dtype), scale=ctx.scale)
        if visible is not None:
            # The kernel reports lse = 0 for a row whose keys are all masked; make it -inf.
            lse = lse.masked_fill(~visible.any(-1).expand_as(lse), float("-inf"))
        return out.to(cd), lse.to(cd)
    scores = torch.matmul(qx.to(cd), kx.to(cd).transpose(-1, -2)) * ctx.scale
    if ctx.score_mod is not None:
        scores = ctx.score_mod(scores, *_positions(piece, ctx, qx))
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs, lse = _softmax_lse(scores)
    if ctx.dropout is not None:
        probs = dropped(probs, _keep(piece, ctx, qx), ctx.dropout.p)  # after the lse: the merge stays exact
    return torch.matmul(probs, vx.to(cd)), lse


def piece_backward(
    piece: Piece,
    ctx: Context,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    delta: Tensor,
    *,
    flash_ok: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """This piece's share of dq, dk, dv from the *total* ``out`` and ``lse`` (given per query
    block as ``(QB, B*Hg, block)``; rows with no visible key carry lse = +inf, so their
    recomputed probabilities are 0). ``delta`` is ``rowsum(dO * O) - dL/dlse``; the flash
    kernel computes its own delta, so a gradient on the lse needs ``flash_ok=False``."""
    block = ctx.plan.block
    qx, kx, vx = _gather(piece, q, k, v, block)
    ox, dox = _take(out, piece, piece.qb, block), _take(grad_out, piece, piece.qb, block)
    lse_x, delta_x = lse[piece.qb], delta[piece.qb]
    use_flash = flash_ok and _uses_flash(piece, ctx)
    visible = _visible(piece, ctx, qx) if piece.kind != "full" and (piece.kind == "mask" or not use_flash) else None
    if use_flash:
        if piece.kind in ("tril", "triu"):
            flip = piece.kind == "triu"
            args = _flip_rows(dox, qx, kx, vx, ox, lse_x) if flip else (dox, qx, kx, vx, ox, lse_x)
            grads = _flash_backward(*args, 0.0, True, scale=ctx.scale)
            return _flip_rows(*grads) if flip else grads
        return _flash_backward(
            dox, qx, kx, vx, ox, lse_x, 0.0, False, attn_mask=additive_mask(visible, q.dtype), scale=ctx.scale
        )
    cd = compute_dtype(q)
    qx, kx, vx, dox = qx.to(cd), kx.to(cd), vx.to(cd), dox.to(cd)
    with torch.enable_grad():
        raw = (torch.matmul(qx, kx.transpose(-1, -2)) * ctx.scale).detach().requires_grad_()
        scores = raw if ctx.score_mod is None else ctx.score_mod(raw, *_positions(piece, ctx, qx))
        # rows that see nothing carry lse = +inf: their weights are 0
        probs = flushed_exp_(scores.detach() - lse_x[..., None], decay_floor(scores.dtype))
        if visible is not None:
            probs = probs.masked_fill(~visible, 0.0)
        d_probs, applied = torch.matmul(dox, vx.transpose(-1, -2)), probs  # applied: what multiplied v
        if ctx.dropout is not None:
            # out = (P * D) v with D = keep / (1 - p): dv = (P * D)^T dO, dP = D * (dO v^T), and
            # delta = rowsum(dO * out) is still rowsum(P * dP).
            keep, p = _keep(piece, ctx, qx), ctx.dropout.p
            d_probs, applied = dropped(d_probs, keep, p), dropped(probs, keep, p)
        d_scores = probs * (d_probs - delta_x[..., None])
        # a bias (score_mods.bias_mod) has slope 1 in the score: no autograd pass for it
        moded = ctx.score_mod is not None and bias_of(ctx.score_mod) is None
        (d_raw,) = torch.autograd.grad(scores, raw, d_scores) if moded else (d_scores,)
    d_raw = d_raw * ctx.scale
    return (
        torch.matmul(d_raw, kx),
        torch.matmul(d_raw.transpose(-1, -2), qx),
        torch.matmul(applied.detach().transpose(-1, -2), dox),
    )


def _pad(x: Tensor, n: int) -> Tensor:
    return x if x.shape[2] == n else torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[2]))


def _row_chunks(piece: Piece, ctx: Context, bh: int) -> list[Piece]:
    """Split a piece's query blocks so one chunk's score matrix stays within SCORE_BUDGET."""
    per_row = bh * ctx.plan.block * ctx.plan.block * piece.kb.shape[1]
    step = max(1, SCORE_BUDGET // per_row)
    return [
        Piece(piece.heads, piece.qb[s : s + step], piece.kb[s : s + step], piece.kind)
        for s in range(0, piece.qb.numel(), step)
    ]


def _chunks(ctx: Context, q: Tensor) -> list[Piece]:
    return [c for p in ctx.plan.pieces for c in _row_chunks(p, ctx, q.shape[0] * p.heads.numel())]


def _padded(plan: Plan) -> tuple[int, int]:
    """``(n_q, n_kv)`` rounded up to whole blocks. Not through ``TileGrid``'s properties: dynamo
    cannot read a property of the constant plan inside an ``autograd.Function``."""
    return -(-plan.n_q // plan.block) * plan.block, -(-plan.n_kv // plan.block) * plan.block


class BlockedAttention(torch.autograd.Function):
    """Forward over pieces merged by log-sum-exp; backward recomputes each piece."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, data: Context) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        plan, batch, heads = data.plan, q.shape[0], q.shape[1]
        n_q_pad, n_kv_pad = _padded(plan)
        qp, kp, vp = _pad(q, n_q_pad), _pad(k, n_kv_pad), _pad(v, n_kv_pad)
        cd = compute_dtype(q)
        # Running output and log-sum-exp per head and query block: [H, QB, B, block, (Dv)].
        acc = torch.zeros(heads, n_q_pad // plan.block, batch, plan.block, v.shape[-1], dtype=cd, device=q.device)
        acc_lse = torch.full(acc.shape[:-1], float("-inf"), dtype=cd, device=q.device)
        for piece in _chunks(data, q):
            out, lse = piece_forward(piece, data, qp, kp, vp)
            hg = piece.heads.numel()
            out = out.view(-1, batch, hg, plan.block, out.shape[-1]).permute(2, 0, 1, 3, 4)  # [Hg, Q', B, block, Dv]
            lse = lse.view(-1, batch, hg, plan.block).permute(2, 0, 1, 3)
            idx = (piece.heads.to(q.device)[:, None], piece.qb.to(q.device)[None, :])
            old, old_lse = acc[idx], acc_lse[idx]
            new_lse = torch.logaddexp(old_lse, lse)
            safe = torch.where(torch.isinf(new_lse), 0.0, new_lse)
            acc[idx] = old * torch.exp(old_lse - safe)[..., None] + out * torch.exp(lse - safe)[..., None]
            acc_lse[idx] = new_lse
        out = acc.permute(2, 0, 1, 3, 4).reshape(batch, heads, -1, v.shape[-1])[:, :, : plan.n_q]
        lse = acc_lse.permute(2, 0, 1, 3).reshape(batch, heads, -1)
        return out.to(q.dtype), lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, data = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.data = data

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        data: Context = ctx.data
        plan = data.plan
        n_q_pad, n_kv_pad = _padded(plan)
        qp, kp, vp = _pad(q, n_q_pad), _pad(k, n_kv_pad), _pad(v, n_kv_pad)
        op, gp = _pad(out, n_q_pad), _pad(grad_out.contiguous(), n_q_pad)
        cd = compute_dtype(q)
        delta = (gp.to(cd) * op.to(cd)).sum(-1)  # [B, H, Nq_pad]
        # d lse_i / d s_ij = p_ij, so a gradient on the lse enters exactly like -delta.
        # Compiled, a graph cannot branch on the values: take the lse path (exact either way).
        lse_grad = grad_lse is not None and (torch.compiler.is_compiling() or bool((grad_lse != 0).any()))
        if lse_grad:
            delta = delta - torch.nan_to_num(grad_lse.to(cd), nan=0.0)
        lse = torch.where(torch.isinf(lse), float("inf"), lse)  # rows that saw no key: probabilities 0
        dq, dk, dv = (torch.zeros(x.shape, dtype=cd, device=q.device) for x in (qp, kp, vp))
        for piece in _chunks(data, q):
            dqx, dkx, dvx = piece_backward(
                piece,
                data,
                qp,
                kp,
                vp,
                op,
                gp,
                _block_rows(lse, piece, plan.block),
                _block_rows(delta, piece, plan.block),
                flash_ok=not lse_grad,
            )
            _scatter(dq, dqx, piece, piece.qb, plan.block)
            _scatter(dk, dkx, piece, piece.kb, plan.block)
            _scatter(dv, dvx, piece, piece.kb, plan.block)
        return (
            dq[:, :, : plan.n_q].to(q.dtype),
            dk[:, :, : plan.n_kv].to(k.dtype),
            dv[:, :, : plan.n_kv].to(v.dtype),
            None,
        )


def _block_rows(x: Tensor, piece: Piece, block: int) -> Tensor:
    """``(B, H, Npad)`` -> ``(QB, B*Hg, block)`` indexed later by ``piece.qb``."""
    x = x[:, piece.heads] if piece.heads.numel() != x.shape[1] else x
    return x.reshape(x.shape[0], x.shape[1], -1, block).permute(2, 0, 1, 3).flatten(1, 2)


def _scatter(target: Tensor, grad: Tensor, piece: Piece, blocks: Tensor, block: int) -> None:
    """Add ``(Q', B*Hg, rows, D)`` gradients into ``(B, H, Npad, D)`` at ``blocks``: ``_take``
    backwards, one ``index_add_`` of whole blocks into the rows (a block read by several
    pieces or query blocks gets each one's share)."""
    rows = grad.reshape(-1, block * grad.shape[-1]).to(target.dtype)
    target.view(-1, block * target.shape[-1]).index_add_(0, _block_index(target, piece, blocks, block), rows)


def blocked_attention(call: Call, plan: Plan, *, return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention of ``call`` over the pieces of ``plan`` (see module docstring).
    Differentiable, the log-sum-exp ``(B, H, N_q)`` too (``-inf`` for rows that see no key) when
    ``return_lse``."""
    q, k, v = call.q, call.k, call.v
    same_dims = q.shape[-1] == v.shape[-1]
    ctx = Context(plan, call.scale, call.mask_mod(), call.score_mod, call.key_mask, same_dims, call.dropout)
    out, lse = BlockedAttention.apply(q, k, v, ctx)
    return (out, lse[:, :, : plan.n_q]) if return_lse else out


def _mod_needs_grad(score_mod: ScoreMod | None, device: torch.device) -> bool:
    """Whether ``score_mod`` reads tensors that need a gradient (a learned bias) while autograd
    records: its pieces differentiate the scores only, so such a gradient would be lost."""
    if score_mod is None or not torch.is_grad_enabled():
        return False
    probe = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    return bool(score_mod(torch.zeros(1, 1, 1, 1, device=device), probe, probe, probe, probe).requires_grad)


class Blocked(Backend):
    """The CPU training backend: the structured path where the pattern has window structure
    (``plan.structure_for``), the key-sets path where its queries fall into groups that share
    their keys (``key_sets``: ``block2d``), the gathered path where it names a few keys per row
    (``gathered``: ``random(r)``), else the generic tile plan (``plan.plan_for``)."""

    NAME = "blocked"

    def not_supported_reasons(self, call: Call) -> list[str]:
        if call.q.device.type != "cpu":
            return [f"blocked runs PyTorch's CPU flash kernel; inputs are on {call.q.device.type} (use flex)"]
        if _mod_needs_grad(call.score_mod, call.q.device):
            return ["a score_mod with tensors that need a gradient (blocked passes gradients to q, k, v only)"]
        return []

    def prepare(self, call: Call) -> Call:
        return in_kernel_dtype(call)

    def path(self, call: Call) -> str:
        if structure_for(call) is not None:
            return "structured"
        if not not_key_set_reasons(call):
            return "key_sets"
        return "tiles" if not_gathered_reasons(call) else "gathered"

    def grouped_kv(self, call: Call) -> bool:
        """Grouped-query K/V as they are on most structured plans (``grouped.grouped_windows``)."""
        structure = structure_for(call)
        return structure is not None and grouped_windows(structure, call.q.shape[1] // call.k.shape[1])

    def run(self, call: Call) -> Tensor:
        structure = structure_for(call)
        if structure is not None:
            return structured_attention(call, structure)
        if not not_key_set_reasons(call):
            return key_set_attention(call)
        if not not_gathered_reasons(call):
            return gathered_attention(call)
        return blocked_attention(call, plan_for(call))


def in_kernel_dtype(call: Call) -> Call:
    """``Blocked.prepare``: ``call`` with half-precision q, k, v (bfloat16, float16) in float32. On
    this backend's short rows torch's CPU flash kernel runs bfloat16 up to 6x slower than float32, with
    AMX tiles or without: on bfloat16 inputs, fwd+bwd at 1K, ``local`` 25.0 -> 13.0 ms and
    ``strided`` 21.9 -> 4.0 on an AVX-512 Xeon without AMX (``benchmarks/ab-half-in-float32-cpu.txt``),
    41.1 -> 23.3 and 52.6 -> 8.2 on one with AMX tiles, where dense bfloat16 SDPA is faster than
    float32 (``benchmarks/ab-half-in-float32-amx-cpu.txt``); float16 took the tile path's explicit
    scores (the structured path takes the kernel's float32, float64 and bfloat16 only:
    ``plan.FLASH_DTYPES``). The backend accumulates in float32 either way (``call.compute_dtype``,
    float32 for both), and the casts are exact one way and the output's rounding the other."""
    if call.q.dtype not in (torch.bfloat16, torch.float16):
        return call
    return replace(call, q=call.q.float(), k=call.k.float(), v=call.v.float())
