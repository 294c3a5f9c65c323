"""Graph interleaving: a stage DAG with more stages than devices, folded onto the devices.

GraphPipe gives every stage its own devices, so a branchy model on few devices gets few,
coarse stages and a large bubble. Interleaving cuts finer and lets a device hold several
stages: a later stage goes on a device that already holds an earlier branch, so the device
works on that later stage while its branch waits for the other branches' micro-batches.
The schedule is `graph_interleaved` (graphpipe.scheduling.generators): 1F1B by a greedy
run of the costs.

    candidates = interleavings(plan_for, base, g)   # plans for N+1.. devices, folded onto N
    best = min(candidates, key=simulated)

A folding is an assignment stage -> device. Three are tried for each finer plan, each
keeping every device busy and the stages of one branch point apart:
    balanced    stages by decreasing time, each on the least-loaded device (LPT);
    ordered     stages in topological order, each on the least-loaded device that holds no
                stage concurrent with it (neither its ancestor nor its descendant), else the
                least-loaded one;
    loop        stages in topological order, round-robin (Megatron's loop on a chain).
Each folded plan is validated (memory together per device) and simulated; the planner keeps
the fastest, and only if it beats the unfolded plan (`partition.PlanConfig.interleave`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import networkx as nx

from graphpipe.errors import PlanError
from graphpipe.ir import Plan
from graphpipe.planning.place import on_devices

__all__ = ["FOLDINGS", "foldings", "interleavings", "place_graph"]

FOLDINGS = ("balanced", "ordered", "loop")
EXTRA_STAGES = 4  # finer plans tried: N+1 .. N+min(N, EXTRA_STAGES) stages


def place_graph(plan: Plan, devices: int, assignment: Sequence[int], how: str = "graph") -> Plan:
    """`plan` (single-device stages) with stage i on device `assignment[i]`.

    Args:
        plan: A plan whose stages each have one device.
        devices: N, the devices to fold onto; every one must get a stage.
        assignment: The device of each stage, by stage index.
        how: Recorded in `plan.info["placement"]`.

    Raises:
        PlanError: a replicated stage, an assignment of the wrong length or out of range,
            or a device left without a stage.
    """
    replicated = [s.index for s in plan.stages if s.replicas != 1]
    if replicated:
        raise PlanError(f"graph interleaving needs single-device stages; {replicated} are not")
    if len(assignment) != len(plan.stages) or not all(0 <= d < devices for d in assignment):
        raise PlanError(
            f"assignment {list(assignment)} must give each of {len(plan.stages)} stages a "
            f"device in 0..{devices - 1}"
        )
    idle = sorted(set(range(devices)) - set(assignment))
    if idle:
        raise PlanError(f"assignment {list(assignment)} leaves devices {idle} without a stage")
    return on_devices(plan, assignment, devices, how, len(plan.stages) / devices)


def foldings(plan: Plan, devices: int) -> dict[str, list[int]]:
    """The candidate assignments of `plan`'s stages to `devices` devices (module docstring)."""
    graph = plan.stage_graph
    order = list(nx.lexicographical_topological_sort(graph))
    times = {s.index: s.time for s in plan.stages}
    related = {s: nx.ancestors(graph, s) | nx.descendants(graph, s) for s in graph}
    by_time = sorted(times, key=lambda s: (-times[s], s))
    return {
        "balanced": _greedy(by_time, times, devices, lambda s, held: True),
        "ordered": _greedy(
            order, times, devices, lambda s, held: all(t in related[s] for t in held)
        ),
        "loop": [order.index(s) % devices for s in sorted(times)],
    }


def _greedy(
    order: Sequence[int],
    times: dict[int, float],
    devices: int,
    fits: Callable[[int, list[int]], bool],
) -> list[int]:
    """Each stage in `order` on the least-loaded device where `fits`, else the least-loaded;
    the first `devices` stages each open a device of their own."""
    load = [0.0] * devices
    held: list[list[int]] = [[] for _ in range(devices)]
    where: dict[int, int] = {}
    for k, s in enumerate(order):
        if k < devices:
            d = k
        else:
            ranked = sorted(range(devices), key=lambda d: (load[d], d))
            d = next((d for d in ranked if fits(s, held[d])), ranked[0])
        where[s] = d
        load[d] += times[s]
        held[d].append(s)
    return [where[s] for s in sorted(where)]


def interleavings(
    plan_for: Callable[[int], Plan], devices: int, stage_count: int, extra: int = EXTRA_STAGES
) -> list[Plan]:
    """Folded plans: finer plans for N+1.. devices, each folded every way (`foldings`).

    Args:
        plan_for: Plans the model for a number of devices (single-device stages).
        devices: N.
        stage_count: The most stages the graph allows (its op count).
        extra: The finer plans tried: N+1 .. N+min(N, extra) devices.

    Returns:
        The folded plans (not validated), possibly none.
    """
    found = []
    for k in range(devices + 1, min(devices + min(devices, extra), stage_count) + 1):
        try:
            finer = plan_for(k)
        except PlanError:  # e.g. nothing fits the budget on k devices
            continue
        if len(finer.stages) <= devices or any(s.replicas != 1 for s in finer.stages):
            continue
        seen: set[tuple[int, ...]] = set()
        for how, assignment in foldings(finer, devices).items():
            if tuple(assignment) in seen or len(set(assignment)) < devices:
                continue
            seen.add(tuple(assignment))
            found.append(place_graph(finer, devices, assignment, how=f"graph:{how}"))
    return found
