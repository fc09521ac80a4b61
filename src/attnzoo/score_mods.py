"""Score modifiers that are not positions: functions with FlexAttention's ``score_mod``
signature, ``score_mod(score, b, h, q_idx, kv_idx) -> score``, usable with every mechanism whose
capabilities list ``score_mod`` (``attnzoo.names(score_mod=True)``).

>>> import torch, attnzoo
>>> from attnzoo.score_mods import chain, softcap
>>> alibi = attnzoo.positional.ALiBi(heads=4)
>>> q = k = v = torch.randn(1, 4, 16, 8)
>>> out = attnzoo.build("softmax")(q, k, v, score_mod=chain(alibi.score_mod(q, 16), softcap(50.0)))

Order matters for a cap: ``chain(position, softcap(cap))`` adds the position bias first and
caps the sum (Gemma 2's order for any additive bias: every score the softmax sees stays in
``(-cap, cap)``); ``chain(softcap(cap), position)`` caps the content score and adds the bias
uncapped on top.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnzoo.spec import ScoreMod

#: ``bias(b, h, q_idx, kv_idx) -> Tensor``: an additive score bias, broadcastable over the index
#: tensors it is given (``backends.reference.pair_indices``'s shapes).
Bias = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def bias_mod(bias: Bias, name: str | None = None) -> ScoreMod:
    """The ``score_mod`` adding ``bias`` to the scores, marked as a pure additive bias
    (``bias_of``): exact softmax paths that cannot take a general ``score_mod`` (the ``softmax``
    and ``softcap`` mechanisms' chunks) add such a bias to each chunk of scores themselves,
    where a general one sends them to the dense reference. A bias whose values need a gradient
    (learned) still takes the general path: the chunks pass no gradient to it.

    >>> from attnzoo.score_mods import bias_mod
    >>> distance = bias_mod(lambda b, h, q_idx, kv_idx: -0.1 * (q_idx - kv_idx).abs(), "distance")
    """

    def additive(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + bias(b, h, q_idx, kv_idx).to(score.dtype)

    additive.__name__ = name or getattr(bias, "__name__", "bias")
    additive.bias = bias  # type: ignore[attr-defined]
    return additive


def bias_of(score_mod: ScoreMod | None) -> Bias | None:
    """The additive bias a ``score_mod`` from ``bias_mod`` (or a ``chain`` of them) adds; None
    for any other (and for None)."""
    return getattr(score_mod, "bias", None)


def softcap_scores(scores: Tensor, cap: float) -> Tensor:
    """Gemma 2's logit soft-capping: ``cap * tanh(scores / cap)`` (Gemma Team 2024,
    https://arxiv.org/abs/2408.00118, Sec. 2). Smooth, odd, slope 1 at 0, bounded by ``cap``;
    as ``cap -> inf`` it is the identity."""
    return scores.div(cap).tanh().mul(cap)


def softcap(cap: float) -> ScoreMod:
    """The soft cap as a ``score_mod``: ``cap * tanh(score / cap)`` on the scaled scores.

    Args:
        cap: > 0 (Gemma 2 uses 50.0 for attention logits).
    """
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0:
        raise ValueError(f"softcap: cap must be a number > 0 (Gemma 2 uses 50.0), got {cap!r}")

    def soft_cap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return softcap_scores(score, cap)

    soft_cap.__name__ = f"softcap({cap})"
    return soft_cap


def chain(*mods: ScoreMod | None) -> ScoreMod | None:
    """The ``score_mod`` applying ``mods`` left to right (None entries skipped); None if none
    is left, so a mechanism can pass ``chain(user_mod, its_own)`` without a case for each."""
    present = [mod for mod in mods if mod is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def chained(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for mod in present:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    chained.__name__ = " then ".join(getattr(mod, "__name__", "score_mod") for mod in present)
    biases = [bias_of(mod) for mod in present]
    if all(bias is not None for bias in biases):  # a sum of biases is one bias

        def summed(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return sum(bias(b, h, q_idx, kv_idx) for bias in biases)  # type: ignore[misc, return-value]

        chained.bias = summed  # type: ignore[attr-defined]
    return chained


def plain_bias(score_mod: ScoreMod | None, device: torch.device) -> Bias | None:
    """The bias of a ``score_mod`` that only adds one (``score_mods.bias_of``) and whose values
    need no gradient here (a learned bias does while autograd records: the chunks would drop it);
    None otherwise, and for None."""
    bias = bias_of(score_mod)
    if bias is None:
        return None
    probe = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    return None if torch.is_grad_enabled() and bias(probe, probe, probe, probe).requires_grad else bias
