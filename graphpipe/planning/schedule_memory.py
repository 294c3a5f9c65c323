"""A plan's memory prediction for the schedule that runs it.

The planner costs every stage with the graph 1F1B count of micro-batches in flight
(`graphpipe.planning.assemble`: min(M, stages on the longest path to a sink)). Other orders
hold more: zb on later stages, zb2 and gpipe everywhere, zbv on some stages past M = 2N.
`for_schedule` raises each stage's count to what the schedule's order holds
(`graphpipe.scheduling.generators.in_flight`) and re-costs its memory; compile applies it to
the plan it runs. The planner's search costs 1F1B's counts, and where a named schedule's
order holds more than fits the budget, searches again with every stage holding what that
order holds (`held_floor`, `search.search`'s `held_floor`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from graphpipe.errors import ScheduleError
from graphpipe.ir import Plan, Schedule, over_budget, schedule_spec
from graphpipe.scheduling.generators import in_flight, make_schedule

__all__ = ["for_schedule", "held_floor"]


def for_schedule(plan: Plan, schedule: Schedule) -> Plan:
    """`plan` with each stage's in-flight micro-batches and predicted memory raised to what
    `schedule`'s order holds (the most micro-batches one replica holds from a forward to
    the end of its backward), where that is more than the plan's count. Under 1f1b the
    plan is unchanged. An asynchronous schedule's call holds backwards of earlier calls, so
    its plan is left as it is (its steady state holds 1F1B's count; the weight copies are
    the policy's). O(actions).

    Example (tests/test_simulate.py has it on chains):
        for_schedule(plan, make_schedule(plan, "zb2"))   # every chain stage: 2p - 1 held
    """
    if schedule_spec(schedule.name, training=False).asynchronous:
        return plan
    held, cost = in_flight(schedule), plan.cost_model
    stages = []
    for s in plan.stages:
        per_replica = math.ceil(min(s.in_flight, cost.micro_batches) / s.replicas)
        if held.get(s.index, 0) <= per_replica:
            stages.append(s)
            continue
        k = min(held[s.index] * s.replicas, cost.micro_batches)  # ceil(k / r) = held
        memory = cost.stage_memory(s.param_bytes, s.activation_bytes, k, s.replicas, s.frozen_bytes)
        stages.append(replace(s, in_flight=k, memory_bytes=int(memory)))
    return replace(plan, stages=tuple(stages))


def held_floor(plan: Plan, schedule: str | None) -> int:
    """0 when `plan` fits its memory budget under `schedule`'s order (or has no budget, or
    the schedule is 1f1b, folded or asynchronous), else the most micro-batches one replica
    of a stage holds in that order: the count to search again with (`search`'s
    `held_floor`), so that every stage is costed at it.

    A schedule that does not run the plan is left to the schedule's own check (0 here).
    """
    if schedule is None or plan.cost_model.memory.budget is None:
        return 0
    spec = schedule_spec(schedule, training=False)
    if spec.asynchronous or spec.placement is not None:
        return 0
    try:
        raised = for_schedule(plan, make_schedule(plan, schedule))
    except ScheduleError:
        return 0
    if not over_budget(raised):
        return 0
    return max(math.ceil(s.in_flight / s.replicas) for s in raised.stages)
