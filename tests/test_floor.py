"""The step floor (graphpipe.scheduling.floor): a lower bound on every flushed schedule's
simulated step, for one stage per device and chains folded loop or v, and one that sees the
pipeline's drain and the last micro-batch's return."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphpipe
from graphpipe.errors import ScheduleError
from graphpipe.planning.profile import ProfileConfig
from graphpipe.scheduling.floor import step_floor
from graphpipe.scheduling.simulate import simulate

FLOPS = ProfileConfig(mode="flops")
# the flushed schedules that run each layout (gpipe and zb2 besides the planner's picks)
FLUSHED = {
    "one": ("1f1b", "zb", "gpipe", "zb2"),
    "loop": ("interleaved", "interleaved_zb"),
    "v": ("zbv", "dualpipev"),
}


def _plan(devices: int, micro_batches: int, layout: str) -> graphpipe.Plan:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    return graphpipe.plan(
        model,
        torch.randn(256, 1024),
        devices=devices,
        micro_batches=micro_batches,
        profile=FLOPS,
        layouts=(layout,),
    )


@pytest.mark.parametrize("layout", list(FLUSHED))
@pytest.mark.parametrize(("devices", "micro_batches"), [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8)])
def test_the_floor_is_within_every_flushed_schedule_s_step(
    layout: str, devices: int, micro_batches: int
) -> None:
    plan = _plan(devices, micro_batches, layout)
    checked = 0
    for name in FLUSHED[layout]:
        try:
            step = simulate(plan, name).iteration_time
        except ScheduleError:
            continue  # the schedule's rule refuses the plan (e.g. dualpipev at M < 2N)
        assert step_floor(plan) <= step * (1 + 1e-9), name
        checked += 1
    assert checked >= 1


def test_the_floor_sees_the_drain_and_the_last_return() -> None:
    """2 micro-batches through the 4 stages planned on 8 devices: zb's step is stage 0's wait
    for the last micro-batch's gradients (each stage after it runs both forwards and both
    input halves of the backward, then the gradients come back through the I's and the
    transfers), then stage 0's backward and update. The floor is that step exactly; with
    the drain term but not the last return it was 0.7% under, with neither 4.2%."""
    plan = _plan(8, 2, "one")
    step = simulate(plan, "zb").iteration_time
    assert len(plan.stages) == 4
    assert step_floor(plan) == pytest.approx(step, rel=1e-9)
