"""Emulated devices: the real runtime with each stage's compute replaced by a wait.

The step time of an emulated 2-stage chain must reach the schedule's analytic value, the
same number the simulator gives for the plan's times (zb, whose weight halves fill the
bubble: the simulator's value), and stay under the time its stages take one after another.
The emulation waits, so a step never comes in under its simulated time, whatever the load;
host overhead comes on top, a few ms per step on an idle machine and more on a loaded one,
so the upper bound is what a step without the pipeline's overlap would take (`_serial`), not
a tight margin. The plan has a third device with no stage, as the fair protocol's plans often
do: that rank runs along idle.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.planning.partition import plan
from graphpipe.runtime import emulate as emulation
from graphpipe.runtime.emulate import DeviceTime, Emulate, emulated_specs
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.simulate import simulate

M, F, B, SCALE = 4, 0.004, 0.008, 10.0  # per-stage seconds before scaling (40 and 80 ms after)


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)), torch.randn(16, 32)


def _timed_plan() -> Plan:
    model, x = _model()
    p = plan(model, x, devices=3, micro_batches=M, pins={"0": 0, "1": 0, "2": 1})
    assert len(p.stages) == 2 and p.num_devices == 3
    stages = tuple(dataclasses.replace(s, forward_time=F, backward_time=B) for s in p.stages)
    return dataclasses.replace(p, stages=stages)


def _serial(the_plan: Plan, scale: float) -> float:
    """Seconds of a step whose stages ran one after another (every stage's M forwards and
    backwards, no overlap): the bound a pipelined step stays under, however loaded the host."""
    return sum(M * (s.forward_time + s.backward_time) for s in the_plan.stages) * scale


def _emulated_steps(schedules: list[str], the_plan: Plan) -> dict[str, float]:
    return {s: _seconds_per_step(s, the_plan) for s in schedules}


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _timed(
    the_plan: Plan, emulate: Emulate, steps: int = 3, record: bool = False, **options: Any
) -> tuple[float, Any]:
    """Seconds per step of the emulated model after one warm-up step, and the model
    (recording its actions' spans if `record`)."""
    model, x = _model()
    pm = gp_compile(
        model,
        x,
        loss_fn=options.pop("loss_fn", _mse),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        plan=the_plan,
        runtime=RuntimeConfig(timeout=60, emulate=emulate, record=record),
        **options,
    )
    pm.step(x, target=x)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        pm.step(x, target=x)
    return (time.perf_counter() - start) / steps, pm


def _seconds_per_step(schedule: str, the_plan: Plan) -> float:
    return _timed(the_plan, Emulate(time_scale=SCALE, byte_scale=4), schedule=schedule)[0]


def test_an_emulated_two_stage_chain_steps_in_its_analytic_time() -> None:
    the_plan, schedules = _timed_plan(), ["1f1b", "gpipe", "zb"]
    analytic = (M + 2 - 1) * (F + B) * SCALE  # 1f1b and gpipe, two equal stages
    expected = {}
    for schedule in schedules:
        sim = simulate(the_plan, make_schedule(the_plan, schedule, M)).iteration_time * SCALE
        expected[schedule] = sim
        if schedule != "zb":  # zb's split backward: the simulator's own value
            assert sim == pytest.approx(analytic, rel=0.01)  # the link is negligible here
    assert expected["zb"] < analytic * 0.95  # the weight halves fill the bubble
    serial = _serial(the_plan, SCALE)  # 960 ms, 1.6 x the analytic 600
    for rank in launch(_emulated_steps, 3, args=(schedules, the_plan), timeout=240)[:2]:
        for schedule, seconds in rank.items():
            sim = expected[schedule]
            assert sim * 0.99 <= seconds < serial, (schedule, seconds, sim, serial)


def test_emulated_values_scale_by_the_byte_scale_and_bad_scales_are_refused() -> None:
    specs = {"h": ((4, 32), torch.float32), "ids": ((4,), torch.int64)}
    assert emulated_specs(specs, Emulate(byte_scale=16)) == {
        "h": ((8,), torch.float32),
        "ids": ((1,), torch.int64),
    }
    assert emulated_specs(specs, Emulate(byte_scale=0.5)) == {  # a slower link stood for
        "h": ((256,), torch.float32),
        "ids": ((8,), torch.int64),
    }
    with pytest.raises(ConfigError, match="time_scale=0"):
        Emulate(time_scale=0)
    with pytest.raises(ConfigError, match="byte_scale=-1"):
        Emulate(byte_scale=-1)
    with pytest.raises(ConfigError, match="'async'"):
        Emulate(host="async")


# -- host work: beside the compute, or overlapped with it -------------------------------------


def test_device_time_is_waited_out_from_the_actions_start_so_host_work_within_it_is_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait ends at the action's start plus its device time, whatever host work ran
    inside it: max(host, device), not their sum. The deadlines are what settle asks for."""
    deadlines: list[float] = []
    monkeypatch.setattr(emulation, "wait_until", deadlines.append)
    clock = DeviceTime()
    clock.owe(0.03)
    clock.owe(0.02)  # the action's parts add up
    clock.settle(10.0)  # an action that began at 10 s
    clock.settle(20.0)  # settled: the next action owes nothing yet
    clock.owe(0.01)
    clock.settle(30.0)
    assert deadlines == pytest.approx([10.05, 20.0, 30.01])


def test_wait_until_ends_at_its_deadline_sleeping_all_but_the_last_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never early (a clock only runs late on a loaded machine, so this holds under load),
    and the wait sleeps, not spins: this thread's CPU time stays far under the 100 ms waited
    (the spin is the last SPIN = 0.3 ms). At once, with no sleep, past the deadline."""
    cpu = time.thread_time()
    deadline = time.perf_counter() + 0.1
    emulation.wait_until(deadline)
    assert time.perf_counter() >= deadline
    assert time.thread_time() - cpu < 0.05, "spun instead of sleeping"
    slept: list[float] = []
    monkeypatch.setattr(emulation.time, "sleep", slept.append)
    emulation.wait_until(time.perf_counter() - 1.0)  # an action whose device time has passed
    assert slept == []


HOST_WORK = 0.02  # seconds of host work in the loss of every micro-batch (an F on stage 1)


def _slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    time.sleep(HOST_WORK)
    return ((out - target) ** 2).mean()


def _steps_by_host(the_plan: Plan) -> dict[str, tuple[float, list[float]]]:
    """For each host mode: seconds per 1f1b step with host work in every loss, and the
    seconds of each of the last stage's forwards (the loss runs in them)."""
    out = {}
    for host in ("serial", "overlapped"):
        emulate = Emulate(time_scale=SCALE, host=host)
        seconds, pm = _timed(the_plan, emulate, schedule="1f1b", loss_fn=_slow_loss, record=True)
        spans = pm.timeline().spans  # every rank's (a collective)
        out[host] = (seconds, [s.end - s.start for s in spans if s.action.startswith("1F")])
    return out


def test_overlapped_host_work_hides_inside_the_compute_and_serial_adds_to_it() -> None:
    """The last stage's loss sleeps 20 ms per micro-batch, within its 40 ms forward: serial
    emulation adds it to the forward (60 ms), overlapped emulation hides it (40 ms).

    Load only lengthens an action, so the lower bounds hold on any machine; that the host
    work hides is an ordering: the quickest of the 16 overlapped forwards ends before host
    work and compute one after another could (every serial forward's floor)."""
    the_plan = _timed_plan()
    sim = simulate(the_plan, make_schedule(the_plan, "1f1b", M)).iteration_time * SCALE
    device = F * SCALE  # each forward's device time
    (serial, serial_forwards), (overlapped, forwards) = launch(
        _steps_by_host, 3, args=(the_plan,), timeout=240
    )[0].values()
    assert len(forwards) == len(serial_forwards) == 4 * M  # warm-up and 3 steps
    assert min(serial_forwards) >= (device + HOST_WORK) * 0.99, serial_forwards
    assert min(forwards) >= device * 0.99, forwards  # the device time is waited out
    assert min(forwards) < device + HOST_WORK, forwards  # with the host work inside it
    assert serial >= sim + M * HOST_WORK * 0.99  # on 1f1b's critical path, M times a step
    assert overlapped >= sim * 0.99


# -- under a mesh: pp2 x dp2 ------------------------------------------------------------------


MESH_SCALE = 30.0  # FSDP2's hooks and gloo's collectives are host work: longer waits dwarf it


def _mesh_plan() -> Plan:
    model, x = _model()
    p = plan(model, x, devices=4, dp=2, micro_batches=M, pins={"0": 0, "1": 0, "2": 1})
    assert len(p.stages) == 2 and p.num_devices == 2 and p.cost_model.dims.dp == 2
    stages = tuple(
        dataclasses.replace(s, forward_time=F, backward_time=B, param_bytes=4e5) for s in p.stages
    )
    return dataclasses.replace(p, stages=stages)


def _mesh_step(the_plan: Plan, host: str) -> tuple[float, int, int]:
    """Seconds per step, and the stand-in weight's local and whole element counts."""
    emulate = Emulate(time_scale=MESH_SCALE, byte_scale=4, host=host)
    seconds, pm = _timed(the_plan, emulate, schedule="1f1b", dp=2)
    (weight,) = pm.module.parameters()
    return seconds, weight.to_local().numel(), weight.numel()


@pytest.mark.parametrize("host", ["serial", "overlapped"])
def test_emulated_stages_under_a_mesh_shard_their_weight_and_step_in_the_simulated_time(
    host: str,
) -> None:
    """Overlapped, the FSDP2 gathers run inside each action, beside its compute."""
    the_plan = _mesh_plan()
    sim = simulate(the_plan, make_schedule(the_plan, "1f1b", M)).iteration_time * MESH_SCALE
    for seconds, local, whole in launch(_mesh_step, 4, args=(the_plan, host), timeout=240):
        assert whole == 4e5 / 4 / 4 and local == whole // 2  # bytes / byte_scale, over dp
        assert sim * 0.99 <= seconds < _serial(the_plan, MESH_SCALE), (seconds, sim)


def _mse_warnings(the_plan: Plan) -> list[str]:
    """The warnings of compiling and stepping an emulated model whose loss is torch's
    mse_loss (it warns when the output and target shapes differ and broadcast)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _timed(the_plan, Emulate(time_scale=1.0), steps=1, loss_fn=torch.nn.functional.mse_loss)
    return [str(w.message) for w in seen]


def test_the_loss_check_of_an_emulated_run_reads_the_output_at_its_real_shape() -> None:
    """Values that cross stages are flat under emulation; the model output is not (the loss
    reads it), so compile's loss check on meta gives mse_loss the output's real shape, the
    target's, and nothing warns of a broadcast."""
    for seen in launch(_mse_warnings, 3, args=(_timed_plan(),), timeout=240):
        assert not [w for w in seen if "target size" in w], seen


def _stash_steps(the_plan: Plan) -> float:
    """Seconds per step of the stash policy (weights swapped in per micro-batch)."""
    return _timed(the_plan, Emulate(time_scale=SCALE), steps=2, weights="stash")[0]


def test_emulated_stages_run_under_a_versioned_weight_policy() -> None:
    """stash runs each micro-batch with its stashed weights (a plain tensor swapped in for
    the parameter): the stand-in reads its weight as the policy gives it, and each call
    still takes every stage's M forwards and backwards."""
    the_plan = _timed_plan()
    for seconds in launch(_stash_steps, 3, args=(the_plan,), timeout=240)[:2]:
        assert seconds >= M * (F + B) * SCALE * 0.99, seconds
