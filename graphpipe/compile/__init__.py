"""compile: train a model pipelined across processes, exactly as it trains in one process.

    pm = graphpipe.compile(model, example_inputs, loss_fn=F.cross_entropy,
                           optimizer=functools.partial(torch.optim.Adam, lr=1e-3),
                           micro_batches=4)
    for inputs, target in data:
        loss = pm.step(*inputs, target=target)      # every rank, the same call

Run it with one process per device: `torchrun --nproc-per-node 2 train.py`, or
`graphpipe.launch(main, nprocs=2)` on one machine. Every rank builds the same model (same
seed), traces it, and rank 0 plans it (or `plan=` a saved Plan) and sends the plan to all. Each
rank then keeps only its own stage: a GraphModule whose parameters have their original names.

Semantics with the flush policy (the default): `step()` takes one mini-batch, splits it into
M micro-batches along dim 0 (as `torch.tensor_split`), runs them through the schedule and
makes one optimizer step; it returns the mean of the M micro-batch losses (weighted by their
rows where they differ), and the gradient is that mean's gradient. With a mean-reduced loss
this is one full-batch step, and for models whose samples do not interact (no BatchNorm) it
equals single-process training; with BatchNorm it equals single-process gradient
accumulation over the same micro-batches. Batches may differ from the example in their rows
and in any other dimension, up to `max_shapes` or else the example's size
(`graphpipe.runtime.shapes`).

`compile()` is a short sequence of named steps: check every argument into one frozen
`RunSpec` (`graphpipe.runtime.spec`), join the process group, trace, plan on rank 0 and
broadcast (or check a given plan), schedule and dry-run, and build the `PipelinedModel`
(`graphpipe.compile.steps` holds the steps that talk to other ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import fx, nn

from graphpipe.compile.agree import agree_schedule, agreed_plan
from graphpipe.compile.steps import (
    check_world,
    checked_plan,
    ensure_process_group,
    join_mesh,
    mesh_on_rank_0,
    plan_on_rank_0,
    schedule_name,
    schedule_plan,
)
from graphpipe.compile.summary import announce
from graphpipe.ir import Plan, Schedule
from graphpipe.ir.registry import schedule_for, schedule_spec
from graphpipe.planning.options import Init, Memory, Numerics, Parallelism, Planning
from graphpipe.planning.recompute import choose_recompute
from graphpipe.planning.schedule_memory import for_schedule
from graphpipe.runtime.failures import install_watch, posted
from graphpipe.runtime.pipeline import PipelinedModel
from graphpipe.runtime.shapes import check_max_shapes, planned_at
from graphpipe.runtime.spec import OptimizerFactory, RunSpec, RuntimeConfig
from graphpipe.runtime.tp import resolve_tp_plan
from graphpipe.runtime.wiring import runtime_device
from graphpipe.scheduling.generators import make_schedule
from graphpipe.tracing.bind import check_output, flat_inputs, normalise
from graphpipe.tracing.tracer import trace

__all__ = [
    "Init",
    "Memory",
    "Numerics",
    "Parallelism",
    "PipelinedModel",
    "Planning",
    "RunSpec",
    "RuntimeConfig",
    "compile",
    "schedule_for",
]


def compile(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: OptimizerFactory,
    plan: Plan | str | Path | None = None,
    planning: Planning | None = None,
    parallelism: Parallelism | None = None,
    numerics: Numerics | None = None,
    memory: Memory | None = None,
    init: Init | None = None,
    runtime: RuntimeConfig | None = None,
    **options: Any,
) -> PipelinedModel:
    """Turn `model` into a pipelined model over every rank of the process group.

    Call it the same way on every rank. The process group is initialised from the
    environment (torchrun's env://) unless it already is.

    Args:
        model: The model; each rank keeps only its stage's parameters.
        example_inputs: One mini-batch: a tensor, a tuple of positional tensors, or a dict
            of keyword inputs as Hugging Face models take them (`input_ids`,
            `attention_mask`; non-tensor values such as `use_cache=False` are constants of
            the trace). Dim 0 of every tensor is the batch. The model is traced and planned
            at its micro-batch size (batch / M). Steps may bring batches of other shapes,
            never larger in any dimension than `max_shapes`, or without it the example.
        loss_fn: (model output, target) -> scalar, mean-reduced over the batch; or (model
            output) -> scalar, a loss of the output alone (`lambda out: out.loss`, labels
            among the inputs), and step() then takes no target.
        optimizer: Builds the optimizer from a list of parameters, e.g.
            `functools.partial(torch.optim.SGD, lr=0.1)`.
        plan: A Plan, or a path to its JSON, instead of planning. Every rank runs rank 0's
            copy: copies made on each rank may differ in their measured stage times, but a
            rank whose copy differs in anything else is refused (`graphpipe.compile.agree`).
        planning, parallelism, numerics, memory, init, runtime: The option groups
            (`graphpipe.planning.options`, `RuntimeConfig`): every option is defined there
            once, with its default and meaning, under the name `graphpipe.plan` and the
            command line use too (docs/training.md has the table).
        **options: Any option by name, routed to its group: `micro_batches=4`,
            `schedule="zb"`, `weights="2bw"`, `dp=2`, `tp=2`, `precision="bf16"`,
            `recompute="auto"`, `memory_budget=...`, `max_shapes={...}`, ... An unknown
            name is a ConfigError naming the closest known one; an option given both as a
            keyword and in its group is one too. The main ones:

            - micro_batches: M (default: the plan's, or 4). The example batch splits into
              M micro-batches (and each into dp slices).
            - schedule: "1f1b", "gpipe", "zb" (ZB-H1) or "zb2" (ZB-H2) for flush, or
              "interleaved", "interleaved_zb" / "zbv" / "dualpipev" with several stages per
              rank, "graph_interleaved" for a stage DAG folded onto the devices, "async"
              for stash and pipemare, "2bw" for 2bw. Default: the one the weight policy
              needs, else the one the planner chose with its layout; a named schedule
              limits the planner to its layouts.
            - weights: "flush", "stash", "2bw" or "pipemare" (`graphpipe.runtime.weights`).
            - mesh, dp, tp, tp_plan, dp_shard, reshard_after_forward: a DeviceMesh with dims
              ("pp", "dp"), ("pp", "tp") or ("pp", "dp", "tp"), or `dp=k` and/or `tp=t`, from
              which compile builds a (world // (k t), k, t) mesh. The plan is made for the
              pp devices; each stage runs on the dp and tp ranks of its pp coordinate,
              sharded by FSDP2 over dp and split by `tp_plan` (None: the model's own) over
              tp (`graphpipe.runtime.mesh`, docs/meshes.md). What a mesh refuses is in
              `graphpipe.runtime.refusals`.
            - precision: "bf16" or "fp16" on float32 masters (`graphpipe.runtime.precision`).
            - max_grad_norm, grad_norm_type, nan_check: the update's checks (flush only).
            - recompute: True, stage indices or "auto" (`graphpipe.planning.recompute`).
            - max_shapes: input name -> the largest whole-batch shape a step may bring
              (`graphpipe.runtime.shapes`).
            - checkpoint, init_weights: a meta-device model's weights
              (`graphpipe.runtime.materialize`).
            - replication: compile plans a pipeline of distinct stages (False, as
              `graphpipe run` and `graphpipe.plan`); True lets the planner copy a stage
              over ranks where that simulates faster (no mesh).
            - devices: if given, must equal the world size (with a mesh, its pp size).

    Returns:
        The pipelined model. rank 0 prints one line of what was chosen and why (stages,
        layout, schedule, micro-batches, replication, mesh: `graphpipe.compile.summary`),
        unless `RuntimeConfig(quiet=True)`.

    Raises:
        ConfigError: bad arguments, every one found before any work named in one error
            (`RunSpec.build`); later, a world size the plan was not made for, or ranks
            given different plans (`graphpipe.compile.agree`).
        PlanError: no plan fits, or the given plan is not for this model.
        ScheduleError: the ranks made different schedules (`agree_schedule`).
    """
    groups = dict(
        planning=planning, parallelism=parallelism, numerics=numerics, memory=memory,
        init=init, runtime=runtime,
    )  # fmt: skip
    spec = RunSpec.build(
        example_inputs, loss_fn=loss_fn, optimizer=optimizer, plan=plan, groups=groups, **options
    )
    if spec.auto_mesh:
        spec = _chosen_mesh(model, example_inputs, spec)
    spec = _join(spec)
    if spec.dims.tp > 1:  # the model's own plan when none is given, checked
        spec = replace(spec, tp_plan=MappingProxyType(resolve_tp_plan(model, spec.tp_plan)))
    gm, inputs = _trace(model, example_inputs, spec)
    if spec.max_shapes is not None:
        check_max_shapes(gm, inputs, spec.max_shapes)
    with _planned_at(model, gm, example_inputs, spec):
        the_plan = _plan(gm, inputs, spec)
    check_world(spec, the_plan)
    the_plan, sched = _scheduled(the_plan, spec)
    agree_schedule(sched, spec.runtime.timeout)
    announce(the_plan, sched, spec)
    with posted("compile"):
        return PipelinedModel(model, gm, inputs, the_plan, sched, spec)


def _chosen_mesh(model: nn.Module, example_inputs: Any, spec: RunSpec) -> RunSpec:
    """mesh="auto": join the process group, let rank 0 choose pp x dp x tp, M and FSDP2's
    resharding for the world (`mesh_on_rank_0`), and return the run built for that mesh with
    that plan, checked as a run that named them would be."""
    ensure_process_group(spec.runtime)
    install_watch(spec.runtime.timeout)
    chosen = mesh_on_rank_0(model, example_inputs, spec)
    parallelism = replace(
        spec.parallelism,
        mesh=None,
        dp=chosen.dims.dp,
        tp=chosen.dims.tp,
        reshard_after_forward=chosen.cost_model.dp.reshard_after_forward,
    )
    groups = dict(
        planning=replace(spec.planning, micro_batches=chosen.micro_batches),
        parallelism=parallelism, numerics=spec.numerics, memory=spec.memory,
        init=spec.init, runtime=spec.runtime,
    )  # fmt: skip
    return RunSpec.build(
        example_inputs, loss_fn=spec.loss_fn, optimizer=spec.optimizer, plan=chosen, groups=groups
    )


def _join(spec: RunSpec) -> RunSpec:
    """Join the process group, build the mesh (dp=, tp=) and the layout, check the sizes,
    and start watching the other ranks. Returns the spec with its mesh and layout."""
    ensure_process_group(spec.runtime)
    install_watch(spec.runtime.timeout)  # every wait from here on stops when a rank fails
    device = runtime_device(spec.runtime)  # NCCL's object collectives need the rank's GPU
    spec = join_mesh(spec, device.type)
    check_world(spec, None)
    return spec


def _trace(
    model: nn.Module, example_inputs: Any, spec: RunSpec
) -> tuple[fx.GraphModule, tuple[torch.Tensor, ...]]:
    """The model traced at the micro-batch size, and its flat example inputs."""
    gm = trace(
        model,
        example_inputs,
        leaf_modules=spec.planning.leaf_modules,
        micro_batch_size=spec.micro_batch_size,
        input_split=spec.input_split,
    )
    check_output(gm)
    args, kwargs = normalise(example_inputs)
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    return gm, tuple(flat_inputs(gm, *args, **tensors))


def _planned_at(
    model: nn.Module, gm: fx.GraphModule, example_inputs: Any, spec: RunSpec
) -> AbstractContextManager[None]:
    """Planning with max_shapes: the graph's bytes at them (`planned_at`). Every rank
    traces at them, so a model that traces to another graph there is refused on every rank
    alike, before the plan's broadcast."""
    if spec.max_shapes is None or spec.plan is not None:
        return nullcontext()
    return planned_at(
        model, gm, example_inputs, spec.max_shapes, spec.micro_batches, spec.planning.leaf_modules
    )


def _plan(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], spec: RunSpec) -> Plan:
    """The given plan checked against the trace, rank 0's copy of it on every rank
    (`agreed_plan`), or the plan rank 0 makes."""
    if spec.plan is not None:
        checked = checked_plan(spec.plan, gm, spec.dims)
        return agreed_plan(checked, spec.runtime.timeout)
    return plan_on_rank_0(gm, inputs, spec)


def _scheduled(plan: Plan, spec: RunSpec) -> tuple[Plan, Schedule]:
    """The plan with its memory predicted for its schedule's order (`for_schedule`) and its
    recomputation chosen at those counts, with its schedule, made once and dry-run checked
    (a simulated peak over the memory budget is refused there).

    Recomputing stages run longer backwards (forward + backward). An order that reads the
    stage times (`ScheduleSpec.reads_times`: zb, zbv and graph_interleaved keep what replays
    fastest over them) is made again where recompute changed a stage; every other order
    reads the plan's shape alone, so the one made before stands.
    """
    name = schedule_name(plan, spec)
    sched = make_schedule(plan, name, spec.micro_batches)
    if spec.memory.recompute is not False:
        held = for_schedule(plan, sched)
        plan = choose_recompute(held, spec.memory.recompute)
        if schedule_spec(sched.name).reads_times and plan.stages != held.stages:
            sched = make_schedule(plan, name, spec.micro_batches)
    sched = schedule_plan(plan, spec, sched)
    return for_schedule(plan, sched), sched
