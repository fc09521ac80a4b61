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

from torch import Tensor

from attnzoo.spec import ScoreMod


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
    return chained
