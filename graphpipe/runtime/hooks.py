"""Update hooks: what runs between the gradient sums and the optimizer step.

A `WeightPolicy` is built with an ordered list of them (`make_policy(..., hooks=...)`) and
runs them before every step until one returns False, which skips the step on every rank
(each hook's decision is agreed by a collective) and drops the gradients. `hooks_for` gives
them in their one correct order:

    Unscale      fp16: divide the gradients by the loss scale; an overflow anywhere skips
    AgreeFinite  nan_check: every rank agrees on the first non-finite loss or gradient
    Clip         max_grad_norm: clip the whole model's gradient norm

Unscaling comes first because the NaN check and the norm must see true gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphpipe.runtime.clip import GradClipper
from graphpipe.runtime.nancheck import NanCheck
from graphpipe.runtime.precision import LossScaler
from graphpipe.runtime.weights import UpdateHook

__all__ = ["AgreeFinite", "Clip", "Unscale", "hooks_for"]


@dataclass
class Unscale:
    """fp16: unscale the gradients and move the loss scale; False on an overflow anywhere."""

    scaler: LossScaler
    params: list[nn.Parameter]  # this rank's parameters, each once
    device: torch.device

    def __call__(self) -> bool:
        finite = self.scaler.unscale(self.params, self.device)
        self.scaler.update(finite)
        return finite


@dataclass
class AgreeFinite:
    """nan_check: every rank agrees on the step's first non-finite value (a collective).

    `problem` keeps what was found, for step() to raise once the run is over; step() clears
    it before each run.
    """

    check: NanCheck
    problem: str | None = None

    def __call__(self) -> bool:
        self.problem = self.check.agree()
        return self.problem is None


@dataclass
class Clip:
    """max_grad_norm: clip the gradients by the norm over every stage (never skips)."""

    clipper: GradClipper
    device: torch.device

    def __call__(self) -> bool:
        self.clipper(self.device)
        return True


def hooks_for(
    unscale: Unscale | None, agree: AgreeFinite | None, clip: Clip | None
) -> list[UpdateHook]:
    """The hooks in use, in the order they must run: unscale, agree, clip."""
    return [h for h in (unscale, agree, clip) if h is not None]
