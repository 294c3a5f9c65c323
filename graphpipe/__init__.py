"""graphpipe: graph pipeline parallelism for branchy PyTorch models.

A model becomes a pipeline in phases, each a module of its own:

    gm    = graphpipe.trace(model, example_inputs)      # torch.fx graph + shapes, bytes, FLOPs
    plan  = graphpipe.plan(model, example_inputs,       # trace + profile + partition:
                           devices=8, micro_batches=8)  #   a DAG of stages (a Plan)
    graphpipe.render(gm, plan)                          # graphviz: ops coloured by stage
    sched = graphpipe.make_schedule(plan, "1f1b")       # per-rank actions (a Schedule)
    graphpipe.simulate(plan, sched).iteration_time      # predicted step time, bubbles, memory

and then, on every rank (torchrun, or graphpipe.runtime.launch on one machine):

    pm   = graphpipe.compile(model, example_inputs, loss_fn=F.cross_entropy,
                             optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    loss = pm.step(*inputs, target=target)              # one mini-batch, pipelined

Independent branches of the model (the towers of a multi-modal transformer, the MLPs of DLRM)
become concurrent stages on disjoint devices, where a sequential pipeline would serialise them.
Plans and schedules are plain data: `Plan.to_json()`, `Plan.from_json(text)`,
`validate_plan(plan, gm)`, `str(schedule)`.

Phases, one folder each, in import order: ir (the shared vocabulary: Plan, Schedule,
ActionKind, the schedule and policy registry), tracing, scheduling (generators, lowering,
simulator, dry run), planning (profile, partition), runtime (the per-rank pieces), compile;
tools (render, timeline, report, calibrate, fair, cli). `graphpipe plan` and `graphpipe run`
on the command line; `graphpipe export CKPT OUT` turns a checkpoint (`pm.save`) into a plain
state dict; `graphpipe.Checkpoints` keeps one per N steps and resumes from
`graphpipe.latest(dir)`, by itself under torchrun's restarts. docs/ARCHITECTURE.md has the map.
"""

from __future__ import annotations

from graphpipe.compile import PipelinedModel, RuntimeConfig, compile
from graphpipe.errors import (
    CheckpointError,
    ConfigError,
    FailureKind,
    GraphPipeError,
    PipelineError,
    PlanError,
    ScheduleError,
    TraceError,
)
from graphpipe.ir import Plan, Schedule
from graphpipe.planning.api import plan
from graphpipe.planning.options import Init, Memory, Numerics, Parallelism, Planning
from graphpipe.runtime.checkpoint import export_checkpoint
from graphpipe.runtime.launch import launch
from graphpipe.runtime.resume import Checkpoints, latest, saved_plan
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.render import render
from graphpipe.tracing.tracer import trace

__all__ = [
    "CheckpointError",
    "Checkpoints",
    "ConfigError",
    "FailureKind",
    "GraphPipeError",
    "Init",
    "Memory",
    "Numerics",
    "Parallelism",
    "PipelineError",
    "PipelinedModel",
    "Plan",
    "PlanError",
    "Planning",
    "RuntimeConfig",
    "Schedule",
    "ScheduleError",
    "TraceError",
    "compile",
    "export_checkpoint",
    "latest",
    "launch",
    "make_schedule",
    "plan",
    "render",
    "saved_plan",
    "simulate",
    "trace",
]

__version__ = "0.1.0"
