"""The small models the benchmark trains: an encoder classifier and a causal language model,
over any registered mechanism. The model's sequence length reaches the mechanism as the layers'
``max_len`` (part of the ``attnzoo.Shape`` they build it with), like ``heads`` and ``head_dim``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.nn.transformer import CausalLM, TransformerEncoder
from attnzoo.positional import build_positional
from attnzoo.registry import describe


class SequenceClassifier(nn.Module):
    """Token embedding, a ``TransformerEncoder`` over the chosen mechanism, mean pooling over real
    tokens, and a linear head (LRA's classifier). ``positional`` as ``CausalLM``: absolute
    encodings are added to the embeddings (token mixers need that), the others act in attention.

    ``causal=True``: the encoder runs causally (each token sees itself and earlier tokens) and the
    last real token, the only one that has seen the whole input, is classified (a decoder-style
    classifier). It is how a causally defined mechanism (``retnet``, ``deltanet``, ...) runs a
    classification task; it is a different model from the bidirectional one, not a drop-in."""

    def __init__(
        self,
        *,
        vocab_size: int,
        n_classes: int,
        dim: int,
        depth: int,
        heads: int,
        mechanism: str,
        positional: str | None = "sinusoidal",
        ff_mult: int = 2,
        dropout: float = 0.0,
        causal: bool = False,
        **mechanism_config: Any,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(vocab_size, dim)
        # Absolute encodings are added to the input; the others act inside every attention layer.
        pe = build_positional(positional, dim=dim, heads=heads, head_dim=dim // heads)
        self.positional = pe if pe is not None and pe.absolute else None
        self.encoder = TransformerEncoder(
            dim,
            depth,
            heads,
            mechanism,
            ff_mult=ff_mult,
            dropout=dropout,
            positional=None if self.positional is not None else positional,
            **mechanism_config,
        )
        self.head = nn.Linear(dim, n_classes)

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """``tokens (B, N)`` int64 and ``mask (B, N)`` bool (True = real) -> logits ``(B, n_classes)``."""
        x = self.embed(tokens)
        if self.positional is not None:
            x = self.positional.add_to_input(x, torch.arange(tokens.shape[1], device=x.device))
        x = self.encoder(x, causal=self.causal, key_mask=mask)
        if self.causal:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            last = torch.where(mask, positions, 0).amax(1)  # (B,): the last real token (0 when none)
            return self.head(x[torch.arange(x.shape[0], device=x.device), last])
        weights = mask.unsqueeze(-1).to(x.dtype)  # (B, N, 1)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(pooled)


class LanguageModel(nn.Module):
    """``CausalLM`` with the classifier's call signature: ``(tokens, mask) -> (B, N, vocab)``."""

    def __init__(
        self,
        *,
        vocab_size: int,
        dim: int,
        depth: int,
        heads: int,
        mechanism: str,
        positional: str | None = "sinusoidal",
        ff_mult: int = 2,
        dropout: float = 0.0,
        **mechanism_config: Any,
    ) -> None:
        super().__init__()
        self.lm = CausalLM(
            vocab_size,
            dim,
            depth,
            heads,
            mechanism,
            positional=positional,
            ff_mult=ff_mult,
            dropout=dropout,
            **mechanism_config,
        )

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        # Padding sits at the end and causal rows never see it, so the mask is only passed on
        # when a row is padded (it keeps mechanisms on their unmasked fast path otherwise).
        return self.lm(tokens, key_mask=None if bool(mask.all()) else mask)


def resolve_positional(positional: str | None, kind: str, mechanism: str) -> str | None:
    """``"auto"``: RoPE inside attention for language models (relative offsets make recall tasks
    like MQAR learnable in hundreds rather than thousands of steps); sinusoidal added to the input
    for classifiers and for token mixers, which have no attention to put positions in."""
    if positional != "auto":
        return positional
    if kind == "lm" and describe(mechanism).capabilities.kind == "attention":
        return "rope"
    return "sinusoidal"


def build_model(
    *,
    kind: str,
    vocab_size: int,
    n_classes: int,
    seq_len: int,
    dim: int,
    depth: int,
    heads: int,
    mechanism: str,
    config: dict[str, Any],
    positional: str | None,
    ff_mult: int,
    dropout: float,
    causal_encoder: bool = False,
) -> nn.Module:
    """The benchmark model for a task of ``kind`` ``"classify"`` or ``"lm"``; ``causal_encoder``:
    a classifier whose encoder runs causally (``SequenceClassifier(causal=True)``)."""
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
    capabilities = describe(mechanism).capabilities
    if kind == "lm" and causal_encoder:
        raise ValueError("causal_encoder applies to classification tasks; a language-model task is causal already")
    if (kind == "lm" or causal_encoder) and not capabilities.causal:
        what = "a causal language model" if kind == "lm" else "run with causal_encoder (--causal-encoder)"
        raise ValueError(
            f"{mechanism!r} cannot run causally, and this task is {what}; "
            f"mechanisms that can: see `attnzoo list` (supports: causal)"
        )
    if kind == "classify" and not causal_encoder and not capabilities.bidirectional:
        raise ValueError(
            f"{mechanism!r} is defined causally only and this classifier is bidirectional; run it with "
            f"causal_encoder=True (--causal-encoder): a causal encoder that classifies the last real token"
        )
    positional = resolve_positional(positional, kind, mechanism)
    common = dict(
        vocab_size=vocab_size,
        dim=dim,
        depth=depth,
        heads=heads,
        mechanism=mechanism,
        positional=positional,
        ff_mult=ff_mult,
        dropout=dropout,
        # The layers' max_len: it fills the mechanism's own (Synthesizer, Linformer, gMLP, MLP-Mixer)
        # unless the config sets one, which then is the layers' max_len too.
        **{"max_len": seq_len, **config},
    )
    if kind == "lm":
        return LanguageModel(**common)
    if kind == "classify":
        return SequenceClassifier(n_classes=n_classes, causal=causal_encoder, **common)
    raise ValueError(f"task kind must be 'classify' or 'lm', got {kind!r}")
