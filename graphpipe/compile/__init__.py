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

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from graphpipe.compile.steps import (
    build_mesh,
    check_world,
    checked_plan,
    ensure_process_group,
    plan_on_rank_0,
    schedule_name,
    schedule_plan,
)
from graphpipe.compile.summary import announce
from graphpipe.ir import Plan, Schedule
from graphpipe.planning.profile import ProfileConfig
from graphpipe.planning.recompute import RecomputeSpec, choose_recompute
from graphpipe.planning.schedule_memory import for_schedule
from graphpipe.runtime.failures import install_watch, posted
from graphpipe.runtime.materialize import InitFn
from graphpipe.runtime.pipeline import PipelinedModel
from graphpipe.runtime.shapes import check_max_shapes, planned_at
from graphpipe.runtime.spec import OptimizerFactory, RunSpec, RuntimeConfig, schedule_for
from graphpipe.runtime.tp import resolve_tp_plan
from graphpipe.runtime.weights import PolicyOptions
from graphpipe.runtime.wiring import runtime_device
from graphpipe.scheduling.generators import READS_TIMES, make_schedule
from graphpipe.tracing.bind import check_output, flat_inputs, normalise
from graphpipe.tracing.tracer import LeafSpec, trace

__all__ = ["PipelinedModel", "RunSpec", "RuntimeConfig", "compile", "schedule_for"]


def compile(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: OptimizerFactory,
    micro_batches: int | None = None,
    schedule: str | None = None,
    weights: str = "flush",
    weight_options: PolicyOptions | None = None,
    partitioner: str | None = None,
    plan: Plan | str | Path | None = None,
    leaf_modules: Sequence[LeafSpec] = (),
    profile_config: ProfileConfig | None = None,
    runtime: RuntimeConfig | None = None,
    init_weights: InitFn | None = None,
    checkpoint: str | Path | None = None,
    max_grad_norm: float | None = None,
    grad_norm_type: float = 2.0,
    compile_stages: bool = False,
    recompute: RecomputeSpec = False,
    precision: str | None = None,
    nan_check: bool = False,
    mesh: DeviceMesh | None = None,
    data_parallel: int | None = None,
    dp_shard: bool = True,
    reshard_after_forward: bool | None = None,
    tp_plan: Mapping[str, str] | None = None,
    max_shapes: Mapping[str, Sequence[int]] | None = None,
    **plan_options: Any,
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
        loss_fn: (model output, target) -> scalar, mean-reduced over the batch.
        optimizer: Builds the optimizer from a list of parameters, e.g.
            `functools.partial(torch.optim.SGD, lr=0.1)`.
        micro_batches: M, micro-batches per mini-batch (default: the plan's, or 4).
        schedule: "1f1b", "gpipe", "zb" (ZB-H1) or "zb2" (ZB-H2) for flush, or
            "interleaved", "interleaved_zb" / "zbv" / "dualpipev" with several stages per rank
            (the plan is a chain of 2 stages per device, folded "loop" or "v"; pin the stages,
            or pass virtual_stages and placement); "graph_interleaved" for a stage DAG folded onto
            the devices (`interleave=True`; the default for such a plan); "async" for stash
            and pipemare; "2bw" for 2bw. Default: the one the weight policy needs, else
            the one the planner chose with its layout (`graphpipe.planning.layouts`: 1f1b
            on one stage per rank); a named schedule limits the planner to its layouts.
        weights: The weight policy: "flush", "stash", "2bw" or "pipemare" (see
            `graphpipe.runtime.weights`).
        weight_options: PipeMare's fixes.
        partitioner: "graph", "sequential" or "manual", when no plan is given. Default
            "manual" when `pins` are given (a plan_options field), else "graph".
        plan: A Plan, or a path to its JSON, instead of planning.
        leaf_modules: Module types or paths to trace as single nodes.
        profile_config: How rank 0 obtains op times when it plans (default: measured on
            the model's device; estimated from FLOPs for a model on the meta device).
        runtime: Timeouts, backend, device, timeline recording.
        init_weights: For a model on the meta device: `init_weights(model)` initialises
            this rank's tensors once they are real (see `graphpipe.runtime.materialize`).
            Default: each module's `reset_parameters()`.
        checkpoint: For a model on the meta device: a state_dict file, safetensors file(s)
            or a DCP directory to load this rank's stage from, by parameter name.
        max_grad_norm: Clip the gradients of the whole model to this total norm in every
            update, as `torch.nn.utils.clip_grad_norm_` on one process would (the norm is
            reduced over the stages; tied copies and replicas count once). weights="flush"
            only. `pm.last_grad_norm` is the norm before clipping.
        grad_norm_type: p of the p-norm (`math.inf` for the largest value).
        recompute: Activation checkpointing: True (every stage), a list of stage indices,
            or "auto" (on each device over the plan's memory budget, the stages that save
            most, until it fits). A recomputing stage keeps only its inputs per micro-batch
            and re-runs its forward in its backward (`graphpipe.planning.recompute`); the
            plan's times and memory say so.
        compile_stages: `torch.compile` each of this rank's stage modules (in place: state
            dict keys stay). Not with zero-bubble schedules (zb, zbv, ...), whose backward is
            split into input and weight halves, which a compiled backward cannot do.
        precision: "bf16" or "fp16": autocast on each stage's forward (under a mesh,
            FSDP2's mixed precision for a graph torch.fx traced), float32 master weights,
            values crossing stages in that dtype (half the bytes; the planner counts them
            so), and for fp16 a loss scale agreed by every rank: an overflow anywhere skips
            the step everywhere (`pm.loss_scale`, `pm.skipped_steps`; weights="flush"
            only). None: float32 (`graphpipe.runtime.precision`).
        nan_check: Stop a step at its first non-finite loss or gradient: every rank raises
            the same PipelineError naming the stage, the micro-batch and (for a gradient)
            the parameter, before the optimizer update, which is skipped and the gradients
            dropped. Costs one all-reduce per step. weights="flush" only
            (`graphpipe.runtime.nancheck`).
        mesh: A `DeviceMesh` with mesh_dim_names ("pp", "dp"), ("pp", "tp") or ("pp",
            "dp", "tp"): the plan is made for its pp devices, and each stage runs on the dp
            and tp ranks of its pp coordinate, sharded by FSDP2 over dp (each dp rank on its
            slice of every micro-batch) and split by `tp_plan` over tp
            (`graphpipe.runtime.mesh`). Every flushed schedule runs; what a mesh refuses is
            in `graphpipe.runtime.refusals`.
        data_parallel: k: the shorthand for `mesh=init_device_mesh(device, (world // k, k),
            mesh_dim_names=("pp", "dp"))`.
        dp_shard: With a mesh, FSDP2 shards each stage over dp; False replicates it (HSDP
            with one shard: whole gradients all-reduced).
        reshard_after_forward: With a mesh, FSDP2 frees each unit's gathered parameters
            after its forward and gathers them again for its backward; False keeps them.
            None (the default): True, but False under a zero-bubble schedule, whose weight
            gradients come after later forwards (True is refused there).
        tp_plan: With a mesh that has a "tp" dimension: the tensor-parallel plan, module
            path ("*" for one component) -> "colwise" or "rowwise" (`graphpipe.runtime.tp`);
            None: the model's own (a Hugging Face model's base_model_tp_plan).
        max_shapes: Input name -> the largest whole-batch shape a step may bring (rows
            included), at least the example's in every dimension; inputs not named: the
            example's. The planner plans memory at these shapes (each rank traces the
            model once more at them: the plan's activation and message bytes are theirs, its op
            times the example's), and a step beyond them is refused by name on every rank,
            before any communication (`graphpipe.runtime.shapes`); a given `plan` is used
            as it is, the bound still applies. None: the example is the largest batch.
        **plan_options: More `PlanConfig` fields (memory_budget, replication, ...),
            checked on every rank before any work (a misspelt name is a ConfigError naming
            the closest field); devices, if given, must equal the world size (one device
            per rank), or with a mesh its pp size. compile plans a pipeline of distinct
            stages (replication=False, as `graphpipe run`); replication=True lets the
            planner copy a stage over ranks where that simulates faster (no mesh).

    Returns:
        The pipelined model. rank 0 prints one line of what was chosen and why (stages,
        layout, schedule, micro-batches, replication, mesh: `graphpipe.compile.summary`),
        unless `RuntimeConfig(quiet=True)`.

    Raises:
        ConfigError: bad arguments, every one found before any work named in one error
            (`RunSpec.build`); later, a world size the plan was not made for.
        PlanError: no plan fits, or the given plan is not for this model.
    """
    spec = RunSpec.build(
        example_inputs,
        loss_fn=loss_fn,
        optimizer=optimizer,
        micro_batches=micro_batches,
        schedule=schedule,
        weights=weights,
        weight_options=weight_options,
        partitioner=partitioner,
        plan=plan,
        leaf_modules=leaf_modules,
        profile_config=profile_config,
        runtime=runtime,
        init_weights=init_weights,
        checkpoint=checkpoint,
        max_grad_norm=max_grad_norm,
        grad_norm_type=grad_norm_type,
        compile_stages=compile_stages,
        recompute=recompute,
        precision=precision,
        nan_check=nan_check,
        mesh=mesh,
        data_parallel=data_parallel,
        dp_shard=dp_shard,
        reshard_after_forward=reshard_after_forward,
        tp_plan=tp_plan,
        max_shapes=max_shapes,
        **plan_options,
    )
    spec = _join(spec)
    if spec.tensor_parallel > 1:  # the model's own plan when none is given, checked
        spec = replace(spec, tp_plan=MappingProxyType(resolve_tp_plan(model, spec.tp_plan)))
    gm, inputs = _trace(model, example_inputs, spec)
    if spec.max_shapes is not None:
        check_max_shapes(gm, inputs, spec.max_shapes)
    with _planned_at(model, gm, example_inputs, spec):
        the_plan = _plan(gm, inputs, spec)
    check_world(spec, the_plan)
    the_plan, sched = _scheduled(the_plan, spec)
    announce(the_plan, sched, spec)
    with posted("compile"):
        return PipelinedModel(model, gm, inputs, the_plan, sched, spec)


def _join(spec: RunSpec) -> RunSpec:
    """Join the process group, build the mesh (data_parallel=), check the sizes, and start
    watching the other ranks. Returns the spec with its mesh."""
    ensure_process_group(spec.runtime)
    install_watch(spec.runtime.timeout)  # every wait from here on stops when a rank fails
    device = runtime_device(spec.runtime)  # NCCL's object collectives need the rank's GPU
    spec = build_mesh(spec, device.type)
    check_world(spec, None)
    return spec


def _trace(
    model: nn.Module, example_inputs: Any, spec: RunSpec
) -> tuple[fx.GraphModule, tuple[torch.Tensor, ...]]:
    """The model traced at the micro-batch size, and its flat example inputs."""
    gm = trace(
        model,
        example_inputs,
        leaf_modules=spec.leaf_modules,
        micro_batch_size=spec.micro_batch_size,
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
        model, gm, example_inputs, spec.max_shapes, spec.micro_batches, spec.leaf_modules
    )


def _plan(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], spec: RunSpec) -> Plan:
    """The given plan checked against the trace, or rank 0's."""
    if spec.plan is not None:
        return checked_plan(spec.plan, gm, spec.data_parallel, spec.tensor_parallel)
    return plan_on_rank_0(gm, inputs, spec)


def _scheduled(plan: Plan, spec: RunSpec) -> tuple[Plan, Schedule]:
    """The plan with its memory predicted for its schedule's order (`for_schedule`) and its
    recomputation chosen at those counts, with its schedule, made once and dry-run checked
    (a simulated peak over the memory budget is refused there).

    Recomputing stages run longer backwards (forward + backward). An order that reads the
    stage times (`READS_TIMES`: zb, zbv and graph_interleaved keep what replays fastest over
    them) is made again where recompute changed a stage; every other order reads the plan's
    shape alone, so the one made before stands.
    """
    name = schedule_name(plan, spec)
    sched = make_schedule(plan, name, spec.micro_batches)
    if spec.recompute is not False:
        held = for_schedule(plan, sched)
        plan = choose_recompute(held, spec.recompute)
        if sched.name in READS_TIMES and plan.stages != held.stages:
            sched = make_schedule(plan, name, spec.micro_batches)
    sched = schedule_plan(plan, spec, sched)
    return for_schedule(plan, sched), sched
