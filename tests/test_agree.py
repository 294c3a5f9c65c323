"""The ranks agree on one plan and one schedule (`graphpipe.compile.agree`).

A plan made on each rank by `graphpipe.plan` holds that rank's measured stage times. zbv
orders its actions by those times, so two ranks could make different programs from "the
same" plan and wait for each other until the timeout: the intermittent 2-rank hang of
test_interleaved. compile runs rank 0's plan on every rank and compares the schedules.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch.distributed as dist
from test_interleaved import CHAINS
from training import M, batch, optimizer_for
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.compile.agree import agree_schedule, agreed_plan, first_difference, plan_shape
from graphpipe.errors import PipelineError, ScheduleError
from graphpipe.ir import Plan
from graphpipe.planning.partition import plan
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.generators import make_schedule

TIMEOUT = 120  # seconds for a whole launch
SLOWER = 10.0  # rank 1's last stage's backward, times this: another zbv order
# each stage's (forward, backward) seconds as one rank measured them, fixed: measured on
# every rank, a loaded machine's noise could give rank 0 the slower order itself (the
# intermittent 'agreed' of a test below); the order depends on their ratios only
MEASURED = ((1.2e-5, 3.7e-5), (2.7e-5, 9.6e-5), (2.7e-5, 9.6e-5), (5.3e-5, 1.8e-4))


def _plan(name: str = "tied", pins: dict[str, int] | None = None) -> Plan:
    model, inputs = ZOO[name]()
    made = plan(
        model,
        inputs,
        devices=2,
        micro_batches=M,
        pins=CHAINS[name] if pins is None else pins,
        virtual_stages=2,
        placement="v",
    )
    stages = tuple(
        replace(s, forward_time=f, backward_time=b, time=f + b)
        for s, (f, b) in zip(made.stages, MEASURED, strict=True)
    )
    return replace(made, stages=stages)


def _slower_last_backward(p: Plan) -> Plan:
    """`p` as a rank that measured its last stage's backward SLOWER times slower."""
    last = p.stages[-1]
    scaled = replace(
        last,
        backward_time=last.backward_time * SLOWER,
        time=last.time + last.backward_time * (SLOWER - 1),
    )
    return replace(p, stages=(*p.stages[:-1], scaled))


def test_two_plans_made_alike_differ_only_in_what_was_measured() -> None:
    a, b = json.loads(_plan().to_json()), json.loads(_plan().to_json())
    assert first_difference(plan_shape(a), plan_shape(b)) is None
    moved = json.loads(_plan(pins={**CHAINS["tied"], "body.2": 2}).to_json())
    where = first_difference(plan_shape(a), plan_shape(moved))
    assert where == ".edges[2].bytes: 640 != 128"  # what the moved stage sends on


def test_first_difference_names_the_path_and_both_values() -> None:
    assert first_difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}) == ".a[1].b: 2 != 3"
    assert first_difference({"a": [1]}, {"a": [1, 2]}) == ".a: 1 items != 2"
    assert first_difference({"a": 1}, {"a": 1, "c": 0}) == ".c: only in the second"
    assert first_difference({"x": 1.5, "y": [0]}, {"x": 1.5, "y": [0]}) is None


def test_measured_times_alone_change_the_zbv_order() -> None:
    """The premise of the hang: the skew below gives rank 1 another zbv schedule."""
    p = _plan()
    assert str(make_schedule(p, "zbv")) != str(make_schedule(_slower_last_backward(p), "zbv"))


def _compiled(p: Plan) -> Any:
    """tied under zbv, compiled with this rank's plan `p`."""
    model, inputs = ZOO["tied"]()
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=optimizer_for(),
        schedule="zbv",
        plan=p,
        runtime=RuntimeConfig(timeout=20, quiet=True),
    )


def _train_with_own_plans() -> dict[str, Any]:
    p = _plan()
    if dist.get_rank() == 1:
        p = _slower_last_backward(p)
    pm = _compiled(p)
    losses = [pm.step(*batch("tied", s)[0], target=batch("tied", s)[1]) for s in range(2)]
    return {"schedule": str(pm.schedule), "own": str(make_schedule(p, "zbv")), "losses": losses}


def test_ranks_given_plans_that_differ_in_measured_times_run_rank_0s() -> None:
    """Each rank gives compile its own plan, rank 1's with a slower last stage: both run
    rank 0's zbv schedule and train (before, they waited for each other: a timeout)."""
    results = launch(_train_with_own_plans, 2, timeout=TIMEOUT)
    assert results[0]["schedule"] == results[1]["schedule"] == results[0]["own"]
    assert results[1]["own"] != results[0]["own"]  # what rank 1 would have run alone
    assert results[0]["losses"] == results[1]["losses"]


def _compile_with_moved_stage() -> None:
    pins = {**CHAINS["tied"], "body.2": 2} if dist.get_rank() == 1 else None
    _compiled(_plan(pins=pins))


def test_ranks_given_plans_with_other_stages_are_all_refused_naming_the_rank() -> None:
    with pytest.raises(PipelineError) as err:
        launch(_compile_with_moved_stage, 2, timeout=TIMEOUT)
    text = str(err.value)
    for rank in (0, 1):
        assert f"rank {rank}: ConfigError: the ranks were given different plans: rank(s) [1]" in (
            text
        )
    assert "(rank 1, rank 0's != its own at .edges[2].bytes: 640 != 128)" in text


def _agree_on_rank_made_schedules() -> str:
    p = _plan()
    mine = p if dist.get_rank() == 0 else _slower_last_backward(p)
    try:
        agree_schedule(make_schedule(mine, "zbv"), timeout=20)
    except ScheduleError as exc:
        return str(exc)
    return "agreed"


def test_different_schedules_are_refused_on_every_rank() -> None:
    said = launch(_agree_on_rank_made_schedules, 2, timeout=TIMEOUT)
    for text in said:
        assert text.startswith("the ranks made different zbv schedules from one plan: rank(s) [1]")


def test_one_process_has_nothing_to_agree() -> None:
    """No process group: nothing is sent, nothing raised, the plan is this rank's."""
    p = _plan()
    assert not dist.is_initialized()
    assert agreed_plan(p) is p
    agree_schedule(make_schedule(p, "zbv"))
