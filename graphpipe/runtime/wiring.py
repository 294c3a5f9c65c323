"""Wiring: build one rank's part of a compiled pipeline (every rank, in the same order).

`wire` makes, from the traced graph, the plan, the schedule and the `RunSpec`: this rank's
stage modules (materialised, moved, maybe compiled or emulated), the process groups for
replicas and tied copies, the update hooks (fp16 unscale, NaN check, clipping), the
optimizer, the weight policy (given the hooks), the transport and the executor (given the
NaN check and the loss scale). Several steps are collectives, so every rank calls `wire`
and creates its groups in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from graphpipe.ir import Plan, Schedule
from graphpipe.ir.program import Program
from graphpipe.ir.registry import schedule_spec
from graphpipe.runtime.batching import cpu
from graphpipe.runtime.clip import GradClipper
from graphpipe.runtime.comm import Transport
from graphpipe.runtime.emulate import DeviceTime, Emulate, EmulatedStage, emulated_specs
from graphpipe.runtime.executor import Executor, StageRuntime
from graphpipe.runtime.failures import guarded, install_watch, set_collective_timeout
from graphpipe.runtime.fsdp_comms import guard_collectives
from graphpipe.runtime.groups import Modules, scale_group, sum_groups, update_group
from graphpipe.runtime.hooks import AgreeFinite, Clip, Unscale, hooks_for
from graphpipe.runtime.materialize import is_meta, materialize, materialize_sharded, names_by_id
from graphpipe.runtime.mesh import MeshLayout, shard_stage
from graphpipe.runtime.nancheck import NanCheck
from graphpipe.runtime.precision import LossScaler, Precision
from graphpipe.runtime.spec import RunSpec, RuntimeConfig
from graphpipe.runtime.stage import arrive_as_traced, build_stage, micro_shapes, retarget
from graphpipe.runtime.sync import GradSync
from graphpipe.runtime.tp import apply_tp, resolve_tp_plan
from graphpipe.runtime.weights import WeightPolicy, make_policy
from graphpipe.scheduling.generators import warmups
from graphpipe.scheduling.program import lower
from graphpipe.tracing.annotate import trace_info

__all__ = ["Wiring", "runtime_device", "wire"]


@dataclass
class Wiring:
    """One rank's built pipeline: what the other parts of a PipelinedModel run on."""

    spec: RunSpec
    plan: Plan
    schedule: Schedule
    rank: int
    device: torch.device
    model: nn.Module  # the whole model as given (its state dict's names and order)
    gm: fx.GraphModule  # the whole traced graph
    stage_indices: tuple[int, ...]  # this rank's stages
    model_inputs: tuple[str, ...]  # the model inputs those stages read
    aliases: dict[int, list[str]]  # id of each tensor -> every name of it (tied ones too)
    orphans: dict[str, torch.Tensor]  # parameters and buffers no stage holds, on the CPU
    module: nn.Module | None  # this rank's stage module (a ModuleList of several); None: idle
    optimizer: torch.optim.Optimizer
    policy: WeightPolicy | None
    executor: Executor | None
    prefetch: bool  # every receive of a call is posted first
    program: Program  # the lowered schedule (the first call's, for an asynchronous one)
    scaler: LossScaler | None = None  # fp16's loss scale
    agree: AgreeFinite | None = None  # nan_check's agreement (also run by an idle rank)
    clipper: GradClipper | None = None  # max_grad_norm's clipping
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tied name -> stages
    layout: MeshLayout | None = None  # pp and dp coordinates (identity without a mesh)

    @property
    def asynchronous(self) -> bool:
        """The schedule keeps micro-batches in flight across step() calls (async, 2bw)."""
        return schedule_spec(self.schedule.name).asynchronous

    @property
    def dp(self) -> int:
        """Data-parallel slices of each micro-batch (a mesh's dp size; 1 without one)."""
        return 1 if self.layout is None else self.layout.dp

    @property
    def loss_copies(self) -> int:
        """Ranks holding each micro-batch slice's loss: its dp slices times the tp ranks
        that each compute the same loss (a sum of the losses over every rank counts each
        micro-batch's this many times, as a share of its mean)."""
        return 1 if self.layout is None else self.layout.dp * self.layout.tp

    @property
    def canonical(self) -> dict[str, str]:
        """Every name of every tensor of the model -> its first name."""
        return {n: names[0] for names in self.aliases.values() for n in names}


def wire(
    model: nn.Module,
    gm: fx.GraphModule,
    example_inputs: tuple[torch.Tensor, ...],
    plan: Plan,
    schedule: Schedule,
    spec: RunSpec,
) -> Wiring:
    """Build this rank's part of the pipeline (a collective: every rank, same order).

    Args:
        model: The model as given (on the meta device or real).
        gm: Its trace at the micro-batch size.
        example_inputs: The flat example inputs (one mini-batch).
        plan: The plan, the same on every rank.
        schedule: The schedule to run (the first call's for an asynchronous one).
        spec: The checked run specification.

    Raises:
        ConfigError: a weight tied across ranks under an asynchronous schedule, or across
            two stages of one pp rank under a mesh (`sum_groups`).
    """
    runtime = spec.runtime
    layout = MeshLayout.current(spec.mesh)
    rank = layout.pp_index  # the plan's device; the transport translates (`rank_of`)
    watch = install_watch(runtime.timeout)
    set_collective_timeout(runtime.timeout)
    device = runtime_device(runtime)
    mine = tuple(s.index for s in plan.stages_on(rank))
    canon = {n: names[0] for names in names_by_id(model).values() for n in names}
    precision = _precision(spec, layout, gm)
    built = _build_modules(model, gm, plan, spec, example_inputs, mine, device, precision)
    modules = built.modules
    sync, shared = sum_groups(plan, spec, schedule.name, rank, canon, modules, mine, layout)
    update_group, scaler, agree = _update_checks(plan, spec, modules, canon, device, layout)
    if built.materialized:
        sync.broadcast()  # tied copies and replicas start equal on every holder
    prefetch = dist.get_backend() == "gloo" if runtime.prefetch is None else runtime.prefetch
    program = lower(plan, schedule, prefetch=prefetch)
    fsdp_mesh = _ready_collectives(device, layout, spec)
    parts = _Parts(None, None, None, None, None)
    tp_plan = resolve_tp_plan(model, spec.tp_plan) if layout.tp_mesh is not None else None
    if mine:
        parts = _wire_stages(
            _Context(
                spec,
                plan,
                rank,
                device,
                gm,
                mine,
                shared,
                canon,
                model,
                layout,
                fsdp_mesh,
                tp_plan,
            ),
            modules,
            built.specs,
            sync,
            update_group,
            precision,
            watch,
            scaler,
            agree,
        )
    aliases = names_by_id(model)  # by the ids of the materialised (and sharded) tensors
    return Wiring(
        spec=spec,
        plan=plan,
        schedule=schedule,
        rank=rank,
        device=device,
        model=model,
        gm=gm,
        stage_indices=mine,
        model_inputs=built.model_inputs,
        aliases=aliases,
        orphans=built.orphans,
        module=parts.module,
        optimizer=parts.optimizer or spec.optimizer([nn.Parameter(torch.zeros(0))]),
        policy=parts.policy,
        executor=parts.executor,
        prefetch=prefetch,
        program=program,
        scaler=scaler,
        agree=agree,
        clipper=parts.clipper,
        shared=shared,
        layout=layout,
    )


def _ready_collectives(device: torch.device, layout: MeshLayout, spec: RunSpec) -> Any:
    """Ready what every rank's collectives need, in the same order on every rank: NCCL's
    communicator (a first all-reduce: the first batched send must not be its first use),
    then the FSDP2 mesh with its groups' timeout (FSDP2's collectives are unguarded: their
    groups' own limit). Returns that mesh, or None without FSDP."""
    if device.type == "cuda":
        warm = torch.zeros(1, device=device)
        guarded("the all-reduce that starts NCCL", lambda: dist.all_reduce(warm))
    fsdp_mesh = layout.fsdp_mesh(spec.dp_shard) if layout.fsdp else None  # every rank
    if fsdp_mesh is not None:
        set_collective_timeout(spec.runtime.timeout, fsdp_mesh.get_all_groups())
    return fsdp_mesh


@dataclass(frozen=True)
class _Context:
    """What building this rank's stages reads."""

    spec: RunSpec
    plan: Plan
    rank: int
    device: torch.device
    gm: fx.GraphModule
    mine: tuple[int, ...]  # this rank's stages
    shared: dict[str, tuple[int, ...]]  # tied name -> the stages holding it
    canon: dict[str, str]  # every name -> the first name of its tensor
    model: nn.Module  # the model as given (its blocks, for FSDP2's units)
    layout: MeshLayout  # pp and dp coordinates
    fsdp_mesh: Any  # the DeviceMesh FSDP2 wraps stages over; None without a mesh
    tp_plan: dict[str, str] | None  # the checked tensor-parallel plan; None without "tp"


@dataclass(frozen=True)
class _Parts:
    """What a rank with stages has and an idle one has not."""

    module: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    clipper: GradClipper | None
    policy: WeightPolicy | None
    executor: Executor | None


@dataclass(frozen=True)
class _Built:
    """Every stage's module, and what crosses stages."""

    modules: Modules  # every stage's module (or emulated stand-in) and StageIO
    specs: dict[str, Any]  # value name -> micro-batch shape and dtype between stages
    model_inputs: tuple[str, ...]  # the model inputs this rank's stages read
    orphans: dict[str, torch.Tensor]  # the model's tensors no stage holds, on the CPU
    materialized: bool  # this rank made real tensors of a meta model's


def _precision(spec: RunSpec, layout: MeshLayout, gm: fx.GraphModule) -> Precision:
    """The run's precision: autocast, or under a mesh FSDP2's mixed-precision policy, but
    autocast still for a graph torch.export traced (its casts are the model's own:
    `graphpipe.runtime.precision`) and on a mesh without a "dp" dimension (no FSDP2 to
    cast the parameters: tp alone)."""
    if not layout.sharded:
        return Precision(spec.precision)
    exported = trace_info(gm).method == "export"  # its own casts: autocast (precision.py)
    return Precision(spec.precision, sharded=True, by_autocast=exported or not layout.fsdp)


def _build_modules(
    model: nn.Module,
    gm: fx.GraphModule,
    plan: Plan,
    spec: RunSpec,
    example_inputs: tuple[torch.Tensor, ...],
    mine: tuple[int, ...],
    device: torch.device,
    precision: Precision,
) -> _Built:
    """Every stage's module carved from the trace; this rank's materialised."""
    modules: Modules = {s.index: build_stage(gm, plan, s.index) for s in plan.stages}
    model_inputs = tuple(sorted({n for i in mine for n in modules[i][1].model_inputs}))
    orphans = _orphans(model, [m for m, _ in modules.values()])
    emulate = spec.runtime.emulate
    # an emulated rank with no stage still builds every stage's stand-in (on meta)
    shaped = bool(mine) or emulate is not None
    rows = plan.micro_batch_size // plan.cost_model.dp.degree  # one dp rank's slice
    specs = micro_shapes(gm, example_inputs, rows) if shaped else {}
    if emulate is not None:  # every stage's compute becomes a wait
        modules = _emulated(gm, plan, modules, specs, emulate, mine, device)
        specs = emulated_specs(specs, emulate)
    if precision.dtype is not None and emulate is None and trace_info(gm).method == "export":
        traced = {name: dtype for name, (_, dtype) in specs.items()}
        for i in mine:  # its graph asserts the traced dtypes: values arrive in them
            arrive_as_traced(*modules[i], traced)
    specs = {  # what crosses stages, in the precision's dtype
        name: (shape, precision.spec_dtype(dtype)) for name, (shape, dtype) in specs.items()
    }
    materialized = [  # under a mesh a stage is sharded first (`_place`)
        t
        for i in mine
        if emulate is None and not spec.meshed
        for t in materialize(model, modules[i][0], device, spec.init_weights, spec.checkpoint)
    ]
    return _Built(modules, specs, model_inputs, orphans, bool(materialized))


def _update_checks(
    plan: Plan,
    spec: RunSpec,
    modules: Modules,
    canon: dict[str, str],
    device: torch.device,
    layout: MeshLayout,
) -> tuple[dist.ProcessGroup | None, LossScaler | None, AgreeFinite | None]:
    """The group that agrees on clipping and the loss scale (a collective, when either is
    on), fp16's scaler and nan_check's agreement."""
    fp16 = spec.precision == "fp16"
    needs_group = spec.clip is not None or fp16
    group = update_group(plan, spec.runtime.timeout, layout) if needs_group else None
    scaler = None
    if fp16:  # under a mesh every dp and tp rank agrees too (scale_group)
        scaler = _scaler(
            scale_group(plan, spec.runtime.timeout, layout) if layout.sharded else group
        )
    agree = _agreement(modules, canon, spec.micro_batches, device) if spec.nan_check else None
    return group, scaler, agree


def _wire_stages(
    c: _Context,
    modules: Modules,
    specs: dict[str, Any],
    sync: GradSync,
    update_group: dist.ProcessGroup | None,
    precision: Precision,
    watch: Any,
    scaler: LossScaler | None,
    agree: AgreeFinite | None,
) -> _Parts:
    """This rank's stages: modules on the device, optimizer, hooks, policy, executor."""
    spec = c.spec
    runtime_stages = {}
    before = {(i, n): p for i in c.mine for n, p in modules[i][0].named_parameters()}
    for i in c.mine:
        module, io = modules[i]
        if spec.runtime.emulate is None:
            retarget(module, c.device)
        _place(c, i, module, precision)
        runtime_stages[i] = StageRuntime(
            c.rank, c.plan, i, module, io, specs, c.gm, spec.loss_fn, c.device,
            tensor_parallel=c.tp_plan is not None,
        )  # fmt: skip
    if c.layout.sharded:  # the tied weights' sums read FSDP2's sharded parameters
        after = {(i, n): p for i in c.mine for n, p in modules[i][0].named_parameters()}
        sync.rebind({id(p): after[key] for key, p in before.items() if key in after})
    held = [r.module for r in runtime_stages.values()]
    whole = held[0] if len(held) == 1 else nn.ModuleList(held)
    params = list(whole.parameters())  # unique: a tied weight is one tensor here
    optimizer = spec.optimizer(params or [nn.Parameter(torch.zeros(0))])
    clipper = None if spec.clip is None else _clipper(c, spec.clip, modules, params, update_group)
    hooks = hooks_for(
        None if scaler is None else Unscale(scaler, params, c.device),
        agree,
        None if clipper is None else Clip(clipper, c.device),
    )
    policy = make_policy(
        spec.weights,
        whole,
        optimizer,
        sync,
        spec.micro_batches,
        warmups(c.plan)[c.mine[0]],
        spec.weight_options,
        hooks,
    )
    transport = Transport(
        c.layout.rank, spec.runtime.timeout, c.device, watch, rank_of=c.layout.rank_of
    )
    executor = Executor(
        runtime_stages,
        policy,
        transport,
        precision,
        nancheck=None if agree is None else agree.check,
        grad_scale=None if scaler is None else lambda: scaler.scale,
        device_time=_device_time(modules, c.mine),
    )
    return _Parts(whole, optimizer, clipper, policy, executor)


def _place(c: _Context, index: int, module: fx.GraphModule, precision: Precision) -> None:
    """Put stage `index`'s module on the device, compiled if asked, and under a mesh
    split by the tp plan and sharded by FSDP2 (its collectives under the watch) before the
    optimizer is made (it steps the sharded parameters). A stage still on meta (a meta model
    under a mesh) is split and sharded first and only its shards materialised."""
    spec = c.spec

    def shard() -> None:
        if c.tp_plan is not None:  # DTensors over tp first: FSDP2 shards them over dp (2D)
            apply_tp(module, c.canon, cast(DeviceMesh, c.layout.tp_mesh), c.tp_plan)
        if c.fsdp_mesh is not None:
            shard_stage(module, c.model, c.fsdp_mesh, spec.reshard_after_forward, precision)
            guard_collectives(module, index)

    meshed = c.fsdp_mesh is not None or c.tp_plan is not None
    if meshed and spec.runtime.emulate is None and is_meta(module):
        materialize_sharded(c.model, module, c.device, shard, spec.init_weights, spec.checkpoint)
        return
    module.to(c.device)
    if spec.compile_stages:  # in place: the module and its state dict keys stay
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
    """Count each parameter on one rank: its first holding stage's first device."""
    counted = []
    seen: set[int] = set()
    for index in c.mine:
        for n, p in modules[index][0].named_parameters():
            owner = c.shared.get(c.canon.get(n, n), (index,))[0]
            if c.plan.stages[owner].devices[0] == c.rank and id(p) not in seen:
                counted.append(p)
                seen.add(id(p))
    return GradClipper(clip[0], clip[1], params, counted, group)


def _emulated(
    gm: fx.GraphModule,
    plan: Plan,
    modules: Modules,
    specs: dict[str, Any],
    emulate: Emulate,
    mine: tuple[int, ...],
    device: torch.device,
) -> Modules:
    """Each stage's stand-in (`graphpipe.runtime.emulate`); other ranks' on meta. Under
    `host="overlapped"` this rank's stand-ins share one `DeviceTime`."""
    clock = DeviceTime() if emulate.host == "overlapped" else None
    meta = torch.device("meta")
    return {
        i: (
            EmulatedStage(
                gm,
                plan,
                i,
                io,
                specs,
                emulate,
                *((device, clock) if i in mine else (meta, None)),
            ),
            io,
        )
        for i, (_, io) in modules.items()
    }


def _device_time(modules: Modules, mine: tuple[int, ...]) -> DeviceTime | None:
    """This rank's emulated device time, when its stand-ins overlap the host's work."""
    stand_ins = [modules[i][0] for i in mine if isinstance(modules[i][0], EmulatedStage)]
    return next((m.clock for m in stand_ins if m.clock is not None), None)


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
