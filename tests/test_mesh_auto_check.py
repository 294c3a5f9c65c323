"""benchmarks.mesh --auto: the simulator's step of an emulated run, the one its measured step
is set against, scales every link a plan names, the dp link included."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import graphpipe
from benchmarks.mesh import emulated_step
from graphpipe.ir.cost import LinkModel
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.emulate import Emulate
from graphpipe.scheduling.simulate import simulate

TIME, BYTES = 8.0, 4.0  # the emulation's time_scale and byte_scale
LINK = LinkModel(bandwidth=1e9, latency=1e-5)  # the plan's link, in device time


@pytest.mark.parametrize("named", [False, True])
def test_the_emulated_run_s_step_is_the_plan_s_step_in_wall_seconds(named: bool) -> None:
    """A loopback whose bandwidth x byte_scale is the plan's link in wall time (its
    bandwidth / time_scale) and whose latency is the plan's x time_scale: the emulated
    run's simulated step is the plan's x time_scale, whether the dp link is the pp link
    (a hand mesh) or named apart (a mesh search's plan, `named`)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    plan = graphpipe.plan(
        model, torch.randn(64, 256), devices=4, dp=2, micro_batches=4, link=LINK,
        profile=ProfileConfig(mode="flops"), layouts=("one",),
    )  # fmt: skip
    if named:
        cost = plan.cost_model
        plan = replace(plan, cost_model=replace(cost, dp=replace(cost.dp, link=LINK)))
    assert plan.cost_model.dims.dp == 2
    loop = LinkModel(bandwidth=LINK.bandwidth / (TIME * BYTES), latency=LINK.latency * TIME)
    step = emulated_step(plan, Emulate(time_scale=TIME, byte_scale=BYTES), loop)
    assert step == pytest.approx(TIME * simulate(plan, plan.schedule).iteration_time, rel=1e-9)
