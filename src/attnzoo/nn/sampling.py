"""How ``CausalLM.generate`` picks the next token: greedy, or sampled with temperature, top-k
and top-p (nucleus) filtering from a seeded generator, so a sampled generation repeats exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Sample the next token from ``softmax(logits / temperature)``, keeping only the ``top_k``
    most likely tokens and then the smallest set whose probability reaches ``top_p`` (the most
    likely token always stays). ``seed``: a fixed seed makes the samples repeat; None draws from
    torch's global generator."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise TypeError(f"temperature must be a number, got {type(self.temperature).__name__}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature must be > 0 and finite (greedy decoding: sampling=None), got {self.temperature}"
            )
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")


class Picker:
    """``picker(logits (B, V)) -> tokens (B,)`` int64: arg-max for ``sampling=None``, else a
    draw under ``sampling`` from its own generator on ``device``."""

    def __init__(self, sampling: Sampling | None, device: torch.device) -> None:
        if sampling is not None and not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be attnzoo.nn.Sampling or None, got {type(sampling).__name__}")
        self.sampling = sampling
        self.generator = None
        if sampling is not None and sampling.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(sampling.seed)

    def __call__(self, logits: Tensor) -> Tensor:
        if self.sampling is None:
            return logits.argmax(-1)
        probs = filtered_probabilities(logits.float(), self.sampling)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def filtered_probabilities(logits: Tensor, sampling: Sampling) -> Tensor:
    """``(B, V)`` probabilities after temperature, top-k and top-p; filtered tokens get 0."""
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the more likely ones already reach top_p; the first never drops.
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.softmax(-1)
