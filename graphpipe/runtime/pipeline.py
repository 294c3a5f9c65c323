"""PipelinedModel: one rank's part of a compiled pipeline, and the calls every rank makes.

`graphpipe.compile` builds it (see there for the semantics of step()). Every public method is
called on every rank: training, inference, state dicts, checkpoints and timelines all move
data between ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

from graphpipe.errors import ConfigError, PipelineError
from graphpipe.ir import Plan, Schedule, Timeline
from graphpipe.runtime import checkpoint
from graphpipe.runtime.clip import GradClipper
from graphpipe.runtime.comm import Transport
from graphpipe.runtime.emulate import Emulate, EmulatedStage, emulated_specs
from graphpipe.runtime.executor import LIVE_WEIGHTS, Batch, Executor, StageRuntime, scalar
from graphpipe.runtime.failures import guarded, install_watch, posted, set_collective_timeout
from graphpipe.runtime.materialize import InitFn, materialize, names_by_id
from graphpipe.runtime.nancheck import NanCheck
from graphpipe.runtime.precision import LossScaler, Precision
from graphpipe.runtime.profiling import profile_actions, spans_from_profiler
from graphpipe.runtime.stage import OUTPUT, build_stage, micro_shapes, retarget
from graphpipe.runtime.sync import GradSync, SyncGroup, make_groups
from graphpipe.runtime.weights import PolicyOptions, WeightPolicy, make_policy
from graphpipe.scheduling.generators import ASYNC, drain_schedule, make_schedule, warmups
from graphpipe.scheduling.program import Comm, Op, Program, lower
from graphpipe.tracing.annotate import trace_info
from graphpipe.tracing.bind import example_output, flat_inputs

__all__ = ["PipelinedModel", "RuntimeConfig"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class RuntimeConfig:
    """How the pipeline runs."""

    timeout: float = 60.0  # seconds any receive or collective may wait before failing
    backend: str | None = None  # None: "nccl" when CUDA is available, else "gloo"
    device: str | None = None  # None: cuda:LOCAL_RANK with nccl, else cpu
    record: bool = False  # time every action (see PipelinedModel.timeline)
    timer: str | None = None  # how: "host" ranges or "profiler"; None: profiler on CUDA only
    plan_timeout: float = 1800.0  # seconds ranks wait for rank 0's plan (profiling included)
    prefetch: bool | None = None  # post every receive of a call first; None: on gloo only
    emulate: Emulate | None = None  # stages wait the plan's times instead of computing

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.plan_timeout <= 0:
            raise ConfigError(
                f"timeouts must be positive, got timeout={self.timeout}, "
                f"plan_timeout={self.plan_timeout}"
            )
        if self.timer not in (None, "host", "profiler"):
            raise ConfigError(f"timer must be 'host' or 'profiler', got {self.timer!r}")


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
        init_weights: InitFn | None = None,
        checkpoint: str | Path | None = None,
        clip: tuple[float, float] | None = None,
        compile_stages: bool = False,
        precision: str | None = None,
        nan_check: bool = False,
    ) -> None:
        self.plan, self.schedule, self.runtime = plan, schedule, runtime
        self.rank = dist.get_rank()
        self._watch = install_watch(runtime.timeout)
        set_collective_timeout(runtime.timeout)
        self.device = runtime_device(runtime)
        self._model, self._gm, self._loss_fn = model, gm, loss_fn
        self._shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self._input_names = list(trace_info(gm).input_names)
        self._m = schedule.micro_batches
        self._calls = 0
        self.steps_done = 0  # step() calls so far (a checkpoint records and restores it)
        stages = plan.stages_on(self.rank)
        self._stage_indices = tuple(s.index for s in stages)
        modules = {s.index: build_stage(gm, plan, s.index) for s in plan.stages}
        self._model_inputs = tuple(
            sorted({n for s in stages for n in modules[s.index][1].model_inputs})
        )
        self._orphans = _orphans(model, [m for m, _ in modules.values()])
        canon = {n: names[0] for names in names_by_id(model).values() for n in names}
        self._precision = Precision(precision)
        # an emulated rank with no stage still builds every stage's stand-in (on meta)
        shaped = stages or runtime.emulate is not None
        specs = micro_shapes(gm, example_inputs, plan.micro_batch_size) if shaped else {}
        if runtime.emulate is not None:  # every stage's compute becomes a wait
            modules = self._emulated(modules, specs, runtime.emulate)
            specs = emulated_specs(specs, runtime.emulate)
        specs = {  # what crosses stages, in the precision's dtype
            name: (shape, self._precision.spec_dtype(dtype))
            for name, (shape, dtype) in specs.items()
        }
        materialized = [
            t
            for s in stages
            if runtime.emulate is None
            for t in materialize(model, modules[s.index][0], self.device, init_weights, checkpoint)
        ]
        self._aliases = names_by_id(model)  # every name of each tensor, tied ones too
        groups = self._groups(canon, modules, weights)
        # the ranks that agree on each update's clipping and loss scale (a collective)
        update_group = self._clip_group() if clip is not None or precision == "fp16" else None
        self._scaler = self._make_scaler(update_group) if precision == "fp16" else None
        self._nancheck: NanCheck | None = None
        if nan_check:  # every rank names every stage's parameters alike
            names = [
                [canon.get(n, n) for n, _ in m.named_parameters()] for m, _ in modules.values()
            ]
            self._nancheck = NanCheck(names, self._m, self.device)
        self._problem: str | None = None
        self._loss_checked = False
        if materialized:
            groups.sync.broadcast()  # tied copies and replicas start equal on every holder
        self.module: nn.Module | None = None
        self._executor: Executor | None = None
        self._prefetch = (
            dist.get_backend() == "gloo" if runtime.prefetch is None else runtime.prefetch
        )
        self.program = lower(plan, schedule, prefetch=self._prefetch)
        self._programs: dict[Any, Program] = {}
        if self.device.type == "cuda":  # the first batched send must not be the first use of
            dist.all_reduce(torch.zeros(1, device=self.device))  # NCCL's communicator
        if stages:
            runtime_stages = {}
            for s in stages:
                module, io = modules[s.index]
                if runtime.emulate is None:
                    retarget(module, self.device)
                module.to(self.device)
                if compile_stages:  # in place: the module and its state dict keys stay
                    module.compile()
                runtime_stages[s.index] = StageRuntime(
                    self.rank, plan, s.index, module, io, specs, gm, loss_fn, self.device
                )
            held = [r.module for r in runtime_stages.values()]
            self.module = held[0] if len(held) == 1 else nn.ModuleList(held)
            params = list(self.module.parameters())
            self.optimizer = optimizer(params or [nn.Parameter(torch.zeros(0))])
            self.policy: WeightPolicy = make_policy(
                weights,
                self.module,
                self.optimizer,
                groups.sync,
                self._m,
                warmups(plan)[stages[0].index],
                weight_options,
            )
            if clip is not None:
                self._clipper = self._make_clipper(clip, canon, modules, groups, update_group)
            if clip is not None or self._scaler is not None or nan_check:
                self.policy.before_step = self._before_step
            transport = Transport(self.rank, runtime.timeout, self.device, self._watch)
            self._executor = Executor(runtime_stages, self.policy, transport, self._precision)
            self._executor.nancheck = self._nancheck
        else:
            self.optimizer = optimizer([nn.Parameter(torch.zeros(0))])
        self._weights = weights
        self._timer = runtime.timer or ("profiler" if self.device.type == "cuda" else "host")
        self.recording = runtime.record

    # -- training -------------------------------------------------------------------------------

    def step(self, *inputs: torch.Tensor, target: Any = None, **kw_inputs: torch.Tensor) -> float:
        """One mini-batch: every micro-batch through the schedule, and the updates.

        Args:
            *inputs: The model's positional inputs, shaped like the example inputs.
            target: What `loss_fn` compares the output with (dim 0 the batch).
            **kw_inputs: The model's keyword inputs, for a model compiled with a dict of
                them (`input_ids=..., attention_mask=...`).

        Returns:
            The mean of the micro-batch losses of this call, on every rank.

        Raises:
            ConfigError: a missing target, inputs or a target of the wrong kind or shape, a
                loss_fn that does not return a real scalar: before any communication, on
                every rank.
            PipelineError: a failure while running (a timeout, a dead peer), or with
                nan_check a non-finite loss or gradient (on every rank, the update skipped).
        """
        if target is None:
            raise ConfigError("step() needs target=...: the loss is computed on the last stage")
        first = self._calls * self._m if self._async else 0
        batch = self._batch(inputs, kw_inputs, target, first=first)
        self._check_loss(target)
        ops = self._program(self._calls)
        self._problem = None
        with posted("step"):
            if self._executor is not None:
                if self._scaler is not None:
                    self._executor.grad_scale = self._scaler.scale
                self._executor.losses.clear()
                self._executor.training = True
                with self._timed(self._executor):
                    self._executor.run(ops, batch)
            elif self._nancheck is not None:  # a rank without a stage takes part in the agreement
                self._problem = self._nancheck.agree()
            self._calls += 1
            self.steps_done += 1
            loss = self._mean_loss()
        if self._problem is not None:
            raise PipelineError(self._problem)
        return loss

    def _check_loss(self, target: Any) -> None:
        """Once, on every rank alike: loss_fn on the model's output for one micro-batch as
        meta tensors (no memory, no values) and the target's first micro-batch must give a
        real scalar. A loss_fn that cannot run on the meta device is left to the stage that
        computes the loss.

        Raises:
            ConfigError: the loss is not a real scalar tensor, naming what it is.
        """
        if self._loss_checked:
            return
        out = example_output(self._gm)
        first = tree_map(
            lambda t: t.to("meta").chunk(self._m)[0] if isinstance(t, torch.Tensor) else t,
            target,
        )
        try:
            loss = self._loss_fn(out, first)
        except Exception:  # e.g. reads values; the loss's stage still checks every loss
            loss = torch.zeros((), device="meta")
        scalar(loss, 0)
        self._loss_checked = True

    @property
    def _async(self) -> bool:
        return self.schedule.name in ASYNC

    def _program(self, call: int) -> Sequence[Op]:
        """This rank's operations for step() call `call`."""
        if not self._async:
            return self.program.ranks[self.rank]
        schedule = make_schedule(self.plan, self.schedule.name, self._m, first_call=call)
        return self._lowered(schedule, call * self._m)

    def _lowered(self, schedule: Schedule, shift: int) -> Sequence[Op]:
        """This rank's part of `schedule` lowered; asynchronous calls repeat one shape with
        micro-batch ids moved on, so the lowering is cached by that shape."""
        shape = tuple(tuple(_moved(a, -shift) for a in actions) for actions in schedule.ranks)
        key = (schedule.name, shape)
        if key not in self._programs:
            base = Schedule(schedule.name, schedule.micro_batches, shape, schedule.calls)
            self._programs[key] = lower(self.plan, base, prefetch=self._prefetch)
        return [_moved(op, shift) for op in self._programs[key].ranks[self.rank]]

    def _mean_loss(self, executor: Executor | None = None) -> float:
        """The call's mean loss on every rank: one device-to-host copy per step."""
        executor = executor or self._executor
        losses = list(executor.losses.values()) if executor is not None else []
        total = (
            torch.stack(losses).sum().to(torch.float64).reshape(1)
            if losses
            else torch.zeros(1, dtype=torch.float64, device=self.device)
        )
        self._all_reduce(total, "the loss")
        return float(total.item()) / self._m

    def _all_reduce(self, t: torch.Tensor, what: str) -> None:
        guarded(f"the all-reduce of {what}", lambda: dist.all_reduce(t))

    def _gather(self, mine: Any, what: str) -> list[Any]:
        """`mine` from every rank (a collective), under the failure watch."""
        gathered: list[Any] = [None] * dist.get_world_size()
        guarded(f"the gather of {what}", lambda: dist.all_gather_object(gathered, mine))
        return gathered

    def _batch(self, args: Sequence[Any], kwargs: dict[str, Any], target: Any, first: int) -> Batch:
        flat = flat_inputs(self._gm, *args, **kwargs)
        for name, x, (shape, dtype) in zip(self._input_names, flat, self._shapes, strict=True):
            if tuple(x.shape) != shape or x.dtype != dtype:
                raise ConfigError(
                    f"input {name} is {x.dtype}{list(x.shape)}, the pipeline was compiled "
                    f"for {dtype}{list(shape)}"
                )
        chunks = {  # only the inputs this rank's stages read are copied to its device
            name: list(_to_device(x, self.device).chunk(self._m))
            for name, x in zip(self._input_names, flat, strict=True)
            if name in self._model_inputs
        }
        if target is None:
            return Batch(first, chunks, None)
        _check_target(target, flat[0].shape[0] if flat else 0)
        has_output = self._executor is not None and any(
            r.io.has_output for r in self._executor.stages.values()
        )
        if not has_output:
            return Batch(first, chunks, [None] * self._m)  # only the loss's stage needs it
        return Batch(first, chunks, _split(target, self._m, self.device))

    # -- inference, state ----------------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor, **kw_inputs: torch.Tensor) -> Any:
        """Forward only, in eval mode: the model's output for this mini-batch, on every rank
        (see `eval_step`)."""
        batch = self._batch(inputs, kw_inputs, None, first=0)
        inference = self._forward_only(batch)
        outputs: dict[int, Any] = {}
        if inference is not None:
            outputs = {
                j: mb.outputs[OUTPUT]
                for (_, j), mb in inference.state.items()
                if OUTPUT in mb.outputs
            }
        gathered = self._gather(tree_map(_cpu, outputs), "the outputs")
        merged = {j: out for part in gathered for j, out in part.items()}
        pieces = [merged[j] for j in range(self._m)]
        return tree_map(lambda *xs: torch.cat(xs), *pieces) if pieces else None

    def eval_step(
        self, *inputs: torch.Tensor, target: Any = None, **kw_inputs: torch.Tensor
    ) -> float:
        """The mean loss of this mini-batch, forward only, in eval mode.

        The micro-batches run through the stages with the live weights, without gradients,
        with every module in eval mode (dropout off, BatchNorm on its running statistics)
        and back in its own mode afterwards. Parameters, gradients, optimizer state and the
        weight policy's versions are left as they were, under every policy.

        Raises:
            ConfigError: no target, or inputs of the wrong shape (before any communication).
            PipelineError: a failure while running.
        """
        if target is None:
            raise ConfigError(
                "eval_step() needs target=...: the loss is computed on the last stage"
            )
        batch = self._batch(inputs, kw_inputs, target, first=0)
        self._check_loss(target)
        return self._mean_loss(self._forward_only(batch))

    def _forward_only(self, batch: Batch) -> Executor | None:
        """Run the forward schedule in eval mode with the live weights, outside the policy."""
        if self._executor is None:
            return None
        assert self.module is not None
        inference = Executor(self._executor.stages, LIVE_WEIGHTS, self._executor.transport)
        inference.training = False
        modes = [(m, m.training) for m in self.module.modules()]
        self.module.eval()
        try:
            inference.run(self._lowered(make_schedule(self.plan, "forward", self._m), 0), batch)
        finally:
            for m, training in modes:
                m.training = training
        return inference

    def drain(self) -> None:
        """Finish the backwards and updates an asynchronous pipeline still has in flight.

        The next step() starts with a new warm-up. Flushed schedules have nothing to drain.
        """
        if not self._async or self._calls == 0:
            return
        actions = drain_schedule(self.plan, self.schedule.name, self._calls, self._m)
        if self._executor is not None:
            end = self._calls * self._m
            self._executor.run(self._lowered(actions, end), Batch(end, {}, None))
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

    def save(self, path: str | Path) -> Path:
        """Write a checkpoint directory (a collective: call it on every rank).

        Each rank writes its shard with torch.distributed.checkpoint, keyed by parameter
        name; the directory is replaced atomically, so a kill at any moment leaves the
        previous checkpoint loadable (`graphpipe.runtime.checkpoint`).
        """
        return checkpoint.save(self, path)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Resume from the checkpoint at `path`, made under this plan or another one (a
        collective). Returns its record: the plan, world size, policy and step it was
        saved at.

        Raises:
            ConfigError: no complete checkpoint there, another weight policy, or keys this
                rank's stages need that it lacks.
        """
        return checkpoint.load(self, path)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict under the original names, gathered on every rank.

        An asynchronous pipeline is drained first (`drain`), so the weights are the ones
        after every update of the micro-batches seen so far.
        """
        self.drain()
        mine: dict[str, torch.Tensor] = {}
        if self.module is not None:
            for name, value in self.module.state_dict(keep_vars=True).items():
                for alias in self._aliases.get(id(value), (name,)):
                    mine[alias] = _cpu(value)
        if self.rank == 0:
            mine.update(self._orphans)
        gathered = self._gather(mine, "the state dict")
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        order = list(self._model.state_dict())
        return {k: merged[k] for k in order if k in merged}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (e.g. the plain model's); each rank takes its stage's part.

        A tied weight is found under any of its names.

        Raises:
            ConfigError: names this stage needs that `state` lacks.
        """
        if self.module is None:
            return
        found: dict[str, torch.Tensor] = {}
        missing = []
        for key, value in self.module.state_dict(keep_vars=True).items():
            names = [a for a in self._aliases.get(id(value), (key,)) if a in state]
            if names:
                found[key] = state[names[0]]
            else:
                missing.append(key)
        if missing:
            raise ConfigError(
                f"state dict lacks {missing} (needed by stages {list(self._stage_indices)})"
            )
        self.module.load_state_dict(found)

    @property
    def recording(self) -> bool:
        """Whether every action's start and end are being recorded (see `timeline`)."""
        return self._recording

    @recording.setter
    def recording(self, on: bool) -> None:
        self._recording = on
        if self._executor is not None:  # the executor's own host ranges
            self._executor.record = on and self._timer == "host"

    @property
    def comm_seconds(self) -> dict[str, float]:
        """While recording (host timer), this rank's seconds outside compute actions since
        the last cleared `timeline()`: "wait" for messages to arrive or sends to finish,
        "post" to issue them (local copies included)."""
        return {} if self._executor is None else dict(self._executor.clock)

    @contextlib.contextmanager
    def _timed(self, executor: Executor) -> Iterator[None]:
        """Record the block's actions with torch.profiler when that is the timer.

        On CUDA an action's span is then the device range of the work it launched, not its
        host enqueue time (see `graphpipe.runtime.profiling`).
        """
        if not (self._recording and self._timer == "profiler"):
            yield
            return
        with profile_actions(self.device) as prof:
            yield
        executor.spans.extend(spans_from_profiler(prof, self.rank))

    def timeline(self, clear: bool = True) -> Timeline:
        """The actions every rank recorded (a collective: call it on every rank).

        With `RuntimeConfig.timer` "host" (CPU's default) a span is the action's host range
        on `time.perf_counter`'s clock; with "profiler" (CUDA's default) it comes from
        torch.profiler: the device range of the work the action launched, on the Unix-epoch
        clock (`graphpipe.runtime.profiling`).

        Args:
            clear: Forget the recorded actions afterwards.
        """
        spans = [] if self._executor is None else self._executor.spans
        gathered = self._gather(spans, "the timeline")
        if clear and self._executor is not None:
            self._executor.spans = []
            self._executor.clock = dict.fromkeys(self._executor.clock, 0.0)
        every = sorted((s for part in gathered for s in part), key=lambda s: s.start)
        return Timeline(tuple(every), self.plan.num_devices, "measured", self.schedule.name)

    # -- set-up --------------------------------------------------------------------------------

    def _clip_group(self) -> dist.ProcessGroup | None:
        """The ranks holding a stage, as a process group (a collective); None: all of them."""
        busy = sorted({d for s in self.plan.stages for d in s.devices})
        if len(busy) == dist.get_world_size():
            return None
        return dist.new_group(busy, timeout=datetime.timedelta(seconds=self.runtime.timeout))

    def _make_clipper(
        self,
        clip: tuple[float, float],
        canon: dict[str, str],
        modules: dict[int, Any],
        groups: _Groups,
        group: dist.ProcessGroup | None,
    ) -> GradClipper:
        """Count each parameter on one rank: its first holding stage's first device."""
        assert self.module is not None
        params = list(self.module.parameters())  # unique: a tied weight is one tensor here
        counted = []
        seen: set[int] = set()
        for index in self._stage_indices:
            for n, p in modules[index][0].named_parameters():
                name = canon.get(n, n)
                owner = groups.shared.get(name, (index,))[0]
                if self.plan.stages[owner].devices[0] == self.rank and id(p) not in seen:
                    counted.append(p)
                    seen.add(id(p))
        return GradClipper(clip[0], clip[1], params, counted, group)

    def _emulated(
        self, modules: dict[int, Any], specs: dict[str, Any], emulate: Emulate
    ) -> dict[int, Any]:
        """Each stage's stand-in (`graphpipe.runtime.emulate`); other ranks' on meta."""
        mine = set(self._stage_indices)
        return {
            i: (
                EmulatedStage(
                    self._gm,
                    self.plan,
                    i,
                    io,
                    specs,
                    emulate,
                    self.device if i in mine else torch.device("meta"),
                ),
                io,
            )
            for i, (_, io) in modules.items()
        }

    def _make_scaler(self, group: dist.ProcessGroup | None) -> LossScaler:
        ranks = None if group is None else dist.get_process_group_ranks(group)

        def all_reduce_max(flag: torch.Tensor) -> None:
            guarded(
                "the all-reduce of the found-inf flag",
                lambda: dist.all_reduce(flag, dist.ReduceOp.MAX, group),
                ranks,
            )

        return LossScaler(all_reduce_max)

    def _before_step(self) -> bool:
        """After the gradient sums: unscale (fp16), nan_check's agreement, then clipping.
        False skips the step (an fp16 overflow, or a non-finite value under nan_check)."""
        if self._scaler is not None:
            assert self.module is not None
            finite = self._scaler.unscale(list(self.module.parameters()), self.device)
            self._scaler.update(finite)
            if not finite:
                return False
        if self._nancheck is not None:
            self._problem = self._nancheck.agree()
            if self._problem is not None:
                return False
        if getattr(self, "_clipper", None) is not None:
            self._clipper(self.device)
        return True

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale, the same on every rank (None without fp16)."""
        return None if self._scaler is None else self._scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Updates skipped because a gradient overflowed somewhere (fp16)."""
        return 0 if self._scaler is None else self._scaler.skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The total gradient norm before clipping at the last update (max_grad_norm=)."""
        clipper = getattr(self, "_clipper", None)
        return None if clipper is None or clipper.last is None else float(clipper.last)

    def _groups(self, canon: dict[str, str], modules: dict[int, Any], weights: str) -> _Groups:
        """Process groups for replicas and tied copies; created in the same order everywhere.

        Args:
            canon: Every name of a parameter -> its canonical name.
            modules: Every stage's module, by stage index.
            weights: The weight policy.

        Raises:
            ConfigError: a weight tied across ranks under an asynchronous schedule (on every
                rank alike, before any collective).
        """
        holders: dict[str, set[int]] = {}
        for index, (module, _) in modules.items():
            for n, _p in module.named_parameters():
                holders.setdefault(canon.get(n, n), set()).add(index)
        shared = {n: tuple(sorted(s)) for n, s in sorted(holders.items()) if len(s) > 1}
        stages = self.plan.stages
        replicas = [(s.devices, f"stage {s.index} replicas") for s in stages if s.replicas > 1]
        tied = [  # copies held by one rank's stages are one tensor there: nothing to sum
            (ranks, f"tied {name}")
            for name, held in shared.items()
            if len(ranks := tuple(sorted({d for t in held for d in stages[t].devices}))) > 1
        ]
        if tied and self._async:
            ranks, label = tied[0]
            raise ConfigError(
                f"weights={weights!r} cannot keep a weight tied across ranks: {label[5:]} is "
                f"held on ranks {list(ranks)}, whose stages update at different points of the "
                f"{self.schedule.name} schedule, so its copies' gradients have no moment to be "
                "summed; use weights='flush', which sums them before each update, or give "
                "the modules that share it copies of their own"
            )
        groups = make_groups(replicas + tied, self.rank, self.runtime.timeout)
        local = {
            canon.get(n, n): p
            for index in self._stage_indices
            for n, p in modules[index][0].named_parameters()
        }
        plan: list[SyncGroup] = []
        for (ranks, label), group in zip(replicas + tied, groups, strict=True):
            if label.startswith("tied "):
                params = [local[label[5:]]] if label[5:] in local else []
            else:
                params = [p for n, p in local.items() if n not in shared]
            plan.append(SyncGroup(ranks, group, params, label))
        return _Groups(GradSync(plan), shared=shared)


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
        k: _cpu(v)
        for k, v in model.state_dict(keep_vars=True).items()
        if id(v) not in held and not v.is_meta
    }


def _check_target(target: Any, batch: int) -> None:
    """Every tensor in `target` must have the batch on dim 0.

    Raises:
        ConfigError: no tensor at all, or naming the first tensor that does not.
    """
    leaves, _ = tree_flatten_with_path(target)
    tensors = [(keystr(path), x) for path, x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ConfigError(
            f"target holds no tensor (it is a {type(target).__name__}); it must be a tensor, "
            "or a tuple/dict of tensors, with the batch on dim 0"
        )
    for path, x in tensors:
        if x.dim() == 0:
            raise ConfigError(
                f"target{path} is a scalar, the batch has {batch} rows; dim 0 must be the batch"
            )
        if x.shape[0] != batch:
            raise ConfigError(f"target{path} has {x.shape[0]} rows, the batch has {batch}")


def _moved(op: Any, shift: int) -> Any:
    """An action or communication group with its micro-batch ids moved by `shift`."""
    if isinstance(op, Comm):
        return Comm(tuple(_moved(a, shift) for a in op.actions))
    return op if op.mb is None or shift == 0 else replace(op, mb=op.mb + shift)


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x` on `device`; from the CPU to CUDA through pinned memory, without blocking."""
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


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
