"""What compile chose, in one line: the stages, the layout, the schedule, replication, the
mesh, and why each (the planner's pick, the user's, the weight policy's).

rank 0 prints it to stderr as compile returns (`RuntimeConfig(quiet=True)` turns it off):

    graphpipe.compile: 2 stages over 2 ranks (mesh none), layout one, schedule 1f1b (the
    planner's fastest of one 1f1b 30.4 ms, loop interleaved_zb 44.1 ms, v dualpipev 35.2 ms),
    M=4 x 8 rows, weights flush, fp32, no replicas (replication=False: data parallelism is
    the mesh's), recompute none
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

from graphpipe.ir import Plan, Schedule
from graphpipe.ir.registry import policy_spec
from graphpipe.runtime.spec import RunSpec

__all__ = ["announce", "describe"]


def describe(plan: Plan, schedule: Schedule, spec: RunSpec) -> str:
    """The run compile built, in one line (no newline)."""
    parts = [
        _stages(plan, spec),
        f"{_layout(plan)}, schedule {schedule.name} ({_why_schedule(plan, schedule, spec)})",
        f"M={spec.micro_batches} x {spec.micro_batch_size} rows"
        + (f" ({spec.input_split.describe()})" if spec.input_split else ""),
        f"weights {spec.numerics.weights}",
        spec.numerics.precision or "fp32",
        _replicas(plan, spec),
        f"recompute {_recompute(plan)}",
    ]
    return "graphpipe.compile: " + ", ".join(parts)


def announce(plan: Plan, schedule: Schedule, spec: RunSpec) -> None:
    """Print `describe(...)` on rank 0 (stderr), unless `spec.runtime.quiet`."""
    if spec.runtime.quiet or (dist.is_initialized() and dist.get_rank() != 0):
        return
    print(describe(plan, schedule, spec), file=sys.stderr, flush=True)


def _stages(plan: Plan, spec: RunSpec) -> str:
    n = len(plan.stages)
    where = "pp ranks" if spec.meshed else "ranks"
    return f"{n} stage{'s' * (n != 1)} over {plan.num_devices} {where} ({_mesh(spec)})"


def _mesh(spec: RunSpec) -> str:
    if not spec.meshed:
        return "mesh none"
    dims = spec.dims
    return "mesh " + " x ".join(f"{n}{s}" for n, s in zip(dims.names, dims.sizes, strict=True))


def _layout(plan: Plan) -> str:
    return f"layout {plan.layout}"


def _why_schedule(plan: Plan, schedule: Schedule, spec: RunSpec) -> str:
    if spec.schedule_given:
        return "named"
    if policy_spec(spec.numerics.weights).schedule is not None:
        return f"weights={spec.numerics.weights!r} runs it"
    considered = plan.info.get("layouts", {}).get("considered", [])
    rows = [_considered(c) for c in considered if c.get("step") is not None]
    if rows:
        return "the planner's fastest of " + ", ".join(rows)
    return "the plan's" if schedule.name == plan.schedule else "runs the plan's placement"


def _considered(entry: dict[str, Any]) -> str:
    return f"{entry['layout']} {entry['schedule']} {entry['step'] * 1e3:.3g} ms"


def _replicas(plan: Plan, spec: RunSpec) -> str:
    copied = [s.index for s in plan.stages if len(s.devices) > 1]
    if copied:
        return f"stages {copied} replicated over ranks (replication=True)"
    if spec.plan_options.get("replication"):
        return "no replicas (replication=True, none faster)"
    return "no replicas (replication=False: data parallelism is the mesh's)"


def _recompute(plan: Plan) -> str:
    stages = [s.index for s in plan.stages if s.recompute]
    return f"stages {stages}" if stages else "none"
