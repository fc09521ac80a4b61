"""Attention-free token mixers (family ``"mixing"``): FNet, gMLP's spatial gating unit and
MLP-Mixer's token-mixing MLP.

Each one is a ``TokenMixer``: it takes the layer input ``x (B, N, dim)`` itself (no q/k/v, no
heads) and returns ``(B, N, dim)``. Use them through
``attnzoo.nn.TransformerEncoderLayer(dim, heads, "fnet")`` (which builds them with its ``dim``
and applies ``x + mixer(LayerNorm(x))``), or build one directly with ``attnzoo.build``.

Padding convention shared by all three: padded tokens (``key_mask`` False) are zeroed
before mixing, and the outputs at padded positions are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.mechanisms.base import TokenMixer
from attnzoo.registry import Config, bounded, register
from attnzoo.spec import Capabilities, Complexity


def _zero_padding(x: Tensor, key_mask: Tensor | None) -> Tensor:
    return x if key_mask is None else x.masked_fill(~key_mask[..., None], 0)


def _check_length(name: str, n: int, max_len: int) -> None:
    if n > max_len:
        raise ValueError(
            f"{name!r} was built for sequences of at most max_len={max_len} tokens, got N={n}; "
            f"build it with max_len >= {n} (e.g. attnzoo.build({name!r}, max_len={n}))"
        )


@dataclass(frozen=True, kw_only=True)
class _MixerConfig(Config):
    """The field every token mixer's config has: ``dim``, the width of ``x`` (default 64;
    ``TransformerEncoderLayer`` sets it to its own ``dim``)."""

    dim: int = bounded(64, ge=1)


#: fnet and mixer: every output depends on every token.
_NOT_CAUSAL = Capabilities(causal=False, key_mask=True, kind="mixer")


# --------------------------------------------------------------------------------------- FNet


@dataclass(frozen=True, kw_only=True)
class FNetConfig(_MixerConfig):
    """Config of ``fnet``: ``dim`` only (``_MixerConfig``); the mixer has no parameters."""


@register(
    "fnet",
    config=FNetConfig,
    family="mixing",
    summary="FNet: Re(FFT over the sequence of FFT over the hidden dim); no parameters.",
    paper="Lee-Thorp et al. 2021, FNet: Mixing Tokens with Fourier Transforms, https://arxiv.org/abs/2105.03824",
    capabilities=_NOT_CAUSAL,
    complexity=Complexity(time="O(N dim (log N + log dim))", memory="O(N dim)", subquadratic_memory=True),
    notes=(
        "not causal: every output depends on every token",
        "padded tokens are zeroed before the transform, so changing their content changes nothing, "
        "but the FFT length is still N including padding: real outputs differ from running the "
        "unpadded sequence alone",
        "float16/bfloat16 inputs are transformed in float32",
    ),
)
class FNet(TokenMixer):
    """FNet token mixing (Lee-Thorp et al. 2021, https://arxiv.org/abs/2105.03824):
    ``y = Re(FFT_seq(FFT_hidden(x)))``.

    Args:
        config: ``FNetConfig`` (``dim`` only; the mixer has no parameters).

    Shapes:
        ``x (B, N, dim)``, ``key_mask (B, N)`` bool (True = real) -> ``(B, N, dim)``.

    Notes:
        Not causal (``causal=True`` raises). Padded tokens are zeroed before the transform and
        padded outputs are zero, so padded *content* never reaches a real output; but the
        sequence FFT still has length N including the padding, so the outputs at real positions
        depend on how much padding there is (they are not those of the unpadded sequence).
        Half-precision inputs are transformed in float32 and cast back.
    """

    config: FNetConfig

    def _mix(self, x: Tensor, *, causal: bool, key_mask: Tensor | None) -> Tensor:
        x = _zero_padding(x, key_mask)
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        out = torch.fft.fft(torch.fft.fft(work, dim=-1), dim=-2).real.to(x.dtype)
        return _zero_padding(out, key_mask)


# --------------------------------------------------------------------------------------- gMLP


@dataclass(frozen=True, kw_only=True)
class GMLPConfig(_MixerConfig):
    """Config of ``gmlp``.

    Args:
        dim: width of ``x`` (``_MixerConfig``).
        max_len: longest sequence; the spatial weight is ``(max_len, max_len)``. Default 512.
        ff_mult: the channel projection goes to ``2 * ff_mult * dim`` (split into u and v).
            Default 2.
        init_eps: the spatial weight starts uniform in ``±init_eps / max_len`` (bias 1), so the
            gate is ≈ 1 at initialisation. Default 1e-3.
    """

    max_len: int = bounded(512, ge=1)
    ff_mult: int = bounded(2, ge=1)
    init_eps: float = bounded(1e-3, ge=0)


@register(
    "gmlp",
    config=GMLPConfig,
    family="mixing",
    summary="gMLP spatial gating unit: u * (W_spatial LayerNorm(v) + b), W ≈ 0 and b = 1 at init.",
    paper="Liu et al. 2021, Pay Attention to MLPs, https://arxiv.org/abs/2105.08050",
    capabilities=Capabilities(causal=True, key_mask=True, kind="mixer"),
    complexity=Complexity(
        time="O(N dim ff + N^2 dim ff)",
        memory="O(max_len^2) parameters, O(N dim ff) activations",
    ),
    notes=(
        "causal masks the spatial weight to lower-triangular (strongly causal)",
        "padded tokens are zeroed in v before the spatial projection; padded outputs are zero",
        "N > max_len raises; N < max_len uses the top-left N x N block of the spatial weight",
        "this is the whole gMLP block but its residual: nn.TransformerEncoderLayer adds a feed-forward block the "
        "paper's gMLP does not have unless built with feedforward=False",
    ),
)
class GMLP(TokenMixer):
    """The core of a gMLP block (Liu et al. 2021, https://arxiv.org/abs/2105.08050, §2):
    ``h = GELU(W_in x)`` with ``2 * ff_mult * dim`` channels, split ``h = (u, v)``,
    ``v' = W_s LayerNorm(v) + b_s`` across the sequence, ``y = W_out (u * v')``.

    Args:
        config: ``GMLPConfig`` (``dim``, ``max_len``, ``ff_mult``, ``init_eps``).

    Shapes:
        ``x (B, N, dim)`` with ``N <= max_len``, ``key_mask (B, N)`` bool -> ``(B, N, dim)``.
        Parameters: ``proj_in (dim -> 2 ff_mult dim)``, ``norm (ff_mult dim)``,
        ``spatial_weight (max_len, max_len)``, ``spatial_bias (max_len,)``,
        ``proj_out (ff_mult dim -> dim)``.

    Notes:
        At initialisation ``W_s ≈ 0`` and ``b_s = 1``, so ``v' ≈ 1`` and ``y ≈ W_out u``: the
        block starts as a plain per-token MLP (the paper's recommended init). ``causal=True``
        uses only the lower triangle of ``W_s`` (output i depends on tokens <= i). Padded tokens
        are zeroed in ``v`` before the spatial projection, so they contribute nothing; outputs at
        padded positions are zero. A sequence shorter than ``max_len`` uses the top-left
        ``N x N`` block of ``W_s`` (positions are absolute from the start).
    """

    config: GMLPConfig

    def __init__(self, config: GMLPConfig) -> None:
        super().__init__(config)
        hidden = config.ff_mult * config.dim
        self.proj_in = nn.Linear(config.dim, 2 * hidden)
        self.norm = nn.LayerNorm(hidden)
        eps = config.init_eps / config.max_len
        self.spatial_weight = nn.Parameter(torch.empty(config.max_len, config.max_len).uniform_(-eps, eps))
        self.spatial_bias = nn.Parameter(torch.ones(config.max_len))
        self.proj_out = nn.Linear(hidden, config.dim)

    def _mix(self, x: Tensor, *, causal: bool, key_mask: Tensor | None) -> Tensor:
        n = x.shape[1]
        _check_length("gmlp", n, self.config.max_len)
        u, v = F.gelu(self.proj_in(x)).chunk(2, dim=-1)
        v = _zero_padding(self.norm(v), key_mask)
        weight = self.spatial_weight[:n, :n]
        if causal:
            weight = weight.tril()
        v = torch.einsum("mn,bnc->bmc", weight.to(v.dtype), v) + self.spatial_bias[:n, None].to(v.dtype)
        return _zero_padding(self.proj_out(u * v), key_mask)


# -------------------------------------------------------------------------------- MLP-Mixer


@dataclass(frozen=True, kw_only=True)
class MixerConfig(_MixerConfig):
    """Config of ``mixer``.

    Args:
        dim: width of ``x`` (``_MixerConfig``).
        max_len: longest sequence; the token MLP maps ``max_len -> token_hidden -> max_len``.
            Default 512.
        token_hidden: hidden width of the token-mixing MLP (the paper's D_S). Default 256.
    """

    max_len: int = bounded(512, ge=1)
    token_hidden: int = bounded(256, ge=1)


@register(
    "mixer",
    config=MixerConfig,
    family="mixing",
    summary="MLP-Mixer token-mixing MLP across the sequence (max_len -> hidden -> max_len, per channel).",
    paper="Tolstikhin et al. 2021, MLP-Mixer: An all-MLP Architecture for Vision, https://arxiv.org/abs/2105.01601",
    capabilities=_NOT_CAUSAL,
    complexity=Complexity(
        time="O(N token_hidden dim)",
        memory="O(max_len token_hidden) parameters, O(token_hidden dim) activations",
        subquadratic_memory=True,
    ),
    notes=(
        "not causal: the token MLP mixes every position into every other",
        "padded tokens are zeroed before mixing; padded outputs are zero",
        "N > max_len raises; N < max_len uses the first N rows/columns of the token-MLP weights",
    ),
)
class Mixer(TokenMixer):
    """MLP-Mixer's token-mixing MLP (Tolstikhin et al. 2021, https://arxiv.org/abs/2105.01601):
    for each channel c, ``y[:, c] = W_2 GELU(W_1 x[:, c] + b_1) + b_2`` across the sequence.

    Args:
        config: ``MixerConfig`` (``dim``, ``max_len``, ``token_hidden``).

    Shapes:
        ``x (B, N, dim)`` with ``N <= max_len``, ``key_mask (B, N)`` bool -> ``(B, N, dim)``.
        Parameters: ``w1 (token_hidden, max_len)``, ``b1 (token_hidden,)``,
        ``w2 (max_len, token_hidden)``, ``b2 (max_len,)``.

    Notes:
        The paper applies the token MLP to a LayerNormed input and adds the residual outside it;
        here both belong to the layer (``TransformerEncoderLayer`` computes ``x + mixer(LN(x))``),
        so this module is the MLP alone. Not causal (``causal=True`` raises). A sequence of
        ``N < max_len`` tokens uses the first ``N`` columns of ``w1`` and the first ``N`` rows of
        ``w2`` / ``b2`` (the same as zero-padding it to ``max_len`` and keeping the first ``N``
        outputs). Padded tokens are zeroed before mixing, so their content never reaches a real
        output; outputs at padded positions are zero.
    """

    config: MixerConfig

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        first = nn.Linear(config.max_len, config.token_hidden)
        second = nn.Linear(config.token_hidden, config.max_len)
        self.w1, self.b1 = first.weight, first.bias
        self.w2, self.b2 = second.weight, second.bias

    def _mix(self, x: Tensor, *, causal: bool, key_mask: Tensor | None) -> Tensor:
        n = x.shape[1]
        _check_length("mixer", n, self.config.max_len)
        x = _zero_padding(x, key_mask)
        w1, w2 = self.w1[:, :n].to(x.dtype), self.w2[:n].to(x.dtype)
        h = F.gelu(torch.einsum("hn,bnc->bhc", w1, x) + self.b1[:, None].to(x.dtype))
        out = torch.einsum("nh,bhc->bnc", w2, h) + self.b2[:n, None].to(x.dtype)
        return _zero_padding(out, key_mask)
