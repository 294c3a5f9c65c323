"""Mesh: plan over a ("pp", "dp") device mesh, with a given or a chosen dp degree.

    plan(model, inputs, devices=16, dp=2)       # a plan over pp = 8, each stage on 2 dp ranks
    plan(model, inputs, devices=16, dp="auto")  # every k dividing 16 and the micro-batch rows

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import networkx as nx

from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir import DEFAULT_SCHEDULE, Plan
from graphpipe.scheduling.simulate import simulate

__all__ = ["check_dp", "choose_mesh", "dp_degrees", "mesh_info", "per_rank_graph"]


def per_rank_graph(g: nx.DiGraph, k: int) -> nx.DiGraph:
    """The op graph one of k dp ranks runs: times and bytes of every op and edge / k.

    Args:
        g: The op graph (`opgraph.op_graph`) of a whole micro-batch.
        k: The dp degree.

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


def check_dp(devices: int, dp: int, rows: int | None = None) -> None:
    """Refuse a dp degree that does not divide the devices or the micro-batch rows.

    Raises:
        ConfigError: naming the degree and the number it does not divide.
    """
    if dp < 1:
        raise ConfigError(f"dp must be >= 1 or 'auto', got {dp}")
    if devices % dp:
        raise ConfigError(f"dp={dp} does not divide devices={devices} into pp x dp")
    if rows is not None and rows % dp:
        raise ConfigError(
            f"dp={dp} does not divide a micro-batch of {rows} rows: each dp rank takes 1/dp "
            "of every micro-batch"
        )


def dp_degrees(devices: int, rows: int) -> list[int]:
    """Every k dividing both the devices and the micro-batch rows, in increasing order."""
    return [k for k in range(1, devices + 1) if devices % k == 0 and rows % k == 0]


def mesh_info(devices: int, dp: int, replication: bool) -> dict[str, Any]:
    """The facts `Plan.info["mesh"]` records for a plan with dp > 1."""
    info: dict[str, Any] = {
        "dp": dp,
        "pp": devices // dp,
        "uniform": "every stage has the same dp degree (one (pp, dp) DeviceMesh)",
    }
    if replication:
        info["replication"] = (
            "off: dp > 1 replaces data-parallel replication inside the pp dimension"
        )
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
