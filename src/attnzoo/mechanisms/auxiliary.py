"""Auxiliary losses: a mechanism whose own parameters the task loss cannot reach (``dsa``'s
lightning indexer sits behind a discrete top-k) leaves a loss of its own in each training-mode
forward, and a training loop adds ``auxiliary_loss(model)`` to its task loss. A module holds at
most the latest forward's loss, so one that is never taken does not pile up graphs."""

from __future__ import annotations

from torch import Tensor, nn

_ATTRIBUTE = "_auxiliary_loss"


def leave_auxiliary_loss(module: nn.Module, loss: Tensor) -> None:
    """Keep ``loss`` on ``module`` until ``auxiliary_loss`` takes it (replacing an untaken one)."""
    setattr(module, _ATTRIBUTE, loss)


def auxiliary_loss(model: nn.Module) -> Tensor | None:
    """The sum of the auxiliary losses the modules of ``model`` left in their latest
    training-mode forward, each cleared as it is taken; None when none left one. Add it to the
    task loss before ``backward()``: such a loss reaches only the parameters it trains."""
    losses = []
    for module in model.modules():
        loss = module.__dict__.pop(_ATTRIBUTE, None)
        if loss is not None:
            losses.append(loss)
    return sum(losses[1:], losses[0]) if losses else None
