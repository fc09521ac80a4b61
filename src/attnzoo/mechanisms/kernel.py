"""Kernel / linear attention: the shared core. The mechanisms built on it: ``kernel_linear.py``
(the base class ``KernelAttention``, ``linear``, ``efficient``), ``kernel_features.py`` (the
random-feature base and ``rfa``), ``kernel_performer.py`` (``performer``), ``based.py``
(``based``, the Taylor feature map).

Every member replaces ``exp(q . k)`` by a dot product of feature maps, ``phi(q) . phi(k)``, and
shares one core ("Transformers are RNNs", Katharopoulos et al. 2020,
https://arxiv.org/abs/2006.16236)::

    O_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps),  S_i = sum_j phi(k_j) v_j^T,  z_i = sum_j phi(k_j)

over the keys ``j`` query ``i`` sees. Re-associating ``(phi(Q) phi(K)^T) V = phi(Q) (phi(K)^T V)``
makes the cost linear in N. ``kernel_attention`` is the fast path (non-causal: in blocks of rows;
causal: chunkwise, optionally with a per-position decay of the running sums, which carries RFA's
gates and Performer's causal stabiliser); ``reference_kernel_attention`` is the quadratic form
that reads like the paper, on features computed beforehand. ``kernel_attention`` calls the
feature maps itself, block by block, from the mechanism it is given (``FeatureMaps``): a
mechanism is a ``KernelAttention`` with two small methods, ``query_features`` and
``key_features``, and a registration (``register_kernel``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attnzoo.backends.grouped import fold_rows, unfold_rows
from attnzoo.mechanisms._ops import feature_floor, floored_exp_, flush_tiny_
from attnzoo.mechanisms.base import AttendArgs
from attnzoo.mechanisms.kernel_chunks import decayed_chunks

#: ``"rows"``: ``num / (den + eps)`` (non-negative features); ``"signed"``: ``den`` kept at
#: ``|den| >= eps`` with its sign (RFA); ``"keys"``: each feature's key weights sum to 1
#: (Efficient Attention: ``S / z`` per feature, no row division).
Normalizer = Literal["rows", "signed", "keys"]

#: Non-causal blocks hold about this many (batch x head x position) rows, so feature tensors
#: stay a few MB (cache-sized, and reused by the allocator instead of page-faulted afresh).
BLOCK_ROWS = 8192
#: ... on the CPU; off it a block's feature tensor ``(B, H, rows, m)`` takes up to this many
#: bytes (one block at most lengths: 64 MiB for ``performer`` at N = 16K, H = 8): a GPU pays per
#: launch, and its caching allocator reuses memory anyway. With the CPU's 8K rows, ``performer`` at
#: N = 16K (16 key and 16 query blocks) issued ~1 900 launches a fwd+bwd step on an H100 and kept
#: the GPU busy 6.7 ms of a 48 ms step (``benchmarks/gpu``, fourth session); the cap keeps a
#: forward without autograd (which frees each block) bounded for wide maps (``based``).
DEVICE_BLOCK_BYTES = 256 * 2**20
#: On the CPU the causal path runs blocks of K/V heads whose key features ``(B, h, N, m)`` take
#: at most this many bytes (one head at least): such tensors come from glibc's heap and are reused
#: block after block, where whole-width ones (32 MiB for ``rfa`` at N = 4096, H = 8) are fresh
#: mappings, page-faulted on every call (``benchmarks/page-faults-rfa-cpu.txt``, ``ab-causal-heads-cpu.txt``,
#: ``ab-causal-heads-split-cpu.txt``) ...
CAUSAL_BLOCK_BYTES = 4 * 2**20
#: ... or, where that is more heads, at least this many (batch x head x position) rows: fewer,
#: longer steps of the scan over chunks and larger batched GEMMs. Blocks of 1, 2, 4 and 8 heads
#: side by side on a 2-core Xeon at 1K-4K were fastest at 2K-8K rows whatever the feature count
#: (``rfa`` at 8K every time; ``based``, 2145 features, at 2K-8K); against the bytes alone,
#: causal fwd+bwd at 4K ``rfa`` 165 -> 153 and 165 -> 157 ms in two runs, ``based`` 159 -> 156
#: and 164 -> 160, 1K and 2K within the noise (``benchmarks/ab-causal-block-rows-cpu.txt``).
CAUSAL_BLOCK_ROWS = 8192
#: The causal chunk length on the CPU; off it, the longer one from this many features on (see
#: ``causal_chunk``).
CPU_CHUNK, DEVICE_CHUNK, DEVICE_CHUNK_FEATURES = 64, 256, 128
#: Causal prefix sums (no decay) over up to this many chunks run as one matmul (see ``_prefix_sums``).
SCAN_MATMUL_CHUNKS = 128


class KeyFeatures(NamedTuple):
    """What a key feature map returns.

    Attributes:
        phi: ``(B, H, N, m)`` key features, possibly relative to an offset ``c``.
        log_decay: causal only, ``(B, H, N)`` or None: ``a_t`` in
            ``S_t = exp(a_t) S_{t-1} + phi(k_t) v_t^T`` (RFA's gate, Performer's stabiliser).
        c: non-causal: None, or the log-offset of this block (true features are
            ``phi * exp(c)``), ``(B, H, 1)`` for ``"rows"`` maps, ``(B, H, m)`` allowed for
            ``"keys"``; -inf where the block holds no real key. Causal: the decode-state value
            after the last key (Performer's running maximum), or None.
        weight: causal only, ``(B, H, N)`` or None: a factor on key ``t``'s whole contribution
            (RFA's ``1 - g_t`` in ``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T``). The true
            features are ``phi * weight``; the core applies it to the key's value row instead
            (E + 1 numbers, where phi has m).
        sparse: causal only: the states' entries may decay through the denormal range (some
            features flushed to 0, Performer's below ``_ops.feature_floor``, and decays that
            multiply to below that floor): the decayed core then sets their tiny entries to 0
            (``_ops.flush_tiny_``).
    """

    phi: Tensor
    log_decay: Tensor | None = None
    c: Tensor | None = None
    weight: Tensor | None = None
    sparse: bool = False


class PairWeights(NamedTuple):
    """The pairs inside a causal chunk from other inputs than the features: ``fn(q_c, k_c)`` on
    chunks of ``q (B, H, N, D)``, ``k (B, H, N, D)`` (see ``FeatureMaps``)."""

    fn: Callable[[Tensor, Tensor], Tensor]
    q: Tensor
    k: Tensor


class FeatureMaps(Protocol):
    """What the core needs from a mechanism (``KernelAttention`` is one): its two feature maps,
    how rows are normalised, the causal chunk length and the denominator's eps.

    A mechanism may also define ``pair_weights(q (..., L, D), k (..., L, D)) -> (..., L, L)`` on
    chunks of the inputs the core was given, equal to ``query_features(q) @ key_features(k).phi^T``
    for real keys but cheaper (Based's Taylor features: a polynomial of ``q . k``, a D-wide
    product where the features are ``1 + D + D (D + 1) / 2`` wide); the causal chunks use it for
    the pairs inside a chunk. Padded keys need no care there: their values and their count column
    are zero.

    ``num_features(D)`` is m for keys of size D; the causal path sizes its blocks of heads by it
    (``causal_block_heads``) and hands ``key_features`` the slice of the mechanism's heads that
    ``k`` holds (``heads``; None: all of them), for maps with a parameter per head (RFA's gate)."""

    normalizer: Normalizer
    chunk: int | None
    eps: float

    def query_features(self, q: Tensor) -> Tensor: ...

    def key_features(
        self, k: Tensor, real: Tensor | None, *, causal: bool, c0: Tensor | None = None, heads: slice | None = None
    ) -> KeyFeatures: ...

    def num_features(self, head_dim: int) -> int: ...


def causal_chunk(chunk: int | None, features: int, device: torch.device) -> int:
    """The causal chunk length L: ``chunk`` when given, else ``CPU_CHUNK`` (64) on the CPU, and off
    it ``DEVICE_CHUNK`` (256) for maps of at least ``DEVICE_CHUNK_FEATURES`` (128) features, 64
    for narrower ones. A chunk costs ``L^2`` pairs and carries an ``m x E`` state. The CPU is
    fastest at 64 for every member (`rfa` and `performer`, 2K and 4K, chunks of 32 to 256:
    ``benchmarks/speed-kernel-chunk-lengths-cpu.jsonl``). A GPU pays per kernel launch, so wide
    maps gain from longer chunks: on an H100 at 16K, causal `performer` (128 features) reached
    1.94x / 2.43x / 3.50x / 3.13x dense SDPA at 64 / 128 / 256 / 512 and `rfa` (256) 2.24x /
    3.06x / 2.73x at 64 / 256 / 512, while `linear` (64 features) was fastest at 64 (7.51x, 6.12x
    at 256). Each default lands on the fastest length measured for it (``benchmarks/gpu``)."""
    if chunk is not None:
        return chunk
    if device.type == "cpu" or features < DEVICE_CHUNK_FEATURES:
        return CPU_CHUNK
    return DEVICE_CHUNK


def normalise(num: Tensor, den: Tensor, normalizer: Normalizer, eps: float) -> Tensor:
    """``num (..., E) / guard(den (...))``. A row that sees no key has ``num = den = 0`` and comes
    out exactly 0 (``"signed"`` treats 0 as positive). ``"keys"`` rows are returned as is."""
    if normalizer == "keys":
        return num
    if normalizer == "signed":
        den = torch.where(den >= 0, den.clamp(min=eps), den.clamp(max=-eps))
    else:
        den = den + eps
    return num / den[..., None]


def kernel_attention(
    q: Tensor, k: Tensor, v: Tensor, maps: FeatureMaps, args: AttendArgs, state: KernelState | None = None
) -> tuple[Tensor, KernelState]:
    """The shared fast path of every kernel mechanism.

    Args:
        q, k, v: inputs. maps: ``query_features`` (``q -> phi(q)``), ``key_features`` (``(k,
            real, causal=, c0=) -> KeyFeatures`` with ``real`` bool ``(B, 1, N)`` or None),
            ``normalizer`` and ``eps`` (see ``normalise``), ``chunk``: the causal chunk length L
            (quadratic inside a chunk, sums carried across chunks; None: ``causal_chunk``).
        args: ``causal``: query ``i`` (end-aligned) sees keys ``j <= i + N_kv - N_q``.
            ``key_mask``: bool ``(B, N_kv)``, True = real. Padded keys have their
            features, values and decay zeroed, so they never enter ``S`` or ``z``.
        state: causal only: sums of earlier keys (decoding); default empty.

    Shapes:
        q ``(B, H, N_q, D)``, k ``(B, H_kv, N_kv, D)``, v ``(B, H_kv, N_kv, E)`` ->
        ``(out (B, H, N_q, E), state after the last key)``. ``H_kv`` divides ``H``
        (grouped-query attention): key features, ``S``, ``z`` and the state are per K/V head,
        and the ``H / H_kv`` query heads of a group read them as extra rows (never repeated).

    Notes:
        Non-causal: ``phi(Q) (phi(K)^T [V, 1])`` over blocks of rows (``BLOCK_ROWS`` on the CPU,
        ``DEVICE_BLOCK_BYTES`` of features off it); O(N m E) time, O(block m + m E) live memory. Causal:
        O(N (L + m) E) time, O(N (m + E + L) + (N / L) m E) memory, run on the CPU in blocks of
        K/V heads (``causal_block_heads``: a few MiB of features or 8K rows a block, the sizes
        that ran fastest) concatenated. Never N x N. ``z`` rides along
        ``S`` as an extra all-ones value column.
    """
    real = None if args.key_mask is None else args.key_mask[:, None]  # [B, 1, N_kv]
    if real is not None:  # 0 * (inf or NaN in a padded value) would leak
        v = torch.where(real[..., None], v, 0.0)
    if not args.causal:
        if state is not None:
            raise ValueError("a decode state needs causal=True")
        return _blocked(q, k, v, real, maps)
    per = causal_block_heads(k.shape[0], k.shape[2], maps.num_features(k.shape[3]), k.element_size())
    # The blocks answer glibc's page faults; off the CPU a caching allocator has none to avoid,
    # and each block would only repeat the chunk loop's kernel launches (launch-bound on an H100).
    if per >= k.shape[1] or k.device.type != "cpu":
        return _causal(q, k, v, real, maps, state, None)
    groups, parts = q.shape[1] // k.shape[1], []
    # split, not slices: its backward is one concatenation, where each slice's would zero-fill a
    # gradient of the whole input and add it (24 passes over (B, H, N, D) for 8 blocks)
    blocks = zip(q.split(per * groups, dim=1), k.split(per, dim=1), v.split(per, dim=1))  # a K/V head's query heads
    for i, (qb, kb, vb) in enumerate(blocks):
        kv = slice(i * per, i * per + kb.shape[1])
        parts.append(_causal(qb, kb, vb, real, maps, None if state is None else state.heads(kv), kv))
    return torch.cat([out for out, _ in parts], dim=1), KernelState.joined([s for _, s in parts])


def causal_block_heads(batch: int, n: int, features: int, itemsize: int) -> int:
    """K/V heads per block of the causal path on the CPU: as many as ``CAUSAL_BLOCK_BYTES`` of
    key features hold, or ``CAUSAL_BLOCK_ROWS`` rows if that is more; one at least."""
    by_bytes = CAUSAL_BLOCK_BYTES // max(1, batch * n * features * itemsize)
    return max(1, by_bytes, CAUSAL_BLOCK_ROWS // max(1, batch * n))


def _causal(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    real: Tensor | None,
    maps: FeatureMaps,
    state: KernelState | None,
    heads: slice | None,
) -> tuple[Tensor, KernelState]:
    """``kernel_attention``'s causal path on the K/V heads ``heads`` of the mechanism (None: all;
    q holds their query heads, k, v and ``state`` those heads)."""
    c0 = None if state is None else state.c
    f = maps.key_features(k, real, causal=True, c0=c0, heads=heads)
    phi_k, log_decay = f.phi, f.log_decay
    if real is not None:
        phi_k = torch.where(real[..., None], phi_k, 0.0)
        log_decay = None if log_decay is None else torch.where(real, log_decay, 0.0)
    s0 = None if state is None else torch.cat([state.s, state.z[..., None]], dim=-1)
    # the count column of z: 0 for a padded key, so it adds nothing whatever weight it gets
    count = torch.ones_like(v[..., :1]) if real is None else real[..., None].to(v.dtype).expand_as(v[..., :1])
    v1 = torch.cat([v, count], dim=-1)  # [B, H, N_kv, E + 1]
    if f.weight is not None:  # a per-key factor scales the key's value row, not its m features
        v1 = v1 * (f.weight if real is None else torch.where(real, f.weight, 0.0))[..., None]
    shift = k.shape[2] - q.shape[2]
    phi_q = maps.query_features(q)
    phi_q = F.pad(phi_q, (0, 0, shift, 0)) if shift else phi_q  # queries end-aligned: zero rows first
    if k.shape[2] == 1 and s0 is not None:
        out1, s1 = _one_token(phi_q, phi_k, v1, log_decay, s0)
    else:
        chunk = causal_chunk(maps.chunk, phi_k.shape[-1], phi_k.device)
        pairs = _pairs(maps, q, k, real, shift)
        out1, s1 = _causal_sums(phi_q, phi_k, v1, log_decay, s0, chunk, pairs, flush=f.sparse)
    out = normalise(out1[:, :, shift:, :-1], out1[:, :, shift:, -1], maps.normalizer, maps.eps)
    return out, KernelState(s1[..., :-1], s1[..., -1], f.c if f.c is not None else c0)


def _pairs(maps: FeatureMaps, q: Tensor, k: Tensor, real: Tensor | None, shift: int) -> PairWeights | None:
    """The mechanism's ``pair_weights`` on q (end-aligned like ``phi_q``) and k, or None."""
    fn = getattr(maps, "pair_weights", None)
    if fn is None:
        return None
    k = k if real is None else torch.where(real[..., None], k, 0.0)  # a NaN in padding must not leak
    return PairWeights(fn, F.pad(q, (0, 0, shift, 0)) if shift else q, k)


def _one_token(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None, s0: Tensor) -> tuple[Tensor, Tensor]:
    """``_causal_sums`` for one new token on a carried state (a decode step): the recurrence
    ``S = exp(a) S_0 + phi(k)^T [v, 1]`` and ``phi(q) S`` as two small products, without the
    chunk layout (its padding, cumulative sums and masks cost more than the step itself). The
    state is per K/V head; the ``G`` query heads of a group read it as ``G`` rows."""
    s0 = s0 if log_decay is None else s0 * log_decay.exp()[..., None]  # log_decay [B, H_kv, 1]
    s1 = s0 + k.transpose(-1, -2) @ v  # [B, H_kv, m, E + 1]
    groups = q.shape[1] // k.shape[1]
    out = fold_rows(q, groups) @ s1  # [B, H_kv, G T, E + 1]: a group's query heads as rows
    return unfold_rows(out, groups), s1


def _blocked(q: Tensor, k: Tensor, v: Tensor, real: Tensor | None, maps: FeatureMaps) -> tuple[Tensor, KernelState]:
    """Non-causal: ``S1 = sum over key blocks of phi(K_b)^T [V_b, 1]`` (offsets merged as in
    ``_merge``), then ``phi(Q_b) S1`` per query block. Grouped-query K/V (``H_kv`` heads):
    ``S1`` is per K/V head and the query heads of a group are its rows (``backends.grouped.fold_rows``)."""
    groups = q.shape[1] // k.shape[1]
    q = fold_rows(q, groups)  # [B, H_kv, G N_q, D]: feature maps are row-wise
    rows = block_positions(q, maps.num_features(k.shape[3]))
    s1 = c = None
    # split, not slices: its backward is one concatenation, where each slice's zero-fills a
    # gradient of the whole input and adds it
    parts = [None] * -(-k.shape[2] // rows) if real is None else real.split(rows, dim=-1)
    for part, kb, vb in zip(parts, k.split(rows, dim=2), v.split(rows, dim=2)):
        f = maps.key_features(kb, part, causal=False, c0=None)
        phi = f.phi if part is None else torch.where(part[..., None], f.phi, 0.0)
        s1, c = _merge(s1, c, phi.transpose(-1, -2) @ torch.cat([vb, torch.ones_like(vb[..., :1])], -1), f.c)
    if len(parts) > 1 and c is not None:  # sums rescaled by ratios down to eps^2 (``_merge``): see flush_tiny_
        s1 = flush_tiny_(s1)
    if maps.normalizer == "keys":  # each feature's weights over the keys sum to 1 (0 if it has none)
        z = s1[..., -1:]
        s1 = torch.cat([s1[..., :-1] / torch.where(z > 0, z, 1.0), z], dim=-1)
    outs = [maps.query_features(qb) @ s1 for qb in q.split(rows, dim=2)]
    out1 = unfold_rows(torch.cat(outs, dim=2), groups)  # [B, H, N_q, E + 1]
    state = KernelState(s1[..., :-1], s1[..., -1], c)
    return normalise(out1[..., :-1], out1[..., -1], maps.normalizer, maps.eps), state


def block_positions(q: Tensor, features: int) -> int:
    """Positions per non-causal block of ``q (B, H_kv, N, D)`` (query heads folded into rows):
    ``BLOCK_ROWS`` rows on the CPU, ``DEVICE_BLOCK_BYTES`` of ``m = features`` features off it."""
    rows = q.shape[0] * q.shape[1]
    if q.device.type == "cpu":
        return max(1, BLOCK_ROWS // rows)
    return max(1, DEVICE_BLOCK_BYTES // (rows * features * q.element_size()))


def _merge(s: Tensor | None, c: Tensor | None, s_b: Tensor, c_b: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Add block sums ``s_b`` at log-offset ``c_b`` to ``s`` at ``c``, rescaled to the larger
    offset (as online softmax does); -inf offsets mark empty sums. A ratio below ``eps^2`` is 0
    (``_ops.feature_floor``: the block's features are all below that share of the larger
    offset's), not a factor that would leave the sums denormal (Performer's large inputs)."""
    if s is None:
        return s_b, c_b
    if c_b is None:
        return s + s_b, None
    top = torch.maximum(c, c_b)
    top_safe = torch.where(torch.isfinite(top), top, 0.0)

    def ratio(x: Tensor) -> Tensor:
        gap = torch.where(torch.isfinite(x), x - top_safe, -math.inf)
        return floored_exp_(gap, feature_floor(gap.dtype))[..., None]

    return s * ratio(c) + s_b * ratio(c_b), top


def _causal_sums(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None,
    s0: Tensor | None,
    chunk: int,
    pairs: PairWeights | None = None,
    *,
    flush: bool = False,
) -> tuple[Tensor, Tensor]:
    """Chunkwise ``sum_{j <= i} decay(j, i) (q_i . k_j) v_j`` and the final ``sum_j k_j v_j^T``.
    ``pairs``: the products ``q_i . k_j`` inside a chunk computed another way (``PairWeights``;
    without a decay). With a decay the chunks run on ``kernel_chunks.decayed_chunks`` (``flush``:
    its states' tiny entries set to 0, see ``KeyFeatures.sparse``).

    Inside a chunk the pairs are a masked ``(L, L)`` product; the sums over earlier chunks come
    from the state at each chunk's start (a cumulative sum, or with a decay a scan over chunks).
    Decays enter only as differences of in-chunk cumulative log decays (all exponents <= 0).

    Grouped-query: ``q`` may have ``G`` times the heads of ``k, v`` (and of ``log_decay``,
    ``s0``): the ``G`` query heads of a group become ``G L`` rows of each chunk (the mask and
    decays repeated per group member by broadcasting), against one K/V chunk and one state.
    """
    b, h, n, m = k.shape
    groups, size = q.shape[1] // h, min(chunk, n)
    pad = -n % size

    def chunks(x: Tensor) -> Tensor:  # [B, H_kv, C, L, e]
        return rearrange(F.pad(x, (0, 0, 0, pad)) if pad else x, "b h (c l) e -> b h c l e", l=size)

    def query_chunks(x: Tensor) -> Tensor:  # [B, H_kv, C, G L, e]: a group's query heads as rows
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        return rearrange(x, "b (h g) (c l) e -> b h c (g l) e", h=h, l=size)

    q, k, v = query_chunks(q), chunks(k), chunks(v)
    if log_decay is not None:  # by hand, forward and backward (``kernel_chunks``); padding decays by 0
        if pairs is not None:
            raise ValueError("_causal_sums: pair weights with a decay are not implemented (no mechanism has both)")
        log_decay = rearrange(F.pad(log_decay, (0, pad)), "b h (c l) -> b h c l", l=size)
        s0 = k.new_zeros(b, h, m, v.shape[-1]) if s0 is None else s0
        out, final = decayed_chunks(q, k, v, log_decay, s0, flush=flush)
    else:
        tril = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
        # [B, H_kv, C, G L, L]
        scores = q @ k.transpose(-1, -2) if pairs is None else pairs.fn(query_chunks(pairs.q), chunks(pairs.k))
        starts, final = _prefix_sums(k.transpose(-1, -2) @ v, s0)  # sums [B, H_kv, C, m, E]
        out = scores.masked_fill(~tril.repeat(groups, 1), 0.0) @ v + q @ starts
    return rearrange(out, "b h c (g l) e -> b (h g) (c l) e", g=groups)[:, :, :n], final


def _prefix_sums(chunk_sums: Tensor, s0: Tensor | None) -> tuple[Tensor, Tensor]:
    """``_ops.gated_scan`` without gates: the states at each chunk start, ``S_c = S_0 + sum_{c' <
    c} U_c'`` ``(B, H, C, m, E)``, and after the last chunk ``(B, H, m, E)``. Up to ``SCAN_MATMUL_CHUNKS``
    chunks one matmul with a ``(C, C)`` 0/1 matrix (one pass, and one matmul backward, where a
    cumulative sum, its padding and its flipped backward cost several passes over the states)."""
    b, h, c, m, e = chunk_sums.shape
    if c > SCAN_MATMUL_CHUNKS:
        starts = F.pad(chunk_sums.cumsum(2)[:, :, :-1], (0, 0, 0, 0, 1, 0))
        final = starts[:, :, -1] + chunk_sums[:, :, -1]
    else:
        earlier = torch.ones(c, c, dtype=chunk_sums.dtype, device=chunk_sums.device).tril(-1)  # c' < c
        starts = (earlier @ chunk_sums.flatten(-2)).view(b, h, c, m, e)  # contiguous, as the next matmul wants
        final = starts[:, :, -1] + chunk_sums[:, :, -1]
    if s0 is None:
        return starts, final
    return starts + s0[:, :, None], final + s0


def reference_kernel_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_mask: Tensor | None,
    log_decay: Tensor | None = None,
    eps: float = 1e-6,
    normalizer: Normalizer = "rows",
    return_weights: bool = False,
) -> Any:
    """The quadratic form: ``A = phi(Q) phi(K)^T``, masked, row-normalised; ``O = A V``.

    Args:
        phi_q ``(B, H, N_q, m)``, phi_k ``(B, H, N_kv, m)``, v ``(B, H, N_kv, E)``: features and
            values. causal, key_mask, eps, normalizer: as ``kernel_attention``.
        log_decay: ``(B, H, N_kv)``: the weight of key ``j`` for the query at position ``p >= j``
            is multiplied by ``prod_{t=j+1..p} exp(a_t)`` (padded ``t`` count as 1), which is what
            the recurrence ``S_t = exp(a_t) S_{t-1} + phi(k_t) v_t^T`` unrolls to.
        return_weights: also return the normalised ``A (B, H, N_q, N_kv)``.

    Notes:
        Dense, O(N^2) memory: the oracle for ``kernel_attention``, and the weights for pictures.
        ``"keys"`` (non-causal only) divides each key feature by its sum over the visible keys.
    """
    n_q, n_kv = phi_q.shape[2], phi_k.shape[2]
    pos = torch.arange(n_q, device=phi_q.device)[:, None] + n_kv - n_q  # query i sits at key position pos
    visible = torch.ones(1, 1, n_q, n_kv, dtype=torch.bool, device=phi_q.device)
    if causal:
        visible = visible & (torch.arange(n_kv, device=phi_q.device) <= pos)
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
        phi_k = torch.where(key_mask[:, None, :, None], phi_k, 0.0)
        v = torch.where(key_mask[:, None, :, None], v, 0.0)
    if normalizer == "keys":
        z = phi_k.sum(2, keepdim=True)
        phi_k = phi_k / torch.where(z > 0, z, 1.0)
    a = phi_q @ phi_k.transpose(-1, -2)  # [B, H, N_q, N_kv]
    if log_decay is not None:
        if key_mask is not None:
            log_decay = torch.where(key_mask[:, None], log_decay, 0.0)
        cum = log_decay.cumsum(-1)
        gap = cum[..., pos] - cum[..., None, :]  # sum of a_t over j < t <= pos
        a = a * gap.masked_fill(~visible, -math.inf).exp()
    a = a.masked_fill(~visible, 0.0)
    weights = normalise(a, a.sum(-1), normalizer, eps)
    out = weights @ v
    return (out, weights) if return_weights else out


@dataclass(frozen=True)
class KernelState:
    """Sums of the keys so far: ``s (B, H_kv, m, D_v)``, ``z (B, H_kv, m)``, and ``c``
    (Performer's running key maximum ``(B, H_kv)``, -inf before the first key; None for the
    others); ``H_kv`` the K/V heads (``H`` unless grouped-query)."""

    s: Tensor
    z: Tensor
    c: Tensor | None = None

    def heads(self, index: slice) -> KernelState:
        """The sums of the K/V heads ``index`` (views)."""
        return KernelState(self.s[:, index], self.z[:, index], None if self.c is None else self.c[:, index])

    @staticmethod
    def joined(states: list[KernelState]) -> KernelState:
        """``heads``' inverse: states of consecutive blocks of heads, concatenated."""
        c = None if states[0].c is None else torch.cat([s.c for s in states], dim=1)  # type: ignore[misc]
        return KernelState(torch.cat([s.s for s in states], dim=1), torch.cat([s.z for s in states], dim=1), c)
