"""Mesh: plan over a ("pp", "dp", "tp") device mesh, with a given or a chosen dp degree.

    plan(model, inputs, devices=16, dp=2)       # a plan over pp = 8, each stage on 2 dp ranks
    plan(model, inputs, devices=16, dp="auto")  # every k dividing 16 and the micro-batch rows
    plan(model, inputs, devices=16, dp=2, tp=2, tp_plan={"blocks.*.fc1": "colwise",
                                                        "blocks.*.fc2": "rowwise"})  # pp = 4

Every stage of the plan runs on one pp coordinate and is sharded (FSDP2's `fully_shard`) over
its dp sub-mesh of k ranks; each dp rank takes 1/k of the rows of every micro-batch. The plan
is a plan over the N / k pp coordinates (`Plan.num_devices`), with k in its cost model
(`CostModel.dp`, whose docstring gives the costs). The planner plans one dp rank: its op graph
is the traced one with every op's forward and backward time and every output's bytes divided
by k (`per_rank_graph`). That assumes both are linear in the rows, as the FLOP estimate and
the activation bytes (bytes per sample x rows) are. A roofline profile is not: `partition`
re-costs it at b / k rows instead (a small slice pays its weight reads and launches in
full), and so does the fair protocol. A measured profile is scaled linearly (measuring at
b / k would need the model run again per k).

dp is uniform: every stage gets the same k. A graph plan whose towers of unequal cost would
each want their own dp degree needs dp sub-meshes of unequal size per pp coordinate, which
the runtime (one DeviceMesh of shape (pp, dp)) does not support.

Choosing k (`choose_mesh`): every k dividing N and the rows whose pp = N / k is at least 1 is
planned and its step simulated under the plan's default schedule; plans that do not fit the
memory budget (the partitioner's or the simulated peak) lose to those that do, then the
shortest step wins, then the smaller k. `Plan.info["mesh"]` says what bound each other k:

    memory      no plan fits the budget, or its simulated peak does not
    ops         pp = N / k is more than the graph's ops (not planned)
    depth       its pipeline is deeper (fill and drain) at no better bottleneck
    dp link     its all-gathers and reduce-scatters (per micro-batch) are at least half of
                its bottleneck
    bottleneck  its slowest stage or link is slower

Cost: one partition and one simulation per divisor k (6 at N = 32).

Tensor parallelism (`tp=t` with a `tp_plan`, module path -> style as
`graphpipe.runtime.tp` applies it): N = pp x dp x t and the planner plans one tp rank of one
dp rank (`tp_rank_graph`), as Megatron-LM splits a transformer:

    column-wise layer  its weight and bias split by output features: parameter bytes, time
                       and output / t; in the backward, an all-reduce of its input's
                       gradient (once per input: q, k and v reading one tensor share it)
    row-wise layer     its weight split by input features (its bias whole): parameter bytes
                       and time / t; in the forward, an all-reduce of its output
    between them       the ops on a path from a column-wise layer to a row-wise one without
                       another planned layer (attention by heads, an MLP's activation): time
                       and activation / t
    a column-wise layer whose output reaches no row-wise layer (an LM head): an all-gather
                       of its output in the forward, which stays whole
    every other op     whole on every tp rank (norms, residuals, embeddings kept whole)

Each all-reduce is a ring over t ranks on the tp link (`CostModel.tp_link`) and is added to
its op's forward or backward time, so stage times, the bottleneck and the simulator pay it.
The graph and sequential partitioners never cut between a column-wise layer and its row-wise
one (`fold.folded_groups`); pins may, and such a cut's gathers are not costed (the value is
made whole on the wire: an op's `wire` bytes stay whole where its `act` is divided). Times
are divided linearly, as dp's are (a roofline profile's weight reads shrink too; its
launches would not).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import networkx as nx

from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir import DEFAULT_SCHEDULE, Plan
from graphpipe.ir.cost import LinkModel
from graphpipe.planning.opgraph import wire_bytes
from graphpipe.scheduling.simulate import simulate

__all__ = [
    "TP_LAYOUTS",
    "check_rows",
    "check_tp_plan",
    "choose_mesh",
    "dp_degrees",
    "mesh_info",
    "path_matches",
    "per_rank_graph",
    "tp_layout",
    "tp_rank_graph",
    "tp_shards",
]

# a tp plan's style -> the layer's layout: "colwise" (split by output features), "rowwise"
# (by input features) or None (kept whole); Hugging Face's names (graphpipe.runtime.tp)
TP_LAYOUTS: dict[str, str | None] = {
    "colwise": "colwise",
    "colwise_rep": "colwise",
    "colwise_gather_output": "colwise",
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "embedding_rowwise": None,
}


def per_rank_graph(g: nx.DiGraph, k: float) -> nx.DiGraph:
    """The op graph one of k dp ranks runs: times and bytes of every op and edge / k.

    Args:
        g: The op graph (`opgraph.op_graph`) of a whole micro-batch.
        k: The dp degree (or any ratio of the traced rows to a rank's rows).

    Returns:
        `g` itself for k = 1, else a copy with forward, backward, act and edge bytes / k.
    """
    if k == 1:
        return g
    out = g.copy()
    for _, data in out.nodes(data=True):
        for key in ("forward", "backward", "act"):
            data[key] = data[key] / k
    for _, _, data in out.edges(data=True):
        data["bytes"] = data["bytes"] / k
    return out


def check_rows(dp: int, rows: int) -> None:
    """Refuse a dp degree that does not divide the micro-batch rows (the devices are the
    layout's check, `ParallelDims.on`).

    Raises:
        ConfigError: naming the degree and the rows.
    """
    if rows % dp:
        raise ConfigError(
            f"dp={dp} does not divide a micro-batch of {rows} rows: each dp rank takes 1/dp "
            "of every micro-batch"
        )


def dp_degrees(devices: int, rows: int) -> list[int]:
    """Every k dividing both the devices and the micro-batch rows, in increasing order."""
    return [k for k in range(1, devices + 1) if devices % k == 0 and rows % k == 0]


def check_tp_plan(tp: int, tp_plan: Mapping[str, str] | None) -> None:
    """Refuse tp > 1 without a plan, or a plan style the planner does not know (the degree
    is the layout's check, `ParallelDims`).

    Raises:
        ConfigError: naming the degree, or the entries.
    """
    if tp > 1 and not tp_plan:
        raise ConfigError(
            f"tp={tp} needs tp_plan={{module path: style}}: the layers tensor parallelism "
            "splits (graphpipe.runtime.tp.model_tp_plan reads a Hugging Face model's own)"
        )
    unknown = {k: v for k, v in (tp_plan or {}).items() if v not in TP_LAYOUTS}
    if unknown:
        raise ConfigError(f"tp_plan entries {unknown}: the styles are {sorted(TP_LAYOUTS)}")


def mesh_info(devices: int, dp: int, replication: bool, tp: int = 1) -> dict[str, Any]:
    """The facts `Plan.info["mesh"]` records for a plan with dp > 1 or tp > 1 (`devices`:
    pp x dp)."""
    info: dict[str, Any] = {
        "dp": dp,
        "pp": devices // dp,
        "uniform": "every stage has the same dp degree (one (pp, dp) DeviceMesh)",
    }
    if tp > 1:
        info["tp"] = tp
        info["uniform"] = "every stage has the same dp and tp degrees (one DeviceMesh)"
    if replication:
        why = "dp > 1" if dp > 1 else "tp > 1"
        info["replication"] = f"off: {why} replaces data-parallel replication inside pp"
    return info


Candidate = tuple[int, Plan | None, float, bool, str]  # k, plan, step, fits, why not


def choose_mesh(
    plan_at: Callable[[int], Plan],
    devices: int,
    degrees: Sequence[int],
    budget: float | None,
    ops: int,
) -> Plan:
    """The fastest plan over the dp degrees `degrees` (see the module docstring).

    Args:
        plan_at: k -> the plan over devices / k pp coordinates with dp degree k.
        devices: N, all devices of the mesh.
        degrees: The k to try.
        budget: Bytes per device, or None.
        ops: The graph's op count: a k whose pp = devices / k exceeds it is not planned.

    Returns:
        The chosen plan, with `info["mesh"]` naming the choice and what bound every other k,
        and the seconds spent on every k as its search time.

    Raises:
        PlanError: no k has a plan (every one's error is named).
    """
    start, tried = time.perf_counter(), list[Candidate]()
    for k in degrees:
        if devices // k > ops:
            why = f"ops: pp={devices // k} is more than the graph's {ops} ops"
            tried.append((k, None, float("inf"), False, why))
            continue
        try:
            p = plan_at(k)
        except PlanError as exc:
            why = f"memory: {exc}" if budget is not None else f"infeasible: {exc}"
            tried.append((k, None, float("inf"), False, why))
            continue
        run = simulate(p, DEFAULT_SCHEDULE)
        fits = budget is None or max(run.peak_memory, default=0) <= budget
        tried.append((k, p, run.iteration_time, fits, ""))
    planned = [c for c in tried if c[1] is not None]
    if not planned:
        reasons = "; ".join(f"dp={k}: {why}" for k, _, _, _, why in tried)
        raise PlanError(f"no dp degree of {list(degrees)} on {devices} devices plans: {reasons}")
    k, best, _, _, _ = min(planned, key=lambda c: (not c[3], c[2], c[0]))
    assert best is not None
    bound = {str(c[0]): _why_not(c, best, budget) for c in tried if c[0] != k}
    summary = f"dp={k} x pp={devices // k}" + "".join(
        f"; {why.split(':')[0]} binds dp={other}" for other, why in bound.items()
    )
    info = {
        **best.info.get("mesh", {"dp": 1, "pp": devices}),
        "chosen_by": "auto",
        "steps": {str(c[0]): c[2] for c in planned},
        "bound": bound,
        "summary": summary,
    }
    return replace(best, search_time=time.perf_counter() - start, info={**best.info, "mesh": info})


def _why_not(c: Candidate, best: Plan, budget: float | None) -> str:
    _, p, step, fits, error = c
    if p is None:
        return error
    if not fits:
        return f"memory: simulated peak over {budget:.4g} bytes"
    if p.depth > best.depth and p.bottleneck <= best.bottleneck * (1 + 1e-9):
        return f"depth: {p.depth} stages deep vs {best.depth}, step {step:.4g} s"
    cost = p.cost_model
    link = max(
        cost.gather_time(s.param_bytes) + cost.dp_sync_time(s.param_bytes) / p.micro_batches
        for s in p.stages
    )
    if link > 0 and link >= 0.5 * p.bottleneck:
        return f"dp link: {link:.4g} s per micro-batch of all-gather and reduce-scatter"
    if p.bottleneck > best.bottleneck:
        return f"bottleneck: {p.bottleneck:.4g} s per micro-batch vs {best.bottleneck:.4g}"
    return f"depth: {p.depth} stages deep vs {best.depth}, step {step:.4g} s"


# -- the tp dimension (module docstring) ----------------------------------------------------------


def path_matches(pattern: str, path: str) -> bool:
    """`path` is the module `pattern` names (`*`: any one path component).

    Example:
        >>> path_matches("layers.*.fc", "layers.3.fc"), path_matches("layers.*.fc", "layers.fc")
        (True, False)
    """
    regex = "\\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.fullmatch(regex, path) is not None


def tp_layout(param: str, plan: Mapping[str, str]) -> str | None:
    """The layout ("colwise", "rowwise") of the layer owning parameter `param` by `plan`, or
    None (kept whole: no entry, or a style that keeps it whole)."""
    module = param.rpartition(".")[0]
    style = next((s for pattern, s in plan.items() if path_matches(pattern, module)), None)
    return None if style is None else TP_LAYOUTS.get(style)


def tp_shards(param: str, layout: str | None) -> bool:
    """Whether a parameter of a layer of `layout` is split over tp: a column-wise layer's
    weight and bias, a row-wise layer's weight (its bias is added after the all-reduce)."""
    return layout == "colwise" or (layout == "rowwise" and not param.endswith(".bias"))


def tp_rank_graph(g: nx.DiGraph, t: int, plan: Mapping[str, str], link: LinkModel) -> nx.DiGraph:
    """The op graph one of t tp ranks runs under `plan` (the module docstring's costs).

    Args:
        g: The op graph (of one dp rank under a dp dimension).
        t: The tp degree.
        plan: The tp plan: module path ("*" for one component) -> style.
        link: The tp link, for the all-reduces and all-gathers.

    Returns:
        `g` itself for t = 1, else a copy with the planned layers' parameter bytes, times and
        sharded activations / t, every op's `wire` bytes (its whole output), and the
        collectives added to the ops' forward and backward times.
    """
    if t == 1:
        return g
    out = g.copy()
    sizes = dict(g.graph["param_bytes"])
    layouts = {p: tp_layout(p, plan) for p in sizes}
    for p, layout in layouts.items():
        if tp_shards(p, layout):
            sizes[p] = sizes[p] / t
    out.graph["param_bytes"] = sizes
    layers = _layers(g, layouts)
    region = _sharded_region(g, layers)
    for n, data in out.nodes(data=True):
        data["wire"] = wire_bytes(g, n)  # the whole value still crosses a cut
        if n in layers or n in region:
            data["forward"] /= t
            data["backward"] /= t
        if n in region or (layers.get(n) == "colwise" and _feeds(g, n, region, layers)):
            data["act"] /= t
            data["tp_split"] = True  # kept with its users by the search (`fold`)
    _add_collectives(g, out, layers, region, t, link)
    return out


def _layers(g: nx.DiGraph, layouts: Mapping[str, str | None]) -> dict[str, str]:
    """The ops computing with a split weight, by layout: those reading it, or reading a
    constant op that reads it (export's transposed weight, itself split work)."""
    layers: dict[str, str] = {}
    for n in nx.topological_sort(g):
        data = g.nodes[n]
        found = sorted({str(layouts[p]) for p in data["params"] if layouts.get(p)})
        if not found:
            found = sorted(
                {layers[u] for u in g.predecessors(n) if g.nodes[u]["constant"] and u in layers}
            )
        if found:
            layers[n] = found[-1]  # "rowwise" where an op somehow reads both
    return layers


def _sharded_region(g: nx.DiGraph, layers: Mapping[str, str]) -> set[str]:
    """The ops between a column-wise layer and a row-wise one: reached forward from a
    column-wise layer and backward from a row-wise one, through no other planned layer."""
    col = [n for n, kind in layers.items() if kind == "colwise" and not g.nodes[n]["constant"]]
    row = [n for n, kind in layers.items() if kind == "rowwise" and not g.nodes[n]["constant"]]
    ahead = _reach(col, g.successors, layers)
    behind = _reach(row, g.predecessors, layers)
    return ahead & behind


def _reach(starts: Iterable[str], step: Callable[[str], Iterable[str]], stop: Any) -> set[str]:
    """Ops reached from `starts` by `step`, not through (nor including) an op in `stop`."""
    seen: set[str] = set()
    todo = [m for n in starts for m in step(n)]
    while todo:
        n = todo.pop()
        if n in seen or n in stop or n == "output":
            continue
        seen.add(n)
        todo.extend(step(n))
    return seen


def _feeds(g: nx.DiGraph, n: str, region: set[str], layers: Mapping[str, str]) -> bool:
    """Whether column-wise layer `n`'s split output reaches a row-wise layer."""
    return any(m in region or layers.get(m) == "rowwise" for m in g.successors(n))


def _add_collectives(
    g: nx.DiGraph,
    out: nx.DiGraph,
    layers: Mapping[str, str],
    region: set[str],
    t: int,
    link: LinkModel,
) -> None:
    """Add tp's all-reduces and all-gathers to the ops' times in `out` (module docstring)."""
    inputs: dict[str, str] = {}  # a column-wise layer's input -> its first such layer
    for n in sorted(layers, key=lambda n: g.nodes[n]["order"]):
        if g.nodes[n]["constant"]:
            continue
        data = out.nodes[n]
        if layers[n] == "rowwise":
            data["forward"] += link.allreduce(wire_bytes(g, n), t)
            continue
        if not _feeds(g, n, region, layers):
            data["forward"] += link.all_gather(wire_bytes(g, n), t)
        for u in g.predecessors(n):
            if g.nodes[u]["float"] and not g.nodes[u]["constant"]:
                inputs.setdefault(u, n)
    for u, n in inputs.items():
        out.nodes[n]["backward"] += link.allreduce(wire_bytes(g, u), t)
