"""PipelinedModel: one rank's part of a compiled pipeline, and the calls every rank makes.

`graphpipe.compile` builds it (see there for the semantics of step()). Every public method is
called on every rank: training, inference, state dicts, checkpoints and timelines all move
data between ranks. The class only delegates, one part per concern, each given the pieces
it reads (`graphpipe.runtime.pieces`: Place, Holdings, Update, Run) and nothing more:

    wiring.py     build the rank's pieces: stages, groups, hooks, policy, transport, executor
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
from graphpipe.runtime.pieces import Holdings, Place, Run
from graphpipe.runtime.shapes import Shapes
from graphpipe.runtime.spec import RunSpec, RuntimeConfig
from graphpipe.runtime.state import ModelState
from graphpipe.runtime.stepping import Programs, Stepper
from graphpipe.runtime.timelines import Recorder
from graphpipe.runtime.tp import for_dtensor
from graphpipe.runtime.weights import WeightPolicy
from graphpipe.runtime.wiring import wire
from graphpipe.tracing.annotate import is_meta, trace_info
from graphpipe.tracing.bind import micro_example

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
        pieces = wire(model, gm, example_inputs, plan, schedule, spec)
        place, held, update, run = pieces.place, pieces.holdings, pieces.update, pieces.run
        self._place, self._update, self._run = place, update, run
        self.plan, self.schedule, self.runtime, self.spec = plan, schedule, spec.runtime, spec
        self.rank, self.device, self.program = place.rank, place.device, run.program
        self.module, self.optimizer = held.module, update.optimizer
        self.policy: WeightPolicy | None = update.policy
        self._collectives = Collectives(place.device)
        shapes = _shapes(
            place, run, pieces.factory.fixed_shapes, gm, example_inputs, traced_on,
            model if exported else None, spec.runtime.compile_stages,
        )  # fmt: skip
        inputs = _inputs(place, run, held, gm, example_inputs, shapes, spec)
        programs = Programs(run, place.rank)
        self._recorder = Recorder(
            run, place, self._collectives, spec.runtime.timer, spec.runtime.record
        )
        self._stepper = Stepper(
            run, update.agree, place.loss_copies, inputs, programs, self._collectives,
            self._recorder,
            spec.runtime.plan_timeout if spec.runtime.compile_stages else None,
        )  # fmt: skip
        self._inference = Inference(run, place, held.module, inputs, programs, self._collectives)
        self._state = ModelState(
            place, held, update, plan, spec.micro_batches, self._stepper, self._collectives
        )

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
        scaler = self._update.scaler
        return 0 if scaler is None else scaler.skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The total gradient norm before clipping at the last update (max_grad_norm=)."""
        clipper = self._update.clipper
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
        return self._run.executor

    @property
    def _stage_indices(self) -> tuple[int, ...]:
        """This rank's stages."""
        return self._place.stage_indices


def _inputs(
    place: Place,
    run: Run,
    held: Holdings,
    gm: fx.GraphModule,
    example_inputs: tuple[torch.Tensor, ...],
    shapes: Shapes,
    spec: RunSpec,
) -> Inputs:
    """What checks and splits a call's inputs (`graphpipe.runtime.batching`): this rank's
    model inputs, its dp slice, and whether it holds the model output (its loss)."""
    stages = {} if run.executor is None else run.executor.stages
    has_output = any(r.io.has_output for r in stages.values())
    return Inputs(
        gm, example_inputs, held.model_inputs, spec.loss_fn, run.micro_batches, place.device,
        has_output, place.dp, place.layout.dp_index, shapes, spec.max_shapes, spec.input_split,
    )  # fmt: skip


def _shapes(
    place: Place,
    run: Run,
    fixed: str | None,
    gm: fx.GraphModule,
    example_inputs: tuple[torch.Tensor, ...],
    traced_on: torch.device,
    model: nn.Module | None,
    compile_stages: bool,
) -> Shapes:
    """The stages at every input shape a step brings (`graphpipe.runtime.shapes`).

    Args:
        place: This rank's place.
        run: Its run (the executor's stages, specs and precision).
        fixed: Why a step must bring the compiled shapes (the stage factory's); None: any.
        gm: The whole traced graph.
        example_inputs: The flat example inputs.
        traced_on: The device the graph was traced on.
        model: The model to export again; None: an fx-traced graph.
        compile_stages: torch.compile each new shape's stages.
    """
    executor = run.executor
    stages = {} if executor is None else executor.stages
    specs = next(iter(stages.values())).specs if stages else {}
    rows = run.plan.micro_batch_size // place.dp  # one dp rank's slice of a micro-batch
    meshed = place.layout.meshed
    tp = meshed and place.layout.tp_mesh is not None
    return Shapes(
        gm,
        run.plan,
        {i: r.module for i, r in stages.items()},
        tuple((tuple(x.shape), x.dtype) for x in micro_example(gm, example_inputs, rows)),
        specs,
        traced_on,
        place.device,
        (lambda d: d) if executor is None else executor.precision.spec_dtype,
        model,
        compile_stages,
        fixed,
        on_live=meshed,  # new shapes' graphs through the live stage's FSDP2 and tp hooks
        rewrite=for_dtensor if tp else None,
    )
