"""Where gradients are summed: process groups for replicated stages and tied weights.

Every rank creates the same groups in the same order (`make_groups` is a collective); each
rank's `GradSync` then sums its own parameters' gradients over the groups it is in.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.ir.registry import schedule_spec
from graphpipe.runtime.failures import guarded
from graphpipe.runtime.mesh import MeshLayout
from graphpipe.runtime.spec import RunSpec
from graphpipe.runtime.sync import GradSync, SyncGroup, make_groups

__all__ = ["Modules", "sum_groups", "update_group"]

Modules = dict[int, tuple[Any, Any]]  # stage index -> (its module, its StageIO)


def sum_groups(
    plan: Plan,
    spec: RunSpec,
    schedule: str,
    rank: int,
    canon: dict[str, str],
    modules: Modules,
    mine: tuple[int, ...],
    meshed: bool = False,
) -> tuple[GradSync, dict[str, tuple[int, ...]]]:
    """Gradient sums over replicas and tied copies; groups created in the same order
    everywhere. Also returns the tied names, each with the stages holding it.

    Raises:
        ConfigError: a weight tied across ranks under an asynchronous schedule or a mesh
            (on every rank alike, before any collective).
    """
    holders: dict[str, set[int]] = {}
    for index, (module, _) in modules.items():
        for n, _p in module.named_parameters():
            holders.setdefault(canon.get(n, n), set()).add(index)
    shared = {n: tuple(sorted(s)) for n, s in sorted(holders.items()) if len(s) > 1}
    stages = plan.stages
    replicas = [(s.devices, f"stage {s.index} replicas") for s in stages if s.replicas > 1]
    tied = [  # copies held by one rank's stages are one tensor there: nothing to sum
        (ranks, f"tied {name}")
        for name, held in shared.items()
        if len(ranks := tuple(sorted({d for t in held for d in stages[t].devices}))) > 1
    ]
    if tied and schedule_spec(schedule).asynchronous:
        _refuse_tied(tied[0], spec.weights, schedule)
    if tied and meshed:
        ranks, label = tied[0]
        raise ConfigError(
            f"a weight tied across pp ranks is not yet summed with a mesh (FSDP2 per stage; "
            f"planned): {label[5:]} is held on pp ranks {list(ranks)}; pin the stages that "
            "share it onto one device, or give the modules copies of their own"
        )
    if shared and meshed:  # on one rank, in two of its stages: FSDP2 shards per stage
        name, held = next(iter(shared.items()))
        raise ConfigError(
            f"a weight tied across stages is not yet run with a mesh (FSDP2 per stage; "
            f"planned): {name} is held by stages {list(held)} on one pp rank, and each "
            "stage's fully_shard would make a sharded copy of its own; put its readers in "
            "one stage, or give the modules copies of their own"
        )
    groups = make_groups(replicas + tied, rank, spec.runtime.timeout)
    local = {canon.get(n, n): p for index in mine for n, p in modules[index][0].named_parameters()}
    sums: list[SyncGroup] = []
    for (ranks, label), group in zip(replicas + tied, groups, strict=True):
        if label.startswith("tied "):
            params = [local[label[5:]]] if label[5:] in local else []
        else:
            params = [p for n, p in local.items() if n not in shared]
        sums.append(SyncGroup(ranks, group, params, label))
    return GradSync(sums), shared


def _refuse_tied(tied: tuple[tuple[int, ...], str], weights: str, schedule: str) -> None:
    """Raises: ConfigError: a weight tied across ranks cannot be summed asynchronously."""
    ranks, label = tied
    raise ConfigError(
        f"weights={weights!r} cannot keep a weight tied across ranks: {label[5:]} is "
        f"held on ranks {list(ranks)}, whose stages update at different points of the "
        f"{schedule} schedule, so its copies' gradients have no moment to be "
        "summed; use weights='flush', which sums them before each update, or give "
        "the modules that share it copies of their own"
    )


def update_group(plan: Plan, timeout: float, layout: MeshLayout) -> dist.ProcessGroup | None:
    """The ranks that agree on an update (clipping's norm, fp16's overflow): every busy plan
    device's process for this rank's dp index (a collective: every rank, same order).

    Under a mesh, one group per dp index d holds the global ranks `layout.ranks[p][d]` of
    the busy plan devices p; each rank gets its own d's. The dp ranks of a stage need no
    part in it: their shards' norm is already whole on each of them (FSDP2's DTensor
    gradients, `graphpipe.runtime.clip`), so one pp sum per dp index counts every stage
    once, where a sum over all ranks would count each dp times.

    Args:
        plan: The plan (which devices hold a stage).
        timeout: Seconds for the group's collectives.
        layout: This process's place in the mesh (the identity without one).

    Returns:
        The group; None when it is every rank (no mesh, no idle device).
    """
    busy = sorted({d for s in plan.stages for d in s.devices})
    if layout.dp == 1 and len(busy) == dist.get_world_size():
        return None
    wait = datetime.timedelta(seconds=timeout)
    groups = [_new_group([layout.ranks[p][d] for p in busy], wait) for d in range(layout.dp)]
    return groups[layout.dp_index]


def _new_group(ranks: list[int], timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group of `ranks` (a collective: every rank calls it)."""
    return guarded("the update group's creation", lambda: dist.new_group(ranks, timeout=timeout))
