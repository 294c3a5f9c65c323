"""Emulated devices: the real runtime, with each stage's compute replaced by a wait.

    pm = graphpipe.compile(model_on_meta, x, ..., plan=the_plan,
                           runtime=RuntimeConfig(emulate=Emulate(time_scale=20, byte_scale=64)))

Everything but the arithmetic is what a real run does: the schedule lowered to programs, the
fused point-to-point groups, the gradient sums of replicas, the weight policy, the optimizer
step. Each stage module is swapped for an `EmulatedStage` whose forward makes its outputs and
then waits until the plan's `forward_time` has passed since it began, and whose backward does
the same for its `backward_time` (split between the input half and the weight half in the
simulator's proportions, `simulate.weight_share`), each times `time_scale`: making the
outputs is part of a device's compute time, not added to it. Waiting does not contend for
the cores, so 8 emulated ranks run on a 2-core machine as 8 devices would.

The values a stage sends and the input gradients it returns are never read by the stand-ins
that receive them, so they are not even written (`torch.empty`), nor copied to attach the
weight half; the model output is zeros (the loss reads it).

Host memory stands for device memory, whose caching allocator hands the same blocks back step
after step. glibc by default gives freed blocks of tens of MB back to the operating system, so
every large message arrives in new memory whose pages fault in, host work that no device does
(and that 8 ranks on 2 cores feel). Start emulated ranks with `MALLOC_MMAP_THRESHOLD_=33554432`
and `MALLOC_TRIM_THRESHOLD_=4294967296` in their environment, as `benchmarks/emulated.py`
does (with `launch(..., start_method="spawn")`: glibc reads them when a process starts, and a
worker forked from the fork server starts with the server's); `mallopt` after start-up does
not remove the faults (measured).

Sizes: a value crossing stages keeps its dtype and is sent as a flat tensor of
`round(numel / byte_scale)` elements (at least one; a `byte_scale` below 1 makes it larger,
so that a slow loopback can stand for a fast link at a large `time_scale`). A replicated
stage's weight, which replicas all-reduce, holds `param_bytes / byte_scale` bytes; an
unreplicated stage's weight is one element: no link carries it, and a real-sized zero
gradient per backward would be host work (a memset and an accumulation on contended cores)
that the emulated device does not do. Under a mesh (the plan's dp degree k > 1) every stage's
weight holds `param_bytes / byte_scale` bytes and FSDP2 shards it over the k dp ranks like a
real stage's: it all-gathers it before the forward and again before the backward
(reshard_after_forward), and reduce-scatters its gradient after the stage's last backward of
the step, so the dp link carries the plan's bytes / byte_scale too. The stand-in is one FSDP
unit: its gathers run before its wait, not behind it, where a real stage of several blocks
prefetches the next block's gather during the current one's compute (the cost model's
max(compute, gathers)). So the loopback link carries the plan's bytes divided
by `byte_scale`: to compare with the simulator, give it a link whose bandwidth is the
loopback's times `byte_scale` and compute times times `time_scale` (`benchmarks/emulated.py`
does). The model output keeps its real shape (the loss needs it); its values are zeros, so
losses mean nothing here: step times do.

A stage with no floating input has no input half: its whole backward runs where the runtime
puts the weight half (W), as in a real run.

Host work: `Emulate(host="serial")` (the default) waits inside the stage, so the runtime's own
host work for an action (its Python, autograd's bookkeeping, the loss) runs before and after
the wait, as on a CPU device, whose compute is the host's. A GPU runs the host ahead of the
device: the runtime launches an action's kernels and goes on with its Python while the device
computes. `Emulate(host="overlapped")` stands for that: the stand-ins only add their time to
the rank's `DeviceTime`, and the executor, once an action's host work is done, calls its
`action_end`, here `DeviceTime.settle` (`graphpipe.runtime.factory`), which waits until the
action's device time has passed since the action began. An action then
takes max(its host work, its device time), not their sum. What is outside an action stays on
the host's path in both: posting and waiting for messages (a gloo message needs the host), the
step's collectives and the optimizer. Under a mesh the FSDP2 gathers of an emulated stage run
inside its action, so "overlapped" also overlaps them with its compute (the cost model's
max(compute, gathers)); "serial" runs them before the wait (see above).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan, weight_share
from graphpipe.runtime.stage import OUTPUT, StageIO

__all__ = [
    "HOST_MODES",
    "DeviceTime",
    "Emulate",
    "EmulatedStage",
    "emulated_specs",
    "wait_until",
]

Spec = tuple[tuple[int, ...], torch.dtype]
HOST_MODES = ("serial", "overlapped")
SPIN = 0.0003  # seconds before a wait's end when it stops sleeping and yields (`wait_until`)


@dataclass(frozen=True)
class Emulate:
    """Run with emulated devices (see the module docstring)."""

    time_scale: float = 1.0  # sleep this many times the plan's compute seconds
    byte_scale: float = 1.0  # values crossing stages and replicated weights shrink by this
    host: str = "serial"  # the runtime's host work beside compute, or overlapped with it

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and self.byte_scale > 0):
            raise ConfigError(
                f"Emulate needs time_scale > 0 and byte_scale > 0, got "
                f"time_scale={self.time_scale}, byte_scale={self.byte_scale}"
            )
        if self.host not in HOST_MODES:
            raise ConfigError(f"Emulate's host must be one of {HOST_MODES}, got {self.host!r}")


class DeviceTime:
    """One rank's emulated device time under `host="overlapped"`: the stand-ins add to it,
    and the executor waits it out at the end of each action."""

    def __init__(self) -> None:
        self.owed = 0.0  # device seconds of the current action

    def owe(self, seconds: float) -> None:
        """The current action keeps the device busy `seconds` more."""
        self.owed += seconds

    def settle(self, start: float) -> None:
        """Wait until the current action's device time has passed since `start` (a
        `perf_counter()` reading when the action began), and start the next action at 0."""
        deadline, self.owed = start + self.owed, 0.0
        wait_until(deadline)


def emulated_specs(specs: dict[str, Spec], emulate: Emulate) -> dict[str, Spec]:
    """The specs of values as they cross stages: flat, `round(numel / byte_scale)` elements."""
    out: dict[str, Spec] = {}
    for name, (shape, dtype) in specs.items():
        numel = 1
        for d in shape:
            numel *= d
        out[name] = ((max(1, round(numel / emulate.byte_scale)),), dtype)
    return out


def wait_until(deadline: float) -> None:
    """Wait until `perf_counter()` reaches `deadline` (at once if it has), to within
    microseconds: a device computes for its time exactly, but a sleep wakes 0.05 to 0.2 ms
    late (timer slack and wake-up, more on a loaded VM), and a rank's actions add that up.
    So it sleeps until `SPIN` seconds before, then yields the core until the deadline (each
    yield releases the GIL: the process's other threads run)."""
    left = deadline - time.perf_counter()
    if left > SPIN:
        time.sleep(left - SPIN)
    while time.perf_counter() < deadline:
        os.sched_yield()


def _made(specs: list[Spec], device: torch.device, unwritten: int) -> tuple[torch.Tensor, ...]:
    """Tensors of `specs`: the first `unwritten` uninitialised, the rest zeros."""
    return tuple(
        (torch.empty if i < unwritten else torch.zeros)(s, dtype=d, device=device)
        for i, (s, d) in enumerate(specs)
    )


class _Compute(torch.autograd.Function):
    """The forward makes the outputs within the forward's time; the backward makes the input
    gradients within the input half's."""

    @staticmethod
    def forward(ctx: Any, stage: EmulatedStage, *inputs: torch.Tensor) -> Any:
        start = time.perf_counter()
        ctx.stage = stage
        ctx.specs = [(x.shape, x.dtype, x.device) for x in inputs]
        outs = _made(stage.out_specs, stage.device, unwritten=len(stage.io.sent))
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        stage.spend(start, "F")
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        start = time.perf_counter()
        made = [  # unread by the stages that sent the inputs
            torch.empty(s, dtype=d, device=dev) if d.is_floating_point else None
            for s, d, dev in ctx.specs
        ]
        ctx.stage.spend(start, "I")
        return (None, *made)


class _WeightHalf(torch.autograd.Function):
    """A zero that depends on the weight: its backward sleeps the weight half."""

    @staticmethod
    def forward(ctx: Any, stage: EmulatedStage, weight: torch.Tensor) -> torch.Tensor:
        ctx.stage = stage
        ctx.weight = (weight.shape, weight.dtype, weight.device)  # unsharded under FSDP2
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        start = time.perf_counter()
        shape, dtype, device = ctx.weight
        made = torch.zeros(shape, dtype=dtype, device=device)
        ctx.stage.spend(start, "W")
        return None, made


class _Attach(torch.autograd.Function):
    """The outputs, unchanged (no copy), made to depend on the weight's zero: their
    gradients pass through, and the zero's gradient starts the weight half."""

    @staticmethod
    def forward(ctx: Any, zero: torch.Tensor, *outs: torch.Tensor) -> Any:
        ctx.zero = (zero.dtype, zero.device)
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        dtype, device = ctx.zero
        return (torch.zeros((), dtype=dtype, device=device), *grads)


class EmulatedStage(nn.Module):
    """Stands in for stage `index`'s module: same inputs, outputs of the sizes that cross.

    Args:
        gm: The traced graph (for the model output's structure).
        plan: The plan (the stage's times and parameter bytes).
        index: The stage.
        io: The real stage's inputs and outputs.
        specs: Real micro-batch shapes and dtypes of every value, by name.
        emulate: The scales.
        device: Where its tensors live.
        clock: The rank's device time under `host="overlapped"` (shared by its stages);
            None: each wait happens in the stage.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        plan: Plan,
        index: int,
        io: StageIO,
        specs: dict[str, Spec],
        emulate: Emulate,
        device: torch.device,
        clock: DeviceTime | None = None,
    ) -> None:
        super().__init__()
        self.clock = clock
        stage = plan.stages[index]
        share = weight_share(stage) if stage.param_bytes > 0 else 0.0
        total = stage.backward_time * emulate.time_scale
        has_inputs = any(specs[n][1].is_floating_point for n in io.received if n in specs)
        self.seconds = {
            "F": stage.forward_time * emulate.time_scale,
            "I": total * (1 - share) if has_inputs else 0.0,
            "W": total * share if has_inputs else total,
        }
        self.device, self.io = device, io
        sent = emulated_specs({n: specs[n] for n in io.sent}, emulate)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self._output_names: list[str] = []
        if io.has_output:
            fx.node.map_arg(output.args[0], lambda a: self._output_names.append(a.name))
        self.out_specs = [sent[n] for n in io.sent] + [specs[n] for n in self._output_names]
        self._output = output.args[0]
        self.weight_name = f"stage{index}"
        numel = max(1, round(stage.param_bytes / 4 / emulate.byte_scale))
        carried = stage.replicas > 1 or plan.cost_model.dims.dp > 1  # a link carries it
        numel = numel if carried else 1
        self.register_parameter(self.weight_name, nn.Parameter(torch.zeros(numel, device=device)))

    def spend(self, start: float, part: str) -> None:
        """Part `part` ("F", "I" or "W") began at `start`: wait until its time has passed,
        or add its time to the rank's device time (`host="overlapped"`)."""
        if self.clock is None:
            wait_until(start + self.seconds[part])
        else:
            self.clock.owe(self.seconds[part])

    def forward(self, *args: torch.Tensor) -> dict[str, Any]:
        """The sent values under their names, and the model output under OUTPUT."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        outs = list(_Compute.apply(self, *tensors))
        # getattr, not get_parameter: a versioned policy (stash, 2bw) swaps in a plain tensor
        zero = _WeightHalf.apply(self, getattr(self, self.weight_name))
        floating = [i for i, o in enumerate(outs) if o.is_floating_point()]
        if floating:
            attached = _Attach.apply(zero, *[outs[i] for i in floating])
            for i, o in zip(floating, attached, strict=True):
                outs[i] = o
        results: dict[str, Any] = dict(zip(self.io.sent, outs, strict=False))
        if self.io.has_output:
            made = dict(zip(self._output_names, outs[len(self.io.sent) :], strict=True))
            results[OUTPUT] = fx.node.map_arg(self._output, lambda a: made[a.name])
        return results
