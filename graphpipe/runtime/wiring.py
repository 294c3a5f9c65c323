"""Wiring: build one rank's part of a compiled pipeline (every rank, in the same order).

`wire` makes, from the traced graph, the plan, the schedule and the `RunSpec`, the pieces
of `graphpipe.runtime.pieces` (`Place`, `Holdings`, `Update`, `Run`), in this order:

    1. the stage factory, from `RuntimeConfig.emulate` (`graphpipe.runtime.factory`):
       real stages or stand-ins, chosen here once; nothing below tests `emulate`
    2. the rank's place: mesh layout, failure watch, device, stages
    3. every stage's module through the factory; this rank's materialised
    4. the process groups for replicas, tied copies and whole stages' dp ranks
       (`sum_groups`), then the group for clipping and the loss scale, fp16's scaler and
       nan_check's agreement
    5. the lowered program; NCCL's first all-reduce and FSDP2's mesh
    6. this rank's stages on the device (split by tp, sharded by FSDP2), the optimizer, the
       update hooks, the weight policy, the transport and the executor

FSDP2 or whole stages is decided once, in `_settings`: under a mesh a versioned weight
policy (stash, 2bw) keeps each dp rank's stages whole (its versions alias whole tensors),
and the GradSync averages their gradients over dp at each of its updates; every other policy
allowed under a mesh shards them with FSDP2.

Several steps are collectives, so every rank calls `wire` and creates its groups in the
same order. The run specification is read here, in `wire` and `_settings` only; the
helpers below get plain values.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from graphpipe.ir import Plan, Schedule
from graphpipe.runtime import hostmem
from graphpipe.runtime.batching import cpu
from graphpipe.runtime.clip import GradClipper
from graphpipe.runtime.comm import Transport
from graphpipe.runtime.executor import Executor, StageRuntime
from graphpipe.runtime.factory import StageFactory, stage_factory
from graphpipe.runtime.failures import guarded, install_watch, set_collective_timeout
from graphpipe.runtime.fsdp_comms import guard_collectives
from graphpipe.runtime.groups import Modules, scale_group, sum_groups, update_group
from graphpipe.runtime.hooks import AgreeFinite, Clip, Unscale, hooks_for
from graphpipe.runtime.materialize import InitFn, is_meta, materialize_sharded, names_by_id
from graphpipe.runtime.mesh import ParallelLayout, shard_stage
from graphpipe.runtime.nancheck import NanCheck
from graphpipe.runtime.pieces import Holdings, Place, Run, Update, WiredRank
from graphpipe.runtime.precision import LossScaler, Precision
from graphpipe.runtime.spec import RunSpec, RuntimeConfig
from graphpipe.runtime.stage import Specs, build_stage, micro_shapes
from graphpipe.runtime.sync import GradSync
from graphpipe.runtime.tp import apply_tp, resolve_tp_plan
from graphpipe.runtime.weights import CLASSES, PolicyOptions, WeightPolicy, make_policy
from graphpipe.scheduling.generators import warmups
from graphpipe.scheduling.program import lower
from graphpipe.tracing.annotate import trace_info

__all__ = ["runtime_device", "wire"]


@dataclass(frozen=True)
class _Settings:
    """What the helpers below read of the run specification, read once (`_settings`)."""

    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    micro_batches: int  # M
    weights: str  # the weight policy's name
    weight_options: PolicyOptions | None
    precision: str | None  # "bf16", "fp16" or None
    clip: tuple[float, float] | None  # (max norm, p); None: no clipping
    nan_check: bool
    timeout: float  # seconds a collective or a message may take
    sharded: bool  # meshed, stages not whole: sharded over the mesh (materialised shard by
    # shard, `_put`)
    # a versioned policy (stash, 2bw) under a mesh: each dp rank's stages whole, no FSDP2,
    # their gradients averaged over dp by the GradSync (`sum_groups`)
    whole: bool
    init_weights: InitFn | None
    checkpoint: str | Path | None
    compile_stages: bool
    reshard_after_forward: bool


@dataclass(frozen=True)
class _Context:
    """What building this rank's stages reads."""

    settings: _Settings
    plan: Plan
    place: Place
    gm: fx.GraphModule
    factory: StageFactory
    shared: dict[str, tuple[int, ...]]  # tied name -> the stages holding it
    canon: dict[str, str]  # every name -> the first name of its tensor
    model: nn.Module  # the model as given (its blocks, for FSDP2's units)
    fsdp_mesh: Any  # the DeviceMesh FSDP2 wraps stages over; None without a mesh
    tp_plan: dict[str, str] | None  # the checked tensor-parallel plan; None without "tp"
    # the DTensor parameter `apply_tp` made of each model tensor (by id), for all of this
    # rank's stages: a weight tied across two of them stays one tensor
    tp_made: dict[int, nn.Parameter] = field(default_factory=dict)


@dataclass(frozen=True)
class _Parts:
    """What a rank with stages has and an idle one has not."""

    module: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    clipper: GradClipper | None = None
    policy: WeightPolicy | None = None
    executor: Executor | None = None


@dataclass(frozen=True)
class _Built:
    """Every stage's module, and what crosses stages."""

    modules: Modules  # every stage's module (or emulated stand-in) and StageIO
    specs: Specs  # value name -> micro-batch shape and dtype between stages
    model_inputs: tuple[str, ...]  # the model inputs this rank's stages read
    orphans: dict[str, torch.Tensor]  # the model's tensors no stage holds, on the CPU
    materialized: bool  # this rank made real tensors of a meta model's


def wire(
    model: nn.Module,
    gm: fx.GraphModule,
    example_inputs: tuple[torch.Tensor, ...],
    plan: Plan,
    schedule: Schedule,
    spec: RunSpec,
) -> WiredRank:
    """Build this rank's part of the pipeline (a collective: every rank, same order).

    Args:
        model: The model as given (on the meta device or real).
        gm: Its trace at the micro-batch size.
        example_inputs: The flat example inputs (one mini-batch).
        plan: The plan, the same on every rank.
        schedule: The schedule to run (the first call's for an asynchronous one).
        spec: The checked run specification.

    Returns:
        The rank's place, holdings, update and run, and the stage factory.

    Raises:
        ConfigError: a weight tied across ranks under an asynchronous schedule, or across
            two stages of one pp rank under a mesh in a model on the meta device
            (`sum_groups`).
    """
    s = _settings(spec)
    factory = stage_factory(spec.runtime.emulate)  # the one place emulation is decided
    layout = spec.layout or ParallelLayout.current(spec.mesh)  # built once by compile
    watch = install_watch(s.timeout)
    set_collective_timeout(s.timeout)
    place = _locate(plan, layout, runtime_device(spec.runtime))
    if spec.runtime.host_cache and place.device.type == "cpu":
        hostmem.keep_freed()  # the step's tensors reuse freed host blocks
    canon = {n: names[0] for names in names_by_id(model).values() for n in names}
    precision = _precision(s.precision, layout, gm, s.whole)
    built = _build_modules(model, gm, plan, example_inputs, place, precision, factory, s)
    modules, mine = built.modules, place.stage_indices
    sync, shared = sum_groups(
        plan, spec, schedule.name, place.rank, canon, modules, mine, layout, s.whole
    )
    group, scaler, agree = _update_checks(plan, s, modules, canon, place)
    if built.materialized:
        sync.broadcast()  # tied copies and replicas start equal on every holder
    prefetch = _prefetch(spec.runtime.prefetch)
    program = lower(plan, schedule, prefetch=prefetch)
    dp_shard = spec.parallelism.dp_shard
    fsdp_mesh = _ready_collectives(place.device, layout, dp_shard, s.timeout, s.whole)
    tp_plan = resolve_tp_plan(model, spec.tp_plan) if layout.tp_mesh is not None else None
    parts = _Parts()
    if mine:
        c = _Context(s, plan, place, gm, factory, shared, canon, model, fsdp_mesh, tp_plan)
        parts = _wire_stages(c, modules, built.specs, sync, group, precision, watch, scaler, agree)
    aliases = names_by_id(model)  # by the ids of the materialised (and sharded) tensors
    holdings = Holdings(
        parts.module, tuple(model.state_dict()), aliases, built.orphans, built.model_inputs
    )
    optimizer = parts.optimizer or s.optimizer([nn.Parameter(torch.zeros(0))])
    update = Update(s.weights, optimizer, parts.policy, scaler, agree, parts.clipper)
    run = Run(plan, schedule, s.micro_batches, program, prefetch, parts.executor)
    return WiredRank(place, holdings, update, run, factory)


def _settings(spec: RunSpec) -> _Settings:
    """The fields of `spec` the helpers read, as plain values."""
    whole = spec.meshed and CLASSES[spec.numerics.weights].versioned
    return _Settings(
        loss_fn=spec.loss_fn,
        optimizer=spec.optimizer,
        micro_batches=spec.micro_batches,
        weights=spec.numerics.weights,
        weight_options=spec.numerics.weight_options,
        precision=spec.numerics.precision,
        clip=spec.clip,
        nan_check=spec.numerics.nan_check,
        timeout=spec.runtime.timeout,
        sharded=spec.meshed and not whole,
        whole=whole,
        init_weights=spec.init.init_weights,
        checkpoint=None if spec.init.checkpoint is None else Path(spec.init.checkpoint),
        compile_stages=spec.runtime.compile_stages,
        reshard_after_forward=spec.reshard_after_forward,
    )


def _locate(plan: Plan, layout: ParallelLayout, device: torch.device) -> Place:
    """This rank's place: its plan device is its pp coordinate (the transport translates,
    `ParallelLayout.rank_of`), and its stages are that device's."""
    rank = layout.pp_index
    return Place(rank, device, tuple(s.index for s in plan.stages_on(rank)), layout)


def _prefetch(asked: bool | None) -> bool:
    """Whether every receive of a call is posted first: as asked, else under gloo."""
    return dist.get_backend() == "gloo" if asked is None else asked


def _ready_collectives(
    device: torch.device, layout: ParallelLayout, dp_shard: bool, timeout: float, whole: bool
) -> Any:
    """Ready what every rank's collectives need, in the same order on every rank: NCCL's
    communicator (a first all-reduce: the first batched send must not be its first use),
    then the FSDP2 mesh with its groups' timeout (FSDP2's collectives are unguarded: their
    groups' own limit). Returns that mesh, or None without FSDP (no "dp" dimension, or
    `whole` stages: a versioned policy's, summed over dp by the GradSync)."""
    if device.type == "cuda":
        warm = torch.zeros(1, device=device)
        guarded("the all-reduce that starts NCCL", lambda: dist.all_reduce(warm))
    fsdp_mesh = layout.fsdp_mesh(dp_shard) if layout.fsdp and not whole else None  # every rank
    if fsdp_mesh is not None:
        set_collective_timeout(timeout, fsdp_mesh.get_all_groups())
    return fsdp_mesh


def _precision(
    name: str | None, layout: ParallelLayout, gm: fx.GraphModule, whole: bool
) -> Precision:
    """The run's precision `name`: autocast, or under a mesh FSDP2's mixed-precision policy,
    but autocast still for a graph torch.export traced (its casts are the model's own:
    `graphpipe.runtime.precision`) and where no FSDP2 casts the parameters: a mesh without
    a "dp" dimension (tp alone), or `whole` stages (a versioned policy's)."""
    if not layout.meshed or whole:
        return Precision(name)
    exported = trace_info(gm).method == "export"  # its own casts: autocast (precision.py)
    return Precision(name, sharded=True, by_autocast=exported or not layout.fsdp)


def _build_modules(
    model: nn.Module,
    gm: fx.GraphModule,
    plan: Plan,
    example_inputs: tuple[torch.Tensor, ...],
    place: Place,
    precision: Precision,
    factory: StageFactory,
    s: _Settings,
) -> _Built:
    """Every stage's module carved from the trace and made by the factory; this rank's
    materialised (under a mesh, later and shard by shard: `_put`)."""
    mine = place.stage_indices
    carved: Modules = {st.index: build_stage(gm, plan, st.index) for st in plan.stages}
    model_inputs = tuple(sorted({n for i in mine for n in carved[i][1].model_inputs}))
    orphans = _orphans(model, [m for m, _ in carved.values()])
    rows = plan.micro_batch_size // plan.cost_model.dims.dp  # one dp rank's slice
    cast_back = precision.dtype is not None and trace_info(gm).method == "export"
    modules, specs = factory.build(
        gm, plan, carved, mine, place.device, lambda: micro_shapes(gm, example_inputs, rows),
        cast_back,
    )  # fmt: skip
    specs = {  # what crosses stages, in the precision's dtype
        name: (shape, precision.spec_dtype(dtype)) for name, (shape, dtype) in specs.items()
    }
    materialized = [
        name
        for i in mine
        if not s.sharded
        for name in factory.materialize(
            model, modules[i][0], place.device, s.init_weights, s.checkpoint
        )
    ]
    return _Built(modules, specs, model_inputs, orphans, bool(materialized))


def _update_checks(
    plan: Plan, s: _Settings, modules: Modules, canon: dict[str, str], place: Place
) -> tuple[dist.ProcessGroup | None, LossScaler | None, AgreeFinite | None]:
    """The group that agrees on clipping and the loss scale (a collective, when either is
    on), fp16's scaler and nan_check's agreement."""
    layout = place.layout
    fp16 = s.precision == "fp16"
    needs_group = s.clip is not None or fp16
    group = update_group(plan, s.timeout, layout) if needs_group else None
    scaler = None
    if fp16:  # under a mesh every dp and tp rank agrees too (scale_group)
        scaler = _scaler(scale_group(plan, s.timeout, layout) if layout.meshed else group)
    agree = _agreement(modules, canon, s.micro_batches, place.device) if s.nan_check else None
    return group, scaler, agree


def _wire_stages(
    c: _Context,
    modules: Modules,
    specs: Specs,
    sync: GradSync,
    update_group: dist.ProcessGroup | None,
    precision: Precision,
    watch: Any,
    scaler: LossScaler | None,
    agree: AgreeFinite | None,
) -> _Parts:
    """This rank's stages: modules on the device, optimizer, hooks, policy, executor."""
    s, place = c.settings, c.place
    stages = _stage_runtimes(c, modules, specs, sync, precision)
    held = [r.module for r in stages.values()]
    whole = held[0] if len(held) == 1 else nn.ModuleList(held)
    optimizer, clipper, policy = _updating(c, whole, modules, sync, update_group, scaler, agree)
    layout = place.layout
    transport = Transport(layout.rank, s.timeout, place.device, watch, rank_of=layout.rank_of)
    executor = Executor(
        stages,
        policy,
        transport,
        precision,
        nancheck=None if agree is None else agree.check,
        grad_scale=None if scaler is None else lambda: scaler.scale,
        action_end=c.factory.action_end,
    )
    return _Parts(whole, optimizer, clipper, policy, executor)


def _updating(
    c: _Context,
    whole: nn.Module,
    modules: Modules,
    sync: GradSync,
    update_group: dist.ProcessGroup | None,
    scaler: LossScaler | None,
    agree: AgreeFinite | None,
) -> tuple[torch.optim.Optimizer, GradClipper | None, WeightPolicy]:
    """The optimizer over this rank's module `whole`, max_grad_norm's clipper, and the weight
    policy, given the update hooks in their order (fp16 unscale, NaN check, clipping)."""
    s, device = c.settings, c.place.device
    params = list(whole.parameters())  # unique: a tied weight is one tensor here
    optimizer = s.optimizer(params or [nn.Parameter(torch.zeros(0))])
    clipper = None if s.clip is None else _clipper(c, s.clip, modules, params, update_group)
    hooks = hooks_for(
        None if scaler is None else Unscale(scaler, params, device),
        agree,
        None if clipper is None else Clip(clipper, device),
    )
    warmup = warmups(c.plan)[c.place.stage_indices[0]]
    policy = make_policy(
        s.weights, whole, optimizer, sync, s.micro_batches, warmup, s.weight_options, hooks
    )
    return optimizer, clipper, policy


def _stage_runtimes(
    c: _Context, modules: Modules, specs: Specs, sync: GradSync, precision: Precision
) -> dict[int, StageRuntime]:
    """Each of this rank's stages on the device (`_put`), with what running it reads. Under
    a mesh the tied weights' sums are rebound to FSDP2's sharded parameters."""
    place = c.place
    before = _named_parameters(modules, place.stage_indices)
    stages = {}
    for i in place.stage_indices:
        module, io = modules[i]
        c.factory.retarget(module, place.device)
        _put(c, i, module, precision)
        stages[i] = StageRuntime(
            place.rank, c.plan, i, module, io, specs, c.gm, c.settings.loss_fn, place.device,
            tensor_parallel=c.tp_plan is not None,
        )  # fmt: skip
    if place.layout.meshed:  # the tied weights' sums read FSDP2's sharded parameters
        after = _named_parameters(modules, place.stage_indices)
        sync.rebind({id(p): after[key] for key, p in before.items() if key in after})
    return stages


def _named_parameters(
    modules: Modules, mine: tuple[int, ...]
) -> dict[tuple[int, str], nn.Parameter]:
    """(stage, name) -> parameter, over stages `mine`."""
    return {(i, n): p for i in mine for n, p in modules[i][0].named_parameters()}


def _put(c: _Context, index: int, module: fx.GraphModule, precision: Precision) -> None:
    """Put stage `index`'s module on the device, compiled if asked, and under a mesh
    split by the tp plan and sharded by FSDP2 (its collectives under the watch) before the
    optimizer is made (it steps the sharded parameters). A stage still on meta (a meta model
    under a mesh) is split and sharded first and only its shards materialised; a stand-in
    (`graphpipe.runtime.factory`) is made on the device, never on meta."""
    s = c.settings

    def shard() -> None:
        if c.tp_plan is not None:  # DTensors over tp first: FSDP2 shards them over dp (2D)
            mesh = cast(DeviceMesh, c.place.layout.tp_mesh)
            apply_tp(module, c.canon, mesh, c.tp_plan, c.tp_made)
        if c.fsdp_mesh is not None:
            shard_stage(module, c.model, c.fsdp_mesh, s.reshard_after_forward, precision)
            guard_collectives(module, index)

    if s.sharded and is_meta(module):
        materialize_sharded(c.model, module, c.place.device, shard, s.init_weights, s.checkpoint)
        return
    module.to(c.place.device)
    if s.compile_stages:  # in place: the module and its state dict keys stay
        module.compile()
    shard()


def _scaler(group: dist.ProcessGroup | None) -> LossScaler:
    """fp16's loss scaler, agreeing on overflows over `group` (None: every rank)."""
    ranks = None if group is None else dist.get_process_group_ranks(group)

    def all_reduce_max(flag: torch.Tensor) -> None:
        guarded(
            "the all-reduce of the found-inf flag",
            lambda: dist.all_reduce(flag, dist.ReduceOp.MAX, group),
            ranks,
        )

    return LossScaler(all_reduce_max)


def _agreement(
    modules: Modules, canon: dict[str, str], m: int, device: torch.device
) -> AgreeFinite:
    """nan_check's agreement; every rank names every stage's parameters alike."""
    names = [[canon.get(n, n) for n, _ in mod.named_parameters()] for mod, _ in modules.values()]
    return AgreeFinite(NanCheck(names, m, device))


def _clipper(
    c: _Context,
    clip: tuple[float, float],
    modules: Modules,
    params: list[nn.Parameter],
    group: dist.ProcessGroup | None,
) -> GradClipper:
    """Count each parameter on one rank: its first holding stage's first device; once there,
    however many copies of it the rank's stages hold (`groups.own_copies`)."""
    counted = []
    seen: set[str] = set()
    for index in c.place.stage_indices:
        for n, p in modules[index][0].named_parameters():
            name = c.canon.get(n, n)
            owner = c.shared.get(name, (index,))[0]
            if c.plan.stages[owner].devices[0] == c.place.rank and name not in seen:
                counted.append(p)
                seen.add(name)
    return GradClipper(clip[0], clip[1], params, counted, group)


def runtime_device(runtime: RuntimeConfig) -> torch.device:
    """This rank's device: the configured one, cuda:LOCAL_RANK with NCCL, else the CPU.

    A CUDA device is made current, as NCCL's object collectives (the plan's broadcast, state
    dicts) need.
    """
    if runtime.device is not None:
        device = torch.device(runtime.device)
    elif dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _orphans(model: nn.Module, modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters and buffers no stage holds (unused by forward), by tensor identity, so a
    tied weight read under one of its names is held under all of them: kept as they are."""
    held = {id(t) for m in modules for t in m.state_dict(keep_vars=True).values()}
    return {  # a meta model's unused tensors have no value to keep
        k: cpu(v)
        for k, v in model.state_dict(keep_vars=True).items()
        if id(v) not in held and not v.is_meta
    }
