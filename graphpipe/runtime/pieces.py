"""WiredRank: one rank's built pipeline, by concern, as `graphpipe.runtime.wiring.wire` returns it.

Each part of a PipelinedModel is given the pieces it reads, not the whole:

    Place     rank, device, stages, mesh layout   every part
    Holdings  the stage module and the model's    state (state dicts, checkpoints), inference
              names for its tensors
    Update    optimizer, weight policy, fp16's    state, stepping (nan_check's agreement),
              scaler, nan_check, clipping         the pipeline's counters
    Run       plan, schedule, lowered program,    stepping, inference, timelines
              executor

`WiredRank` is what `wire` hands the pipeline, which hands each piece on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphpipe.ir import Plan, Schedule
from graphpipe.ir.program import Program
from graphpipe.ir.registry import schedule_spec
from graphpipe.runtime.clip import GradClipper
from graphpipe.runtime.executor import Executor
from graphpipe.runtime.factory import StageFactory
from graphpipe.runtime.hooks import AgreeFinite
from graphpipe.runtime.mesh import ParallelLayout
from graphpipe.runtime.precision import LossScaler
from graphpipe.runtime.weights import WeightPolicy

__all__ = ["Holdings", "Place", "Run", "Update", "WiredRank"]


@dataclass(frozen=True)
class Place:
    """Where this rank sits: its plan device, torch device, stages and mesh coordinates."""

    rank: int  # the plan's device (the pp coordinate under a mesh)
    device: torch.device
    stage_indices: tuple[int, ...]  # this rank's stages; () for an idle rank
    layout: ParallelLayout  # pp, dp and tp coordinates (the identity layout without a mesh)

    @property
    def dp(self) -> int:
        """Data-parallel slices of each micro-batch (a mesh's dp size; 1 without one)."""
        return self.layout.dp

    @property
    def loss_copies(self) -> int:
        """Ranks holding each micro-batch slice's loss: its dp slices times the tp ranks
        that each compute the same loss (a sum of the losses over every rank counts each
        micro-batch's this many times, as a share of its mean)."""
        return self.layout.dp * self.layout.tp


@dataclass(frozen=True)
class Holdings:
    """This rank's stage module, and the model's names for the tensors it holds."""

    module: nn.Module | None  # this rank's stage module (a ModuleList of several); None: idle
    names: tuple[str, ...]  # the model's state dict keys, in its order
    aliases: dict[int, list[str]]  # id of each tensor -> every name of it (tied ones too)
    orphans: dict[str, torch.Tensor]  # parameters and buffers no stage holds, on the CPU
    model_inputs: tuple[str, ...]  # the model inputs this rank's stages read

    @property
    def canonical(self) -> dict[str, str]:
        """Every name of every tensor of the model -> its first name."""
        return {n: names[0] for names in self.aliases.values() for n in names}


@dataclass(frozen=True)
class Update:
    """How this rank's weights change: the optimizer, the policy and its hooks' state."""

    weights: str  # the weight policy's name ("flush", "stash", ...)
    optimizer: torch.optim.Optimizer  # over this rank's parameters (a placeholder when idle)
    policy: WeightPolicy | None  # None without a stage
    scaler: LossScaler | None = None  # fp16's loss scale
    agree: AgreeFinite | None = None  # nan_check's agreement (also run by an idle rank)
    clipper: GradClipper | None = None  # max_grad_norm's clipping


@dataclass(frozen=True)
class Run:
    """What this rank runs each call: the schedule, lowered, and the executor."""

    plan: Plan
    schedule: Schedule  # the first call's, for an asynchronous one
    micro_batches: int  # M: micro-batches per step() call
    program: Program  # the lowered schedule (the first call's, for an asynchronous one)
    prefetch: bool  # every receive of a call is posted first
    executor: Executor | None  # None without a stage

    @property
    def asynchronous(self) -> bool:
        """The schedule keeps micro-batches in flight across step() calls (async, 2bw)."""
        return schedule_spec(self.schedule.name).asynchronous


@dataclass(frozen=True)
class WiredRank:
    """Everything `wire` built for this rank, and the stage factory it built with."""

    place: Place
    holdings: Holdings
    update: Update
    run: Run
    factory: StageFactory  # real stages or stand-ins (`graphpipe.runtime.factory`)
