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
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from graphpipe.errors import ConfigError
from graphpipe.runtime.batching import Inputs, cpu
from graphpipe.runtime.collectives import Collectives
from graphpipe.runtime.executor import LIVE_WEIGHTS, Batch, Executor
from graphpipe.runtime.mesh import reshard
from graphpipe.runtime.stage import OUTPUT
from graphpipe.runtime.stepping import Programs, weighted
from graphpipe.runtime.wiring import Wiring
from graphpipe.scheduling.generators import make_schedule

__all__ = ["Inference"]


class Inference:
    """The model's output or mean loss for one mini-batch, on every rank."""

    def __init__(
        self, w: Wiring, inputs: Inputs, programs: Programs, collectives: Collectives
    ) -> None:
        self.w, self.inputs, self.programs, self.collectives = w, inputs, programs, collectives

    def outputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The model's output for this mini-batch (see `PipelinedModel.__call__`).

        Each rank holding the last stage sends its outputs by (micro-batch j, dp slice d);
        under a mesh a dp rank holds slice d of every micro-batch (`Inputs._slices`) and
        its tp ranks hold the same values, so tp coordinate 0 sends them. The mini-batch's
        output is micro-batch 0's slices in order, then micro-batch 1's, ...: the rows as
        `step()` split them.
        """
        batch = self.inputs.batch(args, kwargs, None, first=0)
        run = self._forward_only(batch)
        mine: dict[tuple[int, int], Any] = {}
        layout = self.w.layout
        dp_index, tp_index = (0, 0) if layout is None else (layout.dp_index, layout.tp_index)
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
            merged[(j, d)] for j in range(self.w.spec.micro_batches) for d in range(self.w.dp)
        ]
        return tree_map(lambda *xs: torch.cat(xs), *pieces) if pieces else None

    def mean_loss(self, args: Sequence[Any], kwargs: dict[str, Any], target: Any) -> float:
        """The mean loss of this mini-batch (see `PipelinedModel.eval_step`).

        Raises:
            ConfigError: no target, or inputs of the wrong shape (before any communication).
        """
        if target is None:
            raise ConfigError(
                "eval_step() needs target=...: the loss is computed on the last stage"
            )
        batch = self.inputs.batch(args, kwargs, target, first=0)
        self.inputs.check_loss(target, batch)
        run = self._forward_only(batch)
        # every rank's losses of its dp slices: the mean over the whole mini-batch
        count = self.w.spec.micro_batches * self.w.loss_copies
        return self.collectives.mean_loss(*weighted(run, batch, count, self.w.loss_copies))

    def _forward_only(self, batch: Batch) -> Executor | None:
        """Run the forward schedule in eval mode with the live weights, outside the policy."""
        w = self.w
        if w.executor is None or w.module is None:
            return None
        run = Executor(  # the run's precision: its messages are sized in its dtype
            w.executor.stages,
            LIVE_WEIGHTS,
            w.executor.transport,
            w.executor.precision,
            device_time=w.executor.device_time,
        )
        run.training = False
        modes = [(m, m.training) for m in w.module.modules()]
        w.module.eval()
        try:
            forward = make_schedule(w.plan, "forward", w.spec.micro_batches)
            run.run(self.programs.lowered(forward, 0), batch)
        finally:
            for m, training in modes:
                m.training = training
            reshard(w.module)  # FSDP2 (a mesh) keeps a root gathered, awaiting a backward
        return run


def _whole(x: Any) -> Any:
    """A DTensor output (a tp stage's) as the whole tensor every tp rank agrees on."""
    return x.full_tensor() if isinstance(x, DTensor) else x
