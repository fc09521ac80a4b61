"""Training checkpoints in safetensors: model weights, AdamW state, RNG state and the run's
bookkeeping (config, step, best validation score) in the file's metadata.

A checkpoint is written to a temporary file and renamed into place, so a run killed while
saving still finds the previous complete checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

_OPTIM = "optim."
_MODEL = "model."
_RNG = "rng.torch"


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, meta: dict[str, Any]) -> None:
    """Write ``model`` (and ``optimizer``, if given) with ``meta`` (JSON-able) atomically to ``path``."""
    # Copies, because safetensors refuses tensors that share memory (tied or shared weights,
    # e.g. Linformer's shared projections); load_state_dict writes each copy back to its owner.
    tensors = {_MODEL + key: value.detach().cpu().clone() for key, value in model.state_dict().items()}
    meta = dict(meta)
    if optimizer is not None:
        state = optimizer.state_dict()
        for index, slots in state["state"].items():
            for slot, value in slots.items():
                tensors[f"{_OPTIM}{index}.{slot}"] = torch.as_tensor(value).detach().cpu().contiguous()
        meta["param_groups"] = state["param_groups"]
        tensors[_RNG] = torch.get_rng_state()
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"attnzoo": json.dumps(meta, default=str)})
    os.replace(tmp, path)


def read_meta(path: Path) -> dict[str, Any]:
    """The bookkeeping stored with a checkpoint, without loading its tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return json.loads(handle.metadata()["attnzoo"])


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Restore what ``save`` wrote into ``model`` (and ``optimizer`` and the torch RNG); returns the meta."""
    tensors = load_file(str(path))
    meta = read_meta(path)
    device = next(model.parameters()).device
    model.load_state_dict({key[len(_MODEL):]: value for key, value in tensors.items() if key.startswith(_MODEL)})
    if optimizer is not None:
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith(_OPTIM):
                index, slot = key[len(_OPTIM):].split(".", 1)
                # AdamW keeps its step counter on the CPU; moments live with the parameters.
                state.setdefault(int(index), {})[slot] = value if slot == "step" else value.to(device)
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        torch.set_rng_state(tensors[_RNG])
    return meta
