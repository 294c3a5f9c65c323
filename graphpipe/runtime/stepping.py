"""Stepping: step() and drain(), and the programs each call runs.

A flushed schedule runs the same lowered program every call. An asynchronous one (async,
2bw) keeps micro-batches in flight across calls: call c runs micro-batches cM..cM+M-1 with
the backwards and updates that fall due, and `drain` finishes the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from graphpipe.errors import ConfigError, FailureKind, PipelineError
from graphpipe.ir import Schedule
from graphpipe.ir.program import Comm, Op, Program
from graphpipe.runtime.batching import Inputs
from graphpipe.runtime.collectives import Collectives
from graphpipe.runtime.executor import Batch, Executor
from graphpipe.runtime.failures import longer_waits, posted
from graphpipe.runtime.hooks import AgreeFinite
from graphpipe.runtime.pieces import Run
from graphpipe.runtime.timelines import Recorder
from graphpipe.scheduling.generators import drain_schedule, make_schedule
from graphpipe.scheduling.program import lower

__all__ = ["Programs", "Stepper", "weighted"]


class Programs:
    """This rank's lowered operations for each call, cached by the schedule's shape.

    Args:
        run: The rank's run (plan, schedule, program, prefetch, M).
        rank: The rank's plan device.
    """

    def __init__(self, run: Run, rank: int) -> None:
        self.run, self.rank = run, rank
        self._cache: dict[Any, Program] = {}

    def for_call(self, call: int) -> Sequence[Op]:
        """This rank's operations for step() call `call`."""
        run = self.run
        if not run.asynchronous:
            return run.program.ranks[self.rank]
        m = run.micro_batches
        schedule = make_schedule(run.plan, run.schedule.name, m, first_call=call)
        return self.lowered(schedule, call * m)

    def lowered(self, schedule: Schedule, shift: int) -> Sequence[Op]:
        """This rank's part of `schedule` lowered; asynchronous calls repeat one shape with
        micro-batch ids moved on, so the lowering is cached by that shape."""
        shape = tuple(tuple(_moved(a, -shift) for a in actions) for actions in schedule.ranks)
        key = (schedule.name, shape)
        if key not in self._cache:
            base = Schedule(schedule.name, schedule.micro_batches, shape, schedule.calls)
            self._cache[key] = lower(self.run.plan, base, prefetch=self.run.prefetch)
        return [_moved(op, shift) for op in self._cache[key].ranks[self.rank]]


class Stepper:
    """Training calls: one mini-batch per step(), and drain() for asynchronous schedules.

    Args:
        run: The rank's run (its executor, plan, schedule and M).
        agree: nan_check's agreement (None without nan_check).
        loss_copies: Ranks holding each micro-batch slice's loss (`Place.loss_copies`).
        inputs: Checks and splits a call's inputs.
        programs: The lowered programs.
        collectives: The mean loss.
        recorder: Times the run under the profiler when recording.
        compile_wait: With compile_stages, the seconds any wait may take in a step at input
            shapes not stepped before (torch.compile's inductor compiles the stages then,
            and a peer's receive waits for it: `RuntimeConfig.plan_timeout`); None: every
            step waits `RuntimeConfig.timeout`.

    Attributes:
        calls: step() calls since the last drain (the next call's number).
        steps_done: step() calls so far (a checkpoint records and restores it).
    """

    def __init__(
        self,
        run: Run,
        agree: AgreeFinite | None,
        loss_copies: int,
        inputs: Inputs,
        programs: Programs,
        collectives: Collectives,
        recorder: Recorder,
        compile_wait: float | None = None,
    ) -> None:
        self.run, self.agree, self.loss_copies = run, agree, loss_copies
        self.inputs, self.programs, self.collectives = inputs, programs, collectives
        self.recorder = recorder
        self.compile_wait = compile_wait
        self._stepped: set[str] = set()  # the input shapes stepped at (compiled for)
        self.calls = 0
        self.steps_done = 0

    def step(self, args: Sequence[Any], kwargs: dict[str, Any], target: Any) -> float:
        """One mini-batch through the schedule, and the updates (see `PipelinedModel.step`).

        Raises:
            ConfigError: a missing or malformed target or inputs, before any communication.
            PipelineError: a failure while running, or nan_check's non-finite value.
        """
        if target is None and self.inputs.needs_target:
            raise ConfigError(
                "step() needs target=...: the loss is computed on the last stage (a loss_fn "
                "of the output alone, lambda out: out.loss, needs none)"
            )
        run, m, agree = self.run, self.run.micro_batches, self.agree
        first = self.calls * m if run.asynchronous else 0
        batch = self.inputs.batch(args, kwargs, target, first=first)
        self.inputs.check_loss(target, batch)
        ops = self.programs.for_call(self.calls)
        if agree is not None:
            agree.problem = None
        with posted("step"), self._compiling(batch):
            self._run(ops, batch)
            self.calls += 1
            self.steps_done += 1
            # with a mesh each of the dp x tp last-stage ranks holds M losses of its slices
            copies = self.loss_copies
            loss = self.collectives.mean_loss(*weighted(run.executor, batch, m * copies, copies))
        if agree is not None and agree.problem is not None:
            raise PipelineError(agree.problem, kind=FailureKind.NONFINITE)
        return loss

    def _compiling(self, batch: Batch) -> contextlib.AbstractContextManager[None]:
        """Longer waits for a step at shapes not stepped before, where stages compile."""
        shapes = repr([s.specs for s in batch.shaped or ()])  # alike on every rank
        if self.compile_wait is None or shapes in self._stepped:
            return contextlib.nullcontext()
        self._stepped.add(shapes)
        return longer_waits(self.compile_wait)

    def _run(self, ops: Sequence[Op], batch: Batch) -> None:
        executor = self.run.executor
        if executor is not None:
            executor.losses.clear()
            executor.training = True
            with self.recorder.timed():
                executor.run(ops, batch)
        elif self.agree is not None:  # a rank without a stage takes part in the agreement
            self.agree()

    def drain(self) -> None:
        """Finish the backwards and updates an asynchronous pipeline still has in flight.

        The next step() starts with a new warm-up. Flushed schedules have nothing to drain.
        """
        run = self.run
        if not run.asynchronous or self.calls == 0:
            return
        m = run.micro_batches
        actions = drain_schedule(run.plan, run.schedule.name, self.calls, m)
        if run.executor is not None:
            end = self.calls * m
            run.executor.run(self.programs.lowered(actions, end), Batch(end, {}, None))
            run.executor.state.clear()
        self.calls = 0


def weighted(
    executor: Executor | None, batch: Batch, count: int, copies: int
) -> tuple[list[torch.Tensor], int]:
    """This rank's micro-batch losses of `batch` and what their sum over the ranks is divided
    by: the losses and `count` (M, times the copies) when the micro-batches have equal rows;
    else each loss times its share of the rows, and `copies` (`graphpipe.runtime.batching`),
    the ranks holding each slice's loss (`Place.loss_copies`: dp slices x tp ranks)."""
    losses = {} if executor is None else executor.losses
    if batch.shares is None:
        return list(losses.values()), count
    return [loss * batch.shares[j - batch.first] for j, loss in losses.items()], copies


def _moved(op: Any, shift: int) -> Any:
    """An action or communication group with its micro-batch ids moved by `shift`."""
    if isinstance(op, Comm):
        return Comm(tuple(_moved(a, shift) for a in op.actions))
    return op if op.mb is None or shift == 0 else replace(op, mb=op.mb + shift)
