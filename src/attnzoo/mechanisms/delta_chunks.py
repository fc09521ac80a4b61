"""The delta rule as plain functions: the chunkwise fast path (``delta_rule``,
``gated_delta_rule``), the token-by-token recurrence (``naive_*``) and the dense form
(``delta_weights``). The mechanisms that wrap them are
in ``delta.py`` (``deltanet``, ``gated_deltanet``).

DeltaNet (Schlag et al. 2021, https://arxiv.org/abs/2102.11174; Yang et al. 2024,
https://arxiv.org/abs/2406.06484) and Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024,
https://arxiv.org/abs/2412.06464) keep a state ``S (D, D_v)`` per head that maps keys to values
and, at each token, replace what it holds for ``k_t`` by a mix of the old and the new value::

    S_t = alpha_t (S_{t-1} - beta_t k_t^T (k_t S_{t-1})) + beta_t k_t^T v_t,    o_t = q_t S_t

(``alpha_t = 1`` for DeltaNet). Rows are tokens, ``k_t`` a row vector.

The chunkwise form (Yang et al. 2024, section 3, the WY/UT representation). Inside a chunk that
starts from state ``S_0``, write ``S_t = G_t S_0 + sum_{j <= t} (G_t / G_j) k_j^T u_j`` with
``G_t = alpha_1 ... alpha_t`` (cumulative from the chunk start) and the "pseudo-values"
``u_t = beta_t (v_t - k_t alpha_t S_{t-1})``. Substituting ``alpha_t S_{t-1}`` makes the u's one
unit lower-triangular system per chunk::

    (I + tril(diag(beta) (K K^T * Dec), -1)) U = diag(beta) V - diag(beta G) K S_0,
    Dec_tj = G_t / G_j,  so  U = U_v - W S_0  with  [U_v, W] = T [diag(beta) V, diag(beta G) K]

(``T`` the inverse, for all chunks at once and independent of the state: formed from its
diagonal blocks by recursive doubling in batched matmuls). Then, carrying ``S`` from chunk to
chunk (the only sequential part, N / C small steps, two in-place matmuls each way)::

    O = diag(G) Q S_0 + (Q K^T * Dec * M) U,    S_C = G_C S_0 + (K * G_C / G)^T U

All of it is one autograd function (``_ChunkRule``) with a written-out backward: a single reverse
scan over the states' adjoints, every other gradient a batched matmul or elementwise product over
all chunks; since U_v and W enter only through ``U = U_v - W S_0``, the adjoints of W and of the
inverse come out of ``T^T dU_v`` without forming ``dW`` or ``dT``. Tensors are chunk-major,
``(N / C, B H, C, ...)``, so that each step of the scan reads and writes whole contiguous blocks.
Decays enter only as differences of in-chunk cumulative logs, masked to ``j <= t`` before the
exponential, so every exponent is <= 0. The largest tensors are ``(B, H, N, C)`` inside the
chunks and the states at the chunk starts, ``(B, H, N / C, D, D_v)``; nothing is N x N. C = 32 by
default: the work inside chunks grows with C and the steps of the scan with N / C; on CPU at
D = 64 the sum is least near 32 (16 and 64 were slower, also after this rewrite).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.mechanisms._ops import decay_floor, flushed_exp_, lower_decay_exp_

#: Tokens per chunk of the fast path: quadratic (C x C) inside, the state carried across. 32 beat
#: 16, 24 and 64 at N = 4096, D = 64 (fwd+bwd on CPU, ``scripts/recurrent_vs_naive.py``).
CHUNK = 32


def delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, initial_state: Tensor | None = None, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """DeltaNet, chunkwise: ``S_t = S_{t-1} + beta_t k_t^T (v_t - k_t S_{t-1})``, ``o_t = q_t S_t``.

    Args:
        q, k: ``(B, H, N, D)``, used as given (the mechanism normalises k and scales q first).
        v: ``(B, H, N, D_v)``. beta: ``(B, H, N)``, the writing strength, in (0, 1).
        initial_state: ``(B, H, D, D_v)``, replaces the zero ``S_0``. chunk: tokens per chunk (32).

    Returns:
        ``(o (B, H, N, D_v), state (B, H, D, D_v))``: the outputs and ``S_N``, in q's dtype.
    """
    return _chunkwise(q, k, v, beta, None, initial_state, chunk)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_alpha: Tensor,
    *,
    initial_state: Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet, chunkwise: ``S_t = alpha_t (S_{t-1} - beta_t k_t^T (k_t S_{t-1})) + beta_t
    k_t^T v_t``, ``alpha_t = exp(log_alpha_t)``, ``o_t = q_t S_t``.

    Args:
        log_alpha: ``(B, H, N)``, <= 0 (a scalar decay per head and token). The rest as
            ``delta_rule``.

    Returns:
        ``(o (B, H, N, D_v), state (B, H, D, D_v))``.
    """
    return _chunkwise(q, k, v, beta, log_alpha, initial_state, chunk)


def naive_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``delta_rule`` token by token, as the paper writes it (O(N) sequential steps)."""
    return naive_gated_delta_rule(q, k, v, beta, None, initial_state=initial_state)


def naive_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_alpha: Tensor | None, *, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``gated_delta_rule`` token by token (``log_alpha=None``: DeltaNet): decay the state, read
    what it holds for ``k_t``, write ``beta_t`` of the way to ``v_t``, read out with ``q_t``."""
    b, h, _, d = k.shape
    s = q.new_zeros(b, h, d, v.shape[-1]) if initial_state is None else initial_state
    alphas = [None] * k.shape[2] if log_alpha is None else log_alpha.exp().unbind(2)
    outs = []
    for q_t, k_t, v_t, beta_t, alpha_t in zip(q.unbind(2), k.unbind(2), v.unbind(2), beta.unbind(2), alphas):
        s = s if alpha_t is None else alpha_t[..., None, None] * s
        old = torch.einsum("bhd,bhde->bhe", k_t, s)  # what S holds for k_t
        s = s + k_t[..., :, None] * (beta_t[..., None] * (v_t - old))[..., None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q_t, s))
    return torch.stack(outs, 2) if outs else v.new_zeros(v.shape), s


def delta_weights(q: Tensor, k: Tensor, beta: Tensor, log_alpha: Tensor | None, *, causal: bool) -> Tensor:
    """The dense ``(B, H, N, N)`` weights the (gated) delta rule applies to V (Yang et al. 2024,
    eq. for the parallel form): with zero ``S_0``, ``u = T diag(beta) V`` (module docstring) and
    ``o_i = sum_{j <= i} Dec_ij (q_i . k_j) u_j``, so::

        O = (Q K^T * Dec * M_causal) (I + tril(diag(beta) (K K^T * Dec), -1))^-1 diag(beta) V

    with ``Dec_ij = exp(g_i - g_j)``, ``g`` the cumulative ``log_alpha`` (all ones for DeltaNet).

    ``causal=False`` (not in the papers, which are causal): every query reads the state after
    the whole sequence, ``o_i = q_i S_N``, as non-causal linear attention reads the sum over all
    keys; its weights replace ``Dec * M_causal`` by ``exp(g_N - g_j)`` for every ``i``.
    """
    n = k.shape[2]
    g = k.new_zeros(beta.shape) if log_alpha is None else log_alpha.cumsum(-1)  # [B, H, N]
    upto = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
    dec = (g[..., :, None] - g[..., None, :]).masked_fill(~upto, -math.inf).exp()  # [B, H, N, N], 0 above
    lower = beta[..., :, None] * (k @ k.transpose(-1, -2)) * dec  # read only below the diagonal
    # T diag(beta): the unit lower-triangular solve against diag(beta).
    t_beta = torch.linalg.solve_triangular(lower, torch.diag_embed(beta), upper=False, unitriangular=True)
    read = dec if causal else (g[..., -1:] - g).exp()[..., None, :]  # [B, H, N | 1, N]
    return ((q @ k.transpose(-1, -2)) * read) @ t_beta


def _chunked(x: Tensor, size: int) -> Tensor:
    """``(B, H, N[, E]) -> (C, BH, L[, E])``: chunk-major and contiguous, so that one chunk of
    every head is one contiguous block the scan writes with ``out=``; N zero-padded to whole
    chunks (padded tokens have k = 0 and beta = 0: no write; log_alpha = 0: no decay; so S_N is
    unchanged)."""
    pad = -x.shape[2] % size
    if x.dim() == 3:
        return rearrange(F.pad(x, (0, pad)) if pad else x, "b h (c l) -> c (b h) l", l=size).contiguous()
    return rearrange(F.pad(x, (0, 0, 0, pad)) if pad else x, "b h (c l) e -> c (b h) l e", l=size).contiguous()


#: Diagonal blocks up to this size are inverted row by row with elementwise ops; larger ones by doubling.
_ROWS = 8


def _diagonal_blocks(x: Tensor, size: int) -> Tensor:
    """``(..., P, P) -> (..., P / size, size, size)``: the diagonal blocks, as a view."""
    return x.unflatten(-1, (-1, size)).unflatten(-3, (-1, size)).diagonal(0, -4, -2).movedim(-1, -3)


def _unit_lower_inverse(a: Tensor) -> Tensor:
    """``(I + tril(a, -1))^-1`` for ``a (..., L, L)``, from blocks: the diagonal blocks of size 8
    by forward substitution (row i is ``-a_i T``, elementwise over all blocks at once), then by
    doubling: with the inverses ``T11, T22`` of two diagonal blocks of size s, the block of size 2s
    holding them has the inverse ``[[T11, 0], [-T22 A21 T11, T22]]`` (the blocked inversion of
    LAPACK's ``trtri``, as stable as forward substitution). Batched matmuls over every chunk
    instead of a LAPACK call per matrix, which on CPU costs far more for the many small matrices
    of the fast path; tiny blocks stay out of matmuls, which also run matrix by matrix. Every
    block is written in place into the one result (concatenating the blocks level by level cost
    more than the products)."""
    n = a.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()  # the next power of two: zero rows and columns invert to I
    a = F.pad(a, (0, p - n, 0, p - n)) if p != n else a
    size = min(_ROWS, p)
    diag = torch.eye(size, dtype=a.dtype, device=a.device).repeat(*a.shape[:-2], p // size, 1, 1)
    blocks = _diagonal_blocks(a, size).contiguous()  # [..., P / 8, 8, 8]; above the diagonal unread
    for i in range(1, size):
        diag[..., i, :i] = -(blocks[..., i, :i, None] * diag[..., :i, :i]).sum(-2)
    t = a.new_zeros(a.shape)
    _diagonal_blocks(t, size).copy_(diag)
    while size < p:  # the diagonal blocks of size 2s of t and a, as views
        t2, a2 = _diagonal_blocks(t, 2 * size), _diagonal_blocks(a, 2 * size)
        t2[..., size:, :size] = -(t2[..., size:, size:] @ a2[..., size:, :size] @ t2[..., :size, :size])
        size *= 2
    return t[..., :n, :n]


def _addmm_(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``acc += a @ b`` over the ``(C, BH)`` batch, one batched matmul into ``acc`` (contiguous,
    ours): on CPU every fresh (N, D) result costs its page faults."""
    acc.flatten(0, 1).baddbmm_(a.flatten(0, 1), b.flatten(0, 1))
    return acc


class _Intra(NamedTuple):
    """Stage one, every chunk at once ``(C, BH, ...)``: ``t`` the inverse ``T``, ``u_v, w``
    (``U = U_v - W S_c``; the scan overwrites ``u_v`` with U), ``qs, k_end`` (q decayed from the
    chunk start, k to its end; q, k without decay), ``p`` the in-chunk scores ``Q K^T * Dec * M``,
    ``kk = K K^T * Dec`` (the Gram matrix, decayed),
    ``dec`` (``exp(g_t - g_j)``, 0 for ``j > t``) and ``gates`` (each chunk's whole decay
    ``(C, BH)``); the last two None without decay."""

    t: Tensor
    u_v: Tensor
    w: Tensor
    qs: Tensor
    k_end: Tensor
    p: Tensor
    kk: Tensor
    dec: Tensor | None
    gates: Tensor | None


def _decays(g: Tensor) -> tuple[Tensor, Tensor]:
    """``exp(g)`` (decay from the chunk's start) and ``exp(g_L - g)`` (to its end) of the in-chunk
    cumulative log decays ``g`` (<= 0), a factor below ``_ops.decay_floor`` counting as 0 (no
    denormal in the products they enter)."""
    floor = decay_floor(g.dtype)
    return flushed_exp_(g.clone(), floor), flushed_exp_(g[..., -1:] - g, floor)


def _intra(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None) -> _Intra:
    """``[U_v, W] = T [diag(beta) V, diag(beta G) K]`` with ``T`` the unit lower-triangular inverse
    of ``I + tril(diag(beta) (K K^T * Dec), -1)`` (module docstring), and the in-chunk scores.
    ``diag(beta)``, ``diag(beta G)`` scale T's columns: (L, L) products, not (L, D) ones."""
    k_t = k.transpose(-1, -2)
    kk, qk = k @ k_t, q @ k_t  # [C, BH, L, L]
    if g is None:
        dec = gates = None
        qs, k_end, p, start = q, k, qk.tril_(), beta
    else:
        dec = lower_decay_exp_(g[..., :, None] - g[..., None, :])
        eg, to_end = _decays(g)
        kk, p = kk.mul_(dec), qk.mul_(dec)  # in place: the backward needs only these
        qs, start = q * eg[..., None], beta * eg
        k_end = k * to_end[..., None]  # decay from token j to the chunk end
        gates = eg[..., -1]
    t = _unit_lower_inverse(kk * beta[..., None])  # read only below the diagonal
    u_v, w = (t * beta[..., None, :]) @ v, (t * start[..., None, :]) @ k
    return _Intra(t, u_v, w, qs, k_end, p, kk, dec, gates)


def _scan(u_v: Tensor, w: Tensor, k_end: Tensor, gates: Tensor | None, s0: Tensor) -> tuple[Tensor, Tensor]:
    """The sequential stage, ``U_c = U_v,c - W_c S_c``, ``S_{c+1} = gate_c S_c + K_end,c^T U_c``:
    ``U (C, BH, L, D_v)`` and the states at the chunk starts, ``(C + 1, BH, D, D_v)`` (the last is
    S_N). Each step accumulates in place into its own contiguous slot: nothing is stacked
    afterwards, and no step allocates or copies (a batched matmul into a strided slot would run
    matrix by matrix; a fresh result costs a copy of the addend). U overwrites ``u_v``, which
    nothing reads afterwards."""
    u = u_v
    starts = s0.new_empty(u_v.shape[0] + 1, *s0.shape)
    starts[0] = s0
    k_end_t = k_end.transpose(-1, -2)
    for c in range(u_v.shape[0]):
        u[c].baddbmm_(w[c], starts[c], alpha=-1)
        if gates is None:
            starts[c + 1] = starts[c]
        else:
            torch.mul(starts[c], gates[c, :, None, None], out=starts[c + 1])
        starts[c + 1].baddbmm_(k_end_t[c], u[c])
    return u, starts


def _scan_back(du: Tensor, lams: Tensor, w: Tensor, k_end: Tensor, gates: Tensor | None, starts: Tensor):  # noqa: ANN202
    """The reverse scan over the adjoints ``l_c = dL/dS_c``, in place: ``lams (C + 1, BH, D, D_v)``
    holds ``dL/dS_N`` last and, before it, what the outputs send to each chunk start; ``du`` what
    they send to ``U``. Then ``dU_c += K_end,c l_{c+1}`` (through the next state) and
    ``l_c += gate_c l_{c+1} - W_c^T dU_c``. Returns the gates' adjoints ``<l_{c+1}, S_c>`` (C, BH),
    taken step by step while both are in cache (None without gates)."""
    w_t = w.transpose(-1, -2)
    d_gates = None if gates is None else gates.new_empty(gates.shape)
    for c in range(du.shape[0] - 1, -1, -1):
        if d_gates is not None:  # [BH, 1, D D_v] @ [BH, D D_v, 1]
            torch.bmm(lams[c + 1].flatten(1)[:, None], starts[c].flatten(1)[..., None], out=d_gates[c, :, None, None])
        du[c].baddbmm_(k_end[c], lams[c + 1])
        if gates is None:
            lams[c].add_(lams[c + 1])
        else:
            lams[c].addcmul_(lams[c + 1], gates[c, :, None, None])
        lams[c].baddbmm_(w_t[c], du[c], alpha=-1)
    return d_gates


class _ChunkRule(torch.autograd.Function):
    """The fast path as one autograd function, ``(q, k (C, BH, L, D), v (C, BH, L, D_v), beta,
    g (C, BH, L) or None, s0 (BH, D, D_v)) -> (o (C, BH, L, D_v), S_N)``, ``g`` the in-chunk
    cumulative log decays. Forward: ``_intra``, ``_scan``, then ``O = diag(G) Q S_c + P U`` for
    all chunks at once. The backward is written out (``_back_outputs``, ``_back_intra``): one
    reverse scan over the states' adjoints, every other gradient a batched matmul or an
    elementwise product over all chunks, where autograd would keep a node per chunk and per
    elementwise step, and would form the inverse's adjoint ``T^T dT T^T`` that ``_back_intra``
    gets without ``dT``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, s0: Tensor):  # noqa: ANN001, ANN205
        f = _intra(q, k, v, beta, g)
        u, starts = _scan(f.u_v, f.w, f.k_end, f.gates, s0)
        o = _addmm_(f.p @ u, f.qs, starts[:-1])
        ctx.save_for_backward(q, k, v, beta, g, u, starts, *f)
        return o, starts[-1].clone()  # a copy: the caller may write into it, the backward reads starts

    @staticmethod
    def backward(ctx, d_o: Tensor, d_s: Tensor):  # noqa: ANN001, ANN205
        q, k, v, beta, g, u, starts, *rest = ctx.saved_tensors
        f = _Intra(*rest)
        # contiguous: out.sum().backward() sends an expanded (stride-0) gradient, on which CPU
        # batched matmuls take a per-matrix path (_ops.dense_gradient)
        dp, dqs, du, dk_end, dgates, ds0 = _back_outputs(d_o.contiguous(), d_s.contiguous(), f, u, starts)
        dq, dk, dv, dbeta, dg = _back_intra(q, k, v, beta, g, f, u, starts[:-1], dp, dqs, du, dk_end, dgates)
        return dq, dk, dv, dbeta, dg, ds0


def _back_outputs(d_o: Tensor, d_s: Tensor, f: _Intra, u: Tensor, starts: Tensor) -> tuple[Tensor, ...]:
    """From ``dL/dO`` and ``dL/dS_N`` through ``O = Q_s S_c + P U`` and the scan: the adjoints of
    ``P, Q_s, U_v, K_end``, the gates and ``S_0`` (W's, ``-dU_v S_c^T``, is left to ``_back_intra``)."""
    s_c = starts[:-1]  # [C, BH, D, D_v]
    dp, du = d_o @ u.transpose(-1, -2), f.p.transpose(-1, -2) @ d_o
    lams = d_s.new_empty(starts.shape)  # [C + 1, BH, D, D_v]
    lams[-1] = d_s
    torch.bmm(f.qs.transpose(-1, -2).flatten(0, 1), d_o.flatten(0, 1), out=lams[:-1].flatten(0, 1))
    dqs = d_o @ s_c.transpose(-1, -2)
    dgates = _scan_back(du, lams, f.w, f.k_end, f.gates, starts)  # du: dL/dU_v from here on
    dk_end = u @ lams[1:].transpose(-1, -2)
    return dp, dqs, du, dk_end, dgates, lams[0]


def _back_intra(q, k, v, beta, g, f: _Intra, u, s_c, dp, dqs, du, dk_end, dgates) -> tuple[Tensor, ...]:  # noqa: ANN001
    """Through ``[U_v, W] = T [diag(beta) V, diag(b) K]`` (``b = beta G``) and the scores. ``U_v``
    and ``W`` enter only as ``U = U_v - W S_c``, so ``dW = -dU_v S_c^T`` and, with ``Y = T^T dU_v``,
    ``T^T dW = -Y S_c^T``: ``dV = diag(beta) Y``, ``dK = -diag(b) Y S_c^T + ...``, and the
    inverse's adjoint ``dA = -T^T dT T^T = -(Y U_v^T - Y S_c^T W^T) = -Y U^T`` (as ``T diag(beta) V
    = U_v``, ``T diag(b) K = W``), read below the diagonal: one (L, D_v) product where autograd
    makes ``dW``, ``dT`` and ``T^T dT T^T``. Row dot products go through one scratch buffer and the
    (L, D) sums accumulate in place: on CPU each fresh (N, D) temporary costs its page faults."""
    t_t, scratch = f.t.transpose(-1, -2), {k.shape: torch.empty_like(k), v.shape: torch.empty_like(v)}

    def rowdot(a: Tensor, b: Tensor) -> Tensor:  # [C, BH, L]
        return torch.mul(a, b, out=scratch[a.shape]).sum(-1)

    y_v = t_t @ du
    y_w = (y_v @ s_c.transpose(-1, -2)).neg_()  # T^T dW
    da = (y_v @ u.transpose(-1, -2)).tril_(-1).neg_()
    d_start, da_kk = rowdot(y_w, k), da * f.kk  # start: beta G, the column scales of W's T
    dbeta = rowdot(y_v, v) + da_kk.sum(-1)
    if f.dec is None:
        dkk, dqk = da.mul_(beta[..., None]), dp.tril_()
        start = beta
    else:
        eg, to_end = _decays(g)
        m = da_kk.mul_(beta[..., None]).addcmul_(dp, f.p)  # dL/dDec * Dec (p, kk: decayed)
        dkk, dqk, start = da.mul_(beta[..., None]).mul_(f.dec), dp.mul_(f.dec), beta * eg
        r = rowdot(dk_end, k) * to_end  # k_end = k exp(g_L - g)
        dg = m.sum(-1) - m.sum(-2) + rowdot(dqs, q) * eg + d_start * start - r
        dg[..., -1] += r.sum(-1) + dgates * f.gates
        dbeta += d_start * eg
        dqs, dk_end = dqs.mul_(eg[..., None]), dk_end.mul_(to_end[..., None])  # fresh, ours
    dk = _addmm_((dkk + dkk.transpose(-1, -2)) @ k, dqk.transpose(-1, -2), q)  # K K^T and Q K^T
    dk.addcmul_(y_w, start[..., None]).add_(dk_end)
    dq = (dqk @ k).add_(dqs)
    if f.dec is None:
        return dq, dk, y_v.mul_(beta[..., None]), dbeta + d_start, None
    return dq, dk, y_v.mul_(beta[..., None]), dbeta, dg


def _chunkwise(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_alpha: Tensor | None, s0: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor]:
    """The fast path of both rules (``log_alpha=None``: no decay); see the module docstring and
    ``_ChunkRule``. Chunking, padding and the in-chunk cumulative decays stay with autograd."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    b, h, n, d = k.shape
    s0 = k.new_zeros(b * h, d, v.shape[-1]) if s0 is None else s0.to(k.dtype).flatten(0, 1)
    if n == 0:
        return v.new_zeros(v.shape), s0.view(b, h, d, -1)
    size = min(chunk, n)
    q, k, v, beta = (_chunked(x, size) for x in (q, k, v, beta))
    g = None if log_alpha is None else _chunked(log_alpha, size).cumsum(-1)
    o, s = _ChunkRule.apply(q, k, v, beta, g, s0)
    return rearrange(o, "c (b h) l e -> b h (c l) e", b=b)[:, :, :n], s.view(b, h, d, -1)
