"""Schedule rules: one rule per schedule, and simulate, make_schedule and compile all ask it."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from plans import chain_plan, placed_plan, random_plan

from graphpipe.compile import steps
from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import Plan
from graphpipe.ir.registry import DEFAULT_SCHEDULE, SCHEDULES, schedule_for, schedule_names
from graphpipe.planning.layouts import layout_schedules
from graphpipe.runtime.spec import RunSpec
from graphpipe.scheduling import dryrun
from graphpipe.scheduling.dryrun import check_schedule
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.rules import BOUNDS, check, problems, rule
from graphpipe.scheduling.simulate import simulate, steady_run

# the module (graphpipe.compile, the attribute, is the function compile)
COMPILE = importlib.import_module("graphpipe.compile")


def _idle_chain() -> Plan:
    """3 chain stages, one per device, on 4 devices (device 3 idle), M = 8."""
    return replace(chain_plan(3, 8), num_devices=4)


def _replicated() -> Plan:
    """A chain of 2 stages on 3 devices, stage 0 replicated on devices 0 and 2, M = 8."""
    plan = chain_plan(2, 8)
    first, second = plan.stages
    return replace(plan, num_devices=3, stages=(replace(first, devices=(0, 2)), second))


PLANS: dict[str, Callable[[], Plan]] = {
    "chain": lambda: chain_plan(3, 8),  # 3 stages, one per device, M = 8
    "shallow M": lambda: chain_plan(3, 2),  # M = 2 < depth 3
    "replicated": _replicated,
    "idle device": _idle_chain,
    "loop": lambda: placed_plan(2, 2, 4, "loop"),  # 4 stages on 2 devices, M = 4
    "v": lambda: placed_plan(2, 2, 4, "v"),  # M = 4 = 2N
    "v at M=2": lambda: placed_plan(2, 2, 2, "v"),
}
SEVERAL = r"runs one stage per device, but devices \[0, 1\] hold several"
# schedule: (a plan it runs, a plan it refuses, what the refusal names)
CASES: dict[str, tuple[str, str, str]] = {
    "gpipe": ("chain", "loop", SEVERAL),
    "1f1b": ("replicated", "loop", SEVERAL),
    "zb": ("chain", "v", SEVERAL),
    "zb2": ("chain", "loop", SEVERAL),
    "async": ("chain", "replicated", r"'async' needs unreplicated stages, but stages \[0\]"),
    "2bw": ("chain", "shallow M", "2bw needs micro_batches >= depth, got M=2 < depth 3"),
    "interleaved": (
        "loop",
        "idle device",
        r"interleaved needs a multiple of 4 stages \(as many on every device\), got 3",
    ),
    "interleaved_zb": (
        "loop",
        "idle device",
        r"interleaved_zb needs a multiple of 4 stages \(as many on every device\), got 3",
    ),
    "zbv": ("v", "loop", r"'zbv' needs a chain of stages placed 'v'.*stages \[2, 3\] are not"),
    "dualpipev": ("v", "v at M=2", r"dualpipev needs micro_batches >= 2 x 2 devices = 4"),
    "graph_interleaved": ("loop", "replicated", "'graph_interleaved' needs unreplicated"),
}


def test_every_schedule_has_a_case_here() -> None:
    assert set(CASES) | {"forward"} == set(SCHEDULES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_schedules_rule_refuses_by_name_everywhere_alike(name: str) -> None:
    """make_schedule, simulate (by name and given a schedule) and the rule itself refuse
    the same plan with the same message."""
    _, refused, why = CASES[name]
    plan = PLANS[refused]()
    with pytest.raises(ScheduleError, match=why) as by_rule:
        check(plan, name)
    assert problems(plan, name) == [str(by_rule.value)]
    with pytest.raises(ScheduleError) as by_make:
        make_schedule(plan, name)
    with pytest.raises(ScheduleError) as by_simulate:
        simulate(plan, name)
    assert str(by_make.value) == str(by_simulate.value) == str(by_rule.value)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_schedules_rule_accepts_a_plan_it_runs(name: str) -> None:
    accepted, *_ = CASES[name]
    plan = PLANS[accepted]()
    assert problems(plan, name) == []
    schedule = steady_run(plan, name)  # an asynchronous one over calls, and drained
    check_schedule(plan, schedule)  # the dry run: complete, ordered, deadlock-free
    assert simulate(plan, schedule).iteration_time > 0


def test_forward_runs_every_plan() -> None:
    """Inference's forward-only schedule has no placement or replica rule."""
    assert rule("forward") == ()
    for make in PLANS.values():
        plan = make()
        assert problems(plan, "forward") == []
        assert simulate(plan, "forward").iteration_time > 0


def test_several_problems_are_named_at_once() -> None:
    plan = placed_plan(2, 2, 3, "loop")  # a loop, not a V, and M = 3 < 2N
    with pytest.raises(ScheduleError) as err:
        check(plan, "dualpipev")
    assert "'dualpipev' cannot run the plan at M=3" in str(err.value)
    assert len(err.value.problems) == 2
    assert "placed 'v'" in err.value.problems[0] and "got 3" in err.value.problems[1]


def _spec(**options: Any) -> RunSpec:
    return RunSpec.build(
        torch.randn(8, 4),
        loss_fn=F.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        micro_batches=8,
        **options,
    )


def test_simulate_refuses_what_compile_refuses_with_the_same_message() -> None:
    """interleaved_zb on 3 stages, one per device, of 4 devices at M = 8: simulate returned
    0.0 s (every device's order empty) while compile refused it."""
    plan = _idle_chain()
    with pytest.raises(ScheduleError) as by_compile:
        steps.schedule_plan(plan, _spec(schedule="interleaved_zb"))
    with pytest.raises(ScheduleError) as by_simulate:
        simulate(plan, "interleaved_zb")
    assert str(by_simulate.value) == str(by_compile.value)
    assert "interleaved_zb needs a multiple of 4 stages" in str(by_compile.value)


def _retimed(plan: Plan, scale: Callable[[int], float]) -> Plan:
    """`plan` with stage s's times scaled by scale(s)."""
    stages = tuple(
        replace(
            s,
            forward_time=s.forward_time * scale(s.index),
            backward_time=s.backward_time * scale(s.index) * 1.7,
            time=s.time * scale(s.index),
        )
        for s in plan.stages
    )
    return replace(plan, stages=stages)


@pytest.mark.parametrize("name", schedule_names(reads_times=False))
def test_orders_outside_reads_times_read_the_plans_shape_only(name: str) -> None:
    """What lets compile keep the schedule it made before choosing recompute, whose stages
    have other times: every order whose spec does not read times is the same under any."""
    plans = [make() for make in PLANS.values()] + [random_plan(seed) for seed in (1, 3, 4)]
    plans += [placed_plan(3, 2, 6, "v"), placed_plan(3, 3, 6, "loop")]
    ran = 0
    for plan in plans:
        if problems(plan, name):
            continue
        ran += 1
        made = make_schedule(plan, name)
        for scale in (lambda s: 0.0, lambda s: 1.0 + 3 * s, lambda s: 5.0 - s):
            assert make_schedule(_retimed(plan, scale), name) == made
    assert ran >= 2


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every make_schedule call compile's steps make, by schedule name."""
    made: list[str] = []

    def counted(plan: Plan, name: str, *args: Any, **kwargs: Any) -> Any:
        made.append(name)
        return make_schedule(plan, name, *args, **kwargs)

    for module in (COMPILE, steps, dryrun):
        monkeypatch.setattr(module, "make_schedule", counted)
    return made


@pytest.mark.parametrize(("name", "builds"), [("1f1b", 1), ("zb", 2), ("zbv", 2)])
def test_compile_makes_the_schedule_once_but_where_recompute_changes_the_times_it_reads(
    name: str, builds: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = chain_plan(4, 8) if name != "zbv" else placed_plan(2, 2, 8, "v")
    made = _counting(monkeypatch)
    scheduled, sched = COMPILE._scheduled(plan, _spec(schedule=name, recompute=True))
    assert all(s.recompute for s in scheduled.stages)
    assert made == [name] * builds
    assert sched == make_schedule(scheduled, name)
    made.clear()
    COMPILE._scheduled(plan, _spec(schedule=name))
    assert made == [name]


def test_one_resolver_names_the_schedule_a_run_runs() -> None:
    """The one named, else the weight policy's, else the plan's, else none (the planner
    chooses); each checked against the policy."""
    assert schedule_for("flush", None) is None
    assert schedule_for("flush", None, "zbv") == "zbv"  # the plan's
    assert schedule_for("flush", "zb", "zbv") == "zb"  # named beats the plan's
    assert schedule_for("2bw", None, "zbv") == "2bw"  # the policy's beats the plan's
    assert schedule_for("flush", "graph1f1b") == "1f1b"  # an alias, by its name
    with pytest.raises(ConfigError, match="weights='2bw' runs with 2bw, not schedule='zb'"):
        schedule_for("2bw", "zb")
    with pytest.raises(ConfigError, match="runs with a flushed schedule .* not schedule='async'"):
        schedule_for("flush", "async")
    with pytest.raises(ConfigError, match="not schedule='async'"):
        schedule_for("flush", None, "async")  # a plan's schedule is checked too


def test_every_schedule_fact_is_read_from_its_registry_entry() -> None:
    """The planner's schedules per layout, the bound on M and whether an order reads stage
    times come from the spec, so a new schedule is an entry and a builder."""
    for layout in ("one", "loop", "v", "graph"):
        assert layout_schedules(layout, None) == schedule_names(layout=layout)
    assert schedule_names(layout="one") == [DEFAULT_SCHEDULE]
    for name, spec in SCHEDULES.items():
        bound = BOUNDS.get(spec.min_micro_batches or "")
        assert (bound in rule(name)) == (bound is not None), name
    assert schedule_names(reads_times=True) == ["zb", "zbv", "graph_interleaved"]
