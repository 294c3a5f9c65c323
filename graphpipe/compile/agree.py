"""The ranks agree before a step runs: one plan and one schedule on every rank.

A plan given to `compile(plan=...)` is made or loaded by every rank itself. A plan that
`graphpipe.plan` made on each rank holds that rank's measured stage times, which differ by
noise, and an order that reads stage times (`ScheduleSpec.reads_times`: zb, zbv,
graph_interleaved) can then differ between ranks: two ranks whose programs disagree wait for
each other until the timeout ("every rank waits for another"). So:

    agreed_plan(plan)      rank 0's plan, on every rank (one broadcast). Measured figures
                           (every float: stage times, the bottleneck, the search's seconds)
                           and the planner's notes (`info`) may differ, and rank 0's are
                           kept; a rank whose plan differs in anything else (stages,
                           devices, edges, micro-batches) is refused.
    agree_schedule(s)      every rank made the same schedule (a digest, one all-gather), else
                           ScheduleError naming the ranks: a schedule made from one plan must
                           not depend on the rank that made it.

Both are one collective each on the default process group, under the watch (`guarded`), so a
rank that never arrives is named after the runtime's timeout. One process: nothing to agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch.distributed as dist

from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import Plan, Schedule
from graphpipe.runtime.collectives import gather_objects
from graphpipe.runtime.failures import guarded

__all__ = ["agree_schedule", "agreed_plan", "first_difference", "plan_shape"]

log = logging.getLogger("graphpipe")


def plan_shape(data: dict[str, Any]) -> dict[str, Any]:
    """A plan's JSON data without what planning measured or noted: every float dropped
    (stage times, the bottleneck, the search's seconds, calibrated link speeds), and the
    planner's notes (`info`: what it profiled and considered), which nothing runs from."""
    return _no_floats({k: v for k, v in data.items() if k != "info"})


def _no_floats(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _no_floats(v) for k, v in data.items() if not isinstance(v, float)}
    if isinstance(data, list):
        return [_no_floats(v) for v in data if not isinstance(v, float)]
    return data


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two JSON values first differ, as a path with both values (`.stages[1].device:
    0 != 1`), or None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{path}.{key}: only in {'the first' if key in a else 'the second'}"
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if a == b else f"{path or 'the plan'}: {_short(a)} != {_short(b)}"


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def agreed_plan(plan: Plan, timeout: float | None = None) -> Plan:
    """Rank 0's copy of a plan every rank was given, after checking that each rank's own
    copy is the same plan but for its measured figures (see the module docstring).

    Args:
        plan: This rank's plan (given to `compile`, checked against its trace).
        timeout: Seconds each collective may take (default: the watch's).

    Returns:
        Rank 0's plan (this rank's own on rank 0, or in one process).

    Raises:
        ConfigError: some rank's plan differs from rank 0's in more than its measured
            figures; every rank raises it, naming those ranks and the first difference.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    mine = plan.to_json()
    message: list[Any] = [mine if dist.get_rank() == 0 else None]
    guarded(
        "the given plan's broadcast",
        lambda: dist.broadcast_object_list(message, src=0),
        timeout=timeout,
    )
    theirs = str(message[0])
    same = theirs == mine
    found = (
        None
        if same
        else first_difference(plan_shape(json.loads(theirs)), plan_shape(json.loads(mine)))
    )
    found_by = gather_objects(found, "the given plans' differences", timeout)
    differ = {r: f for r, f in enumerate(found_by) if f is not None}
    if differ:
        r, where = next(iter(differ.items()))
        raise ConfigError(
            f"the ranks were given different plans: rank(s) {sorted(differ)} differ from "
            f"rank 0's beyond measured times (rank {r}, rank 0's != its own at {where}); "
            "make the plan once (graphpipe.plan on one rank, then Plan.save and Plan.load on "
            "every rank) or let compile plan on rank 0 (no plan=)"
        )
    if same:
        return plan
    log.debug("rank %d runs rank 0's plan: their measured times differ", dist.get_rank())
    return Plan.from_json(theirs)


def agree_schedule(schedule: Schedule, timeout: float | None = None) -> None:
    """Check that every rank made the same schedule (one all-gather of a digest).

    Raises:
        ScheduleError: the ranks made different schedules; every rank raises it, naming
            the ranks whose schedule differs from rank 0's.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = hashlib.sha256(schedule.to_json().encode()).hexdigest()[:16]
    digests = gather_objects(digest, "the schedules' digests", timeout)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ScheduleError(
            f"the ranks made different {schedule.name} schedules from one plan: rank(s) "
            f"{differ} differ from rank 0's (digests {digests[0]} != {digests[differ[0]]}); "
            "their programs would wait for each other"
        )
