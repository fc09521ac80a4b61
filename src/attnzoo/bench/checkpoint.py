"""Training checkpoints in safetensors: model weights, AdamW state, RNG state and the run's
bookkeeping (config, step, best validation score) in the file's metadata.

A checkpoint is written to a temporary file and renamed into place, so a run killed while
saving still finds the previous complete checkpoint. With ``keep_previous`` the checkpoint it
replaces stays beside it as ``<name>.prev.safetensors``: a checkpoint damaged later (a full disk,
a bad copy) can be swapped for the one before it. A file that cannot be read raises a
``ValueError`` that names it and says how to go on."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

_OPTIM = "optim."
_MODEL = "model."
_RNG = "rng.torch"


def previous(path: Path) -> Path:
    """Where ``save(..., keep_previous=True)`` keeps the checkpoint that ``path`` held before."""
    return path.with_name(path.stem + ".prev" + path.suffix)


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any],
    *,
    keep_previous: bool = False,
) -> None:
    """Write ``model`` (and ``optimizer``, if given) with ``meta`` (JSON-able) atomically to ``path``."""
    tensors, aliases = _model_tensors(model)
    meta = {**meta, "aliases": aliases}
    if optimizer is not None:
        state = optimizer.state_dict()
        for index, slots in state["state"].items():
            for slot, value in slots.items():
                tensors[f"{_OPTIM}{index}.{slot}"] = torch.as_tensor(value).detach().cpu().contiguous()
        meta["param_groups"] = state["param_groups"]
        tensors[_RNG] = torch.get_rng_state()
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"attnzoo": json.dumps(meta, default=str)})
    if keep_previous and path.exists():
        _keep(path, previous(path))
    os.replace(tmp, path)


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's state with each tensor stored once: a key whose tensor is another key's (tied
    weights: an embedding tied to the output head) is kept as an alias ``{key: stored key}``."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, value in model.state_dict().items():
        same = (
            value.device,
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            value.stride(),
            value.dtype,
        )
        if value.numel() and same in seen:
            aliases[key] = seen[same]
            continue
        seen[same] = key
        tensors[_MODEL + key] = value.detach().cpu().contiguous()
    return tensors, aliases


def _keep(path: Path, prev: Path) -> None:
    # A hard link (a copy where links are not supported), so ``path`` exists at every moment.
    tmp = prev.with_name(prev.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:
        shutil.copyfile(path, tmp)
    os.replace(tmp, prev)


def _unreadable(path: Path, error: Exception) -> ValueError:
    if isinstance(error, FileNotFoundError) or not path.exists():
        return ValueError(f"checkpoint {path} does not exist")
    prev = previous(path)
    if prev.exists():
        fix = (
            f"the checkpoint saved before it is {prev}: move it over the damaged one "
            f"(mv {prev} {path}) and run the same command again to resume from there"
        )
    else:
        fix = "there is no earlier checkpoint beside it; delete it to start over"
    return ValueError(f"checkpoint {path} cannot be read (truncated or not a checkpoint: {error}); {fix}")


def read_meta(path: Path) -> dict[str, Any]:
    """The bookkeeping stored with a checkpoint, without loading its tensors."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            return json.loads(handle.metadata()["attnzoo"])
    except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise _unreadable(path, error) from error


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Restore what ``save`` wrote into ``model`` (and ``optimizer`` and the torch RNG); returns the meta."""
    path = Path(path)
    meta = read_meta(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise _unreadable(path, error) from error
    device = next(model.parameters()).device
    weights = {key[len(_MODEL) :]: value for key, value in tensors.items() if key.startswith(_MODEL)}
    weights.update({key: weights[stored] for key, stored in meta.get("aliases", {}).items()})
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise ValueError(f"checkpoint {path} holds another model's weights: {' '.join(str(error).split())}") from error
    if optimizer is not None:
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith(_OPTIM):
                index, slot = key[len(_OPTIM) :].split(".", 1)
                # AdamW keeps its step counter on the CPU; moments live with the parameters.
                state.setdefault(int(index), {})[slot] = value if slot == "step" else value.to(device)
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        torch.set_rng_state(tensors[_RNG])
    return meta
