"""PipelinedModel: one rank's part of a compiled pipeline, and the calls every rank makes.

`graphpipe.compile` builds it (see there for the semantics of step()). Every public method is
called on every rank: training, inference, state dicts, checkpoints and timelines all move
data between ranks. The class only delegates, one part per concern:

    wiring.py     build the rank's stages, groups, hooks, policy, transport and executor
    stepping.py   step() and drain(), and the program each call runs
    inference.py  eval_step() and __call__()
    state.py      state dicts, the policy's versions, what a checkpoint reads
    timelines.py  recording and gathering the actions' spans
    checkpoint.py save and load (DCP directories)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from graphpipe.ir import Plan, Schedule, Timeline
from graphpipe.runtime import checkpoint
from graphpipe.runtime.batching import Inputs
from graphpipe.runtime.collectives import Collectives
from graphpipe.runtime.executor import Executor
from graphpipe.runtime.inference import Inference
from graphpipe.runtime.refusals import refusal
from graphpipe.runtime.shapes import Shapes, signature_of
from graphpipe.runtime.spec import RunSpec, RuntimeConfig
from graphpipe.runtime.state import ModelState
from graphpipe.runtime.stepping import Programs, Stepper
from graphpipe.runtime.timelines import Recorder
from graphpipe.runtime.tp import for_dtensor
from graphpipe.runtime.weights import WeightPolicy
from graphpipe.runtime.wiring import Wiring, wire
from graphpipe.tracing.annotate import is_meta, trace_info

__all__ = ["PipelinedModel", "RuntimeConfig"]


class PipelinedModel:
    """A model whose stages run on the ranks of a process group (see `compile`).

    Args:
        model: The model as given (each rank keeps only its stages' parameters).
        gm: Its trace at the micro-batch size.
        example_inputs: The flat example inputs (one mini-batch).
        plan: The plan, the same on every rank.
        schedule: The schedule (the first call's for an asynchronous one).
        spec: The checked run specification.

    Attributes:
        plan: The Plan.
        schedule: The flushed schedule's actions (the first call's for async ones).
        rank: This process's rank.
        device: This rank's device.
        runtime: The RuntimeConfig.
        module: This rank's stage module (an nn.ModuleList of several); None without one.
        optimizer: This rank's optimizer, over its stage's parameters (create LR schedulers
            on it).
        policy: This rank's weight policy (None without a stage).
        program: The lowered schedule (the first call's for async ones).
    """

    def __init__(
        self,
        model: nn.Module,
        gm: fx.GraphModule,
        example_inputs: tuple[torch.Tensor, ...],
        plan: Plan,
        schedule: Schedule,
        spec: RunSpec,
    ) -> None:
        traced_on = torch.device("meta") if is_meta(gm) else example_inputs[0].device
        exported = trace_info(gm).method == "export"  # exported again at new shapes
        w = wire(model, gm, example_inputs, plan, schedule, spec)
        self._wiring = w
        self.plan, self.schedule, self.runtime, self.spec = plan, schedule, spec.runtime, spec
        self.rank, self.device, self.program = w.rank, w.device, w.program
        self.module, self.optimizer = w.module, w.optimizer
        self.policy: WeightPolicy | None = w.policy
        self._collectives = Collectives(w.device)
        has_output = w.executor is not None and any(
            r.io.has_output for r in w.executor.stages.values()
        )
        layout = w.layout
        inputs = Inputs(
            gm, example_inputs, w.model_inputs, spec.loss_fn, spec.micro_batches, w.device,
            has_output, w.dp, 0 if layout is None else layout.dp_index,
            _shapes(w, example_inputs, traced_on, model if exported else None), spec.max_shapes,
        )  # fmt: skip
        programs = Programs(w)
        self._recorder = Recorder(w, self._collectives)
        self._stepper = Stepper(w, inputs, programs, self._collectives, self._recorder)
        self._inference = Inference(w, inputs, programs, self._collectives)
        self._state = ModelState(w, self._stepper, self._collectives)

    # -- training -------------------------------------------------------------------------------

    def step(self, *inputs: torch.Tensor, target: Any = None, **kw_inputs: torch.Tensor) -> float:
        """One mini-batch: every micro-batch through the schedule, and the updates.

        Args:
            *inputs: The model's positional inputs: the example inputs' dtypes and number
                of dimensions, each dimension at most the example's (other sequence
                lengths, image sizes, batch sizes; `graphpipe.runtime.batching`).
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
        return self._stepper.step(inputs, kw_inputs, target)

    def drain(self) -> None:
        """Finish the backwards and updates an asynchronous pipeline still has in flight.

        The next step() starts with a new warm-up. Flushed schedules have nothing to drain.
        """
        self._stepper.drain()

    @property
    def steps_done(self) -> int:
        """step() calls so far (a checkpoint records and restores it)."""
        return self._stepper.steps_done

    @steps_done.setter
    def steps_done(self, steps: int) -> None:
        self._stepper.steps_done = steps

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale, the same on every rank (None without fp16)."""
        return self._state.loss_scale

    @property
    def skipped_steps(self) -> int:
        """Updates skipped because a gradient overflowed somewhere (fp16)."""
        scaler = self._wiring.scaler
        return 0 if scaler is None else scaler.skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The total gradient norm before clipping at the last update (max_grad_norm=)."""
        clipper = self._wiring.clipper
        return None if clipper is None or clipper.last is None else float(clipper.last)

    # -- inference ------------------------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor, **kw_inputs: torch.Tensor) -> Any:
        """Forward only, in eval mode: the model's output for this mini-batch, on every rank
        (see `eval_step`)."""
        return self._inference.outputs(inputs, kw_inputs)

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
        return self._inference.mean_loss(inputs, kw_inputs, target)

    # -- state and checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict under the original names, gathered on every rank.

        An asynchronous pipeline is drained first (`drain`), so the weights are the ones
        after every update of the micro-batches seen so far.
        """
        return self._state.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (e.g. the plain model's); each rank takes its stage's part.

        A tied weight is found under any of its names.

        Raises:
            ConfigError: names this stage needs that `state` lacks.
        """
        self._state.load_state_dict(state)

    def versions(self) -> dict[str, Any]:
        """This rank's weight bookkeeping: the copies it holds and, per micro-batch, the
        updates reflected in the weights its forward and its backward used."""
        return self._state.versions()

    def save(self, path: str | Path) -> Path:
        """Write a checkpoint directory (a collective: call it on every rank).

        Each rank writes its shard with torch.distributed.checkpoint, keyed by parameter
        name; the directory is replaced atomically, so a kill at any moment leaves the
        previous checkpoint loadable (`graphpipe.runtime.checkpoint`).
        """
        return checkpoint.save(self._state, path)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Resume from the checkpoint at `path`, made under this plan or another one (a
        collective). Returns its record: the plan, world size, policy and step it was
        saved at.

        Raises:
            ConfigError: no complete checkpoint there, another weight policy, or keys this
                rank's stages need that it lacks.
        """
        return checkpoint.load(self._state, path)

    # -- timelines ------------------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        """Whether every action's start and end are being recorded (see `timeline`)."""
        return self._recorder.recording

    @recording.setter
    def recording(self, on: bool) -> None:
        self._recorder.recording = on

    @property
    def comm_seconds(self) -> dict[str, float]:
        """While recording (host timer), this rank's seconds outside compute actions since
        the last cleared `timeline()`: "wait" for messages to arrive or sends to finish,
        "post" to issue them (local copies included)."""
        return self._recorder.comm_seconds

    def timeline(self, clear: bool = True) -> Timeline:
        """The actions every rank recorded (a collective: call it on every rank).

        With `RuntimeConfig.timer` "host" (CPU's default) a span is the action's host range
        on `time.perf_counter`'s clock; with "profiler" (CUDA's default) it comes from
        torch.profiler: the device range of the work the action launched, on the Unix-epoch
        clock (`graphpipe.runtime.profiling`).

        Args:
            clear: Forget the recorded actions afterwards.
        """
        return self._recorder.timeline(clear)

    # -- for tests and tools that look inside ---------------------------------------------------

    @property
    def _executor(self) -> Executor | None:
        """This rank's executor (None without a stage)."""
        return self._wiring.executor

    @property
    def _stage_indices(self) -> tuple[int, ...]:
        """This rank's stages."""
        return self._wiring.stage_indices


def _shapes(
    w: Wiring,
    example_inputs: tuple[torch.Tensor, ...],
    traced_on: torch.device,
    model: nn.Module | None,
) -> Shapes:
    """The stages at every input shape a step brings (`graphpipe.runtime.shapes`); `model`
    is the model to export again (None: an fx-traced graph)."""
    executor = w.executor
    stages = {} if executor is None else executor.stages
    specs = next(iter(stages.values())).specs if stages else {}
    rows = w.plan.micro_batch_size // w.dp  # one dp rank's slice of a micro-batch
    fixed = None
    if w.spec.runtime.emulate is not None:
        fixed = refusal("emulated-shapes", "emulate=")
    meshed = w.layout is not None and w.layout.sharded
    tp = meshed and w.layout is not None and w.layout.tp_mesh is not None
    return Shapes(
        w.gm,
        w.plan,
        {i: r.module for i, r in stages.items()},
        signature_of(example_inputs, rows),
        specs,
        traced_on,
        w.device,
        (lambda d: d) if executor is None else executor.precision.spec_dtype,
        model,
        w.spec.compile_stages,
        fixed,
        on_live=meshed,  # new shapes' graphs through the live stage's FSDP2 and tp hooks
        rewrite=for_dtensor if tp else None,
    )
