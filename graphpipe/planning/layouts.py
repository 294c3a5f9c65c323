"""Layouts: one stage per device, or several, chosen by simulating each.

A layout is how stages sit on the devices; each runs under the schedules that can run it:

    one    one stage per device (stages may be replicated)        1f1b (the default schedule)
    loop   a chain of 2N stages, stage i on device i mod N          interleaved, interleaved_zb
    v      a chain of 2N stages, folded 'v' (device d: d, 2N-1-d)   zbv, dualpipev
    graph  a finer stage DAG folded onto the N devices              graph_interleaved

The planner builds each layout it may use (the chain of 2N stages by `even_chain`, the stage
DAGs of N+1.. stages by `interleave.interleavings`),
simulates each under each of its schedules, and keeps the fastest step whose plan and
simulated peak memory fit the memory budget; ties keep the earlier layout in the list above.
A plan whose floor (`scheduling.floor.step_floor`, a lower bound under every flushed
schedule) is no less than the best step found so far is not simulated: it could not be
chosen.
A named schedule (`PlanConfig.schedule`) limits the layouts to those it runs; without
zero-bubble schedules (`PlanConfig.split_backward=False`) loop runs interleaved only and v
is not built. The plan kept records its layout and schedule (`Plan.layout`, `Plan.schedule`:
what `simulate(plan)` and `compile` run), and what was considered, for people, in
`plan.info["layouts"]`:

    {"chosen": "v", "schedule": "zbv",
     "considered": [{"layout": "one", "schedule": "1f1b", "step": 0.72}, ...,
                    {"layout": "graph", "step": None, "why": "no finer plan fits"}]}

Cost: the one-per-device search, one linear partition into 2N stages (shared by loop and
v), and for a graph with branches off its critical path (`side_work`, at least 1/(2N) of the
time) two more graph searches for the finer DAGs (N+1 and N+2 stages); a simulation per
candidate and schedule.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx
import numpy as np

from graphpipe.errors import PlanError, ScheduleError
from graphpipe.ir import Plan, schedule_spec
from graphpipe.ir.cost import CostModel
from graphpipe.ir.plan import LAYOUTS
from graphpipe.ir.registry import schedule_names
from graphpipe.planning.assemble import assemble
from graphpipe.planning.fold import coarse_units
from graphpipe.planning.interleave import interleavings
from graphpipe.planning.place import place_stages
from graphpipe.planning.sptree import condense, linearise, units_of
from graphpipe.planning.validate import validate_plan
from graphpipe.scheduling.floor import step_floor
from graphpipe.scheduling.simulate import simulate

__all__ = [
    "LAYOUTS",
    "Considered",
    "choose",
    "even_chain",
    "finer_dags",
    "folded_chain",
    "layout_schedules",
    "made_for",
    "side_work",
    "usable",
]

_PLACEMENT = {"one": None, "loop": "loop", "v": "v", "graph": "any"}
GRAPH_EXTRA_STAGES = 2  # the default's finer DAGs: N+1 and N+2 stages (interleave=True: 4)


@dataclass(frozen=True)
class Considered:
    """One layout the planner looked at: its plan and fastest schedule, or why not."""

    layout: str
    plan: Plan | None = None
    schedule: str | None = None
    step: float | None = None  # the simulated step() under `schedule`
    why: str = ""  # why the layout has no plan (infeasible, over the budget)

    def record(self) -> dict[str, Any]:
        """Its JSON-able entry in `plan.info["layouts"]["considered"]`."""
        entry: dict[str, Any] = {"layout": self.layout, "schedule": self.schedule}
        entry["step"] = self.step
        if self.why:
            entry["why"] = self.why
        return entry


def layout_schedules(layout: str, schedule: str | None, split_backward: bool = True) -> list[str]:
    """The schedules `layout` may run under: the named `schedule` if it runs the layout (one
    stage per device runs under any schedule without a placement; a folded DAG under any
    placement, "any"), else none; without a name, those the registry picks for it
    (`ScheduleSpec.layout`, in the registry's order; zero-bubble ones only
    with `split_backward`).

    Example:
        >>> layout_schedules("loop", None), layout_schedules("one", "zb")
        (['interleaved', 'interleaved_zb'], ['zb'])
        >>> layout_schedules("v", "1f1b"), layout_schedules("loop", None, split_backward=False)
        ([], ['interleaved'])
    """
    if schedule is None:
        names = schedule_names(layout=layout)
        return [n for n in names if split_backward or not schedule_spec(n).split_backward]
    placement = schedule_spec(schedule).placement
    runs = placement == _PLACEMENT[layout] or (placement == "any" and layout == "one")
    return [schedule] if runs else []


def usable(layouts: Sequence[str], schedule: str | None, split_backward: bool) -> list[str]:
    """The layouts of `layouts` that some allowed schedule runs, in `LAYOUTS`' order."""
    return [x for x in LAYOUTS if x in layouts and layout_schedules(x, schedule, split_backward)]


def choose(
    builders: dict[str, Callable[[], Plan | list[Plan]]],
    g: nx.DiGraph,
    schedule: str | None,
    split_backward: bool,
) -> Plan:
    """The fastest layout's plan, recording its layout and schedule, with what was
    considered in `info["layouts"]`.

    Args:
        builders: Per usable layout (in `LAYOUTS`' order), a function making its plan or
            candidate plans (raising PlanError when it has none).
        g: The op graph, to validate the plans against (memory per device included).
        schedule: The schedule the run names, or None.
        split_backward: Whether zero-bubble schedules may be chosen.

    Raises:
        PlanError: no layout has a plan, naming each layout's reason.
    """
    considered: list[Considered] = []
    beat = math.inf  # the best step so far: a plan whose floor is no less cannot win
    for layout, build in builders.items():
        found = _consider(
            layout, build, g, layout_schedules(layout, schedule, split_backward), beat
        )
        considered.append(found)
        beat = min(beat, found.step if found.step is not None else math.inf)
    ranked = [c for c in considered if c.plan is not None and c.step is not None]
    if not ranked:
        reasons = "; ".join(f"{c.layout}: {c.why}" for c in considered)
        raise PlanError(f"no layout has a plan: {reasons}")
    best = min(ranked, key=lambda c: c.step or 0.0)  # min keeps the first of equal steps
    assert best.plan is not None and best.schedule is not None  # ranked: simulated
    note = {
        "chosen": best.layout,
        "schedule": best.schedule,
        "considered": [c.record() for c in considered],
    }
    info = {**best.plan.info, "layouts": note}
    return replace(best.plan, layout=best.layout, schedule=best.schedule, info=info)


def made_for(plan: Plan, schedule: str | None) -> Plan:
    """`plan` recording `schedule` (`PlanConfig.schedule`, the one the run names) as the
    schedule it was made for; as it is without one. The schedule's rule is checked where it
    runs (`simulate`, `compile`)."""
    if schedule is None:
        return plan
    return replace(plan, schedule=schedule_spec(schedule, training=False).name)


def _consider(
    layout: str,
    build: Callable[[], Plan | list[Plan]],
    g: nx.DiGraph,
    schedules: list[str],
    beat: float = math.inf,
) -> Considered:
    """The layout's fastest (plan, schedule) pair that fits, or why none does. A plan whose
    floor (`step_floor`, under flushed schedules) is no less than `beat` or the layout's
    best so far is not simulated: it could not be chosen (ties keep the earlier)."""
    try:
        made = build()
    except PlanError as exc:
        return Considered(layout, why=_first_line(exc))
    plans = made if isinstance(made, list) else [made]
    best = Considered(layout, why="no plan")
    flushed = all(not schedule_spec(name, training=False).asynchronous for name in schedules)
    for plan in plans:
        bar = min(beat, best.step if best.step is not None else math.inf)
        if flushed and step_floor(plan) * (1 - 1e-9) >= bar:
            best = best if best.plan else Considered(layout, why=f"its floor is over {bar:.4g} s")
            continue
        try:
            validate_plan(plan, g)  # e.g. a device's stages together over the memory budget
        except PlanError as exc:
            best = best if best.plan else Considered(layout, why=_first_line(exc))
            continue
        for name in schedules:
            found = _simulated(layout, plan, name)
            if found.plan is None:
                best = best if best.plan else found
            elif best.step is None or (found.step or 0.0) < best.step:
                best = found
    return best


def _simulated(layout: str, plan: Plan, name: str) -> Considered:
    """`plan` simulated under `name`, refused when its simulated peak is over the budget."""
    try:
        run = simulate(plan, name)
    except ScheduleError as exc:
        return Considered(layout, schedule=name, why=_first_line(exc))
    budget = plan.cost_model.memory.budget
    peak = max(run.peak_memory, default=0)
    if budget is not None and peak > budget:
        why = f"{name} peaks at {peak} bytes on a device, over the budget of {budget:.0f}"
        return Considered(layout, schedule=name, why=why)
    return Considered(layout, plan, name, run.iteration_time)


def _first_line(exc: Exception) -> str:
    """The error in one line: a schedule rule's problems joined, else its first line."""
    if isinstance(exc, ScheduleError) and exc.problems:
        return "; ".join(exc.problems)
    return str(exc).splitlines()[0]


def even_chain(g: nx.DiGraph, cost: CostModel, stages: int, max_units: int, digest: str) -> Plan:
    """A chain of exactly `stages` single-device stages over a topological order of the
    units, the slowest stage as fast as can be (the linear partition problem).

    The units are `partition`'s (folded groups, coarsened, linearised, condensed to at most
    `max_units`); the cut is the classic O(stages x n^2) DP over prefix sums of their
    forward+backward times, n the unit count. Transfers are not weighed here: the planner
    simulates the folded chain, links included.

    Raises:
        PlanError: fewer units than stages.
    """
    units = coarse_units(g, stages)
    units, tree = condense(g, units, linearise(units), max(max_units, 4 * stages))
    order = units_of(tree)
    if len(order) < stages:
        raise PlanError(
            f"a chain of {stages} stages needs {stages} units, the graph has {len(order)}"
        )
    times = [sum(g.nodes[n]["forward"] + g.nodes[n]["backward"] for n in u) for u in order]
    groups = [
        (frozenset(n for u in order[a:b] for n in u), 1)
        for a, b in itertools.pairwise(_cuts(times, stages))
    ]
    return assemble(g, groups, cost, stages, "sequential", digest)


def _cuts(times: Sequence[float], parts: int) -> list[int]:
    """Boundaries 0 = c0 < c1 < ... < c_parts = n splitting `times` into `parts` runs whose
    largest sum is least: best[k][i], the least largest sum splitting times[:i] into k runs,
    is the least over j of max(best[k - 1][j], prefix[i] - prefix[j]), its cut the first
    such j; each row one array operation over (i, j). O(parts x n^2)."""
    n = len(times)
    prefix = np.array(list(itertools.accumulate(times, initial=0.0)))
    i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    run = np.where(j < i, prefix[:, None] - prefix[None, :], np.inf)  # [i, j]: sum of j..i-1
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    back = np.zeros((parts + 1, n + 1), dtype=np.int64)
    for k in range(1, parts + 1):
        value = np.maximum(best[None, :], run)  # [i, j]
        value[:, : k - 1] = np.inf
        back[k] = value.argmin(axis=1)  # the first least j, as a loop keeping strict gains
        row = value.min(axis=1)
        row[:k] = np.inf
        row[n - (parts - k) + 1 :] = np.inf
        best = row
    cuts = [n]
    for k in range(parts, 0, -1):
        cuts.append(int(back[k][cuts[-1]]))
    return cuts[::-1]


def folded_chain(chain: Callable[[], Plan], devices: int, placement: str) -> Plan:
    """The chain of 2 x `devices` stages `chain()` makes, folded `placement` onto the devices.

    Raises:
        PlanError: no chain, or not of 2 x `devices` single-device stages.
    """
    return place_stages(chain(), devices, placement)


def finer_dags(g: nx.DiGraph, plan_for: Callable[[int], Plan], devices: int) -> list[Plan]:
    """Finer stage DAGs of N+1 and N+2 stages folded onto the N devices
    (`interleave.interleavings`), for a graph with branches (`side_work`) of at least
    1/(2N) of its time: a chain's finer plans are chains, which loop and v fold better.

    Raises:
        PlanError: the graph is (nearly) a chain, or no finer DAG folds.
    """
    side, total = side_work(g), _total(g)
    if side < total / (2 * devices):
        raise PlanError(
            f"a chain: off the critical path lies {side / total if total else 0:.0%} of the "
            f"time, under 1/(2N) = {1 / (2 * devices):.0%}"
        )
    ops = sum(1 for n in g if n != "output")
    found = interleavings(plan_for, devices, ops, extra=GRAPH_EXTRA_STAGES)
    if not found:
        raise PlanError(f"no finer stage DAG of {devices + 1} or more stages folds onto {devices}")
    return found


def side_work(g: nx.DiGraph) -> float:
    """The op time off the critical path: the total forward+backward time less that of the
    slowest path (0 for a chain). O(V + E)."""
    longest: dict[str, float] = {}
    for n in nx.topological_sort(g):
        own = g.nodes[n].get("forward", 0.0) + g.nodes[n].get("backward", 0.0)
        longest[n] = own + max((longest[p] for p in g.predecessors(n)), default=0.0)
    return _total(g) - max(longest.values(), default=0.0)


def _total(g: nx.DiGraph) -> float:
    return sum(d.get("forward", 0.0) + d.get("backward", 0.0) for _, d in g.nodes(data=True))
