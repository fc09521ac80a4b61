"""Grouped-query K/V on the blocked backend's structured path: which plans take K/V with
``H_kv`` heads dividing ``H`` as they are (``grouped_windows``), and the layouts that let them.

The ``G = H / H_kv`` query heads that read one K/V head share every key window, sub-sequence
and global column of it, so they are stacked as *rows* of one kernel call against it: a window
block of ``block`` rows becomes ``G block`` rows (the band mask repeated per group member), a
dense sub-sequence of ``n`` rows ``G n``, a product with global keys one matmul over ``G M``
rows. The flash kernel then sees ``H_kv`` heads and ``G`` times the rows; K/V are never
repeated, and their gradients come out summed over the group. With ``G = 1`` every layout is
the one the path had before (views).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange
from torch import Tensor

from attnzoo.backends.structured import Merged, Structure, Windows, WithGlobals


def pad_rows(x: Tensor, front: int, back: int) -> Tensor:
    """``x`` with ``front`` and ``back`` zero rows around its rows (dim -2), contiguous; ``x``
    itself when there is nothing to add and it is contiguous. Only the new rows are zeroed
    (``F.pad`` fills all of its output first, one more pass over it)."""
    if front == back == 0:
        return x.contiguous()
    shape = (*x.shape[:-2], front + x.shape[-2] + back, x.shape[-1])
    out = x.new_empty(shape)
    out[..., :front, :].zero_()
    out[..., front + x.shape[-2] :, :].zero_()
    out[..., front : front + x.shape[-2], :] = x
    return out


def rows_to_blocks(x: Tensor, blocks: int, block: int, groups: int) -> Tensor:
    """Query-side rows ``(B', H, sub, E)`` -> the kernel's ``(B' H_kv, blocks, G block, E)``
    (padded with zeros). Grouped-query K/V (``G = H / H_kv`` query heads per K/V head): the G
    query heads of a group share each block's key window, so they are stacked as the block's
    rows (member ``i`` is rows ``i block .. (i + 1) block``) and K/V are never repeated."""
    if blocks * block != x.shape[2]:
        x = pad_rows(x, 0, blocks * block - x.shape[2])
    return rearrange(x, "b (h g) (t l) e -> (b h) t (g l) e", g=groups, l=block)


def fold_rows(x: Tensor, groups: int) -> Tensor:
    """A dense part's ``(B', H, n, E) -> (B', H_kv, G n, E)``: the G query heads of a K/V head
    as its rows (a view), against the whole sub-sequence of that K/V head."""
    return rearrange(x, "b (h g) n e -> b h (g n) e", g=groups)


def unfold_rows(x: Tensor, groups: int) -> Tensor:
    """The inverse of ``fold_rows``."""
    return rearrange(x, "b h (g n) e -> b (h g) n e", g=groups)


def blocks_to_rows(x: Tensor, heads: int, groups: int, sub: int) -> Tensor:
    """The inverse of ``rows_to_blocks``: ``(B' H_kv, blocks, G block, E) -> (B', H, sub, E)``."""
    return rearrange(x, "(b h) t (g l) e -> b (h g) (t l) e", h=heads // groups, g=groups)[:, :, :sub]


def grouped_windows(plan: Structure, groups: int) -> bool:
    """Whether ``structured_attention`` runs ``plan`` on grouped-query K/V (``groups`` query
    heads per K/V head) as they are: every part a band of windows (``local``, ``dilated``,
    ``block_local``), possibly with global tokens or key columns (``longformer``, ``sinks``,
    ...), dense sub-sequences and unions (``strided``, ``axial``) except a dense part run with
    ``is_causal`` (``_grouped_part``), and per-head parts whose heads are themselves grouped
    (``part_kv_heads``). Anything else gets K/V repeated first."""
    for heads, part in plan.parts:
        windows = part.parts if isinstance(part, Merged) else (part.windows if isinstance(part, WithGlobals) else part,)
        if not all(w is None or _grouped_part(w) for w in windows):
            return False
        if heads is not None and part_kv_heads(heads, groups) is None:
            return False
    return True


def _grouped_part(w: Windows) -> bool:
    """Windows take grouped rows; a dense part too, unless it runs the kernel's ``is_causal``
    (top-left aligned: it would not see G stacked copies of the rows as the same positions)."""
    return w.width > 0 or not (w.causal and w.allowed is None)


def part_kv_heads(heads: Tensor, groups: int) -> Tensor | None:
    """The K/V heads a per-head part with query ``heads`` (ascending) reads, when the part is
    itself grouped-query: its ``m`` heads in runs of ``m / |kv|`` per K/V head (so one K/V
    head's queries are consecutive); else None (the part needs K/V repeated)."""
    kv = torch.unique(heads // groups)
    if heads.numel() % kv.numel():
        return None
    per = heads.numel() // kv.numel()
    return kv if torch.equal(heads // groups, kv[:, None].expand(-1, per).flatten()) else None


def grouped_matmul(x: Tensor, y: Tensor) -> Tensor:
    """``x (B, H, M, A) @ y (B, H_kv, A, X) -> (B, H, M, X)``, query head ``h`` against head
    ``h // G`` of ``y`` (grouped-query): the G heads of a group as the rows of one product
    (views), ``y`` never repeated. A plain matmul when ``H_kv == H``."""
    out = rearrange(x, "b (h g) m a -> b h (g m) a", h=y.shape[1]) @ y
    return rearrange(out, "b h (g m) e -> b (h g) m e", g=x.shape[1] // y.shape[1])


def grouped_outer(x: Tensor, y: Tensor, kv_heads: int) -> Tensor:
    """``x (B, H, M, A)^T @ y (B, H, M, X)`` summed over the query heads of each group:
    ``(B, H_kv, A, X)``, the gradient of a K/V head that G query heads share."""
    x, y = (rearrange(t, "b (h g) m a -> b h (g m) a", h=kv_heads) for t in (x, y))
    return x.transpose(-1, -2) @ y


def grouped_matmul_add_(out: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """``out += grouped_matmul(x, y)`` in place: the product accumulates into ``out (B, H, M, X)``
    (one ``baddbmm_``, no ``(B, H, M, X)`` temporary; see ``_add_product``)."""
    kv = y.shape[1]
    rows = (out.shape[0] * kv, -1, out.shape[-1])  # [B H_kv, G M, X]: a group's rows
    return _add_product(out, rows, _group_rows(x, kv), y.flatten(0, 1), lambda: grouped_matmul(x, y))


def grouped_outer_add_(out: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """``out += grouped_outer(x, y, H_kv)`` in place (``out (B, H_kv, A, X)``; see ``_add_product``)."""
    kv = out.shape[1]
    a = _group_rows(x, kv).transpose(-1, -2)
    return _add_product(out, (-1, *out.shape[2:]), a, _group_rows(y, kv), lambda: grouped_outer(x, y, kv))


def _group_rows(x: Tensor, kv_heads: int) -> Tensor:
    """``(B, H, M, A) -> (B H_kv, G M, A)``: a K/V head's query heads as its rows."""
    return rearrange(x, "b (h g) m a -> (b h) (g m) a", h=kv_heads)


def _add_product(out: Tensor, shape: tuple[int, ...], a: Tensor, b: Tensor, product: Callable[[], Tensor]) -> Tensor:
    """``out += a @ b`` through the view ``out.view(shape)``, or ``out += product()`` (a temporary)
    where ``out``'s rows do not allow that view (a padded layout's slice)."""
    try:
        rows = out.view(shape)
    except RuntimeError:
        return out.add_(product())
    rows.baddbmm_(a, b)
    return out
