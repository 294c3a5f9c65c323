"""Inference: forward-only calls in eval mode, outside the weight policy.

The micro-batches run through the stages with the live weights, without gradients, with
every module in eval mode (dropout off, BatchNorm on its running statistics) and back in its
own mode afterwards. Parameters, gradients, optimizer state and the policy's versions are
left as they were, under every policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from graphpipe._torch import tree_map
from graphpipe.errors import ConfigError
from graphpipe.runtime.batching import Inputs, cpu
from graphpipe.runtime.collectives import Collectives
from graphpipe.runtime.executor import LIVE_WEIGHTS, Batch, Executor
from graphpipe.runtime.mesh import reshard
from graphpipe.runtime.pieces import Place, Run
from graphpipe.runtime.stage import OUTPUT
from graphpipe.runtime.stepping import Programs, weighted
from graphpipe.scheduling.generators import make_schedule

__all__ = ["Inference"]


class Inference:
    """The model's output or mean loss for one mini-batch, on every rank.

    Args:
        run: The rank's run (its executor's stages, transport and precision; plan and M).
        place: The rank's place (its dp and tp coordinates).
        module: The rank's stage module (put in eval mode); None without a stage.
        inputs: Checks and splits a call's inputs.
        programs: The lowered forward schedule.
        collectives: Gathers the outputs, the mean loss.
    """

    def __init__(
        self,
        run: Run,
        place: Place,
        module: nn.Module | None,
        inputs: Inputs,
        programs: Programs,
        collectives: Collectives,
    ) -> None:
        self.run, self.place, self.module = run, place, module
        self.inputs, self.programs, self.collectives = inputs, programs, collectives

    def outputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The model's output for this mini-batch (see `PipelinedModel.__call__`).

        Each rank holding the last stage sends its outputs by (micro-batch j, dp slice d);
        under a mesh a dp rank holds slice d of every micro-batch (`Inputs._slices`) and
        its tp ranks hold the same values, so tp coordinate 0 sends them. The mini-batch's
        output is micro-batch 0's slices in order, then micro-batch 1's, ...: the rows as
        `step()` split them.
        """
        batch = self.inputs.batch(args, kwargs, None, first=0, outputs=True)
        run = self._forward_only(batch)
        mine: dict[tuple[int, int], Any] = {}
        layout = self.place.layout
        dp_index, tp_index = layout.dp_index, layout.tp_index
        if run is not None:
            mine = {
                (j, dp_index): tree_map(_whole, mb.outputs[OUTPUT])
                for (_, j), mb in run.state.items()
                if OUTPUT in mb.outputs
            }
        sent = tree_map(cpu, mine) if tp_index == 0 else {}
        gathered = self.collectives.gather(sent, "the outputs")
        merged = {key: out for part in gathered for key, out in part.items()}
        pieces = [
            merged[(j, d)] for j in range(self.run.micro_batches) for d in range(self.place.dp)
        ]
        return tree_map(lambda *xs: torch.cat(xs), *pieces) if pieces else None

    def mean_loss(self, args: Sequence[Any], kwargs: dict[str, Any], target: Any) -> float:
        """The mean loss of this mini-batch (see `PipelinedModel.eval_step`).

        Raises:
            ConfigError: no target, or inputs of the wrong shape (before any communication).
        """
        if target is None and self.inputs.needs_target:
            raise ConfigError(
                "eval_step() needs target=...: the loss is computed on the last stage (a "
                "loss_fn of the output alone, lambda out: out.loss, needs none)"
            )
        batch = self.inputs.batch(args, kwargs, target, first=0)
        self.inputs.check_loss(target, batch)
        run = self._forward_only(batch)
        # every rank's losses of its dp slices: the mean over the whole mini-batch
        copies = self.place.loss_copies
        count = self.run.micro_batches * copies
        return self.collectives.mean_loss(*weighted(run, batch, count, copies))

    def _forward_only(self, batch: Batch) -> Executor | None:
        """Run the forward schedule in eval mode with the live weights, outside the policy."""
        executor, module = self.run.executor, self.module
        if executor is None or module is None:
            return None
        run = Executor(  # the run's precision: its messages are sized in its dtype
            executor.stages,
            LIVE_WEIGHTS,
            executor.transport,
            executor.precision,
            action_end=executor.action_end,
        )
        run.training = False
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        try:
            forward = make_schedule(self.run.plan, "forward", self.run.micro_batches)
            run.run(self.programs.lowered(forward, 0), batch)
        finally:
            for m, training in modes:
                m.training = training
            reshard(module)  # FSDP2 (a mesh) keeps a root gathered, awaiting a backward
        return run


def _whole(x: Any) -> Any:
    """A DTensor output (a tp stage's) as the whole tensor every tp rank agrees on."""
    return x.full_tensor() if isinstance(x, DTensor) else x
