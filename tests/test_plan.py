"""The Plan records its layout and the schedule it was made for: JSON, text, defaults."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from plans import chain_plan, placed_plan

import graphpipe
from graphpipe.compile.steps import schedule_name
from graphpipe.errors import ConfigError, PlanError, ScheduleError
from graphpipe.ir import Plan
from graphpipe.ir.plan import layout_of
from graphpipe.planning.interleave import place_graph
from graphpipe.runtime.spec import RunSpec
from graphpipe.scheduling.rules import problems
from graphpipe.scheduling.simulate import simulate
from models import nbranch

PLANS = {
    "chain": lambda: chain_plan(3, 8),
    "loop": lambda: placed_plan(2, 2, 4, "loop"),
    "v": lambda: placed_plan(2, 2, 4, "v"),
    "graph": lambda: place_graph(chain_plan(3, 4), 2, [0, 1, 1]),  # a folding of no loop or V
}


@pytest.mark.parametrize(
    ("kind", "layout", "schedule"),
    [
        ("chain", "one", "1f1b"),
        ("loop", "loop", "graph_interleaved"),
        ("v", "v", "graph_interleaved"),
        ("graph", "graph", "graph_interleaved"),
    ],
)
def test_a_plan_records_its_layout_and_a_schedule_that_runs_it(
    kind: str, layout: str, schedule: str
) -> None:
    plan = PLANS[kind]()
    assert (plan.layout, plan.schedule) == (layout, schedule)
    assert layout_of(plan) == layout
    assert problems(plan, plan.schedule) == []
    assert f"layout: {layout} (" in str(plan) and f"run by {schedule}" in str(plan)


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_layout_and_schedule_round_trip_through_json(kind: str) -> None:
    plan = replace(PLANS[kind](), schedule="forward")
    data = json.loads(plan.to_json())
    assert data["schedule"] == "forward" and data["layout"] == plan.layout
    back = Plan.from_json(plan.to_json())
    assert back == plan and (back.layout, back.schedule) == (plan.layout, "forward")


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_plan_files_without_them_derive_them(kind: str) -> None:
    plan = PLANS[kind]()
    data = json.loads(plan.to_json())
    del data["layout"], data["schedule"]
    back = Plan.from_json(json.dumps(data))
    assert (back.layout, back.schedule) == (plan.layout, plan.schedule)


def test_plan_files_without_them_take_the_planners_note() -> None:
    """Files written while the planner's choice lived in info["layouts"] alone."""
    data = json.loads(placed_plan(2, 2, 4, "v").to_json())
    del data["layout"], data["schedule"]
    data["info"]["layouts"] = {"chosen": "v", "schedule": "zbv", "considered": []}
    assert Plan.from_json(json.dumps(data)).schedule == "zbv"


def test_an_unknown_schedule_or_layout_is_named() -> None:
    data = json.loads(chain_plan(2, 2).to_json())
    with pytest.raises(PlanError, match="plan's schedule: unknown schedule 'zigzag'"):
        Plan.from_json(json.dumps({**data, "schedule": "zigzag"}))
    with pytest.raises(PlanError, match="layout must be one of .* got 'ring'"):
        Plan.from_json(json.dumps({**data, "layout": "ring"}))
    assert replace(chain_plan(2, 2), schedule="graph1f1b").schedule == "1f1b"  # an alias


def test_simulate_runs_the_plans_schedule_by_default() -> None:
    plan = replace(chain_plan(4, 8), schedule="zb")
    assert simulate(plan).timeline.title == "zb"
    assert simulate(plan).iteration_time == simulate(plan, "zb").iteration_time
    assert simulate(plan).iteration_time < simulate(plan, "1f1b").iteration_time


def _spec(**options: object) -> RunSpec:
    return RunSpec.build(
        torch.randn(8, 4),
        loss_fn=F.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        micro_batches=8,
        **options,
    )


def test_compile_runs_the_plans_schedule_unless_the_run_names_one() -> None:
    plan = replace(chain_plan(3, 8), schedule="zb")
    assert schedule_name(plan, _spec()) == "zb"
    assert schedule_name(plan, _spec(schedule="1f1b")) == "1f1b"  # named
    assert schedule_name(plan, _spec(weights="stash")) == "async"  # the policy's
    with pytest.raises(ConfigError, match="(?s)made for schedule 'zb'.*compile_stages=True"):
        schedule_name(plan, _spec(compile_stages=True))  # a split backward, not compiled
    with pytest.raises(ConfigError, match="(?s)made for schedule 'async'.*weights='flush'"):
        schedule_name(replace(plan, schedule="async"), _spec())


def test_the_planning_guides_first_example_runs_on_the_plans_schedule() -> None:
    """docs/planning.md's first example (the README's before it): 16 transformer branches
    on the meta device (FLOPs estimates), 16 devices, M = 8. The planner folds the plan
    (a finer stage DAG beats one stage per device), so 1f1b, once the example's schedule,
    cannot run it; simulate(plan) runs the one it was made for. Planning takes 2-4 s."""
    w = nbranch.workload("paper")
    plan = graphpipe.plan(w.model, w.example_inputs, devices=16, micro_batches=8)
    note = plan.info["layouts"]
    assert (plan.layout, plan.schedule) == (note["chosen"], note["schedule"])
    chosen = next(c for c in note["considered"] if c["layout"] == plan.layout)
    assert simulate(plan).iteration_time == pytest.approx(chosen["step"])
    assert f"layout: {plan.layout} (" in str(plan) and f"run by {plan.schedule}" in str(plan)
    assert plan.shared_devices()  # FLOPs estimates: the same plan on every run
    with pytest.raises(ScheduleError, match="runs one stage per device"):
        simulate(plan, "1f1b")
