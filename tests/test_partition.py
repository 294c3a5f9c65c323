"""partition: the SP decomposition, the DP against brute force, graph <= sequential, errors."""

from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import replace
from typing import Any

import networkx as nx
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from plans import cost, random_branchy, random_dag, synthetic
from torch import nn
from zoo import TwoBranch

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir.cost import CostModel, LinkModel
from graphpipe.planning import search as search_module
from graphpipe.planning.fold import bound_groups, folded_groups
from graphpipe.planning.layouts import _cuts
from graphpipe.planning.opgraph import op_graph, value_kind
from graphpipe.planning.partition import PlanConfig, cost_model, partition_op_graph, plan, score
from graphpipe.planning.pieces import CandidateStages, _Accumulator
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.planning.schedule_memory import for_schedule
from graphpipe.planning.search import search
from graphpipe.planning.sptree import (
    Leaf,
    Parallel,
    Series,
    _condensed,
    _condensed_count,
    _subtree_times,
    coarsen,
    condense,
    decompose,
    linearise,
    units_of,
)
from graphpipe.planning.validate import validate_plan
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.dryrun import check_run
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.simulate import simulate
from graphpipe.tracing.tracer import trace

ONE = ("one",)  # one stage per device: the search's plan, no layout choice
FLOPS = ProfileConfig(mode="flops")  # the same plans on every run

# -- synthetic op graphs -----------------------------------------------------------------------


def units_of_graph(g: nx.DiGraph) -> nx.DiGraph:
    units = coarsen(g, max_time=0.0)  # no merging: one unit per op
    units.graph["tensor_bytes"] = {n: g.nodes[n]["act"] for n in g}
    return units


# -- series-parallel decomposition -------------------------------------------------------------


def shape(node: Leaf | Series | Parallel) -> object:
    if isinstance(node, Leaf):
        return node.unit[0]
    kind = "S" if isinstance(node, Series) else "P"
    return (kind, *[shape(c) for c in node.children])


def _equal_ops(edges: list[tuple[str, str]], names: str | list[str]) -> nx.DiGraph:
    return synthetic(edges, dict.fromkeys(names, 1.0), dict.fromkeys(names, 10))


def test_diamond_is_series_of_parallel() -> None:
    g = _equal_ops([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], "abcd")
    assert shape(decompose(units_of_graph(g))) == ("S", "a", ("P", "b", "c"), "d")


def test_skip_connection_keeps_series_cuts() -> None:
    g = _equal_ops([("a", "b"), ("b", "c"), ("a", "c")], "abc")
    assert shape(decompose(units_of_graph(g))) == ("S", "a", "b", "c")


def test_independent_inputs_become_parallel_branches() -> None:
    g = _equal_ops([("a", "b"), ("c", "d"), ("b", "e"), ("d", "e")], "abcde")
    assert shape(decompose(units_of_graph(g))) == (
        "S",
        ("P", ("S", "a", "b"), ("S", "c", "d")),
        "e",
    )


def test_non_series_parallel_segment_is_linearised() -> None:
    # the "N" graph: a->c, a->d, b->d is not series-parallel
    g = _equal_ops(
        [("s", "a"), ("s", "b"), ("a", "c"), ("a", "d"), ("b", "d"), ("c", "t"), ("d", "t")],
        "sabcdt",
    )
    assert shape(decompose(units_of_graph(g))) == ("S", "s", ("S", "a", "b", "c", "d"), "t")


def test_coarsen_merges_cheap_chain_links_only_under_the_limit() -> None:
    g = _equal_ops([("a", "b"), ("b", "c"), ("c", "d")], "abcd")
    assert sorted(coarsen(g, max_time=2.0).nodes) == [("a", "b"), ("c", "d")]
    assert coarsen(g, max_time=0.5).number_of_nodes() == 4


# -- the DP against brute force ----------------------------------------------------------------


def brute_force_sequential(units: nx.DiGraph, c: CostModel, devices: int) -> float:
    """min over contiguous splits and replica counts of max(stage times, cut transfers)."""
    order = [leaf.unit for leaf in linearise(units).children]
    n, best = len(order), float("inf")
    pos = {u: i for i, u in enumerate(order)}
    last_use = {}
    for a, b, data in units.edges(data=True):
        for t in data["tensors"]:
            last_use[t] = (pos[a], max(last_use.get(t, (0, -1))[1], pos[b]))
    for cuts in itertools.chain.from_iterable(
        itertools.combinations(range(1, n), k) for k in range(n)
    ):
        bounds = [0, *cuts, n]
        pieces = [order[a:b] for a, b in itertools.pairwise(bounds)]
        crossing = [
            sum(units.graph["tensor_bytes"][t] for t, (s, e) in last_use.items() if s < p <= e)
            for p in cuts
        ]
        comm = max((c.link.transfer(x) for x in crossing), default=0.0)
        for reps in itertools.product(range(1, devices + 1), repeat=len(pieces)):
            if sum(reps) > devices:
                continue
            worst = comm
            for i, (piece, r) in enumerate(zip(pieces, reps, strict=True)):
                time = sum(units.nodes[u]["forward"] + units.nodes[u]["backward"] for u in piece)
                params = frozenset().union(*(units.nodes[u]["params"] for u in piece))
                pbytes = sum(units.graph["param_bytes"][p] for p in params)
                act = sum(units.nodes[u]["act"] for u in piece)
                if not c.memory.fits(c.stage_memory(pbytes, act, len(pieces) - i, r)):
                    worst = float("inf")
                worst = max(worst, c.stage_time(time, pbytes, r))
            best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_sequential_dp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    units = units_of_graph(random_dag(rng, rng.randint(3, 7)))
    devices = rng.randint(1, 3)
    budget = rng.choice([None, 30000.0, 60000.0])
    c = cost(micro_batches=rng.choice([2, 4]), budget=budget)
    expected = brute_force_sequential(units, c, devices)
    if expected == float("inf"):
        with pytest.raises(PlanError, match="memory budget"):
            search(units, linearise(units), c, devices, objective="bottleneck")
    else:
        found = search(units, linearise(units), c, devices, objective="bottleneck")
        assert found.tau == pytest.approx(expected, rel=1e-9)


# -- graph partitioner vs sequential ------------------------------------------------------------


@pytest.mark.parametrize("objective", ["pipeline", "bottleneck"])
def test_graph_partitioner_never_worse_than_sequential_on_random_dags(objective: str) -> None:
    own, shallower = 0, 0
    for seed in range(40):
        rng = random.Random(100 + seed)
        g = random_branchy(rng) if seed % 2 else random_dag(rng, rng.randint(6, 14))
        devices = rng.randint(2, min(6, g.number_of_nodes()))
        c = cost(micro_batches=4, bandwidth=1e9)
        options = {"devices": devices, "replication": seed % 4 < 2, "objective": objective}
        graph = partition_op_graph(g, c, PlanConfig(**options, layouts=ONE), "x")
        sequential = partition_op_graph(g, c, PlanConfig(**options, partitioner="sequential"), "x")
        assert score(graph, objective) <= score(sequential, objective), seed
        own += graph.info["chosen"] == "graph"  # the SP search itself, not the fallback
        shallower += graph.depth < sequential.depth
    assert own >= 36 and shallower >= 3


@pytest.mark.parametrize("objective", ["pipeline", "bottleneck"])
def test_unbudgeted_array_recursions_plan_as_the_budgeted_loops(objective: str) -> None:
    # without a budget the series rows are min-plus convolutions over numpy arrays; a budget
    # that never binds takes the per-(k, d) loops instead: the plans must be the same
    for seed in range(16):
        rng = random.Random(300 + seed)
        g = random_branchy(rng) if seed % 2 else random_dag(rng, rng.randint(6, 14))
        devices = rng.randint(2, min(6, g.number_of_nodes()))
        options = {"devices": devices, "replication": seed % 4 < 2, "objective": objective}
        free = partition_op_graph(g, cost(micro_batches=4), PlanConfig(**options), "x")
        roomy = cost(micro_batches=4, budget=1e30)
        loops = partition_op_graph(g, roomy, PlanConfig(**options), "x")
        assert [(s.nodes, s.devices) for s in free.stages] == [
            (s.nodes, s.devices) for s in loops.stages
        ], seed
        assert free.bottleneck == loops.bottleneck


def test_budgeted_tables_made_up_to_m_in_flight_plan_as_tables_for_every_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a replica holds at most M micro-batches, so with a budget the DP makes its tables for
    # in-flight counts up to M only and reads the deeper ones off them; made for every
    # count up to the device count instead, the plans must be the same
    def plans(every_count: bool) -> list[Any]:
        made: list[Any] = []
        init = search_module._Search.__init__

        def made_up_to(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if every_count:
                self.top_k = self.depth_bound

        monkeypatch.setattr(search_module._Search, "__init__", made_up_to)
        for seed in range(24):  # fewer micro-batches than devices: counts past M in the tables
            made.append(_budgeted_plan(random.Random(500 + seed), seed, 1 + seed % 3, 0.8, 4))
        monkeypatch.undo()
        return made

    fewer, every = plans(every_count=False), plans(every_count=True)
    assert fewer == every
    assert sum(not isinstance(x, str) for x in fewer) >= 12  # most are planned


def test_a_budget_is_searched_only_at_the_taus_where_it_binds_a_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # below the least stage time of a piece over the budget (`_binding_tau`), no piece
    # that meets tau is over it, so those taus are solved with the unbudgeted tables;
    # searched with the budget at every tau instead, the plans must be the same
    unbudgeted_taus = 0

    def plans(everywhere: bool) -> list[Any]:
        nonlocal unbudgeted_taus
        made: list[Any] = []
        init, feasible = search_module._Search.__init__, search_module._Search.feasible

        def budget_at_every_tau(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if everywhere and self.budgeted:
                self.binding = 0.0

        def counted(self: Any, tau: float) -> Any:
            found = feasible(self, tau)
            nonlocal unbudgeted_taus
            unbudgeted_taus += not everywhere and self.binding < math.inf and not self.budgeted
            return found

        monkeypatch.setattr(search_module._Search, "__init__", budget_at_every_tau)
        monkeypatch.setattr(search_module._Search, "feasible", counted)
        for seed in range(24):
            share = 0.7 + 0.15 * (seed % 3)
            made.append(_budgeted_plan(random.Random(700 + seed), seed, 2 + seed % 4, share, 3))
        monkeypatch.undo()
        return made

    shortcut, everywhere = plans(everywhere=False), plans(everywhere=True)
    assert shortcut == everywhere
    assert sum(not isinstance(x, str) for x in shortcut) >= 12  # most are planned
    assert unbudgeted_taus >= 50  # the shortcut was taken


def _budgeted_plan(rng: random.Random, seed: int, m: int, share: float, fewest: int) -> Any:
    """A random graph (branchy for odd seeds) on `fewest` to 8 devices, planned at M = `m`
    under a budget of `share` of its unbudgeted plan's largest stage: its stages and
    bottleneck, or the PlanError's message."""
    g = random_branchy(rng) if seed % 2 else random_dag(rng, rng.randint(8, 14))
    config = PlanConfig(
        devices=min(rng.randint(fewest, 8), g.number_of_nodes()),
        replication=seed % 4 < 2,
        objective=("pipeline", "bottleneck")[seed % 2],
    )
    loose = partition_op_graph(g, cost(micro_batches=m), config, "x")
    budget = share * max(st.memory_bytes for st in loose.stages)
    try:
        p = partition_op_graph(g, cost(micro_batches=m, budget=budget), config, "x")
    except PlanError as exc:
        return str(exc)
    return [(st.nodes, st.devices) for st in p.stages], p.bottleneck


def test_stage_times_array_equals_stage_time_per_replica_count() -> None:
    for m, pbytes in itertools.product((1, 3, 8, 64), (0.0, 12345.0, 7e9)):
        c = CostModel(1, m, LinkModel(bandwidth=3e9, latency=7e-6))
        expected = [c.stage_time(0.0123, pbytes, r) for r in range(1, 41)]
        assert c.stage_times(0.0123, pbytes, 40).tolist() == expected  # bit for bit


def test_memory_budget_is_respected_and_infeasible_budget_is_an_error() -> None:
    rng = random.Random(7)
    g = random_dag(rng, 10)
    c = cost(micro_batches=8, budget=60000.0)
    p = partition_op_graph(g, c, PlanConfig(devices=4, replication=True), "x")
    assert all(s.memory_bytes <= 60000 for s in p.stages)
    unlimited = partition_op_graph(
        g, cost(micro_batches=8), PlanConfig(devices=4, replication=True), "x"
    )
    assert max(s.memory_bytes for s in unlimited.stages) > 60000  # the budget changed the plan
    with pytest.raises(PlanError, match="memory budget"):
        partition_op_graph(g, cost(budget=100.0), PlanConfig(devices=4, replication=True), "x")


def test_a_named_schedule_is_planned_at_the_micro_batches_its_order_holds() -> None:
    """Costed at 1F1B's counts, the best plan for 8 equal ops on 4 devices is two stages of
    two replicas (2 and 1 in flight); under zb its first stage holds 4 per replica, over the
    budget. Planned for zb, every stage is costed at what zb holds and the plan fits; gpipe
    (8 held) fits nowhere and is refused by name."""
    names = [f"op{i}" for i in range(8)]
    g = synthetic(
        list(itertools.pairwise(names)), dict.fromkeys(names, 3e-3), dict.fromkeys(names, 1000)
    )
    c = cost(micro_batches=8, budget=20000.0)

    def planned(schedule: str | None) -> Any:
        config = PlanConfig(devices=4, schedule=schedule, layouts=("one",), replication=True)
        return partition_op_graph(g, c, config, "x")

    def peak_under_zb(p: Any) -> int:
        return max(s.memory_bytes for s in for_schedule(p, make_schedule(p, "zb")).stages)

    for_1f1b, for_zb = planned(None), planned("zb")
    assert [s.replicas for s in for_1f1b.stages] == [2, 2]
    assert peak_under_zb(for_1f1b) > 20000
    assert len(for_zb.stages) == 4 and peak_under_zb(for_zb) <= 20000
    assert max(simulate(for_zb, "zb").peak_memory) <= 20000
    with pytest.raises(PlanError, match="schedule 'gpipe' holds 8 micro-batches in flight"):
        planned("gpipe")


# -- on real models ----------------------------------------------------------------------------


def _branch_devices(p: object, prefix: str) -> set[tuple[int, ...]]:
    return {
        p.stages[p.stage_of[n]].devices
        for n in p.stage_of  # type: ignore[attr-defined]
        if n.startswith(prefix)
    }


def test_symmetric_two_branch_model_puts_branches_on_different_devices() -> None:
    model, x = TwoBranch(width=64, depth=4), torch.randn(8, 64)
    p = plan(model, x, devices=2, micro_batches=4, replication=False, profile=FLOPS, layouts=ONE)
    a, b = _branch_devices(p, "a_"), _branch_devices(p, "b_")
    assert len(a) == 1 and len(b) == 1 and a != b


def test_graph_plan_runs_branches_concurrently_at_equal_bottleneck() -> None:
    # two branches of 4 equal ops each, then a tail of 4: three devices balance either way,
    # but only the graph plan runs the branches side by side
    edges = [
        ("a0", "a1"),
        ("a1", "a2"),
        ("a2", "a3"),
        ("b0", "b1"),
        ("b1", "b2"),
        ("b2", "b3"),
        ("a3", "t0"),
        ("b3", "t0"),
        ("t0", "t1"),
        ("t1", "t2"),
        ("t2", "t3"),
    ]
    names = [n for e in edges for n in e]
    g = synthetic(edges, dict.fromkeys(names, 1e-3), dict.fromkeys(names, 100))
    c = cost(micro_batches=4, bandwidth=1e9)
    graph = partition_op_graph(g, c, PlanConfig(devices=3, replication=False, layouts=ONE), "x")
    sequential = partition_op_graph(
        g, c, PlanConfig(devices=3, replication=False, partitioner="sequential"), "x"
    )
    assert graph.bottleneck == pytest.approx(sequential.bottleneck)
    assert (graph.depth, sequential.depth) == (2, 3)
    assert graph.stages[0].in_flight < sequential.stages[0].in_flight
    assert {graph.stage_of["a0"], graph.stage_of["b0"]} == {0, 1}


def test_more_devices_than_ops_is_an_error() -> None:
    with pytest.raises(PlanError, match="9 devices for a graph of only 2 ops"):
        plan(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.randn(4, 2), devices=9)


def test_batch_that_does_not_split_is_an_error() -> None:
    with pytest.raises(ConfigError, match="batch of 6 does not split into 4"):
        plan(nn.Linear(2, 2), torch.randn(6, 2), devices=1, micro_batches=4)


def test_unknown_option_is_named() -> None:
    with pytest.raises(ConfigError, match="micro_batchs"):
        plan(nn.Linear(2, 2), torch.randn(4, 2), devices=1, micro_batchs=2)


# -- manual pins -------------------------------------------------------------------------------


def test_pins_place_modules_and_the_rest_follows() -> None:
    model, x = TwoBranch(width=8, depth=2), torch.randn(4, 8)
    p = plan(model, x, devices=3, pins={"a": 0, "b": 1, "head": 2})
    assert p.partitioner == "manual"
    assert _branch_devices(p, "a_") == {(0,)} and _branch_devices(p, "b_") == {(1,)}
    assert p.stage_of["cat"] == 1  # joins the latest stage among its inputs
    assert p.stage_of["head"] == 2 and p.stage_of["output"] == 2


def test_bad_pins_are_rejected() -> None:
    model, x = TwoBranch(width=8, depth=2), torch.randn(4, 8)
    with pytest.raises(ConfigError, match="'nope'"):
        plan(model, x, devices=2, pins={"a": 0, "nope": 1})
    with pytest.raises(PlanError, match="cycle|not convex"):
        # the head before branch a: values flow back from stage 1 to stage 0
        plan(model, x, devices=2, pins={"head": 0, "a": 1})


# -- only tensors cross stages -----------------------------------------------------------------


class SizeLater(nn.Module):
    """Reads the sizes of an intermediate tensor and uses them in a reshape after the layers."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, N, C)
        h = self.embed(x)  # (B, N, C)
        B, N, C = h.shape  # a torch.Size, then three ints
        h = h.flatten(0, 1)  # (B*N, C)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h.view(B, N, C).mean(1))  # (B, 4)


class SplitBranches(nn.Module):
    """A stem whose output is split (torch.split) and unbound (unbind) into four branches."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.width = width
        self.stem = nn.Linear(width, 2 * width)
        self.branches = nn.ModuleList(
            nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]) for _ in range(4)
        )
        self.head = nn.Linear(4 * width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C)
        h = self.stem(x)  # (B, 2C)
        left, right = torch.split(h, self.width, dim=1)  # a tuple: 2 x (B, C)
        up, down = h.view(-1, 2, self.width).unbind(1)  # a tuple: 2 x (B, C)
        parts = [b(p) for b, p in zip(self.branches, (left, right, up, down), strict=True)]
        return self.head(torch.cat(parts, 1))  # (B, 4)


def _traced_op_graph(model: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, nx.DiGraph]:
    gm = trace(model, x, micro_batch_size=2)
    return gm, op_graph(gm, profile(gm, (x[:2],), 2, FLOPS))


def _crossing_non_tensors(p: object, gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    nodes = {n.name: n for n in gm.graph.nodes}
    return [
        (t, value_kind(nodes[t]))
        for e in p.edges  # type: ignore[attr-defined]
        for t in e.tensors
        if value_kind(nodes[t]) != "tensor"
    ]


def test_op_graph_marks_non_tensor_values() -> None:
    _, g = _traced_op_graph(SizeLater(), torch.randn(8, 5, 16))
    kinds = {n: g.nodes[n]["value"] for n in g if not g.nodes[n]["tensor"]}
    assert kinds == {
        "getattr_1": "torch.Size",
        "getitem": "int",
        "getitem_1": "int",
        "getitem_2": "int",
    }
    _, g = _traced_op_graph(SplitBranches(), torch.randn(8, 16))
    kinds = {n: g.nodes[n]["value"] for n in g if not g.nodes[n]["tensor"]}
    assert kinds == {"split": "tuple", "unbind": "tuple"}


@pytest.mark.parametrize("model_x", ["size_later", "split_branches"])
@pytest.mark.parametrize("partitioner", ["graph", "sequential"])
def test_no_plan_cuts_a_non_tensor_value(model_x: str, partitioner: str) -> None:
    model, x = (
        (SizeLater(), torch.randn(8, 5, 16))
        if model_x == "size_later"
        else (SplitBranches(), torch.randn(8, 16))
    )
    gm, g = _traced_op_graph(model, x)
    for devices in (2, 3, 4, 5):
        config = PlanConfig(devices=devices, partitioner=partitioner, replication=False)
        p = partition_op_graph(g, cost_model(config, 2), config, "x")
        assert len(p.stages) >= 2
        assert _crossing_non_tensors(p, gm) == [], (devices, [e.tensors for e in p.edges])
        for n in g:
            if not g.nodes[n]["tensor"]:
                assert {p.stage_of[u] for u in g.successors(n)} <= {p.stage_of[n]}, n
        validate_plan(p, gm)


def test_without_the_tensor_flags_the_int_would_be_cut() -> None:
    # the same graph with every value taken for a tensor is cut right after the size query,
    # and validating that plan against the traced graph names the ints
    gm, g = _traced_op_graph(SizeLater(), torch.randn(8, 5, 16))
    plain = g.copy()
    nx.set_node_attributes(plain, True, "tensor")
    config = PlanConfig(devices=3, replication=False, layouts=ONE)
    p = partition_op_graph(plain, cost_model(config, 2), config, "x")
    assert ("getitem_1", "int") in _crossing_non_tensors(p, gm)
    with pytest.raises(PlanError, match=r"'getitem_1' \(int\) crosses from S"):
        validate_plan(p, gm)


def test_pins_that_split_a_non_tensor_value_are_rejected() -> None:
    model, x = SizeLater(), torch.randn(8, 5, 16)
    with pytest.raises(PlanError, match=r"'getitem_1' \(int\).*must share a stage"):
        plan(model, x, devices=2, pins={"getitem_1": 0, "layers.2": 1, "view": 1})
    # unpinned, the size query follows its pinned users
    p = plan(model, x, devices=2, pins={"layers.2": 1})
    assert p.stage_of["getattr_1"] == p.stage_of["getitem_1"] == p.stage_of["view"] == 1


# -- folding dead ends and constants -----------------------------------------------------------


def test_bound_groups_close_over_paths_between_members() -> None:
    # an int read by two ops with a path between them binds the path too
    edges = [("x", "size"), ("size", "v1"), ("x", "v1"), ("v1", "t"), ("t", "v2"), ("size", "v2")]
    g = _equal_ops(edges, ["x", "size", "v1", "t", "v2"])
    g.nodes["size"]["tensor"] = False
    assert bound_groups(g) == [("x",), ("size", "v1", "t", "v2")]


def test_dead_ends_fold_into_their_latest_producer_and_keep_series_cuts() -> None:
    # a chain a -> b -> c -> output with an assert on a and a check chain on b (and b's
    # shape: a non-tensor read by the assert), and an input-less log call
    edges = [
        ("a", "b"),
        ("b", "c"),
        ("c", "output"),
        ("a", "assert_a"),
        ("a", "shape_b"),
        ("b", "shape_b"),
        ("shape_b", "assert_b"),
    ]
    g = _equal_ops(edges, ["log", "a", "assert_a", "b", "shape_b", "assert_b", "c", "output"])
    g.nodes["shape_b"]["tensor"] = False
    assert folded_groups(g) == [
        ("log", "a", "assert_a"),
        ("b", "shape_b", "assert_b"),
        ("c",),
        ("output",),
    ]
    assert isinstance(decompose(units_of_graph(g)), Parallel)  # unfolded: log stands apart
    tree = decompose(coarsen(g, max_time=0.0, groups=folded_groups(g)))
    assert isinstance(tree, Series)
    assert [c.unit for c in tree.children if isinstance(c, Leaf)] == folded_groups(g)


def test_constants_read_by_the_layers_fold_into_their_first_consumer() -> None:
    # a table built from nothing (arange -> table), viewed by each layer (view0, view1):
    # the views join their layers, the table stays free, and layer 0 | layer 1 is a cut
    edges = [("x", "l0"), ("l0", "l1"), ("arange", "table"), ("table", "view0")]
    edges += [("table", "view1"), ("view0", "l0"), ("view1", "l1"), ("l1", "output")]
    names = ["x", "arange", "table", "view0", "view1", "l0", "l1", "output"]
    g = _equal_ops(edges, names)
    # unfolded, view1 (before l0 in graph order) leaves layer 0 no series cut: linearised
    assert shape(decompose(units_of_graph(g))) == (
        "S",
        ("S", "x", "arange", "table", "view0", "view1", "l0"),
        "l1",
        "output",
    )
    nx.set_node_attributes(g, {n: True for n in ("arange", "table", "view0", "view1")}, "constant")
    groups = folded_groups(g)
    assert groups == [
        ("x",),
        ("arange",),
        ("table",),
        ("view0", "l0"),
        ("view1", "l1"),
        ("output",),
    ]
    assert shape(decompose(coarsen(g, max_time=0.0, groups=groups))) == (
        "S",
        ("P", "x", ("S", "arange", "table")),
        "view0",
        "view1",
        "output",
    )


def test_folded_groups_are_kept_per_structure_and_never_stale() -> None:
    """The mesh search folds one structure at many row counts: the groups are made once per
    what `folded_groups` reads, and an attribute it reads changes them."""
    edges = [("x", "l0"), ("l0", "l1"), ("arange", "table"), ("table", "view0")]
    edges += [("table", "view1"), ("view0", "l0"), ("view1", "l1"), ("l1", "output")]
    names = ["x", "arange", "table", "view0", "view1", "l0", "l1", "output"]
    plain = folded_groups(_equal_ops(edges, names))
    g = _equal_ops(edges, names)
    nx.set_node_attributes(g, {n: 7.0 for n in g}, "forward")  # other times: the same fold
    assert folded_groups(g) == plain
    folded_groups(g).clear()  # each call's own list
    assert folded_groups(g) == plain
    nx.set_node_attributes(g, {n: True for n in ("arange", "table", "view0", "view1")}, "constant")
    assert folded_groups(g) != plain
    assert ("view0", "l0") in folded_groups(g)


def test_a_series_ranges_read_lazily_equal_the_accumulators_sums() -> None:
    """CandidateStages keeps a series' ranges as arrays (`StatsTable`): every range read equals the
    stats `_Accumulator` adds up one unit at a time (a shared parameter counted once), a
    range past the series is no piece, and the least memory is every range's least."""
    names = [f"op{i}" for i in range(6)]
    rng = random.Random(7)
    params = {n: frozenset({f"{n}.w"}) for n in names}
    params["op4"] = frozenset({"op1.w", "op4.w"})  # op4 reads op1's weight too
    g = synthetic(
        list(itertools.pairwise(names)),
        {n: rng.uniform(0.5, 4.0) for n in names},
        {n: rng.choice([100, 1000, 20000]) for n in names},
        params,
    )
    units = units_of_graph(g)
    tree = linearise(units)
    cost = CostModel(1, 4, LinkModel(bandwidth=3e9, latency=7e-6))
    least = CandidateStages(units, tree, cost, max_replicas=1).smallest_memory()  # before any read
    pieces = CandidateStages(units, tree, cost, max_replicas=1)
    order = units_of(tree)
    every = []
    for a in range(len(order)):
        acc = _Accumulator(units)
        for b in range(a, len(order)):
            acc.add(order[b])
            key = ("range", id(tree), a, b)
            assert key in pieces.stats
            assert pieces.stats[key] == acc.stats()
            every.append(acc.stats())
    assert ("range", id(tree), 2, len(order)) not in pieces.stats
    with pytest.raises(KeyError):
        pieces.stats[("range", id(tree), 3, 2)]
    assert least == min(cost.stage_memory(x.pbytes, x.act, 1, 1) for x in every)


# -- condensing large trees ------------------------------------------------------------------------


def test_condense_bounds_the_units_and_keeps_plans_valid() -> None:
    rng = random.Random(3)
    g = random_branchy(rng)
    units = coarsen(g, max_time=0.0)
    units.graph["tensor_bytes"] = {n: g.nodes[n]["act"] for n in g}
    tree = decompose(units)
    small, small_tree = condense(g, units, tree, max_units=6)
    assert small.number_of_nodes() <= 6
    assert sorted(n for u in small for n in u) == sorted(g)
    assert sorted(units_of(small_tree)) == sorted(small)
    assert condense(g, units, tree, max_units=units.number_of_nodes()) == (units, tree)
    for partitioner in ("graph", "sequential"):
        config = PlanConfig(devices=3, max_units=4, partitioner=partitioner)
        p = partition_op_graph(g, cost(bandwidth=1e9), config, "x")
        assert p.info["units"] <= max(4, 4 * 3)


def test_condense_counts_the_units_a_limit_leaves_as_it_builds_them() -> None:
    """condense's bisection counts units without building trees: the count must be the
    built tree's, at every limit, on series, parallel and linearised trees."""
    for seed in range(5):
        g = random_branchy(random.Random(seed))
        units = coarsen(g, max_time=0.0)
        for tree in (decompose(units), linearise(units)):
            time: dict[int, float] = {}
            total = _subtree_times(units, tree, time)
            for limit in [total * f for f in (0.0, 0.01, 0.05, 0.1, 0.3, 0.7, 1.0)]:
                built = _condensed(g, tree, limit, time)
                assert _condensed_count(tree, limit, time) == len(units_of(built))


def test_the_linear_partition_keeps_the_first_least_cut_of_the_loop() -> None:
    """even_chain's DP as array rows: the same cuts as the loop over (k, i, j), ties too."""

    def looped(times: list[float], parts: int) -> list[int]:
        n, prefix = len(times), list(itertools.accumulate(times, initial=0.0))
        best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
        back = [[0] * (n + 1) for _ in range(parts + 1)]
        best[0][0] = 0.0
        for k, i in itertools.product(range(1, parts + 1), range(n + 1)):
            for j in range(k - 1, i) if k <= i <= n - (parts - k) else ():
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], back[k][i] = value, j
        cuts = [n]
        for k in range(parts, 0, -1):
            cuts.append(back[k][cuts[-1]])
        return cuts[::-1]

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 16)
        times = [rng.choice([0.5, 1.0, 2.0, rng.random()]) for _ in range(n)]
        parts = rng.randint(1, n)
        assert _cuts(times, parts) == looped(times, parts), (times, parts)


def _normed(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    conv = [nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)]
    return nn.Sequential(conv[0], norm, nn.ReLU(), conv[1])  # heavy compute, few parameters


def test_a_stage_that_updates_buffers_is_never_replicated() -> None:
    """Replicas of a BatchNorm would each see only their own micro-batches, and their running
    statistics would differ from one device's; a GroupNorm holds no such state."""
    x = torch.randn(16, 3, 32, 32)
    free = plan(
        _normed(nn.GroupNorm(4, 16)), x, devices=2, micro_batches=4, profile=FLOPS, replication=True
    )
    assert [s.replicas for s in free.stages] == [2]  # data parallel over both devices
    bound = plan(
        _normed(nn.BatchNorm2d(16)), x, devices=2, micro_batches=4, profile=FLOPS, replication=True
    )
    assert all(s.replicas == 1 for s in bound.stages)


# -- graph interleaving ----------------------------------------------------------------------------


def towers(branches: int, depth: int, head: int) -> nx.DiGraph:
    """x -> `branches` towers of `depth` unit ops -> cat -> a head of `head` unit ops."""
    times, edges, ends = {"x": 0.01}, [], []
    for b in range(branches):
        prev = "x"
        for d in range(depth):
            times[f"t{b}_{d}"] = 1.0
            edges.append((prev, f"t{b}_{d}"))
            prev = f"t{b}_{d}"
        ends.append(prev)
    times["cat"] = 0.01
    edges += [(e, "cat") for e in ends]
    prev = "cat"
    for h in range(head):
        times[f"h{h}"] = 1.0
        edges.append((prev, f"h{h}"))
        prev = f"h{h}"
    return synthetic(edges, times, dict.fromkeys(times, 1000))


@pytest.mark.parametrize(
    ("branches", "depth", "head", "devices"), [(2, 4, 4, 2), (3, 3, 3, 3), (2, 6, 6, 3)]
)
def test_interleaving_folds_a_finer_stage_dag_when_it_simulates_faster(
    branches: int, depth: int, head: int, devices: int
) -> None:
    """Towers and a head on few devices: a device that ran a tower also runs part of the
    head, which beats the unfolded graph plan's simulated step."""
    g = towers(branches, depth, head)
    config = PlanConfig(devices=devices, micro_batches=8, replication=False, interleave=True)
    p = partition_op_graph(g, cost_model(config, 1), config, "x")
    note = p.info["interleave"]
    assert p.info["placement"].startswith("graph:")
    assert len(p.stages) > devices and {d for s in p.stages for d in s.devices} == set(
        range(devices)
    )
    assert note["interleaved_step"] < note["unfolded_step"]
    assert simulate(p, "graph_interleaved").iteration_time == pytest.approx(
        note["interleaved_step"]
    )
    check_run(p, "graph_interleaved", 8)  # deadlock-free under NCCL's and gloo's semantics
    plain = partition_op_graph(
        g, cost_model(config, 1), replace(config, interleave=False, layouts=ONE), "x"
    )
    assert simulate(plain, "1f1b").iteration_time == pytest.approx(note["unfolded_step"])


@pytest.mark.parametrize("seed", range(0, 12))
def test_interleaving_never_makes_a_plan_slower(seed: int) -> None:
    rng = random.Random(seed)
    g = random_branchy(rng) if seed % 2 else random_dag(rng, rng.randint(6, 14))
    config = PlanConfig(
        devices=rng.randint(2, 4), micro_batches=rng.choice([2, 4, 8]), interleave=True
    )
    p = partition_op_graph(g, cost_model(config, 1), config, "x")
    note = p.info["interleave"]
    folded = bool(p.shared_devices())
    name = "graph_interleaved" if folded else "1f1b"
    t = simulate(p, name).iteration_time
    assert t <= note["unfolded_step"] * (1 + 1e-9)
    assert folded == (note["interleaved_step"] is not None)


def test_interleaving_needs_the_graph_partitioner() -> None:
    with pytest.raises(ConfigError, match="'sequential'"):
        PlanConfig(devices=2, partitioner="sequential", interleave=True)


# -- layouts: the planner chooses one stage per device or several ---------------------------------

SLOW = ProfileConfig(mode="flops", device_flops=1e8)  # compute outweighs overheads and links


def _chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])  # 8 equal layers


def test_the_default_plan_folds_a_chain_when_that_simulates_faster() -> None:
    """8 equal layers on 4 devices, M = 8: a loop or V layout (2 stages per device, zero
    bubble) beats one stage per device; the plan says what was considered and why."""
    x = torch.randn(32, 32)
    p = plan(_chain(), x, devices=4, micro_batches=8, replication=False, profile=SLOW)
    note = p.info["layouts"]
    steps = {c["layout"]: c["step"] for c in note["considered"]}
    assert note["chosen"] in ("loop", "v") and len(p.stages) == 8 and p.shared_devices()
    assert steps[note["chosen"]] == min(s for s in steps.values() if s is not None)
    assert steps[note["chosen"]] < steps["one"]
    assert (p.layout, p.schedule) == (note["chosen"], note["schedule"])
    assert simulate(p).iteration_time == pytest.approx(steps[note["chosen"]])
    text = str(p)
    assert f"layout: {note['chosen']}" in text and f"run by {note['schedule']}" in text
    assert all(f"    {layout} " in text for layout in ("one", "loop", "v", "graph"))
    assert "graph no plan: a chain" in text  # a chain has no branches to fold
    check_run(p, note["schedule"], 8)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_named_one_stage_schedule_keeps_one_stage_per_device(schedule: str) -> None:
    x = torch.randn(32, 32)
    p = plan(_chain(), x, devices=4, micro_batches=8, replication=False, profile=SLOW,
             schedule=schedule)  # fmt: skip
    assert not p.shared_devices() and "layouts" not in p.info
    assert (p.layout, p.schedule) == ("one", schedule)  # the plan records the one named
    assert f"layout: one (one stage per device), run by {schedule}\n" in str(p)
    zbv = plan(_chain(), x, devices=4, micro_batches=8, profile=SLOW, schedule="zbv")
    assert zbv.info["layouts"]["chosen"] == "v" and (zbv.layout, zbv.schedule) == ("v", "zbv")
    assert [c["layout"] for c in zbv.info["layouts"]["considered"]] == ["v"]


def test_layout_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="layouts must be"):
        PlanConfig(devices=2, layouts=("zigzag",))
    with pytest.raises(ConfigError, match="'zbv' runs none of the layouts"):
        PlanConfig(devices=2, layouts=ONE, schedule="zbv")
    with pytest.raises(ConfigError, match="unknown schedule 'zz'"):
        PlanConfig(devices=2, schedule="zz")


def _compiled_chain_worker(schedules: list[str | None]) -> dict[str | None, dict[str, Any]]:
    """2 ranks, compile with no plan: the planner's layout and schedule, 3 SGD steps each."""
    x, target = _chain_batch()
    out = {}
    for schedule in schedules:
        pm = gp_compile(
            _chain(), x, loss_fn=F.mse_loss, optimizer=_sgd(), micro_batches=4,
            schedule=schedule, profile=SLOW, replication=False,
            runtime=RuntimeConfig(timeout=60),
        )  # fmt: skip
        losses = [pm.step(x * (s + 1), target=target) for s in range(3)]
        held = len(pm.plan.stages_on(dist.get_rank()))
        out[schedule] = {
            "losses": losses, "state": pm.state_dict(), "schedule": pm.schedule.name,
            "held": held,
        }  # fmt: skip
    return out


@pytest.fixture(scope="module")
def chain_runs() -> dict[str | None, dict[str, Any]]:
    return launch(_compiled_chain_worker, 2, args=([None, "1f1b"],), timeout=180)[0]


def _chain_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)


def _sgd() -> Any:
    return functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.mark.parametrize(("schedule", "held"), [(None, 2), ("1f1b", 1)])
def test_the_chosen_layout_trains_like_one_process(
    chain_runs: dict[str | None, dict[str, Any]], schedule: str | None, held: int
) -> None:
    """By default the 2-rank chain runs folded (2 stages per rank) under the schedule the
    planner chose; named 1f1b, one stage per rank. Either equals one process accumulating
    the same 4 micro-batches."""
    out = chain_runs[schedule]
    assert out["held"] == held
    assert out["schedule"] in (("zbv", "interleaved", "interleaved_zb") if held == 2 else ("1f1b",))
    model, (x, target) = _chain(), _chain_batch()
    opt = _sgd()(model.parameters())
    for s in range(3):
        total = 0.0
        for xs, ts in zip((x * (s + 1)).chunk(4), target.chunk(4), strict=True):
            loss = F.mse_loss(model(xs), ts)
            (loss / 4).backward()
            total += loss.item() / 4
        opt.step()
        opt.zero_grad()
        assert out["losses"][s] == pytest.approx(total, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(out["state"][key], value, rtol=1e-5, atol=1e-6)
