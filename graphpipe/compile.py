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
M micro-batches along dim 0, runs them through the schedule and makes one optimizer step; it
returns the mean of the M micro-batch losses, and the gradient is that mean's gradient. With
equal micro-batches and a mean-reduced loss this is one full-batch step, and for models whose
samples do not interact (no BatchNorm) it equals single-process training; with BatchNorm it
equals single-process gradient accumulation over the same micro-batches.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from graphpipe.errors import ConfigError, GraphPipeError, PlanError
from graphpipe.ir import Plan
from graphpipe.planning.opgraph import graph_hash, input_shapes
from graphpipe.planning.partition import PlanConfig, micro_batch_size, partition
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.planning.recompute import RecomputeSpec, choose_recompute
from graphpipe.planning.validate import validate_plan
from graphpipe.runtime.clip import check_clipping
from graphpipe.runtime.failures import guarded, install_watch, posted
from graphpipe.runtime.materialize import InitFn
from graphpipe.runtime.nancheck import check_nan_check
from graphpipe.runtime.pipeline import (
    OptimizerFactory,
    PipelinedModel,
    RuntimeConfig,
    runtime_device,
)
from graphpipe.runtime.precision import check_precision
from graphpipe.runtime.weights import POLICIES, PolicyOptions
from graphpipe.scheduling.dryrun import check_run
from graphpipe.scheduling.generators import ANY_PLACEMENT, ASYNC, PLACED, make_schedule
from graphpipe.tracing.annotate import is_meta, trace_info
from graphpipe.tracing.bind import batch_of, check_output, flat_inputs, normalise
from graphpipe.tracing.tracer import LeafSpec, trace

__all__ = ["PipelinedModel", "RuntimeConfig", "compile", "schedule_for"]

SPLIT_BACKWARD = frozenset({"zb", "zbv"})  # schedules with input/weight backward halves

log = logging.getLogger("graphpipe")


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
            the trace). Dim 0 of every tensor is the batch. It fixes the shapes: the model
            is traced at the micro-batch size (batch / M).
        loss_fn: (model output, target) -> scalar, mean-reduced over the batch.
        optimizer: Builds the optimizer from a list of parameters, e.g.
            `functools.partial(torch.optim.SGD, lr=0.1)`.
        micro_batches: M, micro-batches per mini-batch (default: the plan's, or 4).
        schedule: "1f1b", "gpipe" or "zb" for flush, or "interleaved" / "zbv" with several
            stages per rank (the plan is a chain of 2 stages per device, folded "loop" or
            "v"; pin the stages, or pass virtual_stages and placement); "graph_interleaved"
            for a stage DAG folded onto the devices (`interleave=True`; the default for
            such a plan); "async" for stash
            and pipemare; "2bw" for 2bw. Default: 1f1b, or the one the weight policy needs.
        weights: The weight policy: "flush", "stash", "2bw" or "pipemare" (see
            `graphpipe.runtime.weights`).
        weight_options: PipeMare's fixes.
        partitioner: "graph", "sequential" or "manual", when no plan is given. Default
            "manual" when `pins` are given (a plan_options field), else "graph".
        plan: A Plan, or a path to its JSON, instead of planning.
        leaf_modules: Module types or paths to trace as single nodes.
        profile_config: How rank 0 obtains op times when it plans.
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
            dict keys stay). Not with zero-bubble schedules (zb, zbv), whose backward is
            split into input and weight halves, which a compiled backward cannot do.
        precision: "bf16" or "fp16": autocast on each stage's forward, float32 master
            weights, values crossing stages in that dtype (half the bytes; the planner
            counts them so), and for fp16 a loss scale agreed by every rank: an overflow
            anywhere skips the step everywhere (`pm.loss_scale`, `pm.skipped_steps`;
            weights="flush" only). None: float32 (`graphpipe.runtime.precision`).
        nan_check: Stop a step at its first non-finite loss or gradient: every rank raises
            the same PipelineError naming the stage, the micro-batch and (for a gradient)
            the parameter, before the optimizer update, which is skipped and the gradients
            dropped. Costs one all-reduce per step. weights="flush" only
            (`graphpipe.runtime.nancheck`).
        **plan_options: More `PlanConfig` fields (memory_budget, replication, ...);
            devices, if given, must equal the world size (one device per rank).

    Returns:
        The pipelined model.

    Raises:
        ConfigError: bad arguments, e.g. a world size the plan was not made for.
        PlanError: no plan fits, or the given plan is not for this model.
    """
    runtime = runtime or RuntimeConfig()
    args, kwargs = normalise(example_inputs)
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "optimizer must build an optimizer from a parameter list, e.g. "
            "functools.partial(torch.optim.Adam, lr=1e-3); each rank owns "
            "only its stage's parameters"
        )
    _check_micro_batches(micro_batches)
    asked = schedule
    schedule = schedule_for(weights, schedule)
    check_clipping(max_grad_norm, grad_norm_type, weights)
    check_precision(precision, weights)
    check_nan_check(nan_check, weights)
    if nan_check and precision == "fp16":
        raise ConfigError(
            "nan_check=True with precision='fp16': fp16's loss scaler already skips a step "
            "whose gradients overflow (pm.skipped_steps); use one or the other"
        )
    if compile_stages and schedule in SPLIT_BACKWARD:
        raise ConfigError(
            f"compile_stages=True cannot run schedule={schedule!r}: it splits each backward "
            "into input and weight halves, which a compiled backward does not; use 1f1b, "
            "gpipe, interleaved or graph_interleaved"
        )
    devices = plan_options.pop("devices", None)  # the world size; say so if it differs
    options = _plan_options(partitioner, plan_options)
    options.setdefault("precision", precision)  # values cross stages in its dtype
    if weights != "flush":
        options.setdefault("replication", False)
        options.setdefault("weight_versions", 2)
    if schedule in PLACED:  # a chain of stages folded onto the devices, as it needs
        options.setdefault("placement", PLACED[schedule])
        options.setdefault("virtual_stages", 2)
    given = None if plan is None else _load_plan(plan)
    m = _micro_batches(micro_batches, given)
    b = micro_batch_size(batch_of(args, kwargs), m)
    _ensure_process_group(runtime)
    if devices is not None and devices != dist.get_world_size():
        raise ConfigError(
            f"devices={devices!r}, but the process group has {dist.get_world_size()} ranks: "
            "compile plans for one device per rank; launch that many processes (devices= is "
            "only needed by plan(), without a process group)"
        )
    install_watch(runtime.timeout)  # every wait from here on stops when another rank fails
    runtime_device(runtime)  # NCCL's object collectives below need the rank's GPU current
    gm = trace(model, example_inputs, leaf_modules=leaf_modules, micro_batch_size=b)
    check_output(gm)
    inputs = tuple(flat_inputs(gm, *args, **_tensor_items(kwargs)))
    the_plan = (
        _checked_plan(given, gm)
        if given is not None
        else _plan_on_rank_0(gm, inputs, m, profile_config, options, runtime)
    )
    the_plan = choose_recompute(the_plan, recompute)
    world = dist.get_world_size()
    if the_plan.num_devices != world:
        raise ConfigError(
            f"the plan is for {the_plan.num_devices} devices but the process group "
            f"has {world} ranks; launch {the_plan.num_devices} processes"
        )
    if asked is None and schedule == "1f1b" and the_plan.shared_devices():
        schedule = ANY_PLACEMENT  # a folded stage DAG (PlanConfig.interleave, place_graph)
    sched = make_schedule(the_plan, schedule, m)
    check_run(the_plan, schedule, m)
    with posted("compile"):
        return PipelinedModel(
            model,
            gm,
            inputs,
            the_plan,
            sched,
            loss_fn,
            optimizer,
            weights,
            runtime,
            weight_options,
            init_weights,
            checkpoint,
            None if max_grad_norm is None else (max_grad_norm, grad_norm_type),
            compile_stages,
            precision,
            nan_check,
        )


def _check_micro_batches(micro_batches: Any) -> None:
    """M must be a positive int (or None for the default).

    Raises:
        ConfigError: naming the value.
    """
    if micro_batches is None:
        return
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(
            f"micro_batches={micro_batches!r}: it must be a positive integer (or None for the "
            "plan's, or 4)"
        )


def _plan_options(partitioner: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """PlanConfig options: pins imply the manual partitioner, and refuse any other.

    Raises:
        ConfigError: pins with a partitioner other than "manual".
    """
    pins = options.get("pins")
    if pins and partitioner not in (None, "manual"):
        raise ConfigError(
            f"pins={dict(pins)} place stages by hand, which needs partitioner='manual' "
            f"(or none), not {partitioner!r}"
        )
    chosen = partitioner or ("manual" if pins else "graph")
    return {**options, "partitioner": chosen}


def _tensor_items(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}


def _load_plan(plan: Plan | str | Path) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.from_json(Path(plan).read_text())


def _micro_batches(micro_batches: int | None, plan: Plan | None) -> int:
    """M: the one asked for, the given plan's, or 4.

    Raises:
        ConfigError: M differs from the given plan's.
    """
    if plan is None:
        return micro_batches or 4
    if micro_batches is not None and micro_batches != plan.micro_batches:
        raise ConfigError(
            f"micro_batches={micro_batches}, but the plan was made for "
            f"{plan.micro_batches} micro-batches; plan again or leave micro_batches out"
        )
    return plan.micro_batches


SCHEDULE_FOR = {"stash": "async", "pipemare": "async", "2bw": "2bw"}


def schedule_for(weights: str, schedule: str | None) -> str:
    """The schedule to run: the one given, checked against the policy, or the policy's.

    Raises:
        ConfigError: an unknown policy, or a schedule it cannot run with.
    """
    if weights not in POLICIES:
        raise ConfigError(f"unknown weight policy {weights!r}; known: {sorted(POLICIES)}")
    wanted = SCHEDULE_FOR.get(weights)
    if schedule is None:
        return wanted or "1f1b"
    flushed = schedule not in ASYNC
    if (wanted is None and not flushed) or (wanted is not None and schedule != wanted):
        need = wanted or "a flushed schedule (gpipe, 1f1b, zb)"
        raise ConfigError(f"weights={weights!r} runs with {need}, not schedule={schedule!r}")
    return schedule


def _ensure_process_group(runtime: RuntimeConfig) -> None:
    if dist.is_initialized():
        return
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise ConfigError(
            f"no process group and no {missing} in the environment: launch with torchrun, "
            "graphpipe.runtime.launch, or call torch.distributed.init_process_group first"
        )
    backend = runtime.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=runtime.timeout))


def _checked_plan(plan: Plan, gm: fx.GraphModule) -> Plan:
    """A given plan, checked against this model's trace.

    Raises:
        PlanError: the plan was made for another graph, or is invalid for this one.
        ConfigError: the plan was made for another micro-batch size or input shapes.
    """
    b = trace_info(gm).micro_batch_size
    if plan.micro_batch_size != b:
        raise ConfigError(
            f"the plan was made for micro-batches of {plan.micro_batch_size} samples, but "
            f"this batch of {trace_info(gm).batch_size} in {plan.micro_batches} "
            f"micro-batches gives {b}"
        )
    traced = input_shapes(gm)
    for name, shape in plan.input_shapes.items():
        if name in traced and traced[name] != shape:
            raise ConfigError(
                f"the plan was made for input {name} of shape {list(shape)} per micro-batch, "
                f"but this batch traces it at {list(traced[name])}; plan again for these shapes"
            )
    if plan.graph_hash != graph_hash(gm):
        raise PlanError(
            f"the plan was made for another graph (hash {plan.graph_hash}, "
            f"this model traces to {graph_hash(gm)})"
        )
    validate_plan(plan, gm)
    return plan


def _profile_config(gm: fx.GraphModule, config: ProfileConfig | None) -> ProfileConfig:
    """The profile settings; a model on the meta device cannot be measured, so it is
    estimated from FLOPs instead, with a notice."""
    config = config or ProfileConfig()
    if config.mode == "measure" and is_meta(gm):
        log.warning(
            "graphpipe: the model is on the meta device, so op times are estimated from "
            "FLOPs (ProfileConfig.device_flops=%.3g), not measured",
            config.device_flops,
        )
        return replace(config, mode="flops")
    return config


def _plan_on_rank_0(
    gm: fx.GraphModule,
    inputs: tuple[torch.Tensor, ...],
    micro_batches: int,
    profile_config: ProfileConfig | None,
    options: dict[str, Any],
    runtime: RuntimeConfig,
) -> Plan:
    """The plan made on rank 0 and broadcast to every rank.

    The broadcast runs on a group of its own whose timeout is `runtime.plan_timeout`: the other
    ranks wait as long as planning may take, not the step's timeout, and still fail at once
    if rank 0 dies. The group's rendezvous (before planning) and rank 0's side of the
    broadcast (after it: the others wait already) are bounded by `runtime.timeout`, so a rank
    that stalls in compile is named as a stall in a step would be.
    """
    group = guarded(  # its rendezvous, too, stops when a rank dies
        "the plan broadcast's group",
        lambda: dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=runtime.plan_timeout)
        ),
        timeout=runtime.timeout,
    )
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            config = PlanConfig.build(dist.get_world_size(), micro_batches=micro_batches, **options)
            b = trace_info(gm).micro_batch_size
            made = partition(
                gm, profile(gm, inputs, b, _profile_config(gm, profile_config)), config
            )
            message[0] = ("plan", made.to_json())
        except GraphPipeError as exc:
            message[0] = ("error", f"{type(exc).__name__}: {exc}")
    try:
        guarded(
            "the plan broadcast",
            lambda: dist.broadcast_object_list(message, src=0, group=group),
            timeout=runtime.timeout if dist.get_rank() == 0 else runtime.plan_timeout,
        )
    finally:
        dist.destroy_process_group(group)
    kind, payload = message[0]
    if kind == "error":
        raise PlanError(f"planning on rank 0 failed: {payload}")
    return Plan.from_json(payload)
