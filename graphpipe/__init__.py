"""graphpipe: graph pipeline parallelism for branchy PyTorch models.

A model becomes a pipeline in phases, each a module of its own:

    gm   = graphpipe.trace(model, example_inputs)     # torch.fx graph + shapes, bytes, FLOPs
    plan = graphpipe.plan(model, example_inputs,      # trace + profile + partition:
                          devices=8, micro_batches=8) #   a DAG of stages (a Plan)
    graphpipe.render(gm, plan)                        # graphviz: ops coloured by stage
    graphpipe.render(plan)                            # graphviz: the stage graph

Independent branches of the model (the towers of a multi-modal transformer, the MLPs of DLRM)
become concurrent stages on disjoint devices, where a sequential pipeline would serialise them.
The Plan is plain data: `plan.to_json()`, `Plan.from_json(text)`, `plan.validate(gm)`.

Phases and their modules: trace (`graphpipe.trace`), profile (`graphpipe.profile`), partition
(`graphpipe.partition`), render (`graphpipe.render`). The command line is `graphpipe plan`.
"""

from __future__ import annotations

from graphpipe.errors import (
    ConfigError,
    GraphPipeError,
    PipelineError,
    PlanError,
    ScheduleError,
    TraceError,
)
from graphpipe.ir import Plan
from graphpipe.partition import plan
from graphpipe.render import render
from graphpipe.trace import trace

__all__ = [
    "ConfigError",
    "GraphPipeError",
    "PipelineError",
    "Plan",
    "PlanError",
    "ScheduleError",
    "TraceError",
    "plan",
    "render",
    "trace",
]

__version__ = "0.1.0"
