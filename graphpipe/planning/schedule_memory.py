"""A plan's memory prediction for the schedule that runs it.

The planner costs every stage with the graph 1F1B count of micro-batches in flight
(`graphpipe.planning.assemble`: min(M, stages on the longest path to a sink)). Other orders
hold more: zb on later stages, zb2 and gpipe everywhere, zbv on some stages past M = 2N.
`for_schedule` raises each stage's count to what the schedule's order holds
(`graphpipe.scheduling.generators.in_flight`) and re-costs its memory; compile applies it to
the plan it runs. The planner's own search still costs 1F1B's counts.
"""

from __future__ import annotations

import math
from dataclasses import replace

from graphpipe.ir import Plan, Schedule, schedule_spec
from graphpipe.scheduling.generators import in_flight

__all__ = ["for_schedule"]


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
        memory = cost.stage_memory(s.param_bytes, s.activation_bytes, k, s.replicas)
        stages.append(replace(s, in_flight=k, memory_bytes=int(memory)))
    return replace(plan, stages=tuple(stages))
