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
diagonal blocks by recursive doubling in batched matmuls, with the inverse's own backward). Then, carrying ``S`` from
chunk to chunk (the only sequential part, N / C small steps, two matmuls each way)::

    O = diag(G) Q S_0 + (Q K^T * Dec * M) U,    S_C = G_C S_0 + (K * G_C / G)^T U

The scan is one autograd function whose backward is a single reverse scan over the states'
adjoints, every other gradient one batched matmul after it. Decays enter only as differences of
in-chunk cumulative logs, masked to ``j <= t`` before the exponential, so every exponent is <= 0.
The largest tensors are ``(B, H, N, C)`` inside the chunks and the states at the chunk starts,
``(B, H, N / C, D, D_v)``; nothing is N x N. C = 32 by default: the work inside chunks grows
with C and the steps of the scan with N / C; on CPU at D = 64 the sum is least near 32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.mechanisms._ops import dense_gradient

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


class _Solved(NamedTuple):
    """The per-chunk quantities, batched over ``(B H)`` and ``C`` chunks of ``L`` tokens:
    ``u_v, w`` (``U = U_v - W S_0``), ``k`` (padded keys), ``k_end`` (keys decayed to their chunk's
    end), ``g`` (in-chunk cumulative log decays ``(BH, C, L)``), ``dec`` (``exp(g_t - g_j)``, 0 for
    ``j > t``) and ``gates`` (each chunk's whole decay ``(BH, C)``); the last four None without decay."""

    u_v: Tensor
    w: Tensor
    k: Tensor
    k_end: Tensor
    g: Tensor | None
    dec: Tensor | None
    gates: Tensor | None


def _chunked(x: Tensor, size: int) -> Tensor:
    """``(B, H, N[, E]) -> (BH, C, L[, E])``, a view where N is whole chunks, else zero-padded
    (padded tokens have k = 0 and beta = 0: no write; log_alpha = 0: no decay; so S_N is unchanged)."""
    pad = -x.shape[2] % size
    if x.dim() == 3:
        return rearrange(F.pad(x, (0, pad)) if pad else x, "b h (c l) -> (b h) c l", l=size)
    return rearrange(F.pad(x, (0, 0, 0, pad)) if pad else x, "b h (c l) e -> (b h) c l e", l=size)


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
    of the fast path; tiny blocks stay out of matmuls, which also run matrix by matrix."""
    n = a.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()  # the next power of two: zero rows and columns invert to I
    a = F.pad(a, (0, p - n, 0, p - n)) if p != n else a
    size = min(_ROWS, p)
    t = torch.eye(size, dtype=a.dtype, device=a.device).repeat(*a.shape[:-2], p // size, 1, 1)
    blocks = _diagonal_blocks(a, size).contiguous()  # [..., P / 8, 8, 8]; above the diagonal unread
    for i in range(1, size):
        t[..., i, :i] = -(blocks[..., i, :i, None] * t[..., :i, :i]).sum(-2)
    while size < p:  # t: the contiguous diagonal blocks (..., P / s, s, s) of the inverse
        t11, t22 = t[..., 0::2, :, :], t[..., 1::2, :, :]
        t21 = -(t22 @ _diagonal_blocks(a, 2 * size)[..., size:, :size] @ t11)
        t = torch.cat([torch.cat([t11, torch.zeros_like(t11)], -1), torch.cat([t21, t22], -1)], -2)
        size *= 2
    return t[..., 0, :n, :n]


class _UnitLowerInverse(torch.autograd.Function):
    """``T = (I + tril(a, -1))^-1`` with the backward of an inverse, ``da = -tril(T^T dT T^T, -1)``:
    two batched matmuls, where autograd through the doubling would replay each level."""

    @staticmethod
    def forward(ctx, a: Tensor) -> Tensor:  # noqa: ANN001
        t = _unit_lower_inverse(a)
        ctx.save_for_backward(t)
        return t

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ANN001
        (t,) = ctx.saved_tensors
        t_t = t.transpose(-1, -2)
        return (t_t @ grad @ t_t).tril_(-1).neg_()


class _Scan(torch.autograd.Function):
    """The sequential stage, one chunk after another (module docstring)::

        U_c = U_v,c - W_c S_c,    S_{c+1} = gate_c S_c + K_end,c^T U_c

    ``u_v (BH, C, L, D_v)``, ``w, k_end (BH, C, L, D)``, ``gates (BH, C)`` or None, ``s0 (BH, D, D_v)``
    -> ``U (BH, C, L, D_v)``, the chunk starts ``(BH, C, D, D_v)`` and ``S_N (BH, D, D_v)``.
    The backward is one reverse scan over the adjoints ``l_c`` of the states (two matmuls per chunk,
    as the forward); every other gradient is then one batched matmul over all chunks, where autograd
    would keep graph nodes per chunk and compute them inside the loop. Each step computes into a
    fresh block, and the blocks are stacked once at the end: a batched matmul writing into a strided
    slot would run matrix by matrix, and a copy per chunk costs a dispatch per chunk."""

    @staticmethod
    def forward(ctx, u_v: Tensor, w: Tensor, k_end: Tensor, gates: Tensor | None, s: Tensor):  # noqa: ANN001, ANN205
        k_end_t = k_end.transpose(-1, -2)
        us, starts = [], []
        for c in range(u_v.shape[1]):
            starts.append(s)
            us.append(torch.baddbmm(u_v[:, c], w[:, c], s, alpha=-1))
            s = torch.baddbmm(s if gates is None else s * gates[:, c, None, None], k_end_t[:, c], us[-1])
        u, starts = torch.stack(us, 1), torch.stack(starts, 1)  # one copy each, not one per chunk
        ctx.save_for_backward(w, k_end, gates, starts, u)
        return u, starts, s

    @staticmethod
    def backward(ctx, d_u: Tensor, d_starts: Tensor, lam: Tensor):  # noqa: ANN001, ANN205
        w, k_end, gates, starts, u = ctx.saved_tensors
        w_t = w.transpose(-1, -2)
        d_us, lams = [], []  # dL/dU_c (through the outputs and the next states); l_{c+1} = dL/dS_{c+1}
        for c in range(d_u.shape[1] - 1, -1, -1):
            lams.append(lam)
            d_us.append(torch.baddbmm(d_u[:, c], k_end[:, c], lam))
            kept = lam if gates is None else lam * gates[:, c, None, None]
            lam = torch.baddbmm(kept + d_starts[:, c], w_t[:, c], d_us[-1], alpha=-1)
        d_u_all, lams = torch.stack(d_us[::-1], 1), torch.stack(lams[::-1], 1)  # [BH, C, L, D_v], [BH, C, D, D_v]
        d_w = (d_u_all @ starts.transpose(-1, -2)).neg_()
        d_gates = None if gates is None else torch.einsum("bcde,bcde->bc", lams, starts)
        return d_u_all, d_w, u @ lams.transpose(-1, -2), d_gates, lam


def _solved(k: Tensor, v: Tensor, beta: Tensor, log_alpha: Tensor | None, chunk: int) -> _Solved:
    """Stage one, all chunks at once: ``[U_v, W] = T [diag(beta) V, diag(beta G) K]`` with ``T`` the
    unit lower-triangular inverse (module docstring)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    size = min(chunk, max(k.shape[2], 1))
    k, v, beta = (_chunked(x, size) for x in (k, v, beta))
    # diag(beta) scales rows of the Gram matrix and columns of T: (L, L) products, not (L, D) ones.
    gram = (k @ k.transpose(-1, -2)) * beta[..., None]  # [BH, C, L, L]: beta_t k_t . k_j
    g = dec = gates = None
    k_end, start = k, beta  # start: diag(beta G), how the chunk's start state enters u
    if log_alpha is not None:
        g = _chunked(log_alpha, size).cumsum(-1)
        upto = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
        dec = (g[..., :, None] - g[..., None, :]).masked_fill(~upto, -math.inf).exp()
        gram = gram * dec
        start = beta * g.exp()
        k_end = k * (g[..., -1:] - g).exp()[..., None]  # decay from token j to the chunk end
        gates = g[..., -1].exp()
    # The inverse reads gram strictly below the diagonal (I + tril(gram, -1)).
    t = _UnitLowerInverse.apply(gram)
    u_v, w = (t * beta[..., None, :]) @ v, (t * start[..., None, :]) @ k
    return _Solved(u_v, w, k, k_end, g, dec, gates)


def _chunkwise(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_alpha: Tensor | None, s0: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor]:
    """The fast path of both rules (``log_alpha=None``: no decay); see the module docstring.

    Three stages: the triangular inverses (``_solved``), the states at the chunk starts and the
    ``U`` given them (``_Scan``), then, all chunks at once, ``O = diag(G) Q S_c + (Q K^T * Dec * M) U``."""
    b, h, n, d = k.shape
    ch = _solved(k, v, beta, log_alpha, chunk)
    s0 = k.new_zeros(b * h, d, v.shape[-1]) if s0 is None else s0.to(k.dtype).flatten(0, 1)
    u, starts, s = _Scan.apply(ch.u_v, ch.w, ch.k_end, ch.gates, s0)
    s = s.view(b, h, d, -1)
    if n == 0:
        return v.new_zeros(v.shape), s
    q = _chunked(q, ch.k.shape[2])
    scores = q @ ch.k.transpose(-1, -2)  # [BH, C, L, L]
    if ch.dec is None:
        scores = scores.tril()
    else:
        scores, q = scores * ch.dec, q * ch.g.exp()[..., None]  # dec is 0 above the diagonal
    out = torch.baddbmm((scores @ u).flatten(0, 1), q.flatten(0, 1), starts.flatten(0, 1))  # [BH C, L, D_v]
    return rearrange(dense_gradient(out), "(b h c) l e -> b h (c l) e", b=b, h=h)[:, :, :n], s
