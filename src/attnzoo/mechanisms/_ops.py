"""Small rules every mechanism shares, written once so that they cannot drift apart.

Each is a line or two, but each is a *decision* — which dtype low precision is computed in, what
``scale=None`` means, how padding is neutralised, which row a query with no visible key gets — and
the mechanisms' fast paths and dense references must make the same decision for the contract
tests (``tests/test_contracts.py``) to hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo._compat import softmax_backward


def same_width(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` zero-padded to one head size (contiguous), as CPU SDPA's flash kernel needs
    (else it runs its N x N math path: 5x slower at N = 2048), as does every fused kernel that
    takes one last dimension for q, k and v. Zero channels change no score and no value, so
    slicing the output back to ``D_v`` gives the same attention (pass the scale)."""
    width = max(q.shape[-1], v.shape[-1])
    return tuple(F.pad(x, (0, width - x.shape[-1])).contiguous() for x in (q, k, v))  # type: ignore[return-value]


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a mechanism computes in for inputs like ``x``: float64 stays float64, everything
    else (float32, bfloat16, float16) is accumulated in float32 and cast back, as the reference
    backend does — so a half-precision fast path is compared against a float32-accurate
    reference, not against its own rounding."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def default_scale(scale: float | None, head_dim: int) -> float:
    """``scale``, or the Transformer's ``1 / sqrt(D)`` when it is None (every config's
    ``scale=None`` means this)."""
    return head_dim**-0.5 if scale is None else scale


def real_tokens(key_mask: Tensor | None, batch: int, n: int, device: torch.device) -> Tensor:
    """The ``(B, N)`` bool mask of real (not padded) positions: ``key_mask`` itself, or
    all True when there is none, so code downstream has one case, not two."""
    if key_mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    return key_mask


def zero_padding(x: Tensor, key_mask: Tensor | None) -> Tensor:
    """``x (B, H, N, D)`` with its padded positions (``key_mask`` False) set to zero.

    A select, not a multiply: whatever padding held (NaN, ±inf, 1e30) is gone, the padded
    positions get exactly zero gradient, and the real ones' values and gradients are bit for bit
    those of a zero-padded input. ``Attention.forward`` applies it to k and v (and to q of a
    self-attention-only mechanism) before ``_attend``, because a mechanism that gives a padded
    key weight 0 still computes ``0 * NaN = NaN``, and a NaN query row poisons the backward of
    every key it met even under a zero upstream gradient. O(B H N D), once per call.
    """
    if key_mask is None:
        return x
    return torch.where(rearrange(key_mask, "b n -> b 1 n 1"), x, 0.0)


def unit(x: Tensor, eps: float = 1e-12) -> Tensor:
    """``F.normalize(x, dim=-1, eps=eps)``, ``x / max(|x|, eps)`` over the last dimension, with
    its backward written out (``_Unit``)."""
    return _Unit.apply(x, eps)


class _Unit(torch.autograd.Function):
    """``y = x r``, ``r = 1 / max(|x|, eps)``; backward ``dx = r (g - y <g, y>)``, ``<g, y>``
    taken as 0 in rows whose norm was clamped (the divisor a constant there). Autograd ran
    ``F.normalize``'s backward as a division's, a norm's, a clamp's and an expand's: 7.4 against
    3.2 ms fwd+bwd on ``(1, 8, 4096, 64)`` here; end to end a few percent (causal ``rfa`` at 4K
    155 -> 152 ms, ``gated_deltanet`` at 2K 74.6 -> 71.7; ``benchmarks/ab-unit-cpu.txt``).
    Backward takes ``r`` again from ``x`` (one norm) rather than saving it, so that it is a
    function of the saved input and output, which a second-order gradient differentiates."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        y = x * torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(eps).reciprocal_()
        ctx.save_for_backward(x, y)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        x, y = ctx.saved_tensors
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        along = (grad * y).sum(-1, keepdim=True) * (norm >= ctx.eps)  # clamp_min passes it at the bound too
        return torch.addcmul(grad, y, along, value=-1) / norm.clamp_min(ctx.eps), None


def argmax_over(x: Tensor, dim: int) -> Tensor:
    """``x.argmax(dim)`` (the first index on ties; NaN counts as the largest) as ``x.max(dim).indices``:
    the same indices, 6-10x faster on CPU over a dimension that is not the last (routing's
    clusters of ``(B, H, C, N)`` similarities: 5.5 ms against 0.5 at C = 8, N = 4096)."""
    return x.max(dim).indices


def exp_floor(dtype: torch.dtype) -> float:
    """The lowest exponent whose ``exp`` is still a normal number in ``dtype``: -87 in float32,
    -708 in float64. torch's elementwise ``exp`` on CPU leaves its vector path for every value
    outside about [-87, 88] in float32: an underflowing one costs 21 ns here and -inf 1.1 ns,
    against 0.15 ns in range (``torch.softmax`` is not affected). Clamping exponents to this floor
    first keeps ``exp`` on its vector path; the results at the floor are then set to 0
    (``flushed_exp_``, ``floored_exp_``), so no denormal is made either (a denormal slows every
    product it enters)."""
    return float(math.ceil(math.log(torch.finfo(dtype).tiny)))


def decay_floor(dtype: torch.dtype) -> float:
    """The lowest log decay factor the chunkwise cores keep: ``4 ln(eps)`` of ``dtype`` (-63.7 in
    float32, -144 in float64); a factor below ``eps^4`` is 0. Every causal sum they make holds the
    row's own key at factor 1, so such a factor cannot move it; kept, it turns the products it
    enters into denormals, and a matrix product over denormals ran 75x slower here (231 against
    3.1 ms for ``(128, 256, 64) @ (128, 64, 65)``; ``torch.set_flush_denormal`` does not reach
    the BLAS threads): causal ``rfa`` fed q, k 10x larger than unit variance took 188 ms at 2K
    with the floor at float32's smallest normal, 70 with this one, its output unchanged."""
    return 4 * math.log(torch.finfo(dtype).eps)  # results within e^(1/2) of it are 0 too (flushed_exp_)


def feature_floor(dtype: torch.dtype) -> float:
    """The lowest exponent of a random feature ``exp(w^T x - stabiliser)`` that Performer keeps:
    ``2 ln(eps)`` of ``dtype`` (-31.8 in float32, -72.1 in float64), a feature below ``eps^2`` of
    its stabiliser's maximum being 0. With every feature at most ``1/sqrt(m)``, the features so
    dropped move a row's denominator ``phi(q)^T z`` by less than ``2 N eps^2`` (2.8e-14 N in
    float32) and its numerator by that times ``max |v|``: below the ``eps`` (1e-6) the
    denominator already adds, for N up to a few million. At float32's smallest normal instead
    (``exp_floor``), two small features multiply into the denormal range in the products that
    follow (``phi(q) S``, the gradients through them): ``performer`` fed q, k 10x larger than unit
    variance ran its fwd+bwd at 4K in 218 ms, against 72 with this floor (and ``flush_tiny_``) and
    68 at unit variance (``benchmarks/ab-feature-floor-cpu.txt``); its outputs are float64's to
    float32's rounding (``tests/test_kernel.py``)."""
    return 2 * math.log(torch.finfo(dtype).eps)


def floored_exp_(x: Tensor, floor: float | None = None) -> Tensor:
    """``x.exp_()`` with every value that would fall below ``exp(floor)`` (default ``exp_floor``,
    the dtype's smallest normal; where any does, up to ``e^(1/2)`` times that: ``flushed_exp_``)
    made exactly 0, as underflow and ``exp(-inf)`` give, in place (``x`` must be a
    temporary no other node needs); differentiable (twice), the gradient ``grad * exp(x)`` (0
    where flushed: the true one is below ``exp(floor + 1/2)`` times ``grad``). A ``floor`` below
    ``exp_floor`` counts as ``exp_floor``.

    On CPU one reduction decides: where no exponent is below the floor (the usual case) this is
    ``exp_``; where some are, they are clamped to it before ``exp`` and the results at the floor
    set to 0 after (``threshold_``), so ``exp`` stays on its vector path and no denormal reaches
    the products that follow. Not a floor alone: two features at the floor multiply to a denormal.
    Elsewhere (other devices, ``torch.compile``) it is ``exp_``: no host read, and denormals cost
    a GPU nothing; the results differ by less than ``exp(floor + 1/2)``.
    Performer's features of queries and keys 10x larger than unit variance made its fwd+bwd at
    4K several times slower without it, most of it in matrix products over denormals
    (``benchmarks/ab-floored-exp-cpu.txt``)."""
    return _FloorExp.apply(x, exp_floor(x.dtype) if floor is None else max(floor, exp_floor(x.dtype)))


class _FloorExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, floor: float) -> Tensor:  # type: ignore[override]
        eager_cpu = x.device.type == "cpu" and x.numel() and not torch.compiler.is_compiling()
        low = float(x.amin()) if eager_cpu else 0.0
        if low < exp_floor(x.dtype):  # clamped first: exp leaves its vector path below it
            flushed_exp_(x, floor)
        elif low < floor:  # the same results, one pass fewer
            F.threshold_(x.exp_(), math.exp(floor + 0.5), 0.0)
        else:
            x.exp_()
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return grad * out, None


def lower_decay_exp_(gap: Tensor) -> Tensor:
    """``exp(gap)`` on and below the diagonal of the last two dimensions and 0 above, in place:
    ``gap (..., L, L)`` holds differences ``c_i - c_j`` of cumulative log decays, <= 0 on and
    below the diagonal. The exponents are clamped to ``[decay_floor, 0]`` and the upper triangle
    zeroed after ``exp``, where ``masked_fill(-inf)`` before it sent half the entries down
    ``exp``'s slow path (see ``exp_floor``); a decay at the floor is 0 (see ``decay_floor``)."""
    return flushed_exp_(gap.clamp_(max=0.0), decay_floor(gap.dtype)).tril_()


def flushed_exp_(x: Tensor, floor: float) -> Tensor:
    """``x.exp_()`` outside autograd with the exponents clamped to ``floor`` (at least
    ``exp_floor`` of the dtype the result ends in) and every result up to ``exp(floor + 1/2)``
    set to 0: on ``exp``'s vector path, and no denormal made. (The margin keeps the clamped
    values below the threshold whatever the last bit of ``exp`` in the tensor's dtype.)"""
    return F.threshold_(x.clamp_(min=floor).exp_(), math.exp(floor + 0.5), 0.0)


def flush_tiny_(x: Tensor) -> Tensor:
    """Entries of ``x`` below ``tiny / eps^3`` of its dtype in magnitude (7e-18 in float32) set to 0,
    in place: sums of features times values (Performer's states, causal or merged over blocks)
    whose entries the later keys add nothing to are rescaled through the denormal range on their
    way to 0, and every product they then enter runs many times slower (causal ``performer`` fed
    q, k 5x larger than unit variance: 351 against 117 ms fwd+bwd at 4K, with ``feature_floor``;
    ``benchmarks/ab-feature-floor-cpu.txt``). Times a feature kept by
    ``feature_floor`` (0, or at least ``eps^2 / sqrt(m)``) such an entry would make a denormal;
    it moves an output by less than 1e-10 of ``max |v|`` even where the denominator is its own
    ``eps``, and otherwise by far less."""
    info = torch.finfo(x.dtype)
    return x.masked_fill_(x.abs() < info.tiny / info.eps**3, 0.0)


def flush_small_weights_(weights: Tensor) -> Tensor:
    """Softmax weights below ``eps^4`` (``decay_floor``) set to 0, in place: a bias's far pairs
    (ALiBi) leave denormal weights, and the products they enter then run many times slower
    (``P V`` 7.5x: ``score_chunks``). They cannot move a row whose weights sum to 1."""
    return F.threshold_(weights, math.exp(decay_floor(weights.dtype)), 0.0)


def masked_softmax(scores: Tensor, visible: Tensor) -> Tensor:
    """``normalize_scores(scores, visible, "softmax")`` for fast paths, in fewer passes over the
    score tile: softmax over each row's visible entries, rows with none all zeros and zero
    gradient, NaN kept, hidden entries' gradients zero. One masked copy forward and one masked
    softmax backward, where ``normalize_scores`` makes two masked copies and a product each way
    under autograd. Weights below ``eps^4`` are 0 (``flush_small_weights_``), and so is their
    gradient: peaky scores (large q, k) leave denormal weights, which made the products after them
    many times slower (fed q, k 10x larger than unit variance, fwd+bwd at 1K, ``hierarchical`` 66
    -> 24 ms, ``sac`` 48 -> 34: ``benchmarks/ab-softmax-flush-cpu.txt``)."""
    return _MaskedSoftmax.apply(scores, visible)


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scores: Tensor, visible: Tensor) -> Tensor:  # type: ignore[override]
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        weights.masked_fill_(~visible.any(-1, keepdim=True), 0.0)  # softmax over nothing: NaN, made 0
        flush_small_weights_(weights)  # NaN stays NaN
        ctx.save_for_backward(weights, visible)
        return weights

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        weights, visible = ctx.saved_tensors
        # Zero where hidden, as the reference's masked copy does: a row made NaN by one visible
        # NaN score has NaN weights everywhere, and its hidden keys must not take NaN gradients.
        return softmax_backward(grad, weights, -1, weights.dtype).masked_fill_(~visible, 0.0), None


def dropout_keep(seed: int, shape: tuple[int, int, int, int], p: float, device: torch.device) -> Tensor:
    """Bool ``(B, H, N_q, N_kv)``: which attention weights survive dropout with probability
    ``p``, a pure function of ``seed`` and each weight's flat index (``dropout_keep_at``), so any
    path that knows the seed - the fast path, the reference, a backward - draws the same mask
    without storing it."""
    return dropout_keep_at(seed, torch.arange(math.prod(shape), device=device, dtype=torch.int64).view(shape), p)


def dropped(x: Tensor, keep: Tensor, p: float) -> Tensor:
    """``x`` times the dropout factor ``keep / (1 - p)``: dropped entries 0, kept ones rescaled
    (Vaswani et al. 2017, 5.4). Every dropout path applies it: the dense weights, a tile's."""
    return torch.where(keep, x / (1 - p), 0.0)


def dense_dropout(weights: Tensor, seed: int, p: float) -> Tensor:
    """Dropout on dense ``(B, H, N_q, N_kv)`` weights with the seeded mask ``dropout_keep``."""
    return dropped(weights, dropout_keep(seed, tuple(weights.shape), p, weights.device), p)


def dropout_flat_index(b: Tensor, h: Tensor, i: Tensor, j: Tensor, heads: int, n_q: int, n_kv: int) -> Tensor:
    """The flat index of weight ``(b, h, i, j)`` in a ``(B, heads, n_q, n_kv)`` tensor,
    ``((b * heads + h) * n_q + i) * n_kv + j`` (int64, broadcast): what ``dropout_keep_at`` hashes,
    so a tiled path (``backends.blocked``) draws, on its own tiles, the dense mask's bits. ``i``
    counts queries from 0 (not the end-aligned position)."""
    return ((b.long() * heads + h.long()) * n_q + i.long()) * n_kv + j.long()


def dropout_keep_at(seed: int, flat: Tensor, p: float) -> Tensor:
    """Bool, shaped like the int64 ``flat``: whether the weights at these flat indices (see
    ``dropout_flat_index``) survive dropout with probability ``p``. A 64-bit mix of the index
    offset by the seed (splitmix64's finaliser, in int64 arithmetic that wraps) turned into a
    uniform ``u = top53 / 2^53`` in [0, 1); the weight is kept when ``u >= p``, compared exactly as
    ``top53 >= ceil(p * 2^53)`` (an integer against an exact double). In place on one fresh
    tensor: the blocked backend evaluates it on every tile, forward and backward."""
    offset = (seed * 0x9E3779B97F4A7C15) % 2**64  # seed times the golden-ratio odd constant, mod 2^64
    x = flat + (offset - 2**64 if offset >= 2**63 else offset)
    for shift, mult in ((30, -4658895280553007687), (27, -7723592293110705685)):
        x ^= (x >> shift) & ((1 << (64 - shift)) - 1)  # a logical shift on int64
        x *= mult  # wraps mod 2^64
    x ^= (x >> 31) & ((1 << 33) - 1)
    return ((x >> 11) & ((1 << 53) - 1)) >= math.ceil(p * 2.0**53)


class _DenseGradient(torch.autograd.Function):
    """The identity, whose backward hands on its gradient made contiguous."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def dense_gradient(x: Tensor) -> Tensor:
    """``x``, with the gradient that reaches the chunk matmuls' backward made contiguous:
    ``out.sum().backward()`` sends an expanded (stride-0) gradient, and CPU batched matmuls
    given one took a per-matrix path, 25x slower with 2 threads (8.4 s against 0.34 s for
    retention's forward and backward at N = 2048, H = 8, D = 64). The chunkwise recurrences
    (``decay_functions``, ``delta_chunks``) put it on their outputs."""
    return _DenseGradient.apply(x)


def mean_keys(per_row: Tensor) -> float:
    """``keys_per_query`` from the keys each row attends, ``(N,)``: their mean."""
    return float(per_row.double().mean()) if per_row.numel() else 0.0


def visible_counts(n: int, causal: bool) -> Tensor:
    """Keys each of ``n`` self-attention rows can see: ``i + 1`` causal, else ``n``, ``(N,)``."""
    return torch.arange(1, n + 1) if causal else torch.full((n,), n)


def block_union(index: Tensor, valid: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """A per-row key list as query blocks: rows ``index (N, S)`` of key positions (``valid`` marks
    the real entries) grouped ``block`` at a time -> ``cols (blocks, W)``, each block's sorted
    union of its rows' keys (padded with 0), and ``member (blocks, block, W)``, which of them
    each row lists (False in padding rows and columns). A block then attends its union with one
    small GEMM under ``member`` instead of gathering every row's own keys (used where nearby
    rows share most keys: ``hierarchical``, ``sac``)."""
    blocks = -(-index.shape[0] // block)
    pad = blocks * block - index.shape[0]
    index = torch.nn.functional.pad(index, (0, 0, 0, pad)).view(blocks, block, -1)
    valid = torch.nn.functional.pad(valid, (0, 0, 0, pad)).view(blocks, block, -1)
    unions = [index[t][valid[t]].unique() for t in range(blocks)]  # sorted
    cols = torch.zeros(blocks, max(len(u) for u in unions), dtype=torch.long)
    member = torch.zeros(*cols.shape[:1], block, cols.shape[1], dtype=torch.bool)
    for t, union in enumerate(unions):
        cols[t, : len(union)] = union
        rows, slots = valid[t].nonzero(as_tuple=True)
        member[t, rows, torch.searchsorted(union, index[t, rows, slots])] = True  # each key's column
    return cols, member


#: The most bytes a block-union path (``hierarchical``, ``sac``) gathers for one slab of (batch,
#: head) rows (``in_slabs``): past glibc's largest mmap threshold (32 MiB) a temporary is mapped
#: afresh and page-faulted on every call (at 4K each gathered K or V held 40-55 MB; at 8 MiB the
#: slabs cost `hierarchical` 18% at 1K, two slabs where one did).
SLAB_BYTES = 16 << 20


def in_slabs(
    run: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    row_bytes: int,
) -> Tensor:
    """``run(q, k, v, key_mask)`` on ``(B, H, N, e)`` inputs, in slabs of heads (and, where one
    head of every batch row is still too much, of batch rows) whose temporaries, ``row_bytes``
    per (batch, head) row, stay under ``SLAB_BYTES``; the outputs concatenated. For a ``run``
    whose rows are independent and whose mask is per batch row. The slabs are ``split``s, whose
    backward is one concatenation."""
    (b, h), rows = q.shape[:2], max(1, SLAB_BYTES // max(1, row_bytes))
    if rows >= b * h:
        return run(q, k, v, key_mask)
    heads, batch = min(h, rows), max(1, rows // h)
    masks = [None] * -(-b // batch) if key_mask is None else key_mask.split(batch)
    outs = []
    for mask, *parts in zip(masks, *(x.split(batch) for x in (q, k, v))):
        outs.append(torch.cat([run(*p, mask) for p in zip(*(x.split(heads, dim=1) for x in parts))], dim=1))
    return torch.cat(outs)


def gated_scan(chunk_sums: Tensor, gates: Tensor, s0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The chunkwise recurrence ``S_{c+1} = g_c * S_c + U_c`` from ``S_0 = s0`` (None: zeros): the
    states at each chunk's start ``(B, H, C, m, E)`` and the state after the last chunk ``(B, H, m, E)``.

    ``gates``: ``(B, H, C, 1, 1)`` (a scalar per chunk: RFA's gate, Performer's stabiliser) or
    ``(B, H, C, m, 1)`` (one per state row: GLA-style per-channel decays), multiplying the state.
    A loop of one fused multiply-add per chunk into one preallocated tensor, and a backward that
    is the reverse loop (``GatedScan``): O(C m E) time, no graph node per chunk. The unrolled
    form, a ``(C, C)`` matmul over the states, costs C times as much (a fifth of ``rfa``'s causal
    forward+backward at N = 4096, C = 64).
    """
    if s0 is None:
        s0 = chunk_sums.new_zeros(chunk_sums.shape[:2] + chunk_sums.shape[3:])
    return GatedScan.apply(chunk_sums, gates, s0)


class GatedScan(torch.autograd.Function):
    """``gated_scan``'s forward and backward: ``scan_states`` and ``scan_grads``."""

    @staticmethod
    def forward(ctx: Any, chunk_sums: Tensor, gates: Tensor, s0: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        states, final = scan_states(chunk_sums, gates, s0)
        ctx.save_for_backward(gates, states)
        return states, final

    @staticmethod
    def backward(ctx: Any, grad_states: Tensor, grad_final: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        return scan_grads(grad_states, grad_final, *ctx.saved_tensors)


def scan_states(chunk_sums: Tensor, gates: Tensor, s0: Tensor) -> tuple[Tensor, Tensor]:
    """``gated_scan``'s forward loop, outside autograd (hand-written backwards call it too)."""
    states = torch.empty_like(chunk_sums)
    states[:, :, 0] = s0
    # unbind once: the loop then indexes Python lists, not three tensors per chunk
    sums, gate, state = chunk_sums.unbind(2), gates.unbind(2), states.unbind(2)
    for c in range(len(sums) - 1):
        torch.addcmul(sums[c], gate[c], state[c], out=state[c + 1])
    return states, torch.addcmul(sums[-1], gate[-1], state[-1])


def scan_grads(grad_states: Tensor, grad_final: Tensor, gates: Tensor, states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``gated_scan``'s backward: the gradients of the chunk sums, the gates and ``s0``. With
    ``L_c`` the gradient reaching state ``c`` (``L_C`` that of the final state): ``L_c = G_c +
    g_c L_{c+1}``, ``dU_c = L_{c+1}``, ``dg_c = <L_{c+1}, S_c>`` summed over what ``g_c``
    broadcasts across (after the loop, at once)."""
    d_sums = torch.empty_like(states)  # dU_c = L_{c+1}
    d_sums[:, :, -1] = grad_final
    grads, gate, d = grad_states.unbind(2), gates.unbind(2), d_sums.unbind(2)
    for c in range(len(d) - 1, 0, -1):
        torch.addcmul(grads[c], gate[c], d[c], out=d[c - 1])
    d_s0 = torch.addcmul(grads[0], gate[0], d[0])
    return d_sums, gate_grads(d_sums, states, per_chunk=gates.shape[-2] == 1), d_s0


def gate_grads(d_sums: Tensor, states: Tensor, per_chunk: bool) -> Tensor:
    """``dg_c = <L_{c+1}, S_c>`` summed over what the gate broadcasts across: the whole ``(m, E)``
    state for one gate per chunk, ``(B, H, C, 1, 1)``; each row for one gate per state row."""
    if per_chunk:  # einsum, not a (1, mE) @ (mE, 1) bmm per chunk: that ran 8x slower on CPU
        return torch.einsum("...ij,...ij->...", d_sums, states)[..., None, None]
    return (d_sums * states).sum(-1, keepdim=True)
