"""Positional encodings, each usable from ``attnzoo.nn.MultiHeadAttention(positional=...)``.

Every encoding implements the hooks of ``PositionalEncoding``; a layer calls all of them and
each encoding overrides only the ones it needs:

- ``add_to_input(x, positions)``: absolute encodings (sinusoidal, learned) add a vector per
  position. Models add them to the token embeddings; ``MultiHeadAttention`` given one directly
  adds it to the query and key inputs only (DETR-style), never to the values.
- ``rotate(x, positions)``: RoPE rotates queries and keys after projection.
- ``score_mod(q, n_kv)``: ALiBi and Shaw-relative add a bias to the scaled scores; this works
  with every mechanism whose capabilities list ``score_mod``.
- ``value_term(weights)``: Shaw-relative also adds learned embeddings to the values, which needs
  the attention weights, so it runs on the dense ``softmax`` mechanism only (the layer checks).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnzoo._checks import check_positive_int
from attnzoo.score_mods import bias_mod
from attnzoo.spec import ScoreMod


class PositionalEncoding(nn.Module):
    """Base class; every hook defaults to 'no effect'."""

    #: Absolute encodings are added to token embeddings by models (see module docstring).
    absolute: bool = False
    #: True when ``score_mod`` returns a bias (the mechanism must list ``score_mod``).
    biases_scores: bool = False
    #: True when ``value_term`` needs the attention weights (dense mechanisms only).
    needs_weights: bool = False

    def add_to_input(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def score_mod(self, q: Tensor, n_kv: int) -> ScoreMod | None:
        return None

    def value_term(self, weights: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no value term")


def sinusoidal_table(positions: Tensor, dim: int) -> Tensor:
    """``PE[p, 2i] = sin(p / 10000^(2i/dim))``, ``PE[p, 2i+1] = cos(...)``; shape ``(N, dim)``."""
    exponents = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim
    angles = positions.to(torch.float64)[:, None] * 10000.0 ** -exponents[None, :]
    table = torch.zeros(positions.shape[0], dim, dtype=torch.float64, device=positions.device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return table


class SinusoidalPositionalEncoding(PositionalEncoding):
    """Fixed sinusoidal encoding (Vaswani et al. 2017, §3.5); no parameters, any length."""

    absolute = True

    def __init__(self, dim: int) -> None:
        super().__init__()
        check_positive_int(dim, "dim")
        self.dim = dim

    def add_to_input(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + sinusoidal_table(positions, self.dim).to(x.dtype)


class LearnedPositionalEncoding(PositionalEncoding):
    """A learned vector per absolute position (BERT/GPT-2 style), for positions < ``max_len``."""

    absolute = True

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        check_positive_int(dim, "dim")
        check_positive_int(max_len, "max_len")
        self.max_len = max_len
        self.table = nn.Embedding(max_len, dim)
        nn.init.normal_(self.table.weight, std=0.02)

    def add_to_input(self, x: Tensor, positions: Tensor) -> Tensor:
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(
                f"position {int(positions.max())} is beyond the learned table (max_len={self.max_len}); "
                f"build LearnedPositionalEncoding with a larger max_len, or use rope/alibi/sinusoidal"
            )
        return x + self.table(positions).to(x.dtype)


class RotaryEmbedding(PositionalEncoding):
    """RoPE (Su et al. 2021, https://arxiv.org/abs/2104.09864), "rotate half" layout: the pair
    ``(x[i], x[i + C/2])`` of the rotated channels is rotated by ``position * base^(-2i/C)``.
    Scores then depend only on the offset between query and key positions.

    ``channels``: how many channels carry positions, the *last* C of ``head_dim`` (None: all).
    Partial RoPE is what a mechanism with decoupled positions wants (``mla``: DeepSeek-V2
    rotates only its ``rope_dim`` channels; the rest pass through a latent where a rotation
    would break the content match); ``MultiHeadAttention(positional="rope")`` asks the
    mechanism (``Attention.rotary_channels``)."""

    def __init__(self, head_dim: int, base: float = 10000.0, channels: int | None = None) -> None:
        super().__init__()
        check_positive_int(head_dim, "head_dim")
        if channels is None:
            if head_dim % 2:
                raise ValueError(f"RoPE needs an even head_dim, got {head_dim} (or rotate fewer: channels=...)")
            channels = head_dim
        if isinstance(channels, bool) or not isinstance(channels, int) or not 0 <= channels <= head_dim:
            raise ValueError(f"RoPE channels must be an int in [0, head_dim={head_dim}], got {channels!r}")
        if channels % 2:
            raise ValueError(f"RoPE rotates channels in pairs: channels must be even, got {channels}")
        self.head_dim, self.base, self.channels = head_dim, base, channels

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        if self.channels == 0:
            return x
        half, kept = self.channels // 2, x[..., : self.head_dim - self.channels]
        inv_freq = self.base ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2 / self.channels)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [N, C/2]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., -self.channels : -half], x[..., -half:]
        return torch.cat([kept, x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def alibi_slopes(heads: int) -> Tensor:
    """Press et al. 2022 (https://arxiv.org/abs/2108.12409) head slopes: a geometric sequence
    ``2^(-8/n)``, ``2^(-16/n)``, ...; for a head count that is not a power of two, the slopes of
    the power of two below it, then every other slope of the next power of two."""

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    below = 2 ** int(math.floor(math.log2(heads)))
    slopes = geometric(below) + geometric(2 * below)[0::2][: heads - below]
    return torch.tensor(slopes, dtype=torch.float64)


class ALiBi(PositionalEncoding):
    """Attention with Linear Biases: ``score_ij - slope_h * |i - j|`` (symmetric, so it also
    works bidirectionally; under a causal mask it is the paper's ``-slope_h * (i - j)``)."""

    biases_scores = True

    def __init__(self, heads: int) -> None:
        super().__init__()
        check_positive_int(heads, "heads")
        self.register_buffer("slopes", alibi_slopes(heads).float(), persistent=False)

    def score_mod(self, q: Tensor, n_kv: int) -> ScoreMod:
        """An additive bias (``score_mods.bias_mod``): exact softmax paths add it chunk by chunk.
        In float64 for float64 queries, else float32 (the scores' compute dtype)."""
        slopes = self.slopes.to(q.device, torch.float64 if q.dtype == torch.float64 else torch.float32)

        def alibi(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return -slopes[h] * (q_idx - kv_idx).abs()

        return bias_mod(alibi)


class RelativePositionalEncoding(PositionalEncoding):
    """Shaw, Uszkoreit & Vaswani 2018 (https://arxiv.org/abs/1803.02155): learned embeddings
    ``a^K, a^V`` of the clipped distance ``clip(j - i, -max_distance, max_distance)``, shared by
    all heads: ``e_ij = s * q_i (k_j + a^K_ij)``, ``z_i = sum_j w_ij (v_j + a^V_ij)``.

    The key term is a ``score_mod``. The value term needs the weights, so with ``values=True``
    the layer must use the dense ``softmax`` mechanism; ``values=False`` keeps only the key
    term and works with every score_mod-capable mechanism.
    """

    biases_scores = True

    def __init__(
        self, head_dim: int, max_distance: int = 16, *, values: bool = True, scale: float | None = None
    ) -> None:
        super().__init__()
        check_positive_int(head_dim, "head_dim")
        check_positive_int(max_distance, "max_distance")
        self.max_distance, self.needs_weights = max_distance, values
        self.scale = head_dim**-0.5 if scale is None else scale
        self.rel_k = nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * head_dim**-0.5)
        self.rel_v = nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * head_dim**-0.5) if values else None

    def bucket(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx - q_idx).clamp(-self.max_distance, self.max_distance) + self.max_distance

    def score_mod(self, q: Tensor, n_kv: int) -> ScoreMod:
        # q_i . a^K_r for every query and every distance bucket r: [B, H, N_q, 2K+1]
        rel_logits = torch.einsum("bhid,rd->bhir", q, self.rel_k.to(q.dtype)) * self.scale
        offset = n_kv - q.shape[2]

        def shaw(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + rel_logits[b, h, q_idx - offset, self.bucket(q_idx, kv_idx)].to(score.dtype)

        return shaw

    def value_term(self, weights: Tensor) -> Tensor:
        """``sum_j w_ij a^V_{bucket(i, j)}`` from weights ``(B, H, N_q, N_kv)``."""
        n_q, n_kv = weights.shape[-2:]
        q_idx = torch.arange(n_q, device=weights.device)[:, None] + (n_kv - n_q)
        buckets = self.bucket(q_idx, torch.arange(n_kv, device=weights.device)[None, :])
        # Sum each row's weights per distance bucket, then mix the bucket embeddings.
        mass = weights.new_zeros(weights.shape[:-1] + (2 * self.max_distance + 1,))
        mass.scatter_add_(-1, buckets.expand_as(weights), weights)
        return torch.einsum("bhir,rd->bhid", mass, self.rel_v.to(weights.dtype))


def build_positional(
    name: str | PositionalEncoding | None, *, dim: int, heads: int, head_dim: int
) -> PositionalEncoding | None:
    """Resolve ``MultiHeadAttention(positional=...)``: an instance, None, or one of the names
    ``"sinusoidal"``, ``"rope"``, ``"alibi"``, ``"relative"`` (Shaw, max_distance=16, with
    values). A learned table needs its length: pass ``LearnedPositionalEncoding(dim, max_len)``."""
    if name is None or isinstance(name, PositionalEncoding):
        return name
    factories = {
        "sinusoidal": lambda: SinusoidalPositionalEncoding(dim),
        "rope": lambda: RotaryEmbedding(head_dim),
        "alibi": lambda: ALiBi(heads),
        "relative": lambda: RelativePositionalEncoding(head_dim),
    }
    if name == "learned":
        raise ValueError("positional='learned' needs a length: pass LearnedPositionalEncoding(dim, max_len)")
    if name not in factories:
        raise ValueError(f"positional must be None, a PositionalEncoding, or one of {sorted(factories)}, got {name!r}")
    return factories[name]()
