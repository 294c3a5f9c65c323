"""Report: plain-text tables of plans for terminals, logs and closing notes (tabulate)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import networkx as nx
from tabulate import tabulate

from graphpipe._units import format_bytes, format_time
from graphpipe.ir import Plan, Stage
from graphpipe.scheduling.simulate import SimResult

__all__ = ["compare_plans", "plan_summary", "plan_table", "schedule_summary", "schedule_table"]


def plan_table(plan: Plan, modules: dict[str, str] | None = None) -> str:
    """One row per stage: devices, ops, times, memory, in-flight count and inputs.

    Args:
        plan: The plan.
        modules: op name -> module path (from `node.meta["gp_module"]`), to say which
            modules a stage holds; without it ops are only counted.
    """
    inputs = {s.index: sorted(plan.stage_graph.predecessors(s.index)) for s in plan.stages}
    if plan.cost_model.dims.dp > 1:
        return _mesh_table(plan, modules, inputs)
    rows = [
        [
            f"S{s.index}",
            ",".join(map(str, s.devices)),
            _ops_summary(s, modules),
            format_time(s.forward_time),
            format_time(s.backward_time),
            format_time(s.time),
            format_bytes(s.memory_bytes),
            s.in_flight,
            ",".join(f"S{i}" for i in inputs[s.index]) or "-",
        ]
        for s in plan.stages
    ]
    headers = ["stage", "devices", "ops", "fwd", "bwd", "time/mb", "memory", "in flight", "from"]
    return tabulate(rows, headers=headers, tablefmt="simple")


def _mesh_table(plan: Plan, modules: dict[str, str] | None, inputs: dict[int, list[int]]) -> str:
    """`plan_table` for a plan with a dp dimension: a stage's pp coordinate, its dp ranks,
    and its dp link time per micro-batch (all-gathers + reduce-scatter / M)."""
    cost, k = plan.cost_model, plan.cost_model.dims.dp
    rows = [
        [
            f"S{s.index}",
            ",".join(map(str, s.devices)),
            k,
            _ops_summary(s, modules),
            format_time(s.forward_time),
            format_time(s.backward_time),
            format_time(
                cost.gather_time(s.param_bytes)
                + cost.dp_sync_time(s.param_bytes) / plan.micro_batches
            ),
            format_time(s.time),
            format_bytes(s.memory_bytes),
            s.in_flight,
            ",".join(f"S{i}" for i in inputs[s.index]) or "-",
        ]
        for s in plan.stages
    ]
    headers = [
        "stage",
        "pp",
        "dp",
        "ops",
        "fwd",
        "bwd",
        "dp link/mb",
        "time/mb",
        "memory",
        "in flight",
        "from",
    ]
    return tabulate(rows, headers=headers, tablefmt="simple")


def plan_summary(plan: Plan) -> str:
    """The predicted bottleneck and what it means, in one line."""
    slowest = max(plan.stages, key=lambda s: s.time)
    where = (
        f"stage S{slowest.index}"
        if slowest.time >= plan.bottleneck * (1 - 1e-9)
        else "a link (communication)"
    )
    return (
        f"{plan.partitioner} plan: {len(plan.stages)} stages on {plan.devices_used()}/"
        f"{plan.num_devices} devices, depth {plan.depth}; predicted bottleneck "
        f"{format_time(plan.bottleneck)} per micro-batch at {where}; "
        f"{plan.throughput:,.1f} samples/s; searched in {plan.search_time:.2f} s"
    ) + _mesh_summary(plan)


def _mesh_summary(plan: Plan) -> str:
    """ "; mesh pp 8 x dp 2 (sharded), tp 2", and what bound the other degrees when chosen."""
    mesh = plan.info.get("mesh", {})
    dp, tp = plan.cost_model.dims.dp, plan.cost_model.dims.tp
    if dp == 1 and tp == 1 and "summary" not in mesh:
        return ""
    text = f"; mesh {plan.mesh_words}, dp and tp uniform over the stages"
    if "summary" in mesh:
        text += f"; chosen: {mesh['summary']}"
    return text


def compare_plans(graph: Plan, sequential: Plan) -> str:
    """How the graph plan compares with the sequential one."""
    ratio = sequential.bottleneck / graph.bottleneck if graph.bottleneck > 0 else float("nan")
    return (
        f"graph vs sequential: {ratio:.2f}x throughput (bottleneck "
        f"{format_time(graph.bottleneck)} vs {format_time(sequential.bottleneck)}), depth "
        f"{graph.depth} vs {sequential.depth}, concurrent stages "
        f"{_width(graph)} vs {_width(sequential)}"
    )


def schedule_summary(name: str, result: SimResult) -> str:
    """A simulated run in one line: time per step, samples/s, the worst bubble."""
    worst = max(result.bubble, default=0.0)
    return (
        f"schedule {name}: {format_time(result.iteration_time)} per step, "
        f"{result.throughput:,.1f} samples/s, bubble up to {worst:.0%}, peak memory "
        f"{format_bytes(max(result.peak_memory, default=0))}"
    )


def schedule_table(plan: Plan, result: SimResult) -> str:
    """One row per device: its stage, idle share, in-flight peak and memory peak."""
    rows = []
    for rank in range(plan.num_devices):
        held = plan.stages_on(rank)
        rows.append(
            [
                rank,
                ",".join(f"S{s.index}" for s in held) or "-",
                f"{result.bubble[rank]:.1%}",
                result.peak_in_flight[rank],
                format_bytes(result.peak_memory[rank]),
            ]
        )
    return tabulate(
        rows, headers=["device", "stage", "bubble", "in flight", "peak memory"], tablefmt="simple"
    )


def _width(plan: Plan) -> int:
    """The most stages at one level (longest path from a source): how many run side by side."""
    g, level = plan.stage_graph, dict[int, int]()
    for s in nx.topological_sort(g):
        level[s] = 1 + max((level[p] for p in g.predecessors(s)), default=-1)
    return max(Counter(level.values()).values(), default=0)


def _ops_summary(stage: Stage, modules: dict[str, str] | None, limit: int = 3) -> str:
    """The stage's modules with their op counts, the most ops first: a numbered list's
    members by their indices (`model.layers.4-7(57)`: which layers a stage holds)."""
    if not modules:
        return f"{len(stage.nodes)} ops"
    groups: Counter[str] = Counter()
    members: dict[str, set[int]] = {}
    for n in stage.nodes:
        name, index = _group(modules.get(n, ""), n)
        groups[name] += 1
        if index is not None:
            members.setdefault(name, set()).add(index)
    shown = [
        ".".join(filter(None, (name, _ranges(members.get(name, set())))))
        + (f"({count})" if count > 1 else "")
        for name, count in groups.most_common(limit)
    ]
    more = len(groups) - len(shown)
    return " ".join(shown) + (f" +{more} more" if more > 0 else "")


def _group(module: str, op: str) -> tuple[str, int | None]:
    """Where an op is counted: the list above its first numbered module (`model.layers`,
    and its index 3 for `model.layers.3.mlp`), else the module's first two levels."""
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return _top(module, op), None


def _ranges(indices: set[int]) -> str:
    """`0-3,6`: sorted indices with runs joined."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _top(module: str, op: str, depth: int = 2) -> str:
    return ".".join(module.split(".")[:depth]) if module else op


def modules_of(nodes: Iterable[Any]) -> dict[str, str]:
    """op name -> module path, from fx nodes annotated by `graphpipe.tracing.tracer`."""
    return {n.name: str(n.meta.get("gp_module", "")) for n in nodes}
