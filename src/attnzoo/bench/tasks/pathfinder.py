"""Pathfinder: are the two markers on the same contour? (Linsley et al. 2018,
https://arxiv.org/abs/1805.08315; LRA's Pathfinder-32, Tay et al. 2020,
https://arxiv.org/abs/2011.04006). A re-implemented generator in numpy, not the original one.

Each ``resolution x resolution`` image holds two *target* contours grown from nearby seeds, plus
``n_distractors`` distractor contours. A contour is a smooth random curve traced with half-pixel
steps and a slowly drifting heading, rasterised as a chain of ``contour_length`` distinct,
8-adjacent pixels, then dashed: ``dash_len`` pixels drawn, ``dash`` pixels skipped, repeating
(with a random phase). Two markers (3x3 squares) sit on contour ends: label 1 (positive) puts
them on both ends of target A; label 0 puts one on an end of A and one on an end of B. Both
targets are drawn either way, so only the markers' placement differs.

Notes:
    Decidability. Every contour's drawn pixels (and the marker squares its ends may carry) keep
    a Chebyshev distance of more than ``r = dash + 1`` from every other contour's; contours that
    would come closer are re-traced. Within a contour, successive drawn pixels are at most ``r``
    apart. So linking drawn pixels at distance ``<= r`` gives exactly one component per contour,
    and the label is "the two markers are in the same component" -- checkable from the image
    alone (``dash = 0`` makes it plain 8-connectivity). The tests check this with an independent
    flood fill.

    Intensities: background 0, contour 160, marker 255 (crisp, no anti-aliasing). Tokens are
    ``intensity + 1`` in row-major order, so pad 0 never occurs, ``seq_len = resolution ** 2`` and
    ``vocab_size = 257`` (LRA's 256 pixel levels plus pad), of which three ids are used.

    Each split has exactly ``n / 2`` positives (``n`` must be even), in random order, so
    ``chance = 0.5``. Marker distance is roughly matched between classes: a negative marks the
    (end of A, end of B) pair whose distance is closest to A's end-to-end distance. On the
    default settings the best threshold on marker distance alone scores ~58%, not 50%.

    Presets: ``quick`` is 32x32 with 4000/500/500 images; ``full`` is LRA's Pathfinder-32 size
    (160k/20k/20k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from attnzoo._checks import check_int_fields

VERSION = 1
BACKGROUND, CONTOUR, MARKER = 0, 160, 255
VOCAB_SIZE = 257
STEP = 0.5  # tracing step in pixels; < 1 keeps successive pixels 8-adjacent
TURN = 0.25  # std of the heading change per step, radians
_TRACE_TRIES = 40
_IMAGE_TRIES = 200

SIZES = {
    "quick": dict(resolution=32, n_train=4000, n_val=500, n_test=500),
    "full": dict(resolution=32, n_train=160_000, n_val=20_000, n_test=20_000),
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """Pathfinder generator parameters.

    Args:
        resolution: image side in pixels (default 32); ``seq_len = resolution ** 2``.
        contour_length: pixels in each contour's chain before dashing (default 14).
        n_distractors: contours without markers (default 2).
        dash: pixels skipped between dashes; 0 draws solid contours (default 1).
        dash_len: pixels drawn per dash (default 3).
        n_train, n_val, n_test: images per split, each even (half positives).
    """

    resolution: int = 32
    contour_length: int = 14
    n_distractors: int = 2
    dash: int = 1
    dash_len: int = 3
    n_train: int = 4000
    n_val: int = 500
    n_test: int = 500

    def __post_init__(self) -> None:
        check_int_fields(
            self, resolution=8, contour_length=3, n_distractors=0, dash=0, dash_len=1, n_train=2, n_val=2, n_test=2
        )
        for name in ("n_train", "n_val", "n_test"):
            if getattr(self, name) % 2:
                raise ValueError(f"{name} must be even (splits are exactly half positive), got {getattr(self, name)}")
        if self.contour_length > self.resolution**2 // 8:
            raise ValueError(
                f"contour_length ({self.contour_length}) is too long for resolution "
                f"{self.resolution}; at most {self.resolution**2 // 8}"
            )


def describe(cfg: Config) -> dict:
    return dict(
        kind="classify", seq_len=cfg.resolution**2, vocab_size=VOCAB_SIZE, n_classes=2, causal=False, chance=0.5
    )


def _trace(rng: np.random.Generator, start: np.ndarray, cfg: Config) -> list[tuple[int, int]] | None:
    """A chain of ``contour_length`` distinct 8-adjacent pixels from ``start``, one pixel clear
    of the border (room for a marker square), or None when it leaves the image or crosses
    itself."""
    size = cfg.resolution
    y, x = float(start[0]), float(start[1])
    heading = rng.uniform(0.0, 2 * math.pi)
    chain = [(math.floor(y + 0.5), math.floor(x + 0.5))]
    turns = iter(rng.normal(0.0, TURN, size=8 * cfg.contour_length))
    for turn in turns:
        heading += turn
        y, x = y + STEP * math.sin(heading), x + STEP * math.cos(heading)
        pixel = (math.floor(y + 0.5), math.floor(x + 0.5))
        if not (1 <= pixel[0] < size - 1 and 1 <= pixel[1] < size - 1):
            return None
        if pixel != chain[-1]:
            if pixel in chain:
                return None
            chain.append(pixel)
            if len(chain) == cfg.contour_length:
                return chain
    return None


def _footprint(rng: np.random.Generator, chain, cfg: Config, marked: bool):
    """``(dashes, reserved)`` boolean images: the drawn pixels of a dashed contour, and those
    plus the marker squares its ends may carry (reserved at both ends when ``marked``, so the
    spacing never depends on which end gets the marker)."""
    dashes = np.zeros((cfg.resolution, cfg.resolution), dtype=bool)
    period = cfg.dash_len + cfg.dash
    phase = int(rng.integers(period))
    for i, (r, c) in enumerate(chain):
        if (i + phase) % period < cfg.dash_len:
            dashes[r, c] = True
    reserved = dashes.copy()
    if marked:
        for r, c in (chain[0], chain[-1]):
            reserved[r - 1 : r + 2, c - 1 : c + 2] = True
    return dashes, reserved


def _dilate(image: np.ndarray, radius: int) -> np.ndarray:
    """Every pixel within Chebyshev distance ``radius`` of a True pixel."""
    rows, cols = image.shape
    padded = np.zeros((rows + 2 * radius, cols + 2 * radius), dtype=bool)
    padded[radius : radius + rows, radius : radius + cols] = image
    out = np.zeros_like(image)
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            out |= padded[dy : dy + rows, dx : dx + cols]
    return out


def _place(rng, cfg: Config, forbidden: np.ndarray, centre: np.ndarray, spread: float, marked: bool):
    """Trace a contour starting within ``spread`` of ``centre`` whose reserved pixels avoid
    ``forbidden``; returns ``(chain, dashes, reserved)`` or None."""
    for _ in range(_TRACE_TRIES):
        start = np.clip(centre + rng.uniform(-spread, spread, size=2), 1.0, cfg.resolution - 2.0)
        chain = _trace(rng, start, cfg)
        if chain is None:
            continue
        dashes, reserved = _footprint(rng, chain, cfg, marked)
        if not (reserved & forbidden).any():
            return chain, dashes, reserved
    return None


def _image(rng: np.random.Generator, cfg: Config, label: int) -> np.ndarray | None:
    """One ``(resolution, resolution)`` intensity image with the given label, or None when the
    contours did not fit."""
    size, radius = cfg.resolution, cfg.dash + 1
    forbidden = np.zeros((size, size), dtype=bool)
    image = np.full((size, size), BACKGROUND, dtype=np.int64)
    seed = rng.uniform(1.0, size - 2.0, size=2)
    # Target A starts at the seed, target B within a quarter image of it (but far enough that
    # its marker square can clear A's at small sizes), distractors anywhere.
    near = max(size / 4, 2 * radius + 4)
    starts = [(seed, 0.0), (seed, near)] + [(np.full(2, size / 2), size / 2)] * cfg.n_distractors
    chains = []
    for k, (centre, spread) in enumerate(starts):
        placed = _place(rng, cfg, forbidden, centre, spread, marked=k < 2)
        if placed is None:
            return None
        chain, dashes, reserved = placed
        chains.append(chain)
        forbidden |= _dilate(reserved, radius)
        image[dashes] = CONTOUR
    a, b = chains[0], chains[1]
    ends = [a[0], a[-1]]
    if not label:
        # Of the four (end of A, end of B) pairs, mark the one whose distance is closest to A's
        # end-to-end distance, so marker distance alone says little about the label.
        pairs = [(p, q) for p in (a[0], a[-1]) for q in (b[0], b[-1])]
        ends = min(pairs, key=lambda pq: abs(math.dist(*pq) - math.dist(a[0], a[-1])))
    for r, c in ends:
        image[r - 1 : r + 2, c - 1 : c + 2] = MARKER
    return image


def generate(cfg: Config, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    splits = {}
    for index, (name, n) in enumerate([("train", cfg.n_train), ("val", cfg.n_val), ("test", cfg.n_test)]):
        # One independent stream per split, so growing n_train leaves val/test unchanged.
        rng = np.random.default_rng([seed, index, 0x70617468])
        labels = rng.permutation(np.repeat([0, 1], n // 2))
        tokens = np.empty((n, cfg.resolution**2), dtype=np.int64)
        for i, label in enumerate(labels):
            tokens[i] = _retry(rng, cfg, int(label)).reshape(-1) + 1
        splits[name] = (torch.from_numpy(tokens), torch.from_numpy(labels.astype(np.int64)))
    return splits


def _retry(rng: np.random.Generator, cfg: Config, label: int) -> np.ndarray:
    for _ in range(_IMAGE_TRIES):
        image = _image(rng, cfg, label)
        if image is not None:
            return image
    raise ValueError(
        f"could not fit {2 + cfg.n_distractors} contours of length "
        f"{cfg.contour_length} with dash {cfg.dash} into {cfg.resolution}x"
        f"{cfg.resolution} images; lower contour_length, n_distractors or dash"
    )


def render(tokens, resolution: int | None = None) -> str:
    """ASCII picture of one image's tokens (``.`` background, ``o`` contour, ``#`` marker)."""
    values = [int(t) - 1 for t in tokens]
    side = resolution or math.isqrt(len(values))
    glyph = {BACKGROUND: ".", CONTOUR: "o", MARKER: "#"}
    return "\n".join("".join(glyph[v] for v in values[r * side : (r + 1) * side]) for r in range(side))
