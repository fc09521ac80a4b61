"""The registry: names, describe, build, config validation; checked for every registered entry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.registry import Config, config_fields, register
from attnzoo.spec import Capabilities, Complexity

ALL = attnzoo.names()


def test_softmax_is_registered_with_capabilities():
    assert "softmax" in ALL
    spec = attnzoo.describe("softmax")
    assert spec.family == "exact" and "1706.03762" in spec.paper
    caps = spec.capabilities
    assert caps.causal and caps.key_padding and caps.decode_step and caps.cross_attention
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
            capabilities=Capabilities(causal=False, key_padding=False),
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
            capabilities=Capabilities(causal=False, key_padding=False),
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
        def _attend(self, q, k, v, *, causal, key_padding_mask, score_mod):
            return v

    register(
        "_test_no_causal",
        config=NoCausalConfig,
        family="test",
        summary="t",
        paper="t",
        capabilities=Capabilities(causal=False, key_padding=False),
        complexity=Complexity(time="O(1)", memory="O(1)"),
    )(NoCausal)
    q = torch.randn(1, 1, 3, 4)
    module = attnzoo.build("_test_no_causal")
    assert torch.equal(module(q, q, q), q)
    with pytest.raises(ValueError, match="does not support causal=True; mechanisms that do: .*softmax"):
        module(q, q, q, causal=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        module(q, q, q, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="self-attention only"):
        module(q, q[:, :, :2], q[:, :, :2])
    with pytest.raises(ValueError, match="decode step"):
        module.init_state(1, 1, 4, 4)
