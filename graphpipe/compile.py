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
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils._pytree import tree_map

from graphpipe.dryrun import check_schedule
from graphpipe.errors import ConfigError, GraphPipeError, PipelineError, PlanError
from graphpipe.ir import Plan, Schedule, Timeline
from graphpipe.opgraph import graph_hash
from graphpipe.partition import PlanConfig, micro_batch_size, partition
from graphpipe.profile import ProfileConfig, profile
from graphpipe.runtime.comm import FailureBoard, Transport
from graphpipe.runtime.executor import Batch, Executor, StageRuntime
from graphpipe.runtime.stage import OUTPUT, build_stage, micro_shapes
from graphpipe.runtime.sync import GradSync, SyncGroup, make_groups
from graphpipe.runtime.weights import POLICIES, PolicyOptions, WeightPolicy, make_policy
from graphpipe.schedule import ASYNC, drain_schedule, make_schedule, warmups
from graphpipe.trace import LeafSpec, trace, trace_info

__all__ = ["PipelinedModel", "RuntimeConfig", "compile"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class RuntimeConfig:
    """How the pipeline runs."""

    timeout: float = 60.0  # seconds any receive or collective may wait before failing
    backend: str | None = None  # None: "nccl" when CUDA is available, else "gloo"
    device: str | None = None  # None: cuda:LOCAL_RANK with nccl, else cpu
    record: bool = False  # time every action (see PipelinedModel.timeline)

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {self.timeout}")


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
    partitioner: str = "graph",
    plan: Plan | str | Path | None = None,
    leaf_modules: Sequence[LeafSpec] = (),
    profile_config: ProfileConfig | None = None,
    runtime: RuntimeConfig | None = None,
    **plan_options: Any,
) -> PipelinedModel:
    """Turn `model` into a pipelined model over every rank of the process group.

    Call it the same way on every rank. The process group is initialised from the
    environment (torchrun's env://) unless it already is.

    Args:
        model: The model; each rank keeps only its stage's parameters.
        example_inputs: One mini-batch of inputs (dim 0 is the batch); fixes the shapes.
        loss_fn: (model output, target) -> scalar, mean-reduced over the batch.
        optimizer: Builds the optimizer from a list of parameters, e.g.
            `functools.partial(torch.optim.SGD, lr=0.1)`.
        micro_batches: M, micro-batches per mini-batch (default: the plan's, or 4).
        schedule: "1f1b", "gpipe" or "zb" for flush; "async" for stash and pipemare; "2bw"
            for 2bw. Default: 1f1b, or the one the weight policy needs.
        weights: The weight policy: "flush", "stash", "2bw" or "pipemare" (see
            `graphpipe.runtime.weights`).
        weight_options: PipeMare's fixes.
        partitioner: "graph" or "sequential", when no plan is given.
        plan: A Plan, or a path to its JSON, instead of planning.
        leaf_modules: Module types or paths to trace as single nodes.
        profile_config: How rank 0 obtains op times when it plans.
        runtime: Timeouts, backend, device, timeline recording.
        **plan_options: More `PlanConfig` fields (memory_budget, replication, ...).

    Returns:
        The pipelined model.

    Raises:
        ConfigError: bad arguments, e.g. a world size the plan was not made for.
        PlanError: no plan fits, or the given plan is not for this model.
    """
    runtime = runtime or RuntimeConfig()
    inputs = (
        (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    )
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "optimizer must build an optimizer from a parameter list, e.g. "
            "functools.partial(torch.optim.Adam, lr=1e-3); each rank owns "
            "only its stage's parameters"
        )
    schedule = _schedule_for(weights, schedule)
    _ensure_process_group(runtime)
    gm = trace(model, inputs, leaf_modules=leaf_modules)
    options = {"partitioner": partitioner, **plan_options}
    if weights != "flush":
        options.setdefault("replication", False)
        options.setdefault("weight_versions", 2)
    the_plan = _agree_on_plan(gm, inputs, plan, micro_batches, profile_config, options)
    m = micro_batches or the_plan.micro_batches
    micro_batch_size(trace_info(gm).batch_size, m)
    world = dist.get_world_size()
    if the_plan.num_devices != world:
        raise ConfigError(
            f"the plan is for {the_plan.num_devices} devices but the process group "
            f"has {world} ranks; launch {the_plan.num_devices} processes"
        )
    sched = make_schedule(the_plan, schedule, m)
    if schedule not in ASYNC:
        check_schedule(the_plan, sched)
    return PipelinedModel(
        model, gm, inputs, the_plan, sched, loss_fn, optimizer, weights, runtime, weight_options
    )


SCHEDULE_FOR = {"stash": "async", "pipemare": "async", "2bw": "2bw"}


def _schedule_for(weights: str, schedule: str | None) -> str:
    """The schedule to run: the one given, checked against the policy, or the policy's."""
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
            "graphpipe.launch, or call torch.distributed.init_process_group first"
        )
    backend = runtime.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=runtime.timeout))


def _agree_on_plan(
    gm: fx.GraphModule,
    inputs: tuple[torch.Tensor, ...],
    plan: Plan | str | Path | None,
    micro_batches: int | None,
    profile_config: ProfileConfig | None,
    options: dict[str, Any],
) -> Plan:
    """The plan every rank uses: given and checked, or made on rank 0 and broadcast."""
    if plan is not None:
        loaded = plan if isinstance(plan, Plan) else Plan.from_json(Path(plan).read_text())
        if loaded.graph_hash != graph_hash(gm):
            raise PlanError(
                f"the plan was made for another graph (hash {loaded.graph_hash}, "
                f"this model traces to {graph_hash(gm)})"
            )
        loaded.validate(gm)
        return loaded
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            config = PlanConfig.build(
                dist.get_world_size(), micro_batches=micro_batches or 4, **options
            )
            b = micro_batch_size(trace_info(gm).batch_size, config.micro_batches)
            message[0] = (
                "plan",
                partition(gm, profile(gm, inputs, b, profile_config), config).to_json(),
            )
        except GraphPipeError as exc:
            message[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(message, src=0)
    kind, payload = message[0]
    if kind == "error":
        raise PlanError(f"planning on rank 0 failed: {payload}")
    return Plan.from_json(payload)


@dataclass
class _Groups:
    """Where gradients are summed, from this rank's point of view."""

    sync: GradSync
    loss_group: dist.ProcessGroup | None = None
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)


class PipelinedModel:
    """A model whose stages run on the ranks of a process group (see `compile`).

    Attributes:
        plan: The Plan.
        schedule: The flushed schedule's actions (the first call's for async ones).
        rank: This process's rank.
        optimizer: This rank's optimizer, over its stage's parameters (create LR schedulers
            on it).
    """

    def __init__(
        self,
        model: nn.Module,
        gm: fx.GraphModule,
        example_inputs: tuple[torch.Tensor, ...],
        plan: Plan,
        schedule: Schedule,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: OptimizerFactory,
        weights: str,
        runtime: RuntimeConfig,
        weight_options: PolicyOptions | None = None,
    ) -> None:
        self.plan, self.schedule, self.runtime = plan, schedule, runtime
        self.rank = dist.get_rank()
        self.device = _device(runtime)
        self._model, self._gm = model, gm
        self._shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self._input_names = list(trace_info(gm).input_names)[: len(example_inputs)]
        self._m = schedule.micro_batches
        self._calls = 0
        stage = plan.stage_on(self.rank)
        self._stage_index = None if stage is None else stage.index
        modules = {s.index: build_stage(gm, plan, s.index) for s in plan.stages}
        self._orphans = _orphans(model, [m for m, _ in modules.values()])
        groups = self._groups(model, modules)
        self.module: nn.Module | None = None
        self._executor: Executor | None = None
        params: list[nn.Parameter] = []
        if stage is not None:
            module, io = modules[stage.index]
            self.module = module.to(self.device)
            params = list(self.module.parameters())
            specs = micro_shapes(gm, example_inputs, plan.micro_batch_size)
            runtime_stage = StageRuntime(
                self.rank, plan, stage.index, self.module, io, specs, gm, loss_fn, self.device
            )
            self.optimizer = optimizer(params or [nn.Parameter(torch.zeros(0))])
            self.policy: WeightPolicy = make_policy(
                weights,
                self.module,
                self.optimizer,
                groups.sync,
                self._m,
                warmups(plan)[stage.index],
                weight_options,
            )
            board = FailureBoard(dist.get_world_size())
            transport = Transport(self.rank, runtime.timeout, self.device, board)
            self._executor = Executor(runtime_stage, self.policy, transport)
            self._executor.record = runtime.record
        else:
            self.optimizer = optimizer([nn.Parameter(torch.zeros(0))])
        self._weights = weights

    # -- training -------------------------------------------------------------------------------

    def step(self, *inputs: torch.Tensor, target: Any = None) -> float:
        """One mini-batch: every micro-batch through the schedule, and the updates.

        Args:
            *inputs: The model inputs, shaped like the example inputs.
            target: What `loss_fn` compares the output with (dim 0 the batch).

        Returns:
            The mean of the micro-batch losses of this call, on every rank.

        Raises:
            ConfigError: a missing target or inputs of the wrong shape, before any
                communication.
            PipelineError: a failure while running (a timeout, a dead peer).
        """
        if target is None:
            raise ConfigError("step() needs target=...: the loss is computed on the last stage")
        batch = self._batch(inputs, target, first=self._calls * self._m if self._async else 0)
        actions = self._actions(self._calls)
        if self._executor is not None:
            self._executor.losses.clear()
            self._executor.training = True
            self._executor.run(actions, batch, wait_sends=not self._async)
        self._calls += 1
        return self._mean_loss()

    @property
    def _async(self) -> bool:
        return self.schedule.name in ASYNC

    def _actions(self, call: int) -> Sequence[Any]:
        if not self._async:
            return self.schedule.ranks[self.rank]
        return make_schedule(self.plan, self.schedule.name, self._m, first_call=call).ranks[
            self.rank
        ]

    def _mean_loss(self) -> float:
        losses = self._executor.losses if self._executor is not None else {}
        total = torch.tensor([sum(losses.values())], dtype=torch.float64)
        self._all_reduce(total, "the loss")
        return float(total.item()) / self._m

    def _all_reduce(self, t: torch.Tensor, what: str) -> None:
        try:
            dist.all_reduce(t)
        except RuntimeError as exc:
            raise PipelineError(
                f"rank {self.rank}: all-reduce of {what} failed: {str(exc).splitlines()[0]}"
            ) from exc

    def _batch(self, inputs: Sequence[torch.Tensor], target: Any, first: int) -> Batch:
        if len(inputs) != len(self._shapes):
            raise ConfigError(
                f"step() got {len(inputs)} inputs, the model was compiled with {len(self._shapes)}"
            )
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self._shapes, strict=True)):
            if tuple(x.shape) != shape or x.dtype != dtype:
                raise ConfigError(
                    f"input #{i} ({self._input_names[i]}) is {x.dtype}"
                    f"{list(x.shape)}, the pipeline was compiled for {dtype}"
                    f"{list(shape)}"
                )
        chunks = {
            name: list(x.to(self.device).chunk(self._m))
            for name, x in zip(self._input_names, inputs, strict=True)
        }
        targets = None if target is None else _split(target, self._m, self.device)
        return Batch(first, chunks, targets)

    # -- inference, state ----------------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Forward only: the model's output for this mini-batch, on every rank."""
        batch = self._batch(inputs, None, first=0)
        outputs: dict[int, Any] = {}
        if self._executor is not None:
            inference = Executor(self._executor.stage, self.policy, self._executor.transport)
            inference.training = False
            inference.run(make_schedule(self.plan, "forward", self._m).ranks[self.rank], batch)
            outputs = {
                j: mb.outputs[OUTPUT] for j, mb in inference.state.items() if OUTPUT in mb.outputs
            }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tree_map(_cpu, outputs))
        merged = {j: out for part in gathered for j, out in part.items()}
        pieces = [merged[j] for j in range(self._m)]
        return tree_map(lambda *xs: torch.cat(xs), *pieces) if pieces else None

    def drain(self) -> None:
        """Finish the backwards and updates an asynchronous pipeline still has in flight.

        The next step() starts with a new warm-up. Flushed schedules have nothing to drain.
        """
        if not self._async or self._calls == 0:
            return
        actions = drain_schedule(self.plan, self.schedule.name, self._calls, self._m)
        if self._executor is not None:
            self._executor.run(actions.ranks[self.rank], Batch(self._calls * self._m, {}, None))
            self._executor.state.clear()
        self._calls = 0

    def versions(self) -> dict[str, Any]:
        """This rank's weight bookkeeping: the copies it holds and, per micro-batch, the
        updates reflected in the weights its forward and its backward used."""
        if self._executor is None:
            return {"copies": 0, "peak_copies": 0, "forward": {}, "backward": {}}
        log = self.policy.log
        return {
            "copies": self.policy.copies(),
            "peak_copies": self.policy.peak_copies,
            "forward": {j: k for kind, j, k in log if kind == "F"},
            "backward": {j: k for kind, j, k in log if kind == "B"},
        }

    def checkpoint(self) -> dict[str, Any]:
        """Everything a resume needs, gathered on every rank: the model (after `drain`), every
        rank's optimizer state and weight-policy state."""
        self.drain()
        model = self.state_dict()
        mine = None
        if self._executor is not None:
            mine = {"optimizer": self.optimizer.state_dict(), "policy": self.policy.state()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tree_map(_cpu, mine))
        return {"model": model, "ranks": gathered, "weights": self._weights}

    def load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume from `checkpoint` (from a pipeline with the same plan and world size)."""
        self.load_state_dict(checkpoint["model"])
        mine = checkpoint["ranks"][self.rank]
        if self._executor is not None and mine is not None:
            self.optimizer.load_state_dict(mine["optimizer"])
            self.policy.load_state(mine["policy"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict under the original names, gathered on every rank.

        An asynchronous pipeline is drained first (`drain`), so the weights are the ones
        after every update of the micro-batches seen so far.
        """
        self.drain()
        mine = (
            {} if self.module is None else {k: _cpu(v) for k, v in self.module.state_dict().items()}
        )
        if self.rank == 0:
            mine.update(self._orphans)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        order = list(self._model.state_dict())
        return {k: merged[k] for k in order if k in merged}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (e.g. the plain model's); each rank takes its stage's part.

        Raises:
            ConfigError: names this stage needs that `state` lacks.
        """
        if self.module is None:
            return
        keys = list(self.module.state_dict())
        missing = [k for k in keys if k not in state]
        if missing:
            raise ConfigError(f"state dict lacks {missing} (needed by stage {self._stage_index})")
        self.module.load_state_dict({k: state[k] for k in keys})

    @property
    def recording(self) -> bool:
        """Whether every action's start and end are being recorded (see `timeline`)."""
        return self._executor is not None and self._executor.record

    @recording.setter
    def recording(self, on: bool) -> None:
        if self._executor is not None:
            self._executor.record = on

    def timeline(self, clear: bool = True) -> Timeline:
        """The actions every rank recorded (a collective: call it on every rank).

        Args:
            clear: Forget the recorded actions afterwards.
        """
        spans = [] if self._executor is None else self._executor.spans
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, spans)
        if clear and self._executor is not None:
            self._executor.spans = []
        every = sorted((s for part in gathered for s in part), key=lambda s: s.start)
        return Timeline(tuple(every), self.plan.num_devices, "measured", self.schedule.name)

    # -- set-up --------------------------------------------------------------------------------

    def _groups(self, model: nn.Module, modules: dict[int, Any]) -> _Groups:
        """Process groups for replicas and tied copies; created in the same order everywhere."""
        canonical = {id(t): n for n, t in model.named_parameters()}
        holders: dict[str, set[int]] = {}
        for index, (module, _) in modules.items():
            for p in module.parameters():
                holders.setdefault(canonical.get(id(p), ""), set()).add(index)
        shared = {n: tuple(sorted(s)) for n, s in sorted(holders.items()) if len(s) > 1}
        stages = self.plan.stages
        replicas = [(s.devices, f"stage {s.index} replicas") for s in stages if s.replicas > 1]
        tied = [
            (tuple(sorted(d for t in held for d in stages[t].devices)), f"tied {name}")
            for name, held in shared.items()
        ]
        groups = make_groups(replicas + tied, self.rank, self.runtime.timeout)
        mine = self.plan.stage_on(self.rank)
        local = (
            {}
            if mine is None
            else {canonical.get(id(p), n): p for n, p in modules[mine.index][0].named_parameters()}
        )
        plan: list[SyncGroup] = []
        for (ranks, label), group in zip(replicas + tied, groups, strict=True):
            if label.startswith("tied "):
                params = [local[label[5:]]] if label[5:] in local else []
            else:
                params = [p for n, p in local.items() if n not in shared]
            plan.append(SyncGroup(ranks, group, params, label))
        return _Groups(GradSync(plan), shared=shared)


def _device(runtime: RuntimeConfig) -> torch.device:
    if runtime.device is not None:
        return torch.device(runtime.device)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _orphans(model: nn.Module, modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters and buffers no stage holds (unused by forward): kept as they are."""
    held = {k for m in modules for k in m.state_dict()}
    return {k: _cpu(v) for k, v in model.state_dict().items() if k not in held}


def _cpu(x: Any) -> Any:
    return x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x


def _split(target: Any, m: int, device: torch.device) -> list[Any]:
    leaves = tree_map(
        lambda t: list(t.to(device).chunk(m)) if isinstance(t, torch.Tensor) else [t] * m, target
    )
    return [
        tree_map(lambda chunks, j=j: chunks[j], leaves, is_leaf=lambda x: isinstance(x, list))
        for j in range(m)
    ]
