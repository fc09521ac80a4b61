"""attnzoo.viz: pattern and weight pictures (PNG files read back as pixel arrays)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo import patterns as P  # noqa: E402
from attnzoo import viz  # noqa: E402


def test_draw_pattern_pixels_depend_on_the_pattern(tmp_path):
    a = viz.draw_pattern(P.local(2), 32, tmp_path / "a.png", title="same title")
    b = viz.draw_pattern(P.strided(8), 32, tmp_path / "b.png", title="same title")
    assert a == tmp_path / "a.png" and a.stat().st_size > 0 and b.stat().st_size > 0
    pa, pb = imread(a), imread(b)
    assert pa.shape == pb.shape
    assert not (pa == pb).all()


def test_draw_pattern_with_tiles_causal_and_nested_output_dir(tmp_path):
    out = viz.draw_pattern(P.longformer(3, [0]), 40, tmp_path / "x" / "y" / "lf.png", block=8, causal=True)
    assert out.is_file() and imread(out).size > 0


def test_per_head_pattern_is_wider(tmp_path):
    one = imread(viz.draw_pattern(P.local(2), 16, tmp_path / "one.png"))
    two = imread(viz.draw_pattern(P.per_head([P.local(2), P.strided(4)]), 16, tmp_path / "two.png", block=4))
    assert two.shape[1] > 1.5 * one.shape[1]


def test_draw_weights_of_implied_attention(tmp_path):
    q, k = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    weights = attnzoo.build("softmax").implied_attention(q, k, causal=True)
    out = viz.draw_weights(weights, tmp_path / "w.png", title="softmax, causal")
    assert out.stat().st_size > 0
    assert imread(viz.draw_weights(weights[0, 0], tmp_path / "w0.png")).size > 0
    with pytest.raises(ValueError, match="weights"):
        viz.draw_weights(torch.rand(2, 2, 4, 4), tmp_path / "bad.png")


def test_gallery_configs_come_from_the_mechanisms():
    assert not hasattr(viz, "GALLERY_CONFIGS")  # no table keyed by mechanism name to keep in step
    sized = {name: attnzoo.describe(name).config.length_values(64) for name in attnzoo.names(family="sparse")}
    # Only bigbird's kernel tile defaults to its pattern block; the others use the default tile.
    tiles = {name: attnzoo.build(name, **cfg).config.tile for name, cfg in sized.items()}
    assert [name for name, tile in tiles.items() if tile is None] == ["bigbird"]


def test_mechanism_pattern():
    config = attnzoo.describe("graph").config.length_values(64)
    pattern = viz.mechanism_pattern("graph", 64, **config)
    assert pattern.dense(64).shape == (64, 64)
    with pytest.raises(ValueError, match="64"):
        viz.mechanism_pattern("graph", 32, **config)
    with pytest.raises(ValueError, match="not a sparse"):
        viz.mechanism_pattern("softmax", 64)


def test_gallery(tmp_path):
    written = viz.gallery(tmp_path)
    expected = {f"{name}.png" for name in attnzoo.names(family="sparse")} | {"softmax.png", "causal.png"}
    assert {p.name for p in tmp_path.glob("*.png")} == expected
    assert written[-1] == tmp_path / "index.html"
    assert sorted(p.name for p in written[:-1]) == sorted(expected)
    page = written[-1].read_text()
    assert set(re.findall(r'<img src="([^"]+)"', page)) == expected  # relative paths
    assert "://" not in page  # self-contained: no network resources


def test_gallery_fits_every_pattern_to_any_length(tmp_path):
    # 30 = 5 x 6: the grid and graph mechanisms fit themselves to n, not to a fixed 64.
    written = viz.gallery(tmp_path, n=30, block=5)
    assert len(written) == len(attnzoo.names(family="sparse")) + 3
