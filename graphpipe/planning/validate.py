"""Validate a Plan: report every problem at once, naming the stages, devices and ops involved.

Checks that need only the plan:
    stage indices are 0..S-1 in order; every stage has ops and devices; devices lie in
    [0, num_devices); a device holding several stages holds
    unreplicated ones that fit the budget together; edges join existing, different stages;
    the stage graph is acyclic; every stage fits the memory budget.
Checks against the op graph (an fx.GraphModule from `graphpipe.tracing.tracer`, or its
networkx view):
    every op is in exactly one stage and the plan names no unknown op; every stage is convex
    (no path leaves it and comes back); every op edge across stages has its stage edge, and
    that edge lists the tensor; only single tensors cross stages (no tuple, int, torch.Size
    or None: the runtime sends tensors), known from the fx graph's `gp_outputs` or the op
    graph's `tensor` attribute (a networkx graph without it is taken to hold tensors only).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import networkx as nx
from torch import fx

from graphpipe.errors import PlanError
from graphpipe.ir import Plan, over_budget
from graphpipe.planning.opgraph import value_kind

__all__ = ["validate_plan"]


def validate_plan(plan: Plan, graph: Any = None) -> None:
    """Check `plan`, and its fit to `graph` when given.

    Args:
        plan: The plan.
        graph: The traced `fx.GraphModule`, or the networkx op graph, or None.

    Raises:
        PlanError: listing every problem found.
    """
    problems = _structure(plan)
    if graph is not None:
        problems += _against_graph(plan, _as_op_graph(graph))
    if problems:
        raise PlanError(f"invalid plan ({len(problems)} problems):", problems)


def _as_op_graph(graph: Any) -> nx.DiGraph:
    if isinstance(graph, nx.DiGraph):
        return graph
    if isinstance(graph, fx.GraphModule):
        g = nx.DiGraph()
        for order, node in enumerate(graph.graph.nodes):
            if node.op not in ("placeholder", "get_attr"):
                kind = value_kind(node)
                g.add_node(node.name, order=order, tensor=kind == "tensor", value=kind)
                g.add_edges_from(
                    (a.name, node.name)
                    for a in node.all_input_nodes
                    if a.op not in ("placeholder", "get_attr")
                )
        return g
    raise PlanError(f"can only validate against an fx.GraphModule or nx.DiGraph, got {type(graph)}")


def _structure(plan: Plan) -> list[str]:
    problems: list[str] = []
    count = len(plan.stages)
    for i, s in enumerate(plan.stages):
        if s.index != i:
            problems.append(
                f"stage at position {i} has index {s.index}; indices must be 0..{count - 1}"
            )
        if not s.nodes:
            problems.append(f"stage {s.index} has no ops")
        if not s.devices:
            problems.append(f"stage {s.index} has no devices")
        bad = [d for d in s.devices if not 0 <= d < plan.num_devices]
        if bad:
            problems.append(f"stage {s.index} uses devices {bad} outside 0..{plan.num_devices - 1}")
        budget = plan.cost_model.memory.budget
        if budget is not None and s.memory_bytes > budget:
            problems.append(
                f"stage {s.index} needs {s.memory_bytes} bytes per device, over the budget "
                f"of {budget:.0f}"
            )
    problems += _shared_devices(plan)
    for e in plan.edges:
        if not (0 <= e.src < count and 0 <= e.dst < count):
            problems.append(f"edge S{e.src}->S{e.dst} names a stage outside 0..{count - 1}")
        elif e.src == e.dst:
            problems.append(f"edge S{e.src}->S{e.dst} is a self-loop")
    if not problems and not nx.is_directed_acyclic_graph(plan.stage_graph):
        cycle = nx.find_cycle(plan.stage_graph)
        path = " -> ".join(f"S{a}" for a, _ in cycle) + f" -> S{cycle[0][0]}"
        problems.append(f"the stage graph has a cycle: {path}")
    return problems


def _shared_devices(plan: Plan) -> list[str]:
    """A device may hold several stages (interleaved placements) only if none of them is
    replicated, and their memory together must fit the budget."""
    problems = []
    owners = Counter(d for s in plan.stages for d in s.devices)
    over = dict(over_budget(plan))
    for device, n in sorted(owners.items()):
        if n < 2:
            continue
        held = plan.stages_on(device)
        replicated = [s.index for s in held if s.replicas > 1]
        if replicated:
            problems.append(
                f"device {device} holds stages {[s.index for s in held]}, of which "
                f"{replicated} are replicated; a device holding several stages needs them "
                "unreplicated"
            )
        if device in over:
            problems.append(
                f"device {device} holds stages {[s.index for s in held]} needing "
                f"{over[device]} bytes together, over the budget of "
                f"{plan.cost_model.memory.budget:.0f}"
            )
    return problems


def _against_graph(plan: Plan, g: nx.DiGraph) -> list[str]:
    problems: list[str] = []
    seen = Counter(n for s in plan.stages for n in s.nodes)
    unknown = sorted(n for n in seen if n not in g)
    if unknown:
        problems.append(f"ops not in the graph: {unknown}")
    twice = sorted(n for n, c in seen.items() if c > 1)
    if twice:
        where = {n: [s.index for s in plan.stages if n in s.nodes] for n in twice}
        problems.append(f"ops in more than one stage: {where}")
    missing = sorted(n for n in g if n not in seen)
    if missing:
        problems.append(f"ops in no stage: {missing}")
    if problems:
        return problems
    stage_of = plan.stage_of
    for stage in plan.stages:
        path = _leaves_and_returns(g, set(stage.nodes))
        if path:
            problems.append(
                f"stage {stage.index} is not convex: path {' -> '.join(path)} leaves it and "
                "comes back"
            )
    carried = {(e.src, e.dst): set(e.tensors) for e in plan.edges}
    for a, b in g.edges:
        s, t = stage_of[a], stage_of[b]
        if s != t and a not in carried.get((s, t), set()):
            problems.append(
                f"op edge {a} -> {b} crosses S{s}->S{t} but no stage edge carries {a!r}"
            )
    return problems + _non_tensor_crossings(plan, g)


def _non_tensor_crossings(plan: Plan, g: nx.DiGraph) -> list[str]:
    """A problem per non-tensor value that a stage edge carries or another stage uses."""
    stage_of = plan.stage_of
    listed: dict[str, set[int]] = {}
    for e in plan.edges:
        for name in e.tensors:
            listed.setdefault(name, set()).add(e.dst)
    problems = []
    for n in sorted(g, key=lambda n: g.nodes[n].get("order", 0)):
        data = g.nodes[n]
        if data.get("tensor", True):
            continue
        users = {u: stage_of[u] for u in g.successors(n) if stage_of[u] != stage_of[n]}
        stages = sorted(set(users.values()) | listed.get(n, set()))
        if stages:
            problems.append(
                f"{n!r} ({data.get('value', 'non-tensor')}) crosses from S{stage_of[n]} to "
                f"{', '.join(f'S{s}' for s in stages)} (users {sorted(users)}); only single "
                "tensors can cross stages: keep it in the stage of its users"
            )
    return problems


def _leaves_and_returns(g: nx.DiGraph, members: set[str]) -> list[str] | None:
    """A path that starts in `members`, goes outside and comes back, or None."""
    parent: dict[str, str] = {}
    frontier = [(m, o) for m in members for o in g.successors(m) if o not in members]
    for m, o in frontier:
        parent.setdefault(o, m)
    stack = [o for _, o in frontier]
    while stack:
        v = stack.pop()
        for w in g.successors(v):
            if w in members:
                path = [w, v]
                while path[-1] in parent:
                    path.append(parent[path[-1]])
                return path[::-1]
            if w not in parent:
                parent[w] = v
                stack.append(w)
    return None
