"""The collectives every public call of a PipelinedModel makes, under the failure watch.

One small object, shared by the pipeline's parts (stepping, inference, state, timelines), so
each collective has one place where it is issued (and where a test can replace it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.runtime.failures import guarded, guarded_work

__all__ = ["Collectives", "gather_objects"]


class Collectives:
    """Gathers and sums across every rank of the default process group.

    Args:
        device: This rank's device (where sums of scalars are made).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def all_reduce(self, t: torch.Tensor, what: str) -> None:
        """Sum `t` in place over every rank; `what` names it in a failure. Its Work is
        waited for on this thread (`guarded_work`)."""
        guarded_work(f"the all-reduce of {what}", lambda: dist.all_reduce(t, async_op=True))

    def gather(self, mine: Any, what: str) -> list[Any]:
        """`mine` from every rank, by rank; `what` names it in a failure."""
        return gather_objects(mine, what)

    def mean_loss(self, losses: Iterable[torch.Tensor], m: int) -> float:
        """The mean of the M micro-batch losses held across the ranks, on every rank: one
        device-to-host copy per call.

        Args:
            losses: This rank's micro-batch losses (scalars on its device), maybe none.
            m: M, the micro-batches of the call.
        """
        held = list(losses)
        total = (
            torch.stack(held).sum().to(torch.float64).reshape(1)
            if held
            else torch.zeros(1, dtype=torch.float64, device=self.device)
        )
        self.all_reduce(total, "the loss")
        return float(total.item()) / m


def gather_objects(mine: Any, what: str, timeout: float | None = None) -> list[Any]:
    """`mine` from every rank of the default process group, by rank, under the watch
    (`guarded`); `what` names it in a failure; `timeout`: the watch's by default."""
    gathered: list[Any] = [None] * dist.get_world_size()
    guarded(
        f"the gather of {what}", lambda: dist.all_gather_object(gathered, mine), timeout=timeout
    )
    return gathered
