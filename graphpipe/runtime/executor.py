"""Executor: run one rank's schedule actions for one step() call.

For every action (see `graphpipe.ir.KINDS`):
    RF/RB  post a receive of the edge's message for micro-batch j
    F      wait for its inputs, run the stage module (through the weight policy); on the
           stage with the model output, compute the loss of micro-batch j
    SF/SB  send the edge's activations / the gradients of what it received
    B      backward from the loss (scaled by the policy) and the received gradients
    I, W   the two halves of that backward (zero bubble; `graphpipe.runtime.backward`)
    U      the policy's update (sum gradients over replicas and tied copies, step)

Values received with a floating dtype become leaves that require grad, so their gradients are
what SB sends back; integer and boolean values cross stages without gradients. A value sent to
several stages gets the sum of their gradients. A micro-batch's state is dropped once its
backward is done. With `record`, every compute and update action is timed
(`time.perf_counter`, the same clock for all processes of a machine).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from graphpipe.errors import ConfigError, PipelineError
from graphpipe.ir import Action, Plan, Span
from graphpipe.runtime import backward
from graphpipe.runtime.comm import Pending, Spec, Transport, tag_for
from graphpipe.runtime.stage import OUTPUT, StageIO, model_output
from graphpipe.runtime.weights import WeightPolicy

__all__ = ["Batch", "Executor", "StageRuntime"]

TOKEN: list[Spec] = [((1,), torch.uint8)]


@dataclass
class Batch:
    """The micro-batches of one step() call: inputs by placeholder name, and targets."""

    first: int  # id of the first micro-batch (c * M for call c of an async schedule)
    inputs: dict[str, list[torch.Tensor]]
    targets: list[Any] | None

    def input(self, name: str, j: int) -> torch.Tensor:
        """Model input `name` of micro-batch j."""
        return self.inputs[name][j - self.first]


@dataclass
class StageRuntime:
    """Everything one rank needs to run its stage."""

    rank: int
    plan: Plan
    index: int  # the stage this rank holds
    module: fx.GraphModule
    io: StageIO
    specs: dict[str, Spec]  # value name -> micro-batch shape and dtype
    gm: fx.GraphModule  # the whole traced graph (for the output structure)
    loss_fn: Callable[[Any, Any], torch.Tensor]
    device: torch.device


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
    sent_back: int = 0


class Executor:
    """Runs action lists for one rank, keeping in-flight micro-batches between calls.

    Args:
        stage: The rank's stage.
        policy: Its weight policy.
        transport: Its point-to-point messages.
    """

    def __init__(self, stage: StageRuntime, policy: WeightPolicy, transport: Transport) -> None:
        self.stage, self.policy, self.transport = stage, policy, transport
        self.edges = list(stage.plan.edges)
        self.state: dict[int, _MicroBatch] = {}
        self.losses: dict[int, float] = {}
        self.spans: list[Span] = []
        self.record = False
        self.training = True
        self._handlers: dict[str, Callable[[Action, Batch], None]] = {
            "RF": self._recv_forward,
            "F": self._forward,
            "SF": self._send_forward,
            "RB": self._recv_backward,
            "B": self._backward,
            "I": self._input_half,
            "W": self._weight_half,
            "SB": self._send_backward,
            "U": self._update,
        }

    def run(self, actions: Sequence[Action], batch: Batch, wait_sends: bool = True) -> None:
        """Execute `actions` in order, then wait for the sends to complete (with
        `wait_sends`; an asynchronous pipeline's next call receives some of them).

        With a transport that matches messages by tag (gloo), every receive of the call is
        posted first, so data flows as soon as its sender is ready instead of when this rank
        reaches the receive.
        """
        if self.transport.prefetch:
            for a in actions:
                if a.kind in ("RF", "RB"):
                    self._handlers[a.kind](a, batch)
            actions = [a for a in actions if a.kind not in ("RF", "RB")]
        for a in actions:
            try:
                if a.mb is not None and a.kind in ("F", "B", "I"):
                    self._await(a)  # waiting for peers is not part of the action's time
                start = time.perf_counter()
                self._handlers[a.kind](a, batch)
            except (PipelineError, ConfigError):
                raise
            except Exception as exc:
                raise PipelineError(
                    f"rank {self.stage.rank} failed at action {a}: {type(exc).__name__}: {exc}"
                ) from exc
            if self.record and (a.is_compute or a.kind == "U"):
                self.spans.append(Span(self.stage.rank, str(a), start, time.perf_counter()))
        self.transport.finish_sends(block=wait_sends)

    # -- helpers ------------------------------------------------------------------------------

    def _mb(self, j: int) -> _MicroBatch:
        return self.state.setdefault(j, _MicroBatch())

    def _edge(self, src: int, dst: int) -> tuple[int, Any]:
        for i, e in enumerate(self.edges):
            if e.src == src and e.dst == dst:
                return i, e
        raise PipelineError(f"no stage edge S{src}->S{dst} in the plan")

    def _peer(self, stage: int, j: int) -> int:
        return self.stage.plan.stages[stage].device_for(j)

    def _specs(self, names: Sequence[str]) -> list[Spec]:
        return [self.stage.specs[n] for n in names] if names else TOKEN

    def _await(self, a: Action) -> None:
        """Wait for the messages the compute action `a` reads."""
        assert a.mb is not None
        mb = self._mb(a.mb)
        pending = mb.forward_recvs if a.kind == "F" else mb.backward_recvs
        mb.arrived.extend((i, self.transport.wait(p)) for i, p in pending)
        pending.clear()

    # -- forward ------------------------------------------------------------------------------

    def _recv_forward(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None and a.peer is not None
        i, edge = self._edge(a.peer, a.stage)
        pending = self.transport.recv(
            self._specs(edge.tensors), self._peer(a.peer, a.mb), tag_for(i, False, a.mb), str(a)
        )
        self._mb(a.mb).forward_recvs.append((i, pending))

    def _forward(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None
        j, s = a.mb, self.stage
        mb = self._mb(j)
        for i, values in mb.arrived:
            for name, value in zip(self.edges[i].tensors, values, strict=False):
                if value.is_floating_point() and self.training:
                    value.requires_grad_()
                mb.inputs[name] = value
        mb.arrived.clear()
        for name in s.io.model_inputs:
            mb.inputs[name] = batch.input(name, j)
        args = [mb.inputs[name] for name in s.io.inputs]
        with torch.set_grad_enabled(self.training):
            mb.outputs = self.policy.forward(j, lambda w: _call(s.module, w, args))
            if s.io.has_output:
                out = model_output(s.gm, mb.outputs[OUTPUT])
                if batch.targets is None:  # inference: keep the output
                    mb.outputs[OUTPUT] = out
                    return
                mb.target = batch.targets[j - batch.first]
                mb.loss = _scalar(s.loss_fn(out, mb.target), j)
                self.losses[j] = float(mb.loss.detach())

    def _send_forward(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None and a.peer is not None
        i, edge = self._edge(a.stage, a.peer)
        outputs = self.state[a.mb].outputs
        tensors = [outputs[n].detach() for n in edge.tensors] or [torch.zeros(1, dtype=torch.uint8)]
        self.transport.send(tensors, self._peer(a.peer, a.mb), tag_for(i, False, a.mb), str(a))

    # -- backward -----------------------------------------------------------------------------

    def _recv_backward(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None and a.peer is not None
        i, edge = self._edge(a.stage, a.peer)
        pending = self.transport.recv(
            self._specs(edge.grads), self._peer(a.peer, a.mb), tag_for(i, True, a.mb), str(a)
        )
        self._mb(a.mb).backward_recvs.append((i, pending))

    def _roots(self, j: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What the backward of micro-batch j starts from: the loss and received gradients."""
        mb = self.state[j]
        grads: dict[str, torch.Tensor] = {}
        for i, values in mb.arrived:
            for name, g in zip(self.edges[i].grads, values, strict=False):
                grads[name] = grads[name] + g if name in grads else g
        mb.arrived.clear()
        roots: list[torch.Tensor] = []
        seeds: list[torch.Tensor | None] = []
        if mb.loss is not None:
            roots.append(mb.loss * self.policy.loss_scale())
            seeds.append(None)
        for name, g in grads.items():
            out = mb.outputs[name]
            if out.requires_grad:
                roots.append(out)
                seeds.append(g)
        return roots, seeds

    def _grad_inputs(self, j: int) -> list[torch.Tensor]:
        mb = self.state[j]
        return [v for n, v in mb.inputs.items() if n in self.stage.io.received and v.requires_grad]

    def _recompute(self, j: int) -> None:
        """Run micro-batch j's forward again, with the weights the policy picks for backward."""
        mb, s = self.state[j], self.stage
        args = [mb.inputs[name] for name in s.io.inputs]
        with torch.enable_grad():
            mb.outputs = self.policy.recompute(j, lambda w: _call(s.module, w, args))
            if s.io.has_output:
                mb.loss = s.loss_fn(model_output(s.gm, mb.outputs[OUTPUT]), mb.target)

    def _backward(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None
        if self.policy.recomputes:
            self._recompute(a.mb)
        roots, seeds = self._roots(a.mb)
        self.policy.backward(a.mb, lambda: backward.full(roots, seeds))
        self._finish_backward(a.mb)

    def _input_half(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None
        j = a.mb
        roots, seeds = self._roots(j)
        params = list(self.stage.module.parameters())
        mb = self.state[j]

        def run() -> None:
            _, mb.weight_half = backward.input_half(roots, seeds, self._grad_inputs(j), params)

        self.policy.backward(a.mb, run)

    def _weight_half(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None
        half = self.state[a.mb].weight_half
        if half is not None:
            backward.weight_half(half)
        self._finish_backward(a.mb)

    def _send_backward(self, a: Action, batch: Batch) -> None:
        assert a.mb is not None and a.peer is not None
        i, edge = self._edge(a.peer, a.stage)
        mb = self.state[a.mb]
        tensors = [_grad_or_zeros(mb.inputs[n]) for n in edge.grads]
        self.transport.send(
            tensors or [torch.zeros(1, dtype=torch.uint8)],
            self._peer(a.peer, a.mb),
            tag_for(i, True, a.mb),
            str(a),
        )
        mb.sent_back += 1
        self._forget_when_done(a.mb)

    def _finish_backward(self, j: int) -> None:
        self.state[j].backward_done = True
        self._forget_when_done(j)

    def _forget_when_done(self, j: int) -> None:
        """Drop micro-batch j once its backward ran and its gradients were sent back."""
        mb = self.state[j]
        owed = sum(1 for e in self.edges if e.dst == self.stage.index and e.backward_message)
        if mb.backward_done and mb.sent_back >= owed:
            del self.state[j]

    def _update(self, a: Action, batch: Batch) -> None:
        self.policy.update(a.mb)


def _scalar(loss: Any, j: int) -> torch.Tensor:
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
    return x.grad.detach() if x.grad is not None else torch.zeros_like(x)


def _call(module: nn.Module, weights: dict[str, torch.Tensor] | None, args: list[Any]) -> Any:
    if weights is None:
        return module(*args)
    return torch.func.functional_call(module, weights, tuple(args))
