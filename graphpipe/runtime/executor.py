"""Executor: run one rank's program (`graphpipe.scheduling.program`) for one step() call.

For every operation (see `graphpipe.ir.KINDS`):
    [...]  a communication group: post its receives and sends (activations forward, the
           gradients of what was received backward) as one batch
    F      wait for its inputs, run the stage module (through the weight policy); on the
           stage with the model output, compute the loss of micro-batch j
    B      backward from the loss (scaled by the policy) and the received gradients
    I, W   the two halves of that backward (zero bubble; `graphpipe.runtime.backward`)
    U      the policy's update (sum gradients over replicas and tied copies, step)

A rank may hold several stages (interleaved schedules); their state is kept per (stage,
micro-batch). Losses stay on the device until the step reads their sum once.

Values received with a floating dtype become leaves that require grad, so their gradients are
what SB sends back; integer and boolean values cross stages without gradients. A value sent to
several stages gets the sum of their gradients. A micro-batch's state is dropped once its
backward is done. With `record`, every compute and update action is timed
(`time.perf_counter`, the same clock for all processes of a machine), and `clock` sums the
seconds spent waiting for messages and posting them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

import graphpipe._torch as _torch
from graphpipe.errors import ConfigError, PipelineError
from graphpipe.ir import Action, ActionKind, Message, Plan, Span, sends
from graphpipe.ir.program import Comm, Op
from graphpipe.runtime import backward
from graphpipe.runtime.comm import Incoming, Outgoing, Pending, Spec, Transport
from graphpipe.runtime.failures import action_failure
from graphpipe.runtime.mesh import prepare_backward, reduce_gradients
from graphpipe.runtime.nancheck import NanCheck
from graphpipe.runtime.precision import Precision
from graphpipe.runtime.routes import Route, Step, compiled
from graphpipe.runtime.shapes import Lowered
from graphpipe.runtime.stage import OUTPUT, StageIO, model_output
from graphpipe.runtime.tp import tp_context, whole_tensor
from graphpipe.runtime.weights import WeightPolicy

__all__ = ["Batch", "Executor", "StageRuntime", "host_only"]

TOKEN: list[Spec] = [((1,), torch.uint8)]
PROGRAMS_KEPT = 8  # resolved programs an executor keeps (training, evaluation, async calls)


_SENDS = frozenset({ActionKind.SF, ActionKind.SB})


def host_only(start: float) -> None:
    """An action ends with its host work (`Executor`'s `action_end` by default)."""


@dataclass
class Batch:
    """The micro-batches of one step() call: inputs by placeholder name, and targets."""

    first: int  # id of the first micro-batch (c * M for call c of an async schedule)
    inputs: dict[str, list[torch.Tensor]]
    targets: list[Any] | None
    shaped: list[Lowered] | None = None  # each micro-batch's stages and specs (its shapes)
    shares: list[float] | None = None  # each one's rows / B where rows differ; None: 1 / M

    def input(self, name: str, j: int) -> torch.Tensor:
        """Model input `name` of micro-batch j."""
        return self.inputs[name][j - self.first]


@dataclass
class StageRuntime:
    """Everything one rank needs to run one of its stages."""

    rank: int
    plan: Plan
    index: int  # the stage
    module: fx.GraphModule
    io: StageIO
    specs: dict[str, Spec]  # value name -> micro-batch shape and dtype
    gm: fx.GraphModule  # the whole traced graph (for the output structure)
    loss_fn: Callable[[Any, Any], torch.Tensor]
    device: torch.device
    tensor_parallel: bool = False  # its parameters are DTensors over tp (`runtime.tp`)


@dataclass
class _MicroBatch:
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    target: Any = None  # kept when the policy recomputes the forward for its backward
    forward_recvs: list[tuple[int, Pending]] = field(default_factory=list)
    backward_recvs: list[tuple[int, Pending]] = field(default_factory=list)
    arrived: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)
    weight_half: backward.WeightHalf | None = None
    backward_done: bool = False
    # sends of its last action done: its B's gradients (on a stage that runs forward only,
    # its F's outputs), after which it is forgotten
    sent: int = 0


class Executor:
    """Runs programs for one rank, keeping in-flight micro-batches between calls.

    Args:
        stages: The rank's stages, by stage index.
        policy: Its weight policy (one for all its stages).
        transport: Its point-to-point messages.
        precision: Autocast and the dtype of values between stages (default float32).
        nancheck: Notes non-finite losses and gradients (`compile(nan_check=True)`).
        grad_scale: Reads the current loss scale each backward multiplies the loss by (fp16's
            `LossScaler.scale`); None: 1.
        action_end: Called with each compute or update action's `perf_counter()` start once
            its host work is done; returns when the action is over. `host_only` (the
            default) returns at once; a stage factory may wait out a device's time there
            (`graphpipe.runtime.factory`).
    """

    def __init__(
        self,
        stages: dict[int, StageRuntime],
        policy: WeightPolicy,
        transport: Transport,
        precision: Precision | None = None,
        nancheck: NanCheck | None = None,
        grad_scale: Callable[[], float] | None = None,
        action_end: Callable[[float], None] = host_only,
    ) -> None:
        self.stages, self.policy, self.transport = stages, policy, transport
        self.action_end = action_end
        self.precision = precision or Precision()
        self._grad_scale = grad_scale
        first = next(iter(stages.values()))
        self.rank, self.plan = first.rank, first.plan
        self.edges = list(self.plan.edges)
        self.state: dict[tuple[int, int], _MicroBatch] = {}
        self.losses: dict[int, torch.Tensor] = {}
        # micro-batch id -> its stages and specs at its shapes, and its share of the rows
        self.shaped: dict[int, tuple[Lowered | None, float | None]] = {}
        self._mailbox: dict[Message, list[torch.Tensor]] = {}
        self.spans: list[Span] = []
        self.record = False
        self.clock = {"wait": 0.0, "post": 0.0}  # with record: seconds waited, and posting
        self._is_final = False
        self.training = True
        self.nancheck = nancheck
        self._compiled: dict[int, tuple[Sequence[Op], list[Step]]] = {}
        self._owed: dict[tuple[int, int], int] = {}  # (stage, j) -> gradient sends of its B
        self._handlers: dict[str, Callable[[Action, Batch], None]] = {
            "F": self._forward,
            "B": self._backward,
            "I": self._input_half,
            "W": self._weight_half,
            "U": self._update,
        }

    @property
    def grad_scale(self) -> float:
        """fp16's current loss scale (`graphpipe.runtime.precision.LossScaler`), else 1."""
        return 1.0 if self._grad_scale is None else self._grad_scale()

    def run(self, ops: Sequence[Op], batch: Batch) -> None:
        """Execute `ops` in order, then wait for the sends to complete (tensor-parallel
        stages' forwards and backwards under `tp_context`)."""
        with tp_context(any(s.tensor_parallel for s in self.stages.values())):
            self._run(ops, batch)

    def _run(self, ops: Sequence[Op], batch: Batch) -> None:
        self._note_shapes(batch)
        for step in self._steps(ops):
            op = step.op
            self._is_final = step.final
            try:
                if isinstance(op, Comm):
                    start = time.perf_counter()
                    self._issue(step.routes, batch)
                    self._tick("post", start)
                    continue
                if step.awaits:
                    start = time.perf_counter()
                    self._await(op)  # waiting for peers is not part of the action's time
                    self._tick("wait", start)
                start = time.perf_counter()
                with _labelled(step.label):
                    self._handlers[op.kind](op, batch)
                self.action_end(start)
            except PipelineError:
                raise  # posted where it was raised
            except ConfigError as exc:  # a refusal only this stage could make: posted, kept
                self._failed(op, exc)
                raise
            except Exception as exc:  # the stage's own error: posted, so no peer waits for it
                raise self._failed(op, exc) from exc
            if self.record:
                self.spans.append(Span(self.rank, step.text, start, time.perf_counter()))
        start = time.perf_counter()
        self.transport.finish_sends()
        self._tick("wait", start)

    def _steps(self, ops: Sequence[Op]) -> list[Step]:
        """`ops` resolved (`graphpipe.runtime.routes`), once per program: a flushed schedule
        runs the same one every call, an asynchronous one a few."""
        known = self._compiled.get(id(ops))
        if known is not None and known[0] is ops:
            return known[1]
        if len(self._compiled) >= PROGRAMS_KEPT:
            self._compiled.clear()
        steps = compiled(self.plan, self.rank, ops)
        self._compiled[id(ops)] = (ops, steps)  # holding `ops` keeps its id from being reused
        return steps

    def _note_shapes(self, batch: Batch) -> None:
        """Keep each micro-batch's shapes and share while it is in flight: an asynchronous
        schedule runs its backward in a later call, whose batch no longer holds it."""
        live = {j for _, j in self.state}
        self.shaped = {j: v for j, v in self.shaped.items() if j in live}
        count = len(batch.shaped or batch.shares or ())
        for k in range(count):
            self.shaped[batch.first + k] = (
                None if batch.shaped is None else batch.shaped[k],
                None if batch.shares is None else batch.shares[k],
            )

    def _lowered(self, j: int) -> Lowered | None:
        """Micro-batch j's stages and specs when its shapes are not the compiled ones."""
        return self.shaped.get(j, (None, None))[0]

    def _module(self, stage: int, j: int) -> nn.Module:
        """The module that runs micro-batch j on `stage` (the one for its shapes)."""
        lowered = self._lowered(j)
        return self.stages[stage].module if lowered is None else lowered.modules[stage]

    def _failed(self, op: Op, exc: Exception) -> PipelineError:
        """Post why this rank stops, so a peer left waiting for it names this failure (by
        its global rank: with a mesh, `self.rank` is its plan device)."""
        fields = {"stage": op.stage, "micro_batch": op.mb} if isinstance(op, Action) else {}
        return action_failure(f"rank {self.transport.rank}, action {op}", exc, **fields)

    def _tick(self, kind: str, start: float) -> None:
        """With record, add the time since `start` to `clock[kind]`."""
        if self.record:
            self.clock[kind] += time.perf_counter() - start

    # -- helpers ------------------------------------------------------------------------------

    def _mb(self, stage: int, j: int) -> _MicroBatch:
        """Micro-batch j's state on `stage`, made at its first use."""
        mb = self.state.get((stage, j))
        if mb is None:  # not setdefault: that would build a state on every call
            mb = self.state[(stage, j)] = _MicroBatch()
        return mb

    def _specs(self, stage: int, names: Sequence[str], j: int) -> list[Spec]:
        lowered = self._lowered(j)
        specs = self.stages[stage].specs if lowered is None else lowered.specs
        return [specs[n] for n in names] if names else TOKEN

    def _await(self, a: Action) -> None:
        """Wait for the messages the compute action `a` reads."""
        assert a.mb is not None
        mb = self._mb(a.stage, a.mb)
        pending = mb.forward_recvs if a.kind.direction == "F" else mb.backward_recvs
        arrived = self.transport.wait_all([p for _, p in pending])
        mb.arrived.extend((i, tensors) for (i, _), tensors in zip(pending, arrived, strict=True))
        pending.clear()

    # -- communication ------------------------------------------------------------------------

    def _issue(self, routes: Sequence[Route], batch: Batch) -> None:
        """Post every send and receive of a communication group as one batch. A message
        between two stages of this rank is a local copy, made before the batch's receives
        are read."""
        local = [r for r in routes if r.local]
        for r in local:
            if r.action.kind.is_send:
                self._mailbox[r.message] = [t.detach().clone() for t in self._sent(r)]
        remote = [r for r in routes if not r.local]
        outgoing = [
            Outgoing(self._sent(r) or [torch.zeros(1, dtype=torch.uint8)], r.peer, r.tag, r.what)
            for r in remote
            if r.action.kind.is_send
        ]
        receives = [r for r in remote if r.action.kind.is_receive]
        pending = self.transport.exchange(outgoing, [self._incoming(r) for r in receives])
        for r, p in zip(receives, pending, strict=True):
            mb = self._mb(r.action.stage, r.message.mb)
            forward = r.message.direction == "F"
            (mb.forward_recvs if forward else mb.backward_recvs).append((r.edge, p))
        for r in local:
            if r.action.kind.is_receive:
                mb = self._mb(r.action.stage, r.message.mb)
                mb.arrived.append((r.edge, self._mailbox.pop(r.message)))
        for r in routes:
            kind, stage, j = r.action.kind, r.action.stage, r.message.mb
            # the last action's sends: B's, or F's on a stage that runs forward only
            if kind in _SENDS and (kind == ActionKind.SB) == self.plan.stages[stage].backward:
                self.state[(stage, j)].sent += 1
                self._forget_when_done(stage, j)

    def _incoming(self, r: Route) -> Incoming:
        """A remote receive, at its micro-batch's shapes."""
        return Incoming(self._specs(r.action.stage, r.names, r.message.mb), r.peer, r.tag, r.what)

    def _sent(self, r: Route) -> list[torch.Tensor]:
        """What a send carries: the stage's outputs forward, the gradients of its received
        values backward."""
        mb = self.state[(r.action.stage, r.message.mb)]
        if r.message.direction == "F":
            return [mb.outputs[n].detach() for n in r.names]
        return [_grad_or_zeros(mb.inputs[n]) for n in r.names]

    # -- forward ------------------------------------------------------------------------------

    def _forward(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None
        j, s = a.mb, self.stages[a.stage]
        mb = self._mb(a.stage, j)
        grad = self.training and self.plan.stages[a.stage].backward  # else forward only
        for i, values in mb.arrived:
            for name, value in zip(self.edges[i].tensors, values, strict=False):
                if value.is_floating_point() and grad:
                    value.requires_grad_()
                mb.inputs[name] = value
        mb.arrived.clear()
        for name in s.io.model_inputs:
            mb.inputs[name] = batch.input(name, j)
        args = [mb.inputs[name] for name in s.io.inputs]
        module = self._module(a.stage, j)
        call = _call
        if self.training and self.plan.stages[a.stage].recompute:
            call = functools.partial(checkpoint, _call, use_reentrant=False)  # keeps the inputs
        with torch.set_grad_enabled(grad), self.precision.autocast(s.device):
            mb.outputs = self._crossing(s, self.policy.forward(j, lambda w: call(module, w, args)))
            if s.io.has_output:
                out = model_output(s.gm, mb.outputs[OUTPUT])
                if batch.targets is None:  # inference: keep the output
                    mb.outputs[OUTPUT] = out
                    return
                mb.target = batch.targets[j - batch.first]
                mb.loss = scalar(s.loss_fn(out, mb.target), j)
                self.losses[j] = mb.loss.detach()
                if self.nancheck is not None and self.training:
                    self.nancheck.saw_loss(a.stage, j, mb.loss)
        if self.training and not self.plan.stages[a.stage].backward:
            mb.inputs.clear()  # nothing runs backward: only the outputs wait to be sent
            mb.backward_done = True
            self._forget_when_done(a.stage, j)

    # -- backward -----------------------------------------------------------------------------

    def _roots(self, stage: int, j: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What the backward of micro-batch j starts from: the loss and received gradients."""
        mb = self.state[(stage, j)]
        grads: dict[str, torch.Tensor] = {}
        for i, values in mb.arrived:
            for name, g in zip(self.edges[i].grads, values, strict=False):
                grads[name] = grads[name] + g if name in grads else g
        mb.arrived.clear()
        roots: list[torch.Tensor] = []
        seeds: list[torch.Tensor | None] = []
        if mb.loss is not None:
            share = self.shaped.get(j, (None, None))[1]
            roots.append(mb.loss * (self.policy.loss_scale(share) * self.grad_scale))
            seeds.append(None)
        for name, g in grads.items():
            out = mb.outputs[name]
            if out.requires_grad:
                roots.append(out)
                seeds.append(g)
        return roots, seeds

    def _grad_inputs(self, stage: int, j: int) -> list[torch.Tensor]:
        mb, io = self.state[(stage, j)], self.stages[stage].io
        return [v for n, v in mb.inputs.items() if n in io.received and v.requires_grad]

    def _crossing(self, s: StageRuntime, outputs: dict[str, Any]) -> dict[str, Any]:
        """The stage's outputs with what it sends in the precision's dtype (a graph op)."""
        for name in s.io.sent:
            if isinstance(outputs.get(name), torch.Tensor):
                outputs[name] = self.precision.crossing(outputs[name])
        return outputs

    def _recompute(self, stage: int, j: int) -> None:
        """Run micro-batch j's forward again, with the weights the policy picks for backward."""
        mb, s = self.state[(stage, j)], self.stages[stage]
        args = [mb.inputs[name] for name in s.io.inputs]
        module = self._module(stage, j)
        with torch.enable_grad(), self.precision.autocast(s.device):
            mb.outputs = self._crossing(
                s, self.policy.recompute(j, lambda w: _call(module, w, args))
            )
            if s.io.has_output:
                mb.loss = s.loss_fn(model_output(s.gm, mb.outputs[OUTPUT]), mb.target)

    def _backward(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None
        if self.policy.recomputes:
            self._recompute(a.stage, a.mb)
        roots, seeds = self._roots(a.stage, a.mb)
        # FSDP2 (a mesh) reduces the stage's gradients once, on its last backward of the step
        prepare_backward(self.stages[a.stage].module, self._is_final)
        self.policy.backward(a.mb, lambda: backward.full(roots, seeds), self._final(a.stage))
        self._finish_backward(a.stage, a.mb)

    def _input_half(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None
        j = a.mb
        roots, seeds = self._roots(a.stage, j)
        params = list(self.stages[a.stage].module.parameters())
        mb = self.state[(a.stage, j)]

        def run() -> None:
            inputs = self._grad_inputs(a.stage, j)
            _, mb.weight_half = backward.input_half(roots, seeds, inputs, params)

        prepare_backward(self.stages[a.stage].module, last=False)  # reduced after the last W
        self.policy.backward(a.mb, run)

    def _weight_half(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None
        half = self.state[(a.stage, a.mb)].weight_half
        module = self.stages[a.stage].module
        prepare_backward(module, last=False)
        self.policy.accumulate(
            lambda on_grad: None if half is None else backward.weight_half(half, on_grad),
            self._final(a.stage),
        )
        if self._is_final:  # FSDP2 (a mesh): the stage's gradients are complete, reduce them
            reduce_gradients(module)
        self._finish_backward(a.stage, a.mb)

    def _final(self, stage: int) -> list[nn.Parameter]:
        """The stage's parameters on its last backward before an update, else none."""
        return list(self.stages[stage].module.parameters()) if self._is_final else []

    def _finish_backward(self, stage: int, j: int) -> None:
        if self.nancheck is not None:
            self.nancheck.saw_grads(stage, j, self.stages[stage].module)
        self.state[(stage, j)].backward_done = True
        self._forget_when_done(stage, j)

    def _forget_when_done(self, stage: int, j: int) -> None:
        """Drop micro-batch j once its backward ran and its gradients were sent back (on a
        stage that runs forward only: once its outputs were sent)."""
        mb = self.state[(stage, j)]
        kind = ActionKind.B if self.plan.stages[stage].backward else ActionKind.F
        owed = self._owed.get((stage, j))
        if owed is None:
            owed = self._owed[(stage, j)] = len(sends(self.plan, Action(stage, kind, j)))
        if mb.backward_done and mb.sent >= owed:
            del self.state[(stage, j)]

    def _update(self, a: Action, batch: Batch) -> None:
        self.policy.update(a.mb)


class _LiveWeights:
    """The forward-only stand-in for a weight policy: every forward uses the live weights,
    and nothing is logged or versioned (evaluation)."""

    recomputes = False

    def forward(self, j: int, run: Callable[[Any], Any]) -> Any:
        return run(None)


LIVE_WEIGHTS: Any = _LiveWeights()


_UNLABELLED = contextlib.nullcontext()


def _labelled(label: str) -> contextlib.AbstractContextManager[Any]:
    """An action's `graphpipe::` profiler range while a torch profiler records, else
    nothing: a range is two dispatched ops per action, host time on the critical path when
    no one reads it (issue 37: a millisecond of a 2-rank CPU step of 8 micro-batches)."""
    if _torch.profiler_enabled():
        return torch.profiler.record_function(label)
    return _UNLABELLED


def scalar(loss: Any, j: int) -> torch.Tensor:
    """The loss of micro-batch j, which must be a real scalar tensor.

    Raises:
        ConfigError: it is not one, naming what it is.
    """
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss.reshape(())
    what = (
        f"a {loss.dtype} tensor of shape {list(loss.shape)}"
        if isinstance(loss, torch.Tensor)
        else f"a {type(loss).__name__}"
    )
    raise ConfigError(
        f"loss_fn returned {what} for micro-batch {j}; it must return a real scalar tensor "
        "(reduce it, e.g. with mean())"
    )


def _grad_or_zeros(x: torch.Tensor) -> torch.Tensor:
    """A received value's gradient to send back: whole (a tensor-parallel stage's comes as
    a DTensor over tp), or zeros."""
    return whole_tensor(x.grad).detach() if x.grad is not None else torch.zeros_like(x)


def _call(module: nn.Module, weights: dict[str, torch.Tensor] | None, args: list[Any]) -> Any:
    if weights is None:
        return module(*args)
    return torch.func.functional_call(module, weights, tuple(args))
