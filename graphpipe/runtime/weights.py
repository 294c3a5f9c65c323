"""Weight policies: which weights each forward and backward uses, and when the optimizer steps.

One small object per stage and rank. The executor asks it to run every forward and backward,
and hands it every update action (`U`) of the schedule:

    policy.forward(j, run)     run(weights) for micro-batch j; weights None = the live ones
    policy.backward(j, run)    run() the backward of micro-batch j
    policy.update(j)           the schedule's update action (j None when flushed)

    flush   one version; gradients of the M micro-batches accumulate; one optimizer step per
            mini-batch, after the gradients are summed over replicas and tied copies. The
            loss of each micro-batch is scaled by 1/M, so a step equals one step on the mean
            loss of the mini-batch (gradient accumulation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.runtime.sync import GradSync

__all__ = ["POLICIES", "Flush", "WeightPolicy", "make_policy"]

T = TypeVar("T")
Weights = dict[str, torch.Tensor] | None


class WeightPolicy:
    """Base class: the live parameters for everything, a step per update action.

    Args:
        module: The stage module.
        optimizer: Its optimizer.
        sync: Sums gradients over replicas and tied copies.
        micro_batches: M.
    """

    name = "base"

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync: GradSync,
        micro_batches: int,
    ) -> None:
        self.module, self.optimizer, self.sync, self.m = module, optimizer, sync, micro_batches
        self.log: list[tuple[str, int, int]] = []  # (pass, micro-batch, version)
        self.version = 0  # optimizer steps taken

    def loss_scale(self) -> float:
        """What each micro-batch's loss is multiplied by before its backward."""
        return 1.0 / self.m

    def forward(self, j: int, run: Callable[[Weights], T]) -> T:
        """Run micro-batch j's forward with the weights it should see."""
        self.log.append(("F", j, self.version))
        return run(None)

    def backward(self, j: int, run: Callable[[], None]) -> None:
        """Run micro-batch j's backward (its autograd graph already holds the weights)."""
        self.log.append(("B", j, self.version))
        run()

    def update(self, j: int | None) -> None:
        """The schedule's update action: sum gradients, step, clear them."""
        self.sync()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def copies(self) -> int:
        """Copies of the weights this stage holds now (the live ones included)."""
        return 1

    def state(self) -> dict[str, Any]:
        """Extra state a resume needs beyond the parameters (none for flush)."""
        return {}


class Flush(WeightPolicy):
    """One version, gradient accumulation over the mini-batch, one step per mini-batch."""

    name = "flush"


POLICIES: dict[str, type[WeightPolicy]] = {"flush": Flush}


def make_policy(name: str, *args: Any, **kwargs: Any) -> WeightPolicy:
    """The policy called `name`.

    Raises:
        ConfigError: an unknown policy, naming the known ones.
    """
    if name not in POLICIES:
        raise ConfigError(f"unknown weight policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](*args, **kwargs)
