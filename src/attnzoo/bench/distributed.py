"""The one place that knows about torchrun: process group, device, and the few collectives
the trainer needs. Single-process runs (no ``WORLD_SIZE`` in the environment) touch none of it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn


@dataclass(frozen=True)
class Distributed:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str | None = None) -> Distributed:
        """Read torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; start the process group (nccl
        when CUDA is used, gloo otherwise) when there is more than one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        chosen = pick_device(device, local, world)
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        if world > 1 and not torch_dist.is_initialized():
            torch_dist.init_process_group("nccl" if chosen.type == "cuda" else "gloo")
        return cls(rank, world, chosen)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def sum(self, value: int | float) -> int | float:
        if self.world == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(tensor)
        return type(value)(tensor.item())

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, True on every process when it is True on any (a stop signal seen by one
        stops all); one collective for all of them."""
        if self.world == 1:
            return tuple(bool(f) for f in flags)
        tensor = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=self.device)
        torch_dist.all_reduce(tensor)
        return tuple(bool(v) for v in tensor.tolist())

    def gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        torch_dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            torch_dist.barrier()

    def close(self) -> None:
        if self.world > 1 and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def pick_device(device: str | None, local: int = 0, world: int = 1) -> torch.device:
    """The device a process trains on: ``device`` ("cpu", "cuda" or "cuda:N"; default cuda when
    available), under torchrun cuda:LOCAL_RANK. Anything else, or a GPU that is not there, is a
    ``ValueError`` naming the device, never a silent run on the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name; pass cpu or cuda (or cuda:N)") from None
    if chosen.type == "cpu":
        return torch.device("cpu")
    if chosen.type != "cuda":
        raise ValueError(f"device {device!r}: the trainer runs on cpu or cuda, not {chosen.type}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA device; pass --device cpu")
    if chosen.index is not None and world > 1:
        raise ValueError(f"device {device!r}: under torchrun each process takes cuda:LOCAL_RANK; pass --device cuda")
    index = local if chosen.index is None else chosen.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device cuda:{index} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)
