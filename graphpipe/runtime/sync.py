"""Gradient reduction between the ranks that hold the same parameters.

Two kinds of group, both made once at compile time, identically on every rank:
- replicas: the devices of a data-parallel stage; every gradient of the stage is summed
  over them (each replica saw its share of the micro-batches);
- holders of a shared parameter: stages that each hold a copy of a tied weight (its canonical
  name is the same); the copies' gradients are summed, so the copies stay identical.

Gradients are flattened into one buffer per group and summed with one all-reduce.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.errors import PipelineError

__all__ = ["GradSync", "SyncGroup", "make_groups"]


@dataclass
class SyncGroup:
    """One all-reduce: a process group and the local parameters it sums."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None  # None when this rank is not a member
    params: list[nn.Parameter]
    label: str


def make_groups(
    memberships: Sequence[tuple[tuple[int, ...], str]], rank: int, timeout: float
) -> list[dist.ProcessGroup | None]:
    """Create one process group per (ranks, label), in order, on every rank (a collective)."""
    groups = []
    for ranks, _ in memberships:
        group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout))
        groups.append(group if rank in ranks else None)
    return groups


class GradSync:
    """Sums gradients within every group this rank belongs to, in a fixed order."""

    def __init__(self, groups: Sequence[SyncGroup]) -> None:
        self.groups = [g for g in groups if g.group is not None and g.params]

    def broadcast(self) -> None:
        """Make every copy equal to its group's first rank's: tied copies and replicas that
        were initialised separately (a model materialised from the meta device)."""
        with torch.no_grad():
            for g in self.groups:
                for p in g.params:
                    dist.broadcast(p, src=g.ranks[0], group=g.group)

    def __call__(self) -> None:
        for g in self.groups:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params]
            flat = torch.cat([t.reshape(-1) for t in grads])
            try:
                dist.all_reduce(flat, group=g.group)
            except RuntimeError as exc:
                raise PipelineError(
                    f"all-reduce of {g.label} over ranks {list(g.ranks)} failed: "
                    f"{str(exc).splitlines()[0]}"
                ) from exc
            at = 0
            for p in g.params:
                n = p.numel()
                p.grad = flat[at : at + n].view_as(p).clone()
                at += n
