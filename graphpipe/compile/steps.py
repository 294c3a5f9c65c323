"""The steps of `graphpipe.compile` that reach the other ranks: the process group, the plan
made on rank 0 and broadcast to all (or a given plan, checked against this model's trace),
and the schedule chosen for it.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from graphpipe._torch import AGENT_STORE_ENV
from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir import ParallelDims, Plan, Schedule
from graphpipe.planning.automesh import plan_mesh
from graphpipe.planning.opgraph import graph_hash, input_shapes, op_graph
from graphpipe.planning.partition import PlanConfig, partition, partition_mesh
from graphpipe.planning.profile import ProfileConfig, noted, profile
from graphpipe.planning.validate import validate_plan
from graphpipe.runtime.failures import guarded, restart_count
from graphpipe.runtime.mesh import ParallelLayout, build_mesh
from graphpipe.runtime.spec import RunSpec, RuntimeConfig, plan_schedule
from graphpipe.runtime.tp import resolve_tp_plan
from graphpipe.runtime.weights import CLASSES
from graphpipe.scheduling.dryrun import check_run
from graphpipe.scheduling.generators import make_schedule
from graphpipe.tracing.annotate import is_meta, trace_info

__all__ = [
    "broadcast_plan",
    "check_world",
    "checked_plan",
    "ensure_process_group",
    "join_mesh",
    "mesh_on_rank_0",
    "pipeline_devices",
    "plan_on_rank_0",
    "schedule_plan",
]

log = logging.getLogger("graphpipe")


def pipeline_devices(spec: RunSpec) -> int:
    """The devices a plan is made for: the world size, or with a mesh its pp size."""
    if spec.layout is not None:
        return int(spec.layout.pp)
    return dist.get_world_size() // spec.dims.inner


def join_mesh(spec: RunSpec, device_type: str) -> RunSpec:
    """The spec with its mesh and this rank's layout: the given mesh checked against the
    world, or the spec's dims' mesh built (`graphpipe.runtime.mesh.build_mesh`, a
    collective), or none; the layout (`ParallelLayout`) built once from the mesh or the
    world, for the planner and the runtime to read, and the spec's dims resolved (pp).

    Raises:
        ConfigError: the dims do not fit the world (`ParallelDims.on`).
    """
    world = dist.get_world_size()
    dims = spec.dims.on(world)  # a given mesh: it must span the world
    mesh = spec.mesh if spec.mesh is not None else build_mesh(dims, device_type, world)
    shard = dims.dp_shard
    layout = ParallelLayout.current(mesh, spec.micro_batch_size, shard)
    return replace(spec, mesh=mesh, dims=layout.dims, layout=layout)


def check_world(spec: RunSpec, plan: Plan | None) -> None:
    """The world size (with a mesh, its pp size) must be the devices asked for and the plan's.

    Raises:
        ConfigError: naming both numbers.
    """
    world = pipeline_devices(spec)
    asked = spec.parallelism.devices
    if asked is not None and asked != world:
        raise ConfigError(
            f"devices={asked!r}, but the process group has {world} ranks: "
            "compile plans for one device per rank; launch that many processes (devices= is "
            "only needed by plan(), without a process group)"
        )
    if plan is not None and plan.num_devices != world:
        if spec.meshed:
            raise ConfigError(
                f"the plan is for {plan.num_devices} devices but the mesh's pp size is "
                f"{world}; launch {plan.num_devices * spec.dims.inner} processes"
            )
        raise ConfigError(
            f"the plan is for {plan.num_devices} devices but the process group "
            f"has {world} ranks; launch {plan.num_devices} processes"
        )


def schedule_name(plan: Plan, spec: RunSpec) -> str:
    """The schedule `plan` runs under: the one the run names, or its weight policy's; else
    the one the plan was made for (`Plan.schedule`: the planner's choice with its layout,
    1f1b on one stage per device, graph_interleaved on other foldings of a plan made
    elsewhere), checked against the run as a named one is (`plan_schedule`).

    Raises:
        ConfigError: the plan's schedule is one the run's weight policy or compile_stages
            cannot run.
    """
    if spec.schedule is not None:  # named, or the policy's
        return spec.schedule
    return plan_schedule(spec, plan)


def schedule_plan(plan: Plan, spec: RunSpec, made: Schedule | None = None) -> Schedule:
    """The schedule for `plan` (`schedule_name`), checked by a dry run (`check_run`);
    `made`, the schedule already made for it, is checked as it is, not made again.

    Raises:
        ConfigError: as `schedule_name`.
        ScheduleError: the schedule's rule refuses the plan (`graphpipe.scheduling.rules`,
            as `simulate` and `make_schedule` do), or the dry run fails.
    """
    name = made.name if made is not None else schedule_name(plan, spec)
    schedule = made or make_schedule(plan, name, spec.micro_batches)
    check_run(plan, name, spec.micro_batches, made=schedule)
    return schedule


def ensure_process_group(runtime: RuntimeConfig) -> None:
    """The default process group, from the environment when there is none yet (env://;
    under torchrun's agent, on its store under a prefix per restart).

    Raises:
        ConfigError: no process group and no RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT.
    """
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
    timeout = datetime.timedelta(seconds=runtime.timeout)
    if os.environ.get(AGENT_STORE_ENV) != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(f"graphpipe/attempt_{restart_count()}", _agent_store(timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _agent_store(timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of the store torchrun's agent serves at MASTER_ADDR:MASTER_PORT.

    The agent keeps that one store across the restarts of `--max-restarts`, and torch
    2.13's env:// rendezvous puts no prefix per attempt on it (it assumes a new store per
    retry): a restarted group's gloo could read the dead group's addresses, still there
    under the same keys, and fail to connect ("Connection refused"), in about half the
    restarts tried. `ensure_process_group` puts each attempt under a prefix of its own.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world = int(os.environ["WORLD_SIZE"])
    return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)


def checked_plan(plan: Plan, gm: fx.GraphModule, dims: ParallelDims | None = None) -> Plan:
    """A given plan, checked against this model's trace (at one dp rank's slice of the
    run's `dims`; None: no mesh).

    Raises:
        PlanError: the plan was made for another graph, or is invalid for this one.
        ConfigError: the plan was made for another micro-batch size, input shapes, dp or tp.
    """
    dims = dims or ParallelDims(pp=None)
    dp = dims.dp
    b = trace_info(gm).micro_batch_size * dp
    for dim, planned, run in (("dp", plan.dims.dp, dp), ("tp", plan.dims.tp, dims.tp)):
        if planned != run:
            raise ConfigError(
                f"the plan was made for {dim}={planned}, this run has {dim}={run}; "
                f"plan with graphpipe.plan(..., {dim}=...) for the run's mesh"
            )
    if plan.micro_batch_size != b:
        raise ConfigError(
            f"the plan was made for micro-batches of {plan.micro_batch_size} samples, but "
            f"this batch of {trace_info(gm).batch_size} in {plan.micro_batches} "
            f"micro-batches gives {b}"
        )
    traced = _whole_micro_batch(input_shapes(gm), dp)
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


def _profile_config(model: nn.Module, config: ProfileConfig) -> ProfileConfig:
    """The profile settings rank 0 plans with. By default (mode "auto") op times are measured
    on the model's device, and for a model on the meta device, which cannot run, estimated
    from FLOPs (`planning.profile.resolved`). A model on the meta device asked to be
    measured (mode "measure") is estimated too, with a warning. `model`: the traced graph,
    or (mesh="auto", planned before the trace) the model."""
    if config.mode == "measure" and is_meta(model):
        log.warning(
            "graphpipe: the model is on the meta device, so op times are estimated from "
            "FLOPs (ProfileConfig.device_flops=%.3g), not measured",
            config.device_flops,
        )
        return replace(config, mode="flops")
    return config


def _plan(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], spec: RunSpec) -> Plan:
    """Rank 0's plan: over the world's devices, with a mesh over pp = world / (dp x tp) of
    them.

    Under a mesh the model is traced at one dp rank's slice (b rows of a micro-batch of b * dp),
    so the op graph is already one dp rank's: the planner is told the whole micro-batch's rows
    and handed that graph as the slice (`partition_mesh(graph_at=...)`), and costs the dp
    dimension (sharded bytes, all-gathers, the reduce-scatter) with the run's FSDP options,
    and the tp dimension by the run's tp plan (`spec.tp_plan`, resolved by compile: the
    planned layers' bytes and times split, their all-reduces in the stage times).
    """
    dp, tp, b = spec.dims.dp, spec.dims.tp, trace_info(gm).micro_batch_size
    prof = profile(gm, inputs, b, _profile_config(gm, spec.planning.profile))
    if dp == 1 and tp == 1:
        config = PlanConfig.build(
            pipeline_devices(spec), micro_batches=spec.micro_batches, **spec.plan_options
        )
        return partition(gm, prof, config)
    tp_options = {} if tp == 1 else {"tp": tp, "tp_plan": spec.tp_plan}
    config = PlanConfig.build(
        dist.get_world_size(),  # pp x dp x tp
        micro_batches=spec.micro_batches,
        dp=dp,
        # a versioned policy keeps its stages whole on each dp rank, its gradients all-reduced
        # (runtime.weights): costed as replicas, not FSDP2 shards
        dp_shard=spec.parallelism.dp_shard and not CLASSES[spec.numerics.weights].versioned,
        reshard_after_forward=spec.reshard_after_forward,
        **tp_options,
        **spec.plan_options,
    )
    g = op_graph(gm, prof, config.precision)
    made = partition_mesh(
        g, b * dp, config, graph_hash(gm), prof.mode, prof.device, graph_at=lambda k: g
    )
    return noted(replace(made, input_shapes=_whole_micro_batch(input_shapes(gm), dp)), prof)


def _whole_micro_batch(shapes: dict[str, tuple[int, ...]], dp: int) -> dict[str, tuple[int, ...]]:
    """Input shapes of one dp rank's slice -> those of the whole micro-batch (dim 0 x dp),
    as a plan records them (`graphpipe.plan(..., dp=k)` traces the whole micro-batch)."""
    return {name: (s[0] * dp, *s[1:]) if s else s for name, s in shapes.items()}


def plan_on_rank_0(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], spec: RunSpec) -> Plan:
    """The plan made on rank 0 (`_plan`) and broadcast to every rank (`broadcast_plan`)."""
    return broadcast_plan(lambda: _plan(gm, inputs, spec), spec.runtime)


def mesh_on_rank_0(model: nn.Module, example_inputs: Any, spec: RunSpec) -> Plan:
    """mesh="auto": rank 0's whole-mesh search over the world's devices
    (`graphpipe.planning.automesh.plan_mesh`: pp x dp x tp, M, FSDP2's resharding, the
    layout and the schedule), broadcast to every rank. tp is searched where the model has a
    tp plan (`tp_plan=`, or its own base_model_tp_plan), else not."""
    return broadcast_plan(lambda: _plan_mesh(model, example_inputs, spec), spec.runtime)


def _plan_mesh(model: nn.Module, example_inputs: Any, spec: RunSpec) -> Plan:
    try:
        tp_plan = resolve_tp_plan(model, spec.parallelism.tp_plan)
    except ConfigError:
        if spec.parallelism.tp_plan is not None:
            raise  # a tp plan given that does not fit the model
        tp_plan = None  # the model has none: no tp
    m = spec.planning.micro_batches
    return plan_mesh(
        model,
        example_inputs,
        dist.get_world_size(),
        node=spec.parallelism.node,
        micro_batches="auto" if m is None else m,
        workers=spec.planning.search_workers,
        tp_plan=tp_plan,
        **{**spec.plan_options, "profile": _profile_config(model, spec.planning.profile)},
    )


def broadcast_plan(make: Callable[[], Plan], runtime: RuntimeConfig) -> Plan:
    """`make()` on rank 0, broadcast to every rank.

    The broadcast runs on a group of its own whose timeout is `runtime.plan_timeout`: the other
    ranks wait as long as planning may take, not the step's timeout, and still fail at once
    if rank 0 dies. The group's rendezvous (before planning) and rank 0's side of the
    broadcast (after it: the others wait already) are bounded by `runtime.timeout`, so a rank
    that stalls in compile is named as a stall in a step would be.

    Any exception while rank 0 plans (a PlanError, or a crash in profiling or the search)
    is sent in the plan's place: every rank raises a PlanError naming its type and message
    at once, rank 0's chained to the original, instead of the others waiting out
    `plan_timeout`.

    Every rank has finished with the group (a barrier on the default group) before any rank
    destroys it.
    """
    group = guarded(  # its rendezvous, too, stops when a rank dies
        "the plan broadcast's group",
        lambda: dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=runtime.plan_timeout)
        ),
        timeout=runtime.timeout,
    )
    message: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            message[0] = ("plan", make().to_json())
        except Exception as exc:  # any failure: the other ranks are waiting for a plan
            failure = exc
            message[0] = ("error", f"{type(exc).__name__}: {exc}")
    try:
        guarded(
            "the plan broadcast",
            lambda: dist.broadcast_object_list(message, src=0, group=group),
            timeout=runtime.timeout if dist.get_rank() == 0 else runtime.plan_timeout,
        )
        # no rank closes the group's connections while another still reads or connects on
        # them: a rank destroying it right after its own part of the broadcast cut a slow
        # rank's connection ("Connection closed by peer" in connectFullMesh, 8 ranks)
        guarded("the plan broadcast's end", dist.barrier, timeout=runtime.timeout)
    finally:
        dist.destroy_process_group(group)
    kind, payload = message[0]
    if kind == "error":
        raise PlanError(f"planning on rank 0 failed: {payload}") from failure
    return Plan.from_json(payload)
