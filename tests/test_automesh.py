"""The mesh search (graphpipe.planning.automesh): it chooses the grid's best, tp stays in a
node, bad values are named, and print(plan) lists the runners-up."""

from __future__ import annotations

import faulthandler
import json
import math
import multiprocessing
from functools import cache

import pytest
import torch
from torch import fx, nn

from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import Plan
from graphpipe.ir.cost import LinkModel
from graphpipe.planning.automesh import (
    MeshSearch,
    _Search,
    _state,
    candidates,
    choose,
    grid,
    plan_mesh,
)
from graphpipe.planning.devices import NODES, Node
from graphpipe.planning.layouts import layout_schedules
from graphpipe.planning.partition import PlanConfig
from graphpipe.planning.profile import Profile, ProfileConfig, profile
from graphpipe.scheduling.floor import step_floor
from graphpipe.scheduling.simulate import simulate
from graphpipe.tracing.tracer import trace

BATCH, WIDTH, BLOCKS = 16, 256, 4
TIMEOUT = 120  # seconds a forked search may take before the test's process exits
FLOPS = ProfileConfig(mode="flops")
MLP_PLAN = {"*.fc1": "colwise", "*.fc2": "rowwise"}
# a small node so that tp = 2 stays inside and dp and pp cross: 2 GPUs, a fast and a slow link
NODE = Node("pair", NODES["h100x8"].device, 2, LinkModel(400e9, 1e-6), LinkModel(2e9, 1e-5))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


@cache
def _traced() -> tuple[fx.GraphModule, Profile]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
    x = torch.randn(BATCH, WIDTH)
    gm = trace(model, (x,), micro_batch_size=BATCH)
    return gm, profile(gm, (x,), BATCH, FLOPS)


def _config(devices: int, **options: object) -> PlanConfig:
    return PlanConfig(devices=devices, micro_batches=1, profile=FLOPS, tp_plan=MLP_PLAN, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_the_choice_is_the_best_of_the_whole_grid(devices: int) -> None:
    gm, prof = _traced()
    config, search = _config(devices), MeshSearch(node=NODE)
    chosen = choose(gm, prof, config, search)
    every = [s for s in grid(gm, prof, config, search) if s.plan is not None]
    best = min(s.step for s in every)
    assert simulate(chosen).iteration_time == pytest.approx(best, rel=1e-9)
    note = chosen.info["mesh"]
    assert note["planned"] < note["candidates"] or devices == 2  # the bounds pruned some
    assert chosen.dims.devices == devices and chosen.info["mesh"]["chosen_by"] == "auto"


def test_forked_workers_choose_the_serial_search_s_plan() -> None:
    """Candidates planned by two forked processes, a family of meshes each at a time, each
    against the best step known when its family started: the same plan as planned here."""
    gm, prof = _traced()
    faulthandler.dump_traceback_later(TIMEOUT, exit=True)  # a hung worker cannot hang CI
    try:
        serial = choose(gm, prof, _config(8), MeshSearch(node=NODE))
        forked = choose(gm, prof, _config(8), MeshSearch(node=NODE, workers=2))
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert forked.dims == serial.dims and forked.micro_batches == serial.micro_batches
    assert _bare(forked) == _bare(serial)
    assert forked.info["mesh"]["candidates"] == serial.info["mesh"]["candidates"]
    assert multiprocessing.active_children() == []  # the workers were joined


def _bare(plan: Plan) -> dict[str, object]:
    """The plan as JSON without what the search's course may change: its time and notes
    (the runners-up: a worker may plan one that the serial search pruned)."""
    data = json.loads(plan.to_json())
    data.pop("info"), data.pop("search_time")
    return data


def test_a_candidate_plans_the_same_alone_and_after_the_others() -> None:
    """A candidate's plan is a function of the candidate alone (its own cut), so the order
    the search plans candidates in cannot change it: what makes the choice the grid's best."""
    gm, prof = _traced()
    config, search = _config(8), MeshSearch(node=NODE)
    after = {s.candidate: s.step for s in grid(gm, prof, config, search)}
    state = _state(gm, prof, config, search, BATCH)
    for c in sorted(after, reverse=True)[:4]:
        alone = _state(gm, prof, config, search, BATCH).evaluate(c, search.reshard)
        assert alone.step == after[c] == state.evaluate(c, search.reshard).step


def test_tp_never_crosses_a_node() -> None:
    space = candidates(16, BATCH, NODE.gpus, tp=True)
    assert {c.tp for c in space} == {1, 2}
    assert all(c.pp * c.dp * c.tp == 16 and BATCH % (c.dp * c.micro_batches) == 0 for c in space)
    assert {c.tp for c in candidates(16, BATCH, 8, tp=False)} == {1}


def test_the_links_are_the_node_s_by_where_each_group_lies() -> None:
    node = NODES["h100x8"]
    pp, dp, tp = node.mesh_links(pp=4, dp=2, tp=4)
    assert (tp, dp, pp) == (node.intra, node.intra, node.inter)
    assert node.mesh_links(pp=1, dp=16, tp=8)[1] == node.inter


@pytest.mark.parametrize(
    ("search", "named"),
    [
        (MeshSearch(micro_batches=3), "micro_batches=3"),
        (MeshSearch(micro_batches="some"), "'some'"),
        (MeshSearch(node="h200x9"), "'h200x9'"),
        (MeshSearch(node=NODES["h100x8"]), "devices=12"),
        (MeshSearch(reshard=()), "reshard"),
        (MeshSearch(workers=0), "workers must be an int >= 1, got 0"),
        (MeshSearch(workers=True), "workers must be an int >= 1, got True"),
    ],
)
def test_a_bad_search_value_is_a_config_error_naming_it(search: MeshSearch, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        search.check(12, BATCH)


def test_print_plan_lists_the_runners_up_and_what_bound_each() -> None:
    gm, prof = _traced()
    chosen = choose(gm, prof, _config(4, memory_budget=64 * 2**20), MeshSearch(node=NODE))
    text = str(chosen)
    assert f"mesh: {chosen.dims}, M {chosen.micro_batches} on pair nodes, chosen of" in text
    runners = chosen.info["mesh"]["runners_up"]
    assert runners and all(r["bound"] for r in runners)
    assert all(r["bound"].split(":")[0] in text for r in runners)
    steps = [r["step"] for r in runners if r["step"] is not None]
    assert steps == sorted(steps) and all(s >= simulate(chosen).iteration_time for s in steps)


def test_the_plan_round_trips_and_its_mesh_reads_from_the_json() -> None:
    gm, prof = _traced()
    chosen = choose(gm, prof, _config(4), MeshSearch(node=NODE))
    back = Plan.from_json(chosen.to_json())
    assert back == chosen and back.dims == chosen.dims and str(back) == str(chosen)


def test_plan_mesh_traces_and_plans_a_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(2)])
    made = plan_mesh(model, torch.randn(8, WIDTH), devices=2, profile=FLOPS, tp_plan=MLP_PLAN)
    assert made.dims.devices == 2 and math.isfinite(simulate(made).iteration_time)
    assert all(shape[0] == 8 // made.micro_batches for shape in made.input_shapes.values())


@pytest.mark.parametrize("devices", [4, 8])
def test_a_plan_s_floor_is_within_its_simulated_step_under_every_schedule(devices: int) -> None:
    """`step_floor` bounds every flushed schedule's step from below: what lets the search
    skip simulating a plan whose floor is over the best step found (the choice stays the
    grid's best, checked above)."""
    gm, prof = _traced()
    checked = 0
    for s in grid(gm, prof, _config(devices), MeshSearch(node=NODE)):
        if s.plan is None:
            continue
        for name in layout_schedules(s.plan.layout, None):
            try:
                step = simulate(s.plan, name).iteration_time
            except ScheduleError:
                continue  # the schedule's rule refuses the plan
            assert step_floor(s.plan) <= step * (1 + 1e-9), (s.candidate, name)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("devices", [4, 8])
def test_a_candidate_planned_against_a_best_step_has_its_grid_step_wherever_either_is_within(
    devices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned against a best step found so far (`beat`), a candidate skips the plans whose
    floor is over it; its step is then over `beat` or exactly the grid's, and the grid's
    within `beat` is always found. The unsure choice (a plan of one stage per rank chosen
    over `beat` while folded plans were skipped) is among the cases."""
    gm, prof = _traced()
    config, search = _config(devices), MeshSearch(node=NODE)
    every = grid(gm, prof, config, search)
    best = min(s.step for s in every)
    state = _state(gm, prof, config, search, BATCH)
    unsure = []
    folded_or = _Search._folded_or

    def noted(self: _Search, *args: object, **kwargs: object) -> object:
        made = folded_or(self, *args, **kwargs)  # type: ignore[arg-type]
        unsure.extend([made[1]] if made is not None else [])
        return made

    monkeypatch.setattr(_Search, "_folded_or", noted)
    for s in every:
        for beat in (0.8 * best, best, 1.05 * best, 1.2 * best, 1.5 * best, 2 * best):
            step = state.evaluate(s.candidate, search.reshard, beat).step
            if step <= beat or s.step <= beat:
                assert step == pytest.approx(s.step, rel=1e-12), (s.candidate, beat)
    assert any(unsure)
