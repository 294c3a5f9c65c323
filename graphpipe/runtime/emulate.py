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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan, weight_share
from graphpipe.runtime.stage import OUTPUT, StageIO

__all__ = ["Emulate", "EmulatedStage", "emulated_specs"]

Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class Emulate:
    """Run with emulated devices (see the module docstring)."""

    time_scale: float = 1.0  # sleep this many times the plan's compute seconds
    byte_scale: float = 1.0  # values crossing stages and replicated weights shrink by this

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and self.byte_scale > 0):
            raise ConfigError(
                f"Emulate needs time_scale > 0 and byte_scale > 0, got "
                f"time_scale={self.time_scale}, byte_scale={self.byte_scale}"
            )


def emulated_specs(specs: dict[str, Spec], emulate: Emulate) -> dict[str, Spec]:
    """The specs of values as they cross stages: flat, `round(numel / byte_scale)` elements."""
    out: dict[str, Spec] = {}
    for name, (shape, dtype) in specs.items():
        numel = 1
        for d in shape:
            numel *= d
        out[name] = ((max(1, round(numel / emulate.byte_scale)),), dtype)
    return out


def _sleep_until(deadline: float) -> None:
    """Wait until `perf_counter()` reaches `deadline` (at once if it has)."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


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
        deadline = time.perf_counter() + stage.seconds["F"]
        ctx.stage = stage
        ctx.specs = [(x.shape, x.dtype, x.device) for x in inputs]
        outs = _made(stage.out_specs, stage.device, unwritten=len(stage.io.sent))
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        _sleep_until(deadline)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        deadline = time.perf_counter() + ctx.stage.seconds["I"]
        made = [  # unread by the stages that sent the inputs
            torch.empty(s, dtype=d, device=dev) if d.is_floating_point else None
            for s, d, dev in ctx.specs
        ]
        _sleep_until(deadline)
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
        deadline = time.perf_counter() + ctx.stage.seconds["W"]
        shape, dtype, device = ctx.weight
        made = torch.zeros(shape, dtype=dtype, device=device)
        _sleep_until(deadline)
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
    ) -> None:
        super().__init__()
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
        carried = stage.replicas > 1 or plan.cost_model.dp.degree > 1  # a link carries it
        numel = numel if carried else 1
        self.register_parameter(self.weight_name, nn.Parameter(torch.zeros(numel, device=device)))

    def forward(self, *args: torch.Tensor) -> dict[str, Any]:
        """The sent values under their names, and the model output under OUTPUT."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        outs = list(_Compute.apply(self, *tensors))
        zero = _WeightHalf.apply(self, self.get_parameter(self.weight_name))
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
