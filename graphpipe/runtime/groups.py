"""Where gradients are summed: process groups for replicated stages and tied weights.

Every rank creates the same groups in the same order (`make_groups` is a collective); each
rank's `GradSync` then sums its own parameters' gradients over the groups it is in.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.ir.registry import schedule_spec
from graphpipe.runtime.failures import guarded
from graphpipe.runtime.mesh import ParallelLayout
from graphpipe.runtime.refusals import refusal
from graphpipe.runtime.spec import RunSpec
from graphpipe.runtime.sync import GradSync, SyncGroup, make_groups

__all__ = ["Modules", "own_copies", "scale_group", "sum_groups", "update_group"]

Modules = dict[int, tuple[Any, Any]]  # stage index -> (its module, its StageIO)


def sum_groups(
    plan: Plan,
    spec: RunSpec,
    schedule: str,
    rank: int,
    canon: dict[str, str],
    modules: Modules,
    mine: tuple[int, ...],
    layout: ParallelLayout | None = None,
    whole: bool = False,
) -> tuple[GradSync, dict[str, tuple[int, ...]]]:
    """Gradient sums over replicas and tied copies; groups created in the same order
    everywhere. Also returns the tied names, each with the stages holding it.

    Under a mesh a weight tied across pp ranks is summed as Megatron-LM sums its embedding
    group: one group per dp and tp coordinate (d, t) holds the global ranks
    `layout.ranks[p][d][t]` of the pp ranks p that hold it, and sums their local shards
    (each holder's FSDP2 reduce-scatter over dp comes first, in its backward; the shards of
    one coordinate are the same rows of the same tensor on every holder). The group's
    parameters are FSDP2's sharded ones once the stages are sharded (`GradSync.rebind`).

    A weight tied across two stages of this rank is one tensor there, except where FSDP2
    wraps the stages (a "dp" dimension; `whole` stages run one stage per device, under
    async or 2bw): each stage is an FSDP2 root of its own, so every stage after the first
    gets a copy of its own, of equal values, before it is wrapped (`own_copies`); the
    GradSync adds the copies' gradients on this rank after FSDP2's reduce-scatter, sums
    that over the tie's group where the tie spans other pp ranks too, and gives every copy
    the sum (`GradSync.copies`).

    With `whole` (a versioned weight policy under a mesh: each dp rank keeps its stages
    whole, no FSDP2) one group per pp device p and tp index t holds the dp ranks
    `layout.ranks[p][d][t]`, d = 0..dp-1, and averages every parameter of the rank's stages
    over them (`SyncGroup.mean`: each dp rank ran its slice of every micro-batch, and the
    mean of the slices' gradients of their mean losses is the whole micro-batch's), at each
    update of the policy, i.e. once per weight version, as PipeDream-2BW does.

    Raises:
        ConfigError: a weight tied across ranks under an asynchronous schedule, or across
            two stages of one pp rank under a mesh in a model on the meta device, on every
            rank alike, before any collective.
    """
    meshed = layout is not None and layout.meshed
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
        _refuse_tied(tied[0], spec.numerics.weights, schedule)
    copies = _doubled(plan, shared, modules, canon, mine, layout, whole) if meshed else []
    over_dp: list[tuple[tuple[int, ...], str]] = []
    if meshed:
        assert layout is not None
        tied = _per_coordinate(tied, layout)
        rank = layout.rank
        if whole and layout.dp > 1:
            over_dp = _over_dp(plan, layout)
    memberships = replicas + tied + over_dp
    groups = make_groups(memberships, rank, spec.runtime.timeout)
    local: dict[str, Any] = {}  # canonical name -> its first copy on this rank
    for index in mine:
        for n, p in modules[index][0].named_parameters():
            local.setdefault(canon.get(n, n), p)
    sums: list[SyncGroup] = []
    for (ranks, label), group in zip(memberships, groups, strict=True):
        if label.startswith("tied "):
            params = [local[label[5:]]] if label[5:] in local else []
        elif label.startswith("dp "):
            params = list(local.values())
        else:
            params = [p for n, p in local.items() if n not in shared]
        sums.append(SyncGroup(ranks, group, params, label, mean=label.startswith("dp ")))
    return GradSync(sums, copies=copies), shared


def _over_dp(plan: Plan, layout: ParallelLayout) -> list[tuple[tuple[int, ...], str]]:
    """The dp ranks of each busy pp device p and tp index t, in global ranks, the same list
    on every rank: `make_groups` gives this rank its own (p, t)'s."""
    busy = sorted({d for s in plan.stages for d in s.devices})
    return [
        (tuple(layout.ranks[p][d][t] for d in range(layout.dp)), f"dp ranks of pp device {p}")
        for p in busy
        for t in range(layout.tp)
    ]


def _refuse_meta(
    doubled: dict[str, tuple[int, ...]], modules: Modules, canon: dict[str, str]
) -> None:
    """Raises: ConfigError: a weight tied across two stages of one pp rank under a mesh, in
    a model on the meta device (every stage's module is on every rank, so every rank
    refuses alike)."""
    for name, held in doubled.items():
        module = modules[held[0]][0]
        if any(p.is_meta for n, p in module.named_parameters() if canon.get(n, n) == name):
            subject = f"{name} is held by stages {list(held)} on one pp rank, on meta"
            raise ConfigError(refusal("meta-tie-one-rank", subject))


def own_copies(modules: Modules, mine: tuple[int, ...], canon: dict[str, str]) -> list[list[Any]]:
    """Give each of this rank's stages its own copy of a weight an earlier stage of the rank
    holds (equal values, under every name the stage reads it by), so that each stage's
    FSDP2 root shards a parameter of its own; in place, before the stages are wrapped.

    The copies get the same gradient (their sum, `GradSync`) and so step identically; the
    optimizer keeps a state for each, duplicated and identical. A checkpoint and
    `pm.state_dict()` show one value under the canonical name, and a load fills every copy
    (`graphpipe.runtime.checkpoint`, `graphpipe.runtime.state`).

    Args:
        modules: Every stage's module.
        mine: This rank's stages, in order.
        canon: Every name -> the first name of its tensor.

    Returns:
        Per tied weight this rank's stages hold twice, its copies, the first stage's first.
    """
    seen: dict[int, Any] = {}  # id of a tensor an earlier stage holds -> that tensor
    copies: dict[str, list[Any]] = {}
    for index in mine:
        stage = modules[index][0]
        held = list(stage.named_parameters(remove_duplicate=False))
        made: dict[int, Any] = {}  # the original's id -> this stage's copy
        for name, p in held:
            if id(p) not in seen:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                copies.setdefault(canon.get(name, name), [p]).append(made[id(p)])
            *path, leaf = name.split(".")
            setattr(stage.get_submodule(".".join(path)), leaf, made[id(p)])
        seen.update((id(p), p) for _, p in held)
    return list(copies.values())


def _doubled(
    plan: Plan,
    shared: dict[str, tuple[int, ...]],
    modules: Modules,
    canon: dict[str, str],
    mine: tuple[int, ...],
    layout: ParallelLayout | None,
    whole: bool,
) -> list[list[Any]]:
    """Under a mesh, the copies `own_copies` gives this rank's stages of the weights tied
    across two stages of one pp rank, where FSDP2 wraps each stage (none: one tensor).

    Raises:
        ConfigError: such a weight in a model on the meta device (`meta-tie-one-rank`).
    """
    doubled = {  # on one rank, in two of its stages
        name: held for name, held in shared.items() if _on_one_rank_twice(held, plan.stages)
    }
    if not doubled:
        return []
    _refuse_meta(doubled, modules, canon)
    fsdp = layout is not None and layout.fsdp and not whole  # each stage an FSDP2 root
    return own_copies(modules, mine, canon) if fsdp else []


def _on_one_rank_twice(held: tuple[int, ...], stages: Any) -> bool:
    """Whether two of the stages `held` run on one device."""
    devices = [d for t in held for d in stages[t].devices]
    return len(devices) != len(set(devices))


def _per_coordinate(
    tied: list[tuple[tuple[int, ...], str]], layout: ParallelLayout
) -> list[tuple[tuple[int, ...], str]]:
    """Each tie across pp ranks as one membership per dp and tp coordinate (d, t), in global
    ranks, the same list on every rank: `make_groups` gives this rank its own (d, t)'s."""
    return [
        (tuple(layout.ranks[p][d][t] for p in ranks), label)
        for ranks, label in tied
        for d in range(layout.dp)
        for t in range(layout.tp)
    ]


def _refuse_tied(tied: tuple[tuple[int, ...], str], weights: str, schedule: str) -> None:
    """Raises: ConfigError: a weight tied across ranks cannot be summed asynchronously."""
    ranks, label = tied
    subject = (
        f"weights={weights!r} cannot keep a weight tied across ranks under {schedule}: "
        f"{label[5:]} is held on ranks {list(ranks)}"
    )
    raise ConfigError(refusal("async-tie", subject))


def update_group(plan: Plan, timeout: float, layout: ParallelLayout) -> dist.ProcessGroup | None:
    """The ranks that agree on an update (clipping's norm, fp16's overflow): every busy plan
    device's process for this rank's dp index (a collective: every rank, same order).

    Under a mesh, one group per dp and tp index (d, t) holds the global ranks
    `layout.ranks[p][d][t]` of the busy plan devices p; each rank gets its own (d, t)'s. The
    dp and tp ranks of a stage need no part in it: their shards' norm is already whole on
    each of them (DTensor gradients, `graphpipe.runtime.clip`), so one pp sum per (d, t)
    counts every stage once, where a sum over all ranks would count each dp x tp times.

    Args:
        plan: The plan (which devices hold a stage).
        timeout: Seconds for the group's collectives.
        layout: This process's place in the mesh (the identity without one).

    Returns:
        The group; None when it is every rank (no mesh, no idle device).
    """
    busy = sorted({d for s in plan.stages for d in s.devices})
    if layout.dp == 1 and layout.tp == 1 and len(busy) == dist.get_world_size():
        return None
    wait = datetime.timedelta(seconds=timeout)
    groups = {
        (d, t): _new_group([layout.ranks[p][d][t] for p in busy], wait)
        for d in range(layout.dp)
        for t in range(layout.tp)
    }
    return groups[(layout.dp_index, layout.tp_index)]


def scale_group(plan: Plan, timeout: float, layout: ParallelLayout) -> dist.ProcessGroup | None:
    """The ranks that agree on fp16's loss scale: every rank of every busy plan device, at
    every dp and tp coordinate (a collective: every rank, same order). A dp rank's gradient
    shard can overflow where its peers' do not, so the found-inf flag is reduced over all of
    them, where clipping's norm needs only one pp sum per (d, t) (`update_group`).

    Returns:
        The group; None when it is every rank.
    """
    busy = sorted({d for s in plan.stages for d in s.devices})
    ranks = sorted(
        layout.ranks[p][d][t] for p in busy for d in range(layout.dp) for t in range(layout.tp)
    )
    if len(ranks) == dist.get_world_size():
        return None
    return _new_group(ranks, datetime.timedelta(seconds=timeout))


def _new_group(ranks: list[int], timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group of `ranks` (a collective: every rank calls it)."""
    return guarded("the update group's creation", lambda: dist.new_group(ranks, timeout=timeout))
