"""Pre-norm Transformer blocks over any registered mechanism, and a causal language model with
a decode-step path whose step-by-step outputs equal its full causal forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._checks import check_key_mask, check_module_input, check_positive_int, renamed_key_mask
from attnzoo.mechanisms.base import Attention, TokenMixer
from attnzoo.nn.attention import MHAState, MultiHeadAttention
from attnzoo.nn.sampling import Picker, Sampling
from attnzoo.positional import PositionalEncoding, build_positional
from attnzoo.registry import build, describe
from attnzoo.spec import Shape


class TransformerEncoderLayer(nn.Module):
    """Pre-norm block: ``x + MHA(LN(x))``, then ``x + FFN(LN(x))`` (Xiong et al. 2020).

    With a token mixer (a mechanism whose ``attnzoo.describe(name).capabilities.kind`` is
    ``"mixer"``, e.g. ``"fnet"``, ``"gmlp"``, ``"mixer"``) the first half is
    ``x + mixer(LN(x))`` instead: the mixer is built with ``dim=dim`` added to its config,
    ``heads`` is unused, and ``self.mixer`` holds it (``self.attn`` is None).

    Args:
        dim, heads, mechanism, positional, max_len, **mechanism_config: as ``MultiHeadAttention``;
            ``mechanism`` may also be a token mixer's name or a built ``TokenMixer`` (built with
            ``dim`` and ``attnzoo.Shape(max_len=max_len)``: gMLP and MLP-Mixer size their
            per-position weights by it unless their config sets ``max_len``).
        ff_mult: feed-forward hidden width is ``ff_mult * dim``. Default 4.
        dropout: on the attention (or mixer) output and in the feed-forward block. Default 0.
        feedforward: False drops the second half (``norm2`` and ``ff``): the block is
            ``x + mixer(LN(x))`` alone, which is the gMLP block of Liu et al. 2021 (``"gmlp"``
            has its channel projections inside). Default True.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        mechanism: str | Attention | TokenMixer = "softmax",
        *,
        ff_mult: int = 4,
        dropout: float = 0.0,
        positional: str | PositionalEncoding | None = None,
        feedforward: bool = True,
        max_len: int | None = None,
        **mechanism_config: Any,
    ) -> None:
        super().__init__()
        check_positive_int(ff_mult, "ff_mult")
        if not isinstance(feedforward, bool):
            raise TypeError(f"feedforward must be a bool, got {feedforward!r}")
        self.norm1 = nn.LayerNorm(dim)
        self.mixer = _resolve_mixer(dim, mechanism, positional, mechanism_config, Shape(max_len=max_len))
        if self.mixer is None:
            self.attn = MultiHeadAttention(
                dim, heads, mechanism, positional=positional, dropout=dropout, max_len=max_len, **mechanism_config
            )
        else:
            self.attn = None
            self.mixer_dropout = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim) if feedforward else None
        self.ff = (
            nn.Sequential(
                nn.Linear(dim, ff_mult * dim),
                nn.GELU(),
                nn.Dropout(dropout),
                nn.Linear(ff_mult * dim, dim),
                nn.Dropout(dropout),
            )
            if feedforward
            else None
        )

    @renamed_key_mask
    def forward(self, x: Tensor, *, causal: bool = False, key_mask: Tensor | None = None) -> Tensor:
        if isinstance(x, Tensor):
            check_module_input(self, x, "x")
        if self.mixer is not None:
            x = x + self.mixer_dropout(self.mixer(self.norm1(x), causal=causal, key_mask=key_mask))
        else:
            x = x + self.attn(self.norm1(x), causal=causal, key_mask=key_mask)
        return self._feedforward(x)

    def _feedforward(self, x: Tensor) -> Tensor:
        return x if self.ff is None else x + self.ff(self.norm2(x))

    def init_state(self, batch: int, *, device: Any = None, dtype: Any = None, capacity: int = 0) -> MHAState:
        self._no_decode()
        return self.attn.init_state(batch, device=device, dtype=dtype, capacity=capacity)

    @renamed_key_mask
    def step(self, x: Tensor, state: MHAState, *, key_mask: Tensor | None = None) -> tuple[Tensor, MHAState]:
        """The next ``T`` tokens ``x (B, T, dim)``: the rows of ``forward(..., causal=True)``."""
        self._no_decode()
        if isinstance(x, Tensor):
            check_module_input(self, x, "x")
        h, state = self.attn.step(self.norm1(x), state, key_mask=key_mask)
        return self._feedforward(x + h), state

    def _no_decode(self) -> None:
        if self.mixer is not None:
            raise ValueError(
                f"token mixer {self.mixer.spec.name!r} has no decode step (init_state / step are for "
                f"attention mechanisms); run the whole sequence through forward(x, causal=True) instead"
            )


def _resolve_mixer(
    dim: int, mechanism: object, positional: object, config: dict[str, Any], shape: Shape
) -> TokenMixer | None:
    """The token mixer ``mechanism`` names (built with ``dim`` and the layer's ``shape``), or
    None for attention."""
    if isinstance(mechanism, TokenMixer):
        if config:
            raise ValueError(
                f"mechanism is already built; pass its config to attnzoo.build instead of {sorted(config)}"
            )
        built_dim = getattr(mechanism.config, "dim", dim)
        if built_dim != dim:
            raise ValueError(
                f"token mixer {mechanism.spec.name!r} was built with dim={built_dim}, but the layer has dim={dim}"
            )
        mixer = mechanism
    elif isinstance(mechanism, str) and describe(mechanism).capabilities.kind == "mixer":
        if "dim" in config and config["dim"] != dim:
            raise ValueError(
                f"token mixer {mechanism!r} takes its dim from the layer (dim={dim}); got a different "
                f"dim={config['dim']!r} in its config; drop it or make them equal"
            )
        mixer = build(mechanism, shape=shape, **{**config, "dim": dim})
        if not isinstance(mixer, TokenMixer):
            raise TypeError(f"{mechanism!r} is registered as a mixer but is not a TokenMixer")
    else:
        return None
    if positional is not None:
        raise ValueError(
            f"positional encodings act inside attention, and token mixer {mixer.spec.name!r} has none; "
            f"use positional=None (gmlp and mixer learn positions; add an absolute encoding to the input yourself)"
        )
    return mixer


class TransformerEncoder(nn.Module):
    """``depth`` pre-norm layers and a final LayerNorm. Arguments as ``TransformerEncoderLayer``;
    a positional name builds one encoding per layer, an instance is shared by all layers."""

    def __init__(
        self,
        dim: int,
        depth: int,
        heads: int,
        mechanism: str | Attention | TokenMixer = "softmax",
        *,
        ff_mult: int = 4,
        dropout: float = 0.0,
        positional: str | PositionalEncoding | None = None,
        feedforward: bool = True,
        **mechanism_config: Any,
    ) -> None:
        super().__init__()
        check_positive_int(depth, "depth")
        if isinstance(mechanism, (Attention, TokenMixer)) and depth > 1:
            raise ValueError("pass mechanism by name for depth > 1, so each layer builds its own module")
        self.layers = nn.ModuleList(
            TransformerEncoderLayer(
                dim,
                heads,
                mechanism,
                ff_mult=ff_mult,
                dropout=dropout,
                positional=positional,
                feedforward=feedforward,
                **mechanism_config,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    @renamed_key_mask
    def forward(self, x: Tensor, *, causal: bool = False, key_mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, causal=causal, key_mask=key_mask)
        return self.norm(x)


@dataclass(frozen=True)
class LMState:
    """Decode state of ``CausalLM``: one state per layer and the next position."""

    layers: tuple[MHAState, ...]
    position: int


class CausalLM(nn.Module):
    """A decoder-only language model: embedding, causal ``TransformerEncoder`` layers, LM head.

    ``forward(tokens)`` runs the whole sequence causally; ``init_state`` + ``step`` decode token
    by token (a KV cache for ``softmax``, the recurrent state for mechanisms that have one), and
    the logits of each step equal the matching row of ``forward``.

    Args:
        vocab_size, dim, depth, heads, mechanism, ff_mult, dropout, feedforward,
            **mechanism_config: as ``TransformerEncoder``; the mechanism must support ``causal`` (and ``decode_step``
            for ``step``).
        positional: default ``"rope"``. Absolute encodings are added to the token embeddings;
            the others act inside every attention layer.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        heads: int,
        mechanism: str = "softmax",
        *,
        positional: str | PositionalEncoding | None = "rope",
        ff_mult: int = 4,
        dropout: float = 0.0,
        feedforward: bool = True,
        **mechanism_config: Any,
    ) -> None:
        super().__init__()
        check_positive_int(vocab_size, "vocab_size")
        self.embed = nn.Embedding(vocab_size, dim)
        pe = build_positional(positional, dim=dim, heads=heads, head_dim=dim // heads)
        self.input_positional = pe if pe is not None and pe.absolute else None
        layer_positional = None if self.input_positional is not None else positional
        self.decoder = TransformerEncoder(
            dim,
            depth,
            heads,
            mechanism,
            ff_mult=ff_mult,
            dropout=dropout,
            positional=layer_positional,
            feedforward=feedforward,
            **mechanism_config,
        )
        self.head = nn.Linear(dim, vocab_size, bias=False)
        first = self.decoder.layers[0]
        module = first.mixer if first.attn is None else first.attn.attn
        if not module.spec.capabilities.causal:
            module._refuse("causal=True (a language model is causal)", "causal")

    @renamed_key_mask
    def forward(self, tokens: Tensor, *, key_mask: Tensor | None = None) -> Tensor:
        """``tokens (B, N)`` int64 -> logits ``(B, N, vocab_size)``."""
        x = self._embed(tokens, 0)
        return self.head(self.decoder(x, causal=True, key_mask=key_mask))

    def init_state(self, batch: int, *, device: Any = None, dtype: Any = None, capacity: int = 0) -> LMState:
        """Empty decode state; ``capacity``: the length decoding will reach, if known."""
        dtype = self.embed.weight.dtype if dtype is None else dtype
        device = self.embed.weight.device if device is None else device
        layers = tuple(
            layer.init_state(batch, device=device, dtype=dtype, capacity=capacity) for layer in self.decoder.layers
        )
        return LMState(layers, 0)

    @renamed_key_mask
    def step(self, tokens: Tensor, state: LMState, *, key_mask: Tensor | None = None) -> tuple[Tensor, LMState]:
        """Next tokens ``(B, T)`` -> their logits ``(B, T, vocab_size)`` and the new state;
        ``key_mask (B, T)`` marks the real ones (True), as in ``forward``."""
        x = self._embed(tokens, state.position)
        new_states = []
        for layer, layer_state in zip(self.decoder.layers, state.layers):
            x, layer_state = layer.step(x, layer_state, key_mask=key_mask)
            new_states.append(layer_state)
        logits = self.head(self.decoder.norm(x))
        return logits, LMState(tuple(new_states), state.position + tokens.shape[1])

    @torch.no_grad()
    @renamed_key_mask
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        *,
        key_mask: Tensor | None = None,
        sampling: Sampling | None = None,
        eos_token_id: int | None = None,
    ) -> Tensor:
        """Decode ``max_new_tokens`` after ``prompt (B, N)`` -> ``(B, N + generated)``.

        One forward-equivalent step over the prompt (a prefill), then one step per token, over
        the mechanism's decode state (``init_state`` / ``step``). ``key_mask (B, N)``
        marks the prompt's real tokens: pad prompts on the left so each row's last token is
        real. ``sampling``: None is greedy (arg-max); else ``Sampling(temperature, top_k,
        top_p, seed)``. With ``eos_token_id``, a row that emitted it emits it again from then
        on, and decoding stops early once every row has (so fewer than ``max_new_tokens``
        columns may come back)."""
        check_positive_int(max_new_tokens, "max_new_tokens", allow_zero=True)
        mask = check_key_mask(key_mask, *prompt.shape[:2], prompt.device) if prompt.ndim == 2 else None
        if mask is not None and not bool(mask[:, -1].all()):
            raise ValueError("key_mask: every prompt's last token must be real - pad prompts on the left")
        pick = Picker(sampling, prompt.device)
        state = self.init_state(prompt.shape[0], capacity=prompt.shape[1] + max_new_tokens)
        logits, state = self.step(prompt, state, key_mask=mask)
        out, done = [prompt], torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for _ in range(max_new_tokens):
            token = pick(logits[:, -1])
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
                done = done | (token == eos_token_id)
            out.append(token[:, None])
            if eos_token_id is not None and bool(done.all()):
                break
            logits, state = self.step(token[:, None], state)
        return torch.cat(out, dim=1)

    def _embed(self, tokens: Tensor, start: int) -> Tensor:
        if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens must be an integer tensor (B, N), got {getattr(tokens, 'shape', type(tokens))}")
        check_module_input(self, tokens, "tokens", dtype=False)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.embed.num_embeddings):
            raise ValueError(
                f"tokens must lie in [0, vocab_size={self.embed.num_embeddings}), got range "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        x = self.embed(tokens)
        if self.input_positional is not None:
            x = self.input_positional.add_to_input(x, torch.arange(tokens.shape[1], device=x.device) + start)
        return x
