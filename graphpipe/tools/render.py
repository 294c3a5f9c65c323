"""Render: graphviz pictures of the op graph and of the stage graph.

    render(plan)          the stage DAG: devices, times and memory per stage, bytes per edge
    render(gm)            the op graph, boxed by top-level module
    render(gm, plan)      the op graph, one coloured cluster per stage

Rendering returns a `graphviz.Digraph` and writes nothing; the caller chooses:
`render(gm, plan).render("plan", format="svg")` or `.pipe(format="svg")`.

Large graphs stay readable: past `max_nodes` ops, ops of the same module (at the deepest
module depth that fits) and the same stage are drawn as one box labelled with the module path
and its op count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import graphviz
from torch import fx

from graphpipe._torch import tree_flatten
from graphpipe._units import format_bytes, format_time
from graphpipe.errors import ConfigError
from graphpipe.ir import Plan

__all__ = ["render", "side_by_side", "stage_colour"]

PALETTE = (
    "#a6cee3",
    "#b2df8a",
    "#fb9a99",
    "#fdbf6f",
    "#cab2d6",
    "#ffff99",
    "#8dd3c7",
    "#bebada",
    "#fb8072",
    "#80b1d3",
    "#fdb462",
    "#b3de69",
)
IO_COLOUR = "#eeeeee"


def stage_colour(index: int) -> str:
    """The fill colour of stage `index`, shared by every picture graphpipe draws."""
    return PALETTE[index % len(PALETTE)]


def render(
    obj: fx.GraphModule | Plan, plan: Plan | None = None, *, max_nodes: int = 80
) -> graphviz.Digraph:
    """Draw a plan's stage graph, or an op graph (coloured by stage when a plan is given).

    Args:
        obj: A `Plan` (stage graph) or a traced `fx.GraphModule` (op graph).
        plan: With a GraphModule: the plan whose stages group and colour the ops.
        max_nodes: Op graphs with more ops are drawn module by module.

    Returns:
        The picture as a `graphviz.Digraph`.

    Raises:
        ConfigError: `obj` is neither, or `plan` was given with a Plan.

    Example:
        >>> import torch
        >>> from graphpipe.tracing.tracer import trace
        >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.randn(1, 2))
        >>> "digraph" in render(gm).source
        True
    """
    if isinstance(obj, Plan):
        if plan is not None:
            raise ConfigError(
                "render(plan) draws the stage graph; pass the GraphModule too "
                "as render(gm, plan) to draw ops by stage"
            )
        return _stage_graph(obj)
    if isinstance(obj, fx.GraphModule):
        return _op_graph(obj, plan, max_nodes)
    raise ConfigError(f"render() takes a Plan or an fx.GraphModule, got {type(obj).__name__}")


def _digraph(name: str) -> graphviz.Digraph:
    dot = graphviz.Digraph(name)
    dot.attr(rankdir="TB", fontname="Helvetica", fontsize="11", nodesep="0.25", ranksep="0.35")
    dot.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10")
    dot.attr("edge", fontname="Helvetica", fontsize="8", color="#555555")
    return dot


# -- the stage graph -----------------------------------------------------------------------


def side_by_side(plans: Sequence[Plan]) -> graphviz.Digraph:
    """Several plans' stage graphs in one picture, each in its own box (e.g. graph vs sequential).

    Args:
        plans: The plans, drawn left to right.

    Returns:
        The picture.
    """
    dot = _digraph("plans")
    for i, plan in enumerate(plans):
        box = graphviz.Digraph(name=f"cluster_plan{i}")
        _draw_stages(box, plan, prefix=f"p{i}_")
        box.attr(style="rounded", color="#888888")
        dot.subgraph(box)
    return dot


def _stage_graph(plan: Plan) -> graphviz.Digraph:
    dot = _digraph("stages")
    _draw_stages(dot, plan, prefix="")
    return dot


def _draw_stages(dot: graphviz.Digraph, plan: Plan, prefix: str) -> None:
    dot.attr(
        label=(
            f"{plan.partitioner} plan: {len(plan.stages)} stages on "
            f"{plan.devices_used()}/{plan.num_devices} devices, depth {plan.depth}, "
            f"bottleneck {format_time(plan.bottleneck)}/micro-batch"
        ),
        labelloc="t",
    )
    for s in plan.stages:
        label = (
            f"S{s.index}  devices {list(s.devices)}\n{len(s.nodes)} ops, "
            f"{format_time(s.time)}\n{format_bytes(s.memory_bytes)}, "
            f"{s.in_flight} in flight"
        )
        dot.node(f"{prefix}s{s.index}", label, fillcolor=stage_colour(s.index))
    for e in plan.edges:
        dot.edge(
            f"{prefix}s{e.src}",
            f"{prefix}s{e.dst}",
            label=f"{format_bytes(e.bytes)} ({len(e.tensors)})",
        )


# -- the op graph ----------------------------------------------------------------------------


def _op_graph(gm: fx.GraphModule, plan: Plan | None, max_nodes: int) -> graphviz.Digraph:
    nodes = [n for n in gm.graph.nodes if n.op != "get_attr"]
    ops = [n for n in nodes if n.op not in ("placeholder", "output")]
    group = _grouping(ops, plan, max_nodes)
    dot = _digraph("ops")
    clusters: dict[str, graphviz.Digraph] = {}
    sizes = Counter(group(n) for n in ops)
    declared: set[str] = set()
    for n in nodes:
        box = n.name if n.op in ("placeholder", "output") else group(n)
        if box in declared:
            continue
        declared.add(box)
        cluster_key = _cluster_of(n, plan)
        target = (
            dot
            if cluster_key is None
            else clusters.setdefault(cluster_key, graphviz.Digraph(name=f"cluster_{cluster_key}"))
        )
        target.node(box, _op_label(gm, n, box, sizes[box]), fillcolor=_fill(n, plan))
    for key, sub in clusters.items():
        sub.attr(label=_cluster_label(key, plan), style="rounded,dashed", color="#888888")
        dot.subgraph(sub)
    _op_edges(dot, nodes, group)
    return dot


def _grouping(ops: list[fx.Node], plan: Plan | None, max_nodes: int) -> Callable[[fx.Node], str]:
    """Map an op to the box drawing it: itself, or its module at the deepest depth that fits."""
    if len(ops) <= max_nodes:
        return lambda n: n.name
    stage_of = plan.stage_of if plan else {}
    depth = max(len(_module(n).split(".")) for n in ops)
    while depth > 0:
        keys = {_box_key(n, depth, stage_of) for n in ops}
        if len(keys) <= max_nodes:
            break
        depth -= 1
    return lambda n: _box_key(n, depth, stage_of)


def _module(n: fx.Node) -> str:
    return str(n.meta.get("gp_module", ""))


def _box_key(n: fx.Node, depth: int, stage_of: dict[str, int]) -> str:
    module = _module(n)
    if not module or depth == 0:
        return n.name
    prefix = ".".join(module.split(".")[:depth])
    stage = stage_of.get(n.name, "")
    return f"{prefix}@{stage}"


def _op_label(gm: fx.GraphModule, n: fx.Node, box: str, count: int) -> str:
    if n.op in ("placeholder", "output"):
        return f"input {n.name}" if n.op == "placeholder" else "output"
    if box != n.name:
        return f"{box.split('@')[0]}\n({count} ops)"
    if n.op == "call_module":
        return f"{n.target}\n{type(gm.get_submodule(str(n.target))).__name__}"
    module = _module(n)
    return f"{n.name}\nin {module}" if module else n.name


def _cluster_of(n: fx.Node, plan: Plan | None) -> str | None:
    if plan is None or n.op == "placeholder":
        return None
    stage = plan.stage_of.get(n.name)
    return None if stage is None else f"s{stage}"


def _cluster_label(key: str, plan: Plan | None) -> str:
    if plan is None:
        return key
    s = plan.stages[int(key[1:])]
    return f"S{s.index} on devices {list(s.devices)} ({format_time(s.time)})"


def _fill(n: fx.Node, plan: Plan | None) -> str:
    if plan is None or n.name not in plan.stage_of:
        return IO_COLOUR
    return stage_colour(plan.stage_of[n.name])


def _shape_label(n: fx.Node) -> str:
    leaves, _ = tree_flatten(n.meta.get("gp_outputs"))
    specs = [str(s) for s in leaves if s is not None]
    return specs[0] if len(specs) == 1 else f"{len(specs)} tensors" if specs else ""


def _op_edges(dot: graphviz.Digraph, nodes: list[fx.Node], group: Callable[[fx.Node], str]) -> None:
    def box(n: fx.Node) -> str:
        return n.name if n.op in ("placeholder", "output") else group(n)

    drawn: set[tuple[str, str]] = set()
    for n in nodes:
        for src in n.all_input_nodes:
            if src.op == "get_attr":
                continue
            a, b = box(src), box(n)
            if a != b and (a, b) not in drawn:
                drawn.add((a, b))
                dot.edge(a, b, label=_shape_label(src))
