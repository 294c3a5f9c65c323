"""Stage factories: real stages or emulated stand-ins, chosen once per run.

`stage_factory(RuntimeConfig.emulate)` is the one place a run decides whether its stages
compute. Wiring builds every stage through the factory it returns, and the pipeline and the
executor read what the factory says, never the `emulate` option itself:

    factory.build(...)        this rank's stage modules and the specs of what crosses stages
    factory.materialize(...)  a meta model's tensors for one stage (stand-ins own theirs)
    factory.retarget(...)     the device constants of a stage's graph made the rank's
    factory.action_end        what the executor calls as each action's host work ends
    factory.fixed_shapes      why a step must bring the compiled shapes (None: any shapes)

`RealStages` are the stage modules carved from the trace. `EmulatedStages` swaps each for an
`EmulatedStage` that waits out the plan's times (`graphpipe.runtime.emulate`); under
`Emulate(host="overlapped")` this rank's stand-ins share one `DeviceTime`, which the
executor settles at each action's end.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import fx, nn

from graphpipe.ir import Plan
from graphpipe.runtime.emulate import DeviceTime, Emulate, EmulatedStage, emulated_specs
from graphpipe.runtime.executor import host_only
from graphpipe.runtime.groups import Modules
from graphpipe.runtime.materialize import InitFn, materialize
from graphpipe.runtime.refusals import refusal
from graphpipe.runtime.stage import Specs, arrive_as_traced, retarget

__all__ = ["EmulatedStages", "RealStages", "StageFactory", "stage_factory"]


class StageFactory(Protocol):
    """How a run realises its stages: real modules or stand-ins (see the module docstring).

    Attributes:
        action_end: Called by the executor with an action's start once its host work is
            done (`Executor`'s `action_end`).
        fixed_shapes: Why every step must bring the compiled shapes; None: any shapes.
    """

    action_end: Callable[[float], None]
    fixed_shapes: str | None

    def build(
        self,
        gm: fx.GraphModule,
        plan: Plan,
        carved: Modules,
        mine: tuple[int, ...],
        device: torch.device,
        shapes: Callable[[], Specs],
        cast_back: bool,
    ) -> tuple[Modules, Specs]:
        """Every stage's module and the micro-batch specs of the values crossing stages.

        Args:
            gm: The whole traced graph.
            plan: The plan.
            carved: Every stage's module carved from the trace, and its StageIO.
            mine: This rank's stages.
            device: This rank's device.
            shapes: Computes every value's micro-batch shape and dtype (a fake run).
            cast_back: Values a stage receives are cast back to their traced dtype (an
                exported graph under bf16 or fp16: `arrive_as_traced`).
        """
        ...

    def materialize(
        self,
        model: nn.Module,
        module: nn.Module,
        device: torch.device,
        init: InitFn | None,
        checkpoint: str | Path | None,
    ) -> list[str]:
        """Give stage `module` real storage for the meta tensors it reads; their names."""
        ...

    def retarget(self, module: nn.Module, device: torch.device) -> None:
        """Make the devices written into the stage's graph `device`."""
        ...


class RealStages:
    """The stage modules carved from the trace, computing the model's arithmetic."""

    def __init__(self) -> None:
        self.action_end: Callable[[float], None] = host_only  # the host's work is the action
        self.fixed_shapes: str | None = None  # a step's shapes get stages of their own

    def build(
        self,
        gm: fx.GraphModule,
        plan: Plan,
        carved: Modules,
        mine: tuple[int, ...],
        device: torch.device,
        shapes: Callable[[], Specs],
        cast_back: bool,
    ) -> tuple[Modules, Specs]:
        """The carved modules; the specs only where this rank has stages (see
        `StageFactory.build`)."""
        specs = shapes() if mine else {}
        if cast_back:
            traced = {name: dtype for name, (_, dtype) in specs.items()}
            for i in mine:  # its graph asserts the traced dtypes: values arrive in them
                arrive_as_traced(*carved[i], traced)
        return carved, specs

    def materialize(
        self,
        model: nn.Module,
        module: nn.Module,
        device: torch.device,
        init: InitFn | None,
        checkpoint: str | Path | None,
    ) -> list[str]:
        """`graphpipe.runtime.materialize.materialize`."""
        return materialize(model, module, device, init, checkpoint)

    def retarget(self, module: nn.Module, device: torch.device) -> None:
        """`graphpipe.runtime.stage.retarget` (a real stage is a GraphModule)."""
        retarget(cast(fx.GraphModule, module), device)


class EmulatedStages:
    """Stand-ins that wait out the plan's times (`graphpipe.runtime.emulate`).

    Args:
        emulate: The scales and the host mode.
    """

    def __init__(self, emulate: Emulate) -> None:
        self.emulate = emulate
        # a stand-in waits the plan's times, which are the compiled shape's
        self.fixed_shapes: str | None = refusal("emulated-shapes", "emulate=")
        # under host="overlapped" this rank's stand-ins share one device time
        self.clock = DeviceTime() if emulate.host == "overlapped" else None
        self.action_end: Callable[[float], None] = (
            host_only if self.clock is None else self.clock.settle
        )

    def build(
        self,
        gm: fx.GraphModule,
        plan: Plan,
        carved: Modules,
        mine: tuple[int, ...],
        device: torch.device,
        shapes: Callable[[], Specs],
        cast_back: bool,
    ) -> tuple[Modules, Specs]:
        """Every stage's stand-in, other ranks' on meta (an emulated rank with no stage
        still builds them all), and the specs: those of values that cross stages as they
        cross (flat, scaled by byte_scale), the others (the model output's, which the loss
        reads) as they are. Stand-ins read no received value, so `cast_back` changes
        nothing."""
        specs = shapes()
        meta = torch.device("meta")
        stand_ins: Modules = {
            i: (
                EmulatedStage(
                    gm,
                    plan,
                    i,
                    io,
                    specs,
                    self.emulate,
                    *((device, self.clock) if i in mine else (meta, None)),
                ),
                io,
            )
            for i, (_, io) in carved.items()
        }
        crossing = {name for _, io in carved.values() for name in io.sent}
        flat = emulated_specs({n: s for n, s in specs.items() if n in crossing}, self.emulate)
        return stand_ins, {**specs, **flat}

    def materialize(
        self,
        model: nn.Module,
        module: nn.Module,
        device: torch.device,
        init: InitFn | None,
        checkpoint: str | Path | None,
    ) -> list[str]:
        """Nothing: a stand-in's weight is its own, made on the device."""
        return []

    def retarget(self, module: nn.Module, device: torch.device) -> None:
        """Nothing: a stand-in has no graph."""


def stage_factory(emulate: Emulate | None) -> StageFactory:
    """The run's stage factory: real stages, or stand-ins under `RuntimeConfig.emulate`."""
    return RealStages() if emulate is None else EmulatedStages(emulate)
