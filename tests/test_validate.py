"""Plan: JSON round trip, and one test per validation error, each naming what is wrong."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from zoo import TwoBranch

from graphpipe.cost import MemoryModel
from graphpipe.errors import PlanError
from graphpipe.ir import Plan, StageEdge
from graphpipe.partition import PlanConfig, partition
from graphpipe.profile import profile
from graphpipe.trace import trace


@pytest.fixture(scope="module")
def traced() -> torch.fx.GraphModule:
    model = TwoBranch(width=32, depth=2)
    return trace(model, torch.randn(8, 32))


@pytest.fixture(scope="module")
def plan(traced: torch.fx.GraphModule) -> Plan:
    prof = profile(traced, (torch.randn(8, 32),), 2)
    p = partition(traced, prof, PlanConfig(devices=3, micro_batches=4, replication=False))
    assert len(p.stages) == 3 and p.edges
    return p


def test_json_round_trip(plan: Plan) -> None:
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.info == plan.info and again.cost_model == plan.cost_model


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "something-else"}', "not a graphpipe plan"),
        ("[1, 2]", "not a graphpipe plan"),
        ('{"format": "graphpipe-plan/1", "stages": []}', "malformed plan file"),
    ],
)
def test_malformed_plan_file(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Plan.from_json(text)


def test_plan_file_with_a_wrongly_typed_field(plan: Plan) -> None:
    data = json.loads(plan.to_json())
    data["stages"][0]["devices"] = 7  # not a list
    with pytest.raises(PlanError, match="malformed plan file"):
        Plan.from_json(json.dumps(data))


def _with_stage(plan: Plan, i: int, **changes: object) -> Plan:
    stages = list(plan.stages)
    stages[i] = replace(stages[i], **changes)  # type: ignore[arg-type]
    return replace(plan, stages=tuple(stages))


def _fails(plan: Plan, graph: object, pattern: str) -> None:
    with pytest.raises(PlanError, match=pattern):
        plan.validate(graph)


def test_valid_plan_passes(plan: Plan, traced: torch.fx.GraphModule) -> None:
    plan.validate(traced)


def test_stage_index_out_of_order(plan: Plan) -> None:
    _fails(_with_stage(plan, 1, index=5), None, "position 1 has index 5")


def test_stage_without_ops(plan: Plan, traced: torch.fx.GraphModule) -> None:
    _fails(_with_stage(plan, 2, nodes=()), None, "stage 2 has no ops")


def test_stage_without_devices(plan: Plan) -> None:
    _fails(_with_stage(plan, 0, devices=()), None, "stage 0 has no devices")


def test_device_out_of_range(plan: Plan) -> None:
    _fails(_with_stage(plan, 0, devices=(9,)), None, r"devices \[9\] outside 0..2")


def test_device_given_to_two_stages(plan: Plan) -> None:
    _fails(_with_stage(plan, 1, devices=(0,)), None, r"device 0 is given to stages \[0, 1\]")


def test_edge_to_unknown_stage(plan: Plan) -> None:
    bad = replace(plan, edges=(*plan.edges, StageEdge(0, 7, (), 0)))
    _fails(bad, None, "S0->S7 names a stage outside")


def test_self_loop(plan: Plan) -> None:
    _fails(replace(plan, edges=(*plan.edges, StageEdge(1, 1, (), 0))), None, "self-loop")


def test_cycle(plan: Plan) -> None:
    back = StageEdge(plan.edges[0].dst, plan.edges[0].src, (), 0)
    _fails(replace(plan, edges=(*plan.edges, back)), None, "cycle")


def test_memory_over_budget(plan: Plan) -> None:
    tight = replace(plan.cost_model, memory=MemoryModel(budget=10.0))
    _fails(replace(plan, cost_model=tight), None, "over the budget of 10")


def test_unknown_op(plan: Plan, traced: torch.fx.GraphModule) -> None:
    s0 = plan.stages[0]
    _fails(
        _with_stage(plan, 0, nodes=(*s0.nodes, "ghost")), traced, r"not in the graph: \['ghost'\]"
    )


def test_op_in_two_stages(plan: Plan, traced: torch.fx.GraphModule) -> None:
    stolen = plan.stages[0].nodes[0]
    bad = _with_stage(plan, 1, nodes=(*plan.stages[1].nodes, stolen))
    _fails(bad, traced, f"more than one stage: .*{stolen}")


def test_op_in_no_stage(plan: Plan, traced: torch.fx.GraphModule) -> None:
    dropped = plan.stages[2].nodes[-1]
    _fails(_with_stage(plan, 2, nodes=plan.stages[2].nodes[:-1]), traced, f"no stage: .*{dropped}")


def test_non_convex_stage(plan: Plan, traced: torch.fx.GraphModule) -> None:
    # move the branch's middle op out: its first and last op stay, the path leaves and returns
    branch = next(s for s in plan.stages if len(s.nodes) >= 3)
    middle = branch.nodes[1]
    other = next(s for s in plan.stages if s.index != branch.index)
    bad = _with_stage(plan, branch.index, nodes=tuple(n for n in branch.nodes if n != middle))
    bad = _with_stage(bad, other.index, nodes=(*other.nodes, middle))
    _fails(bad, traced, f"stage {branch.index} is not convex: path .*{middle}")


def test_crossing_tensor_without_stage_edge(plan: Plan, traced: torch.fx.GraphModule) -> None:
    edge = plan.edges[0]
    bad = replace(plan, edges=(replace(edge, tensors=()), *plan.edges[1:]))
    _fails(bad, traced, f"no stage edge carries '{edge.tensors[0]}'")


def test_every_problem_is_reported_at_once(plan: Plan) -> None:
    bad = _with_stage(_with_stage(plan, 0, devices=()), 1, nodes=())
    with pytest.raises(PlanError) as err:
        bad.validate()
    assert len(err.value.problems) == 2
