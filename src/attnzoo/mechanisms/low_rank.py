"""Low rank and compression (MECHANISMS.md §D): each attends to a few *representative keys*
instead of all N (the seed notes' "pick K of N keys"). ``linformer`` (``linformer.py``): k learned
mixtures of all keys; ``compressed`` (``compressed.py``): ceil(N / stride) strided local mixtures;
``nystrom`` (``nystrom.py``): m segment means, the N x N softmax rebuilt from three small ones
through a pseudo-inverse. (LAMA pooling, which pools N tokens to one vector per head, is a layer:
``attnzoo.nn.LAMAPooling``.)

This module holds their base class. Every member's output is linear in v, so its dense reference
is one function that builds the ``(B, H, N_q, N_kv)`` weights its paper's approximation applies
(``linformer_weights``, ``compressed_weights``, ``nystrom_weights``, each reading like its paper);
``reference`` and ``implied_attention`` come from it here, once. The fast paths never build an
N x N tensor.
"""

from __future__ import annotations

from torch import Tensor

from attnzoo.mechanisms.base import AttendArgs, Attention, Weighted


class LowRankAttention(Attention):
    """Base of the family: a member implements ``_attend`` (the fast path) and ``_weights`` (the
    dense weights its output is, applied to v)."""

    def _weights(self, q: Tensor, k: Tensor, args: AttendArgs) -> Tensor:
        """The ``(B, H, N_q, N_kv)`` weights, in the compute dtype (``compute_dtype(q)``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _weights")

    def _reference(self, q: Tensor, k: Tensor, v: Tensor, args: AttendArgs, return_weights: bool) -> Weighted:
        weights = self._weights(q, k, args)
        out = (weights @ v.to(weights.dtype)).to(q.dtype)
        return (out, weights) if return_weights else out

    def _check_heads(self, q: Tensor, used: bool) -> None:
        """For a config with per-head parameters (``used``): q must have the heads it was built for."""
        if used and q.shape[1] != self.config.heads:
            raise ValueError(
                f"{self.spec.name} was built for heads={self.config.heads} but q has "
                f"H={q.shape[1]}; build it with heads={q.shape[1]}"
            )
