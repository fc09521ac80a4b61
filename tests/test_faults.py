"""Nothing silent under bad input and faults (issue 14): state dicts, empty inputs, dtype and
device at the layer boundary, refusals, and the command line's errors and failed runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import attnzoo
from attnzoo.bench import checkpoint
from attnzoo.bench.configs import sized
from attnzoo.nn import MultiHeadAttention

ATTENTION = attnzoo.names(kind="attention")
N = 16  # every mechanism's sized config fits this length (axial and block2d on a 4x4 grid)


def _mha(name: str) -> MultiHeadAttention:
    return MultiHeadAttention(32, 2, name, **sized(name, N))


# --- one registration per mechanism: complete, storable state dicts ---------------------------


@pytest.mark.parametrize("name", ATTENTION)
def test_state_dict_saves_with_safetensors_and_is_complete_before_the_first_forward(name, tmp_path):
    mha = _mha(name)
    before = mha.state_dict()
    save_file(before, str(tmp_path / "mha.safetensors"))  # refuses tensors that share memory
    assert not any(key.startswith("attn.") for key in before), "the mechanism is registered twice"
    mha(torch.randn(2, N, 32))
    assert list(mha.state_dict()) == list(before)
    # And the file loads back into a fresh layer (strict: no key missing or left over).
    fresh = _mha(name)
    fresh.load_state_dict(load_file(str(tmp_path / "mha.safetensors")))


def test_a_checkpoint_with_the_old_duplicate_keys_still_loads():
    mha = _mha("sinkhorn")
    state = mha.state_dict()
    old = {**state, **{"attn." + key[len("mechanisms.0."):]: value for key, value in state.items()
                       if key.startswith("mechanisms.0.")}}
    assert len(old) > len(state)
    fresh = _mha("sinkhorn")
    fresh.load_state_dict(old)  # strict
    assert all(torch.equal(fresh.state_dict()[key], value) for key, value in state.items())


def test_checkpoint_stores_a_tied_weight_once_and_keeps_it_tied(tmp_path):
    lm = attnzoo.nn.SHARNN(vocab_size=11, dim=8, depth=1)  # the head is tied to the embedding
    checkpoint.save(tmp_path / "lm.safetensors", lm, None, {})
    stored = load_file(str(tmp_path / "lm.safetensors"))
    assert "model.embed.weight" in stored and "model.head.weight" not in stored
    clone = attnzoo.nn.SHARNN(vocab_size=11, dim=8, depth=1)
    checkpoint.load(tmp_path / "lm.safetensors", clone)
    assert clone.head.weight is clone.embed.weight and torch.equal(clone.embed.weight, lm.embed.weight)
