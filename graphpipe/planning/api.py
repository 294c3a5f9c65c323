"""graphpipe.plan: the planner's entry point, over one mesh or the mesh it chooses.

    plan(model, x, devices=8, micro_batches=8)                   # one stage graph, pp = 8
    plan(model, x, devices=16, dp=2)                              # over a pp 8 x dp 2 mesh
    plan(model, x, devices=64, mesh="auto", node="h100x8",        # the planner chooses
         micro_batches="auto", tp_plan=...)                       #   pp x dp x tp and M

One mesh is `graphpipe.planning.partition.plan`; `mesh="auto"` is
`graphpipe.planning.automesh.plan_mesh`, which plans and simulates each candidate mesh and
keeps the fastest (`plan.dims` names it; `print(plan)` lists the runners-up and what bound
each). Both take the same options (`graphpipe.planning.options`), routed here once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.planning import partition
from graphpipe.planning.automesh import plan_mesh
from graphpipe.planning.options import Memory, Numerics, Parallelism, Planning, joined, split

__all__ = ["plan"]

# what mesh="auto" chooses itself, so it cannot also be given
CHOSEN = ("dp", "tp", "reshard_after_forward")


def plan(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any],
    devices: int | None = None,
    *,
    planning: Planning | None = None,
    parallelism: Parallelism | None = None,
    numerics: Numerics | None = None,
    memory: Memory | None = None,
    **options: Any,
) -> Plan:
    """Trace, profile and partition a model: the whole planner in one call.

    Args:
        model: The model.
        example_inputs: One mini-batch (a tensor, a tuple, or a dict of keyword inputs);
            dim 0 is the batch.
        devices: N, every device (pp x dp x tp); or `parallelism.devices`.
        planning, parallelism, numerics, memory: Option groups
            (`graphpipe.planning.options`), the same values compile takes.
        **options: Any option by name, routed to its group (see
            `graphpipe.planning.partition.plan` for one mesh: micro_batches, dp, tp,
            tp_plan, memory_budget, ...). `mesh="auto"` lets the planner choose pp x dp x tp
            (tp inside a `node`, with `tp_plan`), M (`micro_batches="auto"` or one M),
            FSDP2's resharding, the layout, the schedule and recompute under the memory
            budget (`graphpipe.planning.automesh`); dp, tp and reshard_after_forward are
            then its to choose.

    Returns:
        A validated `Plan`; with mesh="auto", `plan.dims` names the mesh chosen.

    Raises:
        ConfigError: every bad option, at once.
        TraceError: the model cannot be traced.
        PlanError: no plan meets the constraints.
    """
    groups: dict[str, Any] = dict(
        planning=planning, parallelism=parallelism, numerics=numerics, memory=memory
    )
    asked = parallelism.mesh if parallelism is not None else options.get("mesh")
    if asked != "auto":
        return partition.plan(model, example_inputs, devices, **groups, **options)
    return _auto(model, example_inputs, devices, groups, options)


def _auto(
    model: nn.Module,
    example_inputs: Any,
    devices: int | None,
    groups: Mapping[str, Any],
    options: Mapping[str, Any],
) -> Plan:
    """mesh="auto": the options checked at once, then `plan_mesh`."""
    got, problems = split(
        groups, options, partition.PLAN_GROUPS, elsewhere=partition.PLAN_ELSEWHERE
    )
    par: Any = got["parallelism"]
    planning: Any = got["planning"]
    m = planning.micro_batches
    n = devices if devices is not None else par.devices
    if n is None:
        problems.append("devices= is needed: the number of devices to plan for")
    problems.extend(
        f"{name}={getattr(par, name)!r} with mesh='auto', which chooses it; leave it out"
        for name in CHOSEN
        if getattr(par, name) is not None
    )
    kwargs = {
        k: v for k, v in partition.plan_options(got).items() if k not in (*CHOSEN, "micro_batches")
    }
    if problems:
        raise ConfigError(joined(problems))
    return plan_mesh(
        model, example_inputs, n, node=par.node, micro_batches=m or "auto",
        workers=planning.search_workers, **kwargs,
    )  # fmt: skip
