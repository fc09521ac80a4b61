"""The registry: names, describe, build, config validation; checked for every registered entry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.registry import Config, bounded, check_values, config_fields, quarter, register
from attnzoo.spec import Capabilities, Complexity

ALL = attnzoo.names()


def test_softmax_is_registered_with_capabilities():
    assert "softmax" in ALL
    spec = attnzoo.describe("softmax")
    assert spec.family == "exact" and "1706.03762" in spec.paper
    caps = spec.capabilities
    assert caps.causal and caps.key_mask and caps.decode_step and caps.cross_attention
    assert "softmax" in attnzoo.names(causal=True, decode_step=True)
    assert "softmax" in attnzoo.names(family="exact", kind="attention")


@pytest.mark.parametrize("name", ALL)
def test_every_entry_builds_with_defaults_and_declares_itself(name):
    spec = attnzoo.describe(name)
    params = spec.config.__dataclass_params__
    assert params.frozen and all(f.kw_only for f in dataclasses.fields(spec.config))
    assert spec.paper and spec.summary and spec.complexity.time and spec.complexity.memory
    module = attnzoo.build(name)
    assert isinstance(module, nn.Module) and module.spec is spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(module.config, next(iter(config_fields(name)), "x"), None)


def test_unknown_key_names_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown config key\(s\) 'bogus' for 'softmax'; valid keys: normalizer, scale"
    ):
        attnzoo.build("softmax", bogus=1)


@pytest.mark.parametrize(
    ("name", "old", "new"),
    [("longformer", "window", "left and right"), ("etc", "window", "left and right"), ("local", "block", "tile")]
    + [("block_local", "size", "block"), ("block_local", "block", None), ("bigbird", "block", None)],
)
def test_renamed_keys_are_refused_with_the_new_name(name, old, new):
    # A renamed key says what replaced it, through build and check_values (the command line's
    # path); a base's renames apply to subclasses, unless the old name is a field again there
    # (``block`` is a semantic block in block_local and bigbird, the tile in SparseConfig).
    if new is None:
        attnzoo.build(name, **{old: 4})
        return
    for call in (lambda: attnzoo.build(name, **{old: 4}), lambda: check_values(name, {old: 4})):
        with pytest.raises(ValueError, match=rf"{name!r}: config key {old!r} was renamed: use {new}"):
            call()


def test_wrong_types_and_values_are_rejected():
    with pytest.raises(ValueError, match="'softmax' \\| 'relu'"):
        attnzoo.build("softmax", normalizer="sparsemax")
    with pytest.raises(TypeError, match="'scale' must be float \\| None"):
        attnzoo.build("softmax", scale="big")
    with pytest.raises(ValueError, match="scale must be > 0"):
        attnzoo.build("softmax", scale=-1.0)


def test_unknown_name_suggests_close_matches():
    with pytest.raises(ValueError, match="did you mean 'softmax'"):
        attnzoo.build("softmx")
    with pytest.raises(ValueError, match="unknown capability"):
        attnzoo.names(flies=True)


def test_register_demands_a_frozen_keyword_only_config():
    @dataclasses.dataclass
    class Loose:
        x: int = 1

    with pytest.raises(TypeError, match="frozen, keyword-only"):
        register(
            "loose",
            config=Loose,
            family="x",
            summary="x",
            paper="x",
            capabilities=Capabilities(causal=False, key_mask=False),
            complexity=Complexity(time="O(1)", memory="O(1)"),
        )

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Dup(Config):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register(
            "softmax",
            config=Dup,
            family="x",
            summary="x",
            paper="x",
            capabilities=Capabilities(causal=False, key_mask=False),
            complexity=Complexity(time="O(1)", memory="O(1)"),
        )


def test_refusals_name_mechanisms_that_can(monkeypatch):
    # A registered mechanism without causal support must refuse and point at those that have it.
    from attnzoo import registry

    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "_BY_CONFIG", dict(registry._BY_CONFIG))

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NoCausalConfig(Config):
        pass

    from attnzoo.mechanisms.base import Attention

    class NoCausal(Attention):
        def _attend(self, q, k, v, args):
            return v

    register(
        "_test_no_causal",
        config=NoCausalConfig,
        family="test",
        summary="t",
        paper="t",
        capabilities=Capabilities(causal=False, key_mask=False),
        complexity=Complexity(time="O(1)", memory="O(1)"),
    )(NoCausal)
    q = torch.randn(1, 1, 3, 4)
    module = attnzoo.build("_test_no_causal")
    assert torch.equal(module(q, q, q), q)
    with pytest.raises(ValueError, match="does not support causal=True; mechanisms that do: .*softmax"):
        module(q, q, q, causal=True)
    with pytest.raises(ValueError, match="key_mask"):
        module(q, q, q, key_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="self-attention only"):
        module(q, q[:, :, :2], q[:, :, :2])
    with pytest.raises(ValueError, match="decode step"):
        module.init_state(1, 1, 4, 4)


# ----------------------------------------------------------- configs carry examples and ranges


@pytest.mark.parametrize("name", attnzoo.names())
def test_for_length_gives_a_valid_config_at_every_length(name):
    config_class = attnzoo.describe(name).config
    for n in (1, 4, 16, 64, 75, 100, 256, 1024):
        config = config_class.for_length(n)
        assert isinstance(config, config_class)
        assert attnzoo.build(name, **config_class.length_values(n)).config == config
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        config_class.for_length(0)


def test_for_length_defaults_to_the_defaults_and_sized_reads_it():
    from attnzoo.bench.configs import sized

    assert attnzoo.describe("softmax").config.for_length(64) == attnzoo.registry.make_config("softmax")
    assert sized("local", 64) == {"left": 16, "right": 16}
    assert attnzoo.describe("local").config.for_length(64).left == 16


def test_for_length_reads_the_rule_declared_beside_each_field():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Sized(Config):
        window: int = bounded(64, ge=1, for_length=quarter)
        buckets: int = bounded(8, ge=1, for_length=4)
        seed: int = 3

    assert Sized.length_values(100) == {"window": 25, "buckets": 4}
    assert Sized.for_length(100) == Sized(window=25, buckets=4, seed=3)
    assert Sized.for_length(1).window == 2  # quarter's floor


@pytest.mark.parametrize(
    ("name", "values", "message"),
    [
        ("local", {"tile": 0}, "LocalConfig: tile must be >= 1, got 0"),
        ("topk", {"scale": -1.0}, r"TopKConfig: scale must be > 0 or None \(for 1/sqrt\(D\)\), got -1.0"),
        ("routing", {"decay": 1.5}, r"RoutingConfig: decay must be in \[0.0, 1.0\], got 1.5"),
        ("routing", {"window": 0}, r"RoutingConfig: window must be >= 1 or None \(for ceil\(N / n_clusters\)\), got 0"),
        ("performer", {"redraw_every": 0}, r"PerformerConfig: redraw_every must be >= 1 or None \(never redraw\)"),
        ("linear", {"eps": 0.0}, "LinearConfig: eps must be > 0, got 0.0"),
    ],
)
def test_a_range_violation_names_the_config_field_bound_and_value(name, values, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        attnzoo.build(name, **values)


def test_no_range_helper_per_config_and_no_name_keyed_tables():
    import pathlib

    import attnzoo.bench.configs as configs
    import attnzoo.bench.fidelity as fidelity
    from attnzoo import viz

    src = pathlib.Path(attnzoo.__file__).parent
    mechanisms = "\n".join(p.read_text() for p in (src / "mechanisms").glob("*.py"))
    for helper in ("def _check_ranges", "def _at_least", "def _positive"):
        assert helper not in mechanisms
    assert not hasattr(viz, "GALLERY_CONFIGS")
    assert not any(hasattr(fidelity, table) for table in ("DEFAULTS", "NOTES", "NOT_APPLICABLE"))
    # The benchmark modules and viz name no mechanism outside docs and examples.
    code = "\n".join(
        p.read_text()
        for p in [pathlib.Path(configs.__file__), pathlib.Path(fidelity.__file__), pathlib.Path(viz.__file__)]
    )
    for name in attnzoo.names(family="sparse"):
        if name not in ("global", "pattern", "local"):  # also ordinary words / the docstring example
            assert f'"{name}"' not in code, name


# --- layer geometry: one Shape, filled into the fields a config has ----------------------------

GEOMETRY = attnzoo.Shape(heads=3, head_dim=5, value_dim=7, max_len=11)


@pytest.mark.parametrize("name", attnzoo.names())
def test_build_with_a_shape_fills_exactly_the_geometry_fields_the_config_has(name):
    spec = attnzoo.describe(name)
    filled = attnzoo.registry.make_config(name, shape=GEOMETRY)
    default = spec.config()
    geometry = dataclasses.asdict(GEOMETRY)
    for f in dataclasses.fields(spec.config):
        want = geometry[f.name] if f.name in geometry else getattr(default, f.name)
        assert getattr(filled, f.name) == want, f.name


def test_a_field_the_caller_sets_wins_over_the_shape_and_an_empty_shape_changes_nothing():
    synth = attnzoo.build("synthesizer", shape=GEOMETRY, heads=2, max_len=16)
    assert (synth.config.heads, synth.config.head_dim, synth.config.max_len) == (2, 5, 16)
    assert attnzoo.build("synthesizer", shape=attnzoo.Shape()).config == attnzoo.build("synthesizer").config
    assert attnzoo.build("softmax", shape=GEOMETRY).config == attnzoo.build("softmax").config


def test_a_shape_is_checked_and_must_be_a_shape():
    with pytest.raises(ValueError, match="heads must be an int >= 1"):
        attnzoo.Shape(heads=0)
    with pytest.raises(ValueError, match="max_len"):
        attnzoo.Shape(max_len=True)
    with pytest.raises(TypeError, match="attnzoo.Shape"):
        attnzoo.build("synthesizer", shape={"heads": 2})


def test_no_layer_asks_which_geometry_fields_a_mechanism_has():
    """Geometry reaches configs through ``Shape`` alone: no ``config_fields`` probe for it, no
    hand-written state-dict hook to create parameters that a Shape creates at construction."""
    import pathlib
    import re

    root = pathlib.Path(attnzoo.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"\"(heads|head_dim|max_len)\" in config_fields", text), path
        if path.name != "attention.py":  # MultiHeadAttention's old-key alias only (not geometry)
            assert "def _load_from_state_dict" not in text, path


def test_every_causal_mechanism_says_how_it_decodes_or_why_not():
    # One note per causal attention mechanism, read by `attnzoo list --decode` and the README:
    # "decode step: <state, cost per token>" when it decodes, "no decode step: <why>" when not.
    for name in attnzoo.names(kind="attention", causal=True):
        spec = attnzoo.describe(name)
        notes = [n for n in spec.notes if n.startswith(("decode step: ", "no decode step: "))]
        assert len(notes) == 1, f"{name}: {len(notes)} decode notes"
        assert notes[0].startswith("decode step: ") == spec.capabilities.decode_step, name


def test_a_list_where_a_tuple_is_declared_becomes_the_tuple():
    cfg = attnzoo.build("longformer", left=4, right=4, global_indices=[0, 3]).config
    assert cfg.global_indices == (0, 3) and hash(cfg) == hash(
        attnzoo.build("longformer", left=4, right=4, global_indices=(0, 3)).config
    )
    with pytest.raises(TypeError, match="global_indices"):
        attnzoo.build("longformer", left=4, right=4, global_indices=["a"])
