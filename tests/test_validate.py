"""Plan: JSON round trip, and one test per validation error, each naming what is wrong."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from zoo import TwoBranch

from graphpipe.errors import PlanError
from graphpipe.ir import Plan, StageEdge
from graphpipe.ir.cost import MemoryModel
from graphpipe.planning.opgraph import op_graph
from graphpipe.planning.partition import PlanConfig, partition
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.planning.validate import validate_plan
from graphpipe.tracing.tracer import trace

FLOPS = ProfileConfig(mode="flops")  # the same plans on every run


@pytest.fixture(scope="module")
def traced() -> torch.fx.GraphModule:
    model = TwoBranch(width=32, depth=2)
    return trace(model, torch.randn(8, 32))


@pytest.fixture(scope="module")
def plan(traced: torch.fx.GraphModule) -> Plan:
    prof = profile(traced, (torch.randn(8, 32),), 2, FLOPS)
    config = PlanConfig(devices=3, micro_batches=4, replication=False, layouts=("one",))
    p = partition(traced, prof, config)
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
        validate_plan(plan, graph)


def test_valid_plan_passes(plan: Plan, traced: torch.fx.GraphModule) -> None:
    validate_plan(plan, traced)


def test_stage_index_out_of_order(plan: Plan) -> None:
    _fails(_with_stage(plan, 1, index=5), None, "position 1 has index 5")


def test_stage_without_ops(plan: Plan, traced: torch.fx.GraphModule) -> None:
    _fails(_with_stage(plan, 2, nodes=()), None, "stage 2 has no ops")


def test_stage_without_devices(plan: Plan) -> None:
    _fails(_with_stage(plan, 0, devices=()), None, "stage 0 has no devices")


def test_device_out_of_range(plan: Plan) -> None:
    _fails(_with_stage(plan, 0, devices=(9,)), None, r"devices \[9\] outside 0..2")


def test_a_device_may_hold_two_unreplicated_stages(plan: Plan) -> None:
    validate_plan(_with_stage(plan, 1, devices=(0,)))


def test_a_device_holding_a_replicated_stage_holds_no_other(plan: Plan) -> None:
    shared = _with_stage(_with_stage(plan, 0, devices=(0, 2)), 1, devices=(0,))
    _fails(shared, None, r"device 0 holds stages \[0, 1\], of which \[0\] are replicated")


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
        validate_plan(bad)
    assert len(err.value.problems) == 2


# -- only single tensors cross stages ----------------------------------------------------------


class SizeLater(torch.nn.Module):
    """The sizes of an intermediate tensor are read early and used in a late reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, N, C)
        h = self.embed(x)  # (B, N, C)
        _, n, c = h.shape  # a torch.Size, then two ints
        return self.layers(h.flatten(0, 1)).view(-1, n, c).sum(1)  # (B, C)


@pytest.fixture(scope="module")
def sized() -> tuple[torch.fx.GraphModule, Plan]:
    x = torch.randn(8, 5, 8)
    gm = trace(SizeLater(), x, micro_batch_size=2)
    config = PlanConfig(devices=2, replication=False, layouts=("one",))
    p = partition(gm, profile(gm, (x[:2],), 2, FLOPS), config)
    assert len(p.stages) == 2 and p.stage_of["getitem_1"] == p.stage_of["view"] == 1
    return gm, p


def _move_size_query_to_stage_0(p: Plan) -> Plan:
    """The size query and its ints in stage 0, their reshape in stage 1: the ints cross."""
    moved = ("getattr_1", "getitem_1", "getitem_2")
    bad = _with_stage(p, 1, nodes=tuple(n for n in p.stages[1].nodes if n not in moved))
    bad = _with_stage(bad, 0, nodes=(*p.stages[0].nodes, *moved))
    edge = bad.edges[0]
    return replace(bad, edges=(replace(edge, tensors=(*edge.tensors, "getitem_1", "getitem_2")),))


def test_plan_cutting_an_int_is_rejected(sized: tuple[torch.fx.GraphModule, Plan]) -> None:
    gm, p = sized
    validate_plan(p, gm)
    bad = _move_size_query_to_stage_0(p)
    with pytest.raises(PlanError) as err:
        validate_plan(bad, gm)
    assert err.value.problems == (
        "'getitem_1' (int) crosses from S0 to S1 (users ['view']); only single tensors can "
        "cross stages: keep it in the stage of its users",
        "'getitem_2' (int) crosses from S0 to S1 (users ['view']); only single tensors can "
        "cross stages: keep it in the stage of its users",
    )
    # the same from the networkx op graph, and from a plan file edited by hand
    g = op_graph(gm, profile(gm, (torch.randn(2, 5, 8),), 2))
    _fails(bad, g, r"'getitem_1' \(int\) crosses from S0 to S1")
    data = json.loads(p.to_json())
    data["stages"][0]["nodes"].append("getattr_1")
    data["stages"][1]["nodes"].remove("getattr_1")
    _fails(
        Plan.from_json(json.dumps(data)), gm, r"'getattr_1' \(torch.Size\) crosses from S0 to S1"
    )


def test_plan_cutting_a_tuple_is_rejected() -> None:
    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 8)
            left, right = torch.split(x * 2, 4, dim=1)  # a tuple of 2 x (B, 4)
            return self.a(left) + self.b(right)

    x = torch.randn(4, 8)
    gm = trace(Split(), x, micro_batch_size=2)
    p = partition(gm, profile(gm, (x[:2],), 2, FLOPS), PlanConfig(devices=1))
    stage = p.stages[0]
    cut = replace(stage, nodes=("mul", "split"))
    rest = replace(
        stage, index=1, devices=(1,), nodes=tuple(n for n in stage.nodes if n not in cut.nodes)
    )
    bad = replace(p, stages=(cut, rest), edges=(StageEdge(0, 1, ("split",), 0),), num_devices=2)
    _fails(bad, gm, r"'split' \(tuple\) crosses from S0 to S1 \(users \['getitem', 'getitem_1'\]\)")
