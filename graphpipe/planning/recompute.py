"""Activation checkpointing per stage: a stage that recomputes keeps only its inputs.

A stage with `recompute` saves, for each micro-batch in flight, only the tensors it received
(its in-edges' bytes; model inputs are held by the batch anyway) instead of every activation
its backward needs, and re-runs its forward at the start of its backward:

    activation_bytes   sum of its in-edges' bytes
    backward_time      backward + forward

The simulator and the memory prediction read these fields, so they account for it. The
runtime wraps the stage's forward in `torch.utils.checkpoint` (non-reentrant), so losses
and gradients are those of the plain run.

    with_recompute(plan, [1, 2])    those stages
    choose_recompute(plan, "auto")  per device over the memory budget, the stages that save
                                    most first, until the device fits
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan, Stage, over_budget
from graphpipe.planning.assemble import bottleneck

__all__ = ["RecomputeSpec", "choose_recompute", "with_recompute"]

RecomputeSpec = bool | str | Sequence[int]  # True, False, "auto" or stage indices


def _recomputed(plan: Plan, s: Stage) -> Stage:
    cost = plan.cost_model
    kept = sum(e.bytes for e in plan.edges if e.dst == s.index)
    backward = s.backward_time + s.forward_time
    return replace(
        s,
        recompute=True,
        backward_time=backward,
        activation_bytes=kept,
        time=cost.stage_time(s.forward_time + backward, s.param_bytes, s.replicas),
        memory_bytes=int(
            cost.stage_memory(s.param_bytes, kept, s.in_flight, s.replicas, s.frozen_bytes)
        ),
    )


def with_recompute(plan: Plan, stages: Sequence[int]) -> Plan:
    """`plan` with the given stages recomputing their forward in the backward.

    Raises:
        ConfigError: an index that is not a stage of the plan, naming it.
    """
    unknown = sorted(set(stages) - {s.index for s in plan.stages})
    if unknown:
        raise ConfigError(
            f"recompute names stages {unknown}, but the plan has stages 0..{len(plan.stages) - 1}"
        )
    chosen = set(stages)
    new = tuple(
        _recomputed(plan, s) if s.index in chosen and not s.recompute else s for s in plan.stages
    )
    return replace(plan, stages=new, bottleneck=bottleneck(new, plan.edges, plan.cost_model))


def choose_recompute(plan: Plan, spec: RecomputeSpec) -> Plan:
    """Apply `spec`: False (none), True (every stage), "auto" or stage indices.

    "auto": on each device whose stages' predicted memory exceeds the budget, recompute
    its stages, the one that saves most first, until it fits (or all do); nothing without a
    budget. Each stage is costed at its plan's in-flight count: compile raises the counts to
    those of the schedule's order first (`schedule_memory.for_schedule`). The search itself
    does not trade recomputation for depth: a model that fits no plan without recomputing
    is still refused by the planner.

    Raises:
        ConfigError: an unknown spec or stage index, naming it.
    """
    if spec is False:
        return plan
    if spec is True:
        return with_recompute(plan, [s.index for s in plan.stages])
    if isinstance(spec, str):
        if spec != "auto":
            raise ConfigError(
                f"recompute must be True, False, 'auto' or stage indices, got {spec!r}"
            )
        return _auto(plan)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
        raise ConfigError(f"recompute stage indices must be ints, got {list(spec)!r}")
    return with_recompute(plan, list(spec))


def _auto(plan: Plan) -> Plan:
    for device, _ in over_budget(plan):
        saving = {
            s.index: s.memory_bytes - _recomputed(plan, s).memory_bytes
            for s in plan.stages_on(device)
            if not s.recompute
        }
        for index in sorted(saving, key=lambda i: -saving[i]):
            if device not in dict(over_budget(plan)):
                break
            plan = with_recompute(plan, [index])
    return plan
