"""nan_check: stop a step at its first non-finite loss or gradient, on every rank, before the
update.

Only the rank that computes a loss, or holds a gradient, can see that it is not finite; the
others would train on, or wait for it. With `compile(..., nan_check=True)` each rank notes,
on the device and without reading anything back, the first problem it sees:

    loss      after the forward of micro-batch j on the stage that computes the loss
    gradient  after the backward of micro-batch j of a stage (B, or the zero-bubble W), for
              each of its parameters: gradients accumulate, so the first micro-batch whose
              backward leaves one non-finite is the one that made it so

Each problem is one int64 code ordered by (micro-batch, loss before gradient, later stage
first: a NaN flows backwards from where it starts, parameter), so the smallest code is the
first problem. At the update (an update hook of the policy, `graphpipe.runtime.hooks`, after
the gradient sums) every rank holding a stage all-reduces its smallest code with MIN, ranks
without a stage take part from step(); the one value is read once per step. Every rank then
knows the same problem: the optimizer step is skipped, the gradients dropped, and step() raises
the same PipelineError on every rank, after the step's usual loss all-reduce, so nobody is left
waiting. The names come from the stage modules every rank builds, so a rank can name another
rank's parameter.

Only a policy with one update per step on every rank at once (`PolicySpec.whole_step`:
flush, as for clipping, `graphpipe.runtime.clip`) can stop it; other policies are refused
(`check_nan_check`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.ir.registry import POLICIES, policy_spec
from graphpipe.runtime.failures import guarded

__all__ = ["NanCheck", "check_nan_check"]
NONE = torch.iinfo(torch.int64).max  # "no problem": the largest code
LOSS, GRAD = 0, 1
LOSS_KINDS = ("nan", "inf", "-inf")


def check_nan_check(on: bool, weights: str) -> None:
    """Refuse nan_check with a policy that has no one update per step.

    Raises:
        ConfigError: naming the policy (an unknown one too).
    """
    if on and not policy_spec(weights).whole_step:
        whole = sorted(name for name, spec in POLICIES.items() if spec.whole_step)
        raise ConfigError(
            f"nan_check=True stops the one update of a step on every rank; weights={weights!r} "
            f"updates the stages at different times (use weights in {whole})"
        )


class NanCheck:
    """The first non-finite loss or gradient of a step, agreed on by every rank.

    Args:
        names: Per stage index, its parameters' names, in the order of the stage module's
            `named_parameters()` (equal on every rank).
        micro_batches: M.
        device: This rank's device, where the codes are kept.
        group: The process group every rank of the pipeline is in (None: the default one).
    """

    def __init__(
        self,
        names: Sequence[Sequence[str]],
        micro_batches: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.names = [list(n) for n in names]
        self.width = max([len(LOSS_KINDS), *(len(n) for n in self.names)])
        self.m, self.device, self.group = micro_batches, device, group
        self._found: torch.Tensor | None = None

    def _code(self, j: int, kind: int, stage: int) -> int:
        """The code of slot 0 of a problem; add the parameter index (or the loss's kind)."""
        return ((j * 2 + kind) * len(self.names) + len(self.names) - 1 - stage) * self.width

    def _keep(self, code: torch.Tensor) -> None:
        self._found = code if self._found is None else torch.minimum(self._found, code)

    def saw_loss(self, stage: int, j: int, loss: torch.Tensor) -> None:
        """Note micro-batch j's loss (a scalar), computed on `stage`."""
        loss = loss.detach()
        kind = torch.where(loss.isnan(), 0, torch.where(loss > 0, 1, 2))
        code = torch.where(loss.isfinite(), NONE, self._code(j, LOSS, stage) + kind)
        self._keep(code.to(torch.int64))

    def saw_grads(self, stage: int, j: int, module: nn.Module) -> None:
        """Note the gradients of `stage`'s parameters after micro-batch j's backward."""
        slots = [
            (i, p.grad) for i, (_, p) in enumerate(module.named_parameters()) if p.grad is not None
        ]
        if not slots:
            return
        finite = torch.stack([g.detach().isfinite().all() for _, g in slots])
        base = self._code(j, GRAD, stage)
        codes = torch.tensor([base + i for i, _ in slots], dtype=torch.int64, device=finite.device)
        self._keep(torch.where(finite, NONE, codes).min())

    def agree(self) -> str | None:
        """The step's first problem on any rank, the same text on every rank (a collective:
        one all-reduce and one read to the host); None when every value was finite. Forgets
        what was noted."""
        local = torch.full((1,), NONE, dtype=torch.int64, device=self.device)
        if self._found is not None:
            local = torch.minimum(local, self._found.to(self.device).reshape(1))
        self._found = None
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        guarded(
            "the all-reduce of nan_check's first problem",
            functools.partial(dist.all_reduce, local, op=dist.ReduceOp.MIN, group=self.group),
            ranks,
        )
        code = int(local.item())
        return None if code == NONE else self.describe(code)

    def describe(self, code: int) -> str:
        """The PipelineError text of a problem's code."""
        rest, slot = divmod(code, self.width)
        rest, back = divmod(rest, len(self.names))
        j, kind = divmod(rest, 2)
        stage = len(self.names) - 1 - back
        what = (
            f"loss {LOSS_KINDS[slot]}" if kind == LOSS else f"gradient of {self.names[stage][slot]}"
        )
        return (
            f"non-finite {what} at stage {stage}, micro-batch {j} (nan_check): the optimizer "
            "step was skipped on every rank and the gradients dropped"
        )
