"""Assemble: turn groups of ops with replica counts into a `Plan`, with every prediction filled in.

Every partitioner (graph, sequential, manual) ends here, so all plans are costed the same way:

- stages are ordered topologically (ties broken by graph order), devices handed out in that
  order, contiguous per stage;
- a stage edge carries each crossing tensor once, whatever the number of its consumers;
- a sequential plan is a chain: consecutive stages get an edge even when no tensor flows
  between them (a dependency-only edge, 0 bytes), as in PipeDream, so its depth is its
  number of stages and the baseline gains no concurrency the graph partitioner alone finds;
- in_flight(s) = min(M, stages on the longest path from s to a sink), the graph 1F1B count;
- with a dp dimension, a stage's forward and backward times carry the all-gathers that
  prefetch does not hide (`CostModel.exposed_gather`), so the simulator pays them too;
- the bottleneck is the largest of every stage's `time` and every stage's send and receive
  time: `link.transfer` of the bytes it sends (receives) per micro-batch, all edges together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import networkx as nx

from graphpipe.errors import PlanError
from graphpipe.ir import Plan, Stage, StageEdge, edges_to_sink, input_halves
from graphpipe.ir.cost import CostModel
from graphpipe.planning.opgraph import wire_bytes

__all__ = ["assemble", "bottleneck"]

Group = tuple[frozenset[str], int]  # op names, replicas


def assemble(
    g: nx.DiGraph,
    groups: Sequence[Group],
    cost: CostModel,
    num_devices: int,
    partitioner: str,
    graph_hash: str,
    search_time: float = 0.0,
    info: dict | None = None,
) -> Plan:
    """Build a Plan from op groups.

    Args:
        g: The op graph (`graphpipe.planning.opgraph.op_graph`).
        groups: One (op names, replicas) per stage; the ops must cover `g` exactly once.
        cost: The cost model to predict with.
        num_devices: Devices the plan is for.
        partitioner: Recorded in the plan.
        graph_hash: Digest of the traced graph.
        search_time: Seconds spent searching.
        info: Extra facts recorded in the plan.

    Returns:
        The plan. It is not validated here; call `Plan.validate`.

    Raises:
        PlanError: the groups need more devices than `num_devices`, or the stage graph they
            induce has a cycle (named).
    """
    needed = sum(r for _, r in groups)
    if needed > num_devices:
        raise PlanError(f"the stages need {needed} devices but only {num_devices} are available")
    order = _stage_order(g, groups)
    stage_of = {n: i for i, gi in enumerate(order) for n in groups[gi][0]}
    edges = _stage_edges(g, stage_of, chain=partitioner == "sequential", count=len(order))
    stage_graph = nx.DiGraph()
    stage_graph.add_nodes_from(range(len(order)))
    stage_graph.add_edges_from((e.src, e.dst) for e in edges)
    heights = {s: h + 1 for s, h in edges_to_sink(stage_graph).items()}  # stages, incl. itself
    halves = input_halves(edges)
    stages, next_device = [], 0
    for i, gi in enumerate(order):
        nodes, replicas = groups[gi]
        devices = tuple(range(next_device, next_device + replicas))
        next_device += replicas
        stage = _stage(g, i, nodes, devices, heights[i], cost)
        stages.append(replace(stage, input_half=i in halves))
    edges = _forward_only_ends(edges, stages)
    return Plan(
        stages=tuple(stages),
        edges=tuple(edges),
        num_devices=num_devices,
        cost_model=cost,
        partitioner=partitioner,
        bottleneck=bottleneck(stages, edges, cost),
        search_time=search_time,
        graph_hash=graph_hash,
        info=dict(info or {}),
    )


def _stage_order(g: nx.DiGraph, groups: Sequence[Group]) -> list[int]:
    """Group indices in a topological order of the stage graph."""
    group_of = {n: i for i, (nodes, _) in enumerate(groups) for n in nodes}
    quotient = nx.DiGraph()
    quotient.add_nodes_from(range(len(groups)))
    quotient.add_edges_from(
        (group_of[a], group_of[b]) for a, b in g.edges if group_of[a] != group_of[b]
    )
    first = {i: min(g.nodes[n]["order"] for n in nodes) for i, (nodes, _) in enumerate(groups)}
    try:
        return list(nx.lexicographical_topological_sort(quotient, key=first.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(quotient)
        names = " -> ".join(f"group {a}" for a, _ in cycle) + f" -> group {cycle[0][0]}"
        raise PlanError(f"the stage graph has a cycle: {names}") from None


def _forward_only_ends(edges: list[StageEdge], stages: Sequence[Stage]) -> list[StageEdge]:
    """No gradient or backward token along an edge into or out of a stage that runs forward
    only (`Stage.backward`): its values' gradients are nobody's."""
    out = []
    for e in edges:
        if stages[e.src].backward and stages[e.dst].backward:
            out.append(e)
        else:
            out.append(replace(e, grads=(), grad_bytes=0, token_back=False))
    return out


def _stage_edges(
    g: nx.DiGraph, stage_of: dict[str, int], chain: bool, count: int
) -> list[StageEdge]:
    crossing: dict[tuple[int, int], set[str]] = {}
    for a, b in g.edges:
        s, t = stage_of[a], stage_of[b]
        if s != t:
            crossing.setdefault((s, t), set()).add(a)
    if chain:
        for s in range(count - 1):
            crossing.setdefault((s, s + 1), set())
    edges = []
    for (s, t), names in sorted(crossing.items()):
        tensors = tuple(sorted(names, key=lambda n: g.nodes[n]["order"]))
        grads = tuple(n for n in tensors if g.nodes[n].get("grad", g.nodes[n].get("float", True)))
        edges.append(
            StageEdge(
                src=s,
                dst=t,
                tensors=tensors,
                bytes=int(sum(wire_bytes(g, n) for n in tensors)),
                grads=grads,
                grad_bytes=int(sum(wire_bytes(g, n) for n in grads)),
            )
        )
    return edges


def _stage(
    g: nx.DiGraph,
    index: int,
    nodes: frozenset[str],
    devices: tuple[int, ...],
    height: int,
    cost: CostModel,
) -> Stage:
    ordered = tuple(sorted(nodes, key=lambda n: g.nodes[n]["order"]))
    forward = sum(g.nodes[n]["forward"] for n in ordered)
    backward = sum(g.nodes[n]["backward"] for n in ordered)
    params = frozenset().union(*(g.nodes[n]["params"] for n in ordered))
    pbytes = int(sum(g.graph["param_bytes"].get(p, 0) for p in params))
    frozen = int(
        sum(g.graph["param_bytes"].get(p, 0) for p in params & g.graph.get("frozen", set()))
    )
    act = int(sum(g.nodes[n]["act"] for n in ordered))
    in_flight = min(height, cost.micro_batches)
    forward, backward = cost.exposed_gather(forward, backward, pbytes)  # dp all-gathers
    grad = any(g.nodes[n].get("grad", True) for n in ordered)
    return Stage(
        index=index,
        nodes=ordered,
        devices=devices,
        forward_time=forward,
        backward_time=backward,
        time=cost.stage_time(forward + backward, pbytes - frozen, len(devices)),  # grads reduced
        param_bytes=pbytes,
        activation_bytes=act,
        in_flight=in_flight,
        memory_bytes=int(cost.stage_memory(pbytes, act, in_flight, len(devices), frozen)),
        backward=grad,
        frozen_bytes=frozen,
    )


def bottleneck(stages: Sequence[Stage], edges: Sequence[StageEdge], cost: CostModel) -> float:
    """The slowest of every stage's compute, send and receive time, per micro-batch."""
    sent = {s.index: 0 for s in stages}
    received = dict(sent)
    for e in edges:
        sent[e.src] += e.bytes
        received[e.dst] += e.bytes
    comm = [cost.link.transfer(b) for b in (*sent.values(), *received.values())]
    return max([s.time for s in stages] + comm, default=0.0)
