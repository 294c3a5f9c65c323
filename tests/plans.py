"""Synthetic op graphs and plans shared by the partition, schedule, program, plan,
routing, rules, messages and simulator tests (no test module imports another)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import networkx as nx

from graphpipe.ir import Plan
from graphpipe.ir.cost import CostModel, LinkModel, MemoryModel
from graphpipe.ir.registry import SCHEDULES
from graphpipe.planning.interleave import foldings, place_graph
from graphpipe.planning.partition import PlanConfig, partition_op_graph

__all__ = [
    "chain_plan",
    "cost",
    "folded_plans",
    "placed_plan",
    "placed_plans",
    "random_branchy",
    "random_dag",
    "random_plan",
    "synthetic",
    "zoo_plans",
]


def synthetic(
    edges: list[tuple[str, str]],
    times: dict[str, float],
    acts: dict[str, int],
    params: dict[str, frozenset[str]] | None = None,
) -> nx.DiGraph:
    """An op graph with the attributes `opgraph.op_graph` writes."""
    g = nx.DiGraph(param_bytes={})
    names = list(times)
    for i, n in enumerate(names):
        ps = (params or {}).get(n, frozenset({f"{n}.w"}))
        g.add_node(
            n,
            forward=times[n] / 3,
            backward=2 * times[n] / 3,
            act=acts[n],
            params=ps,
            order=i,
            module=n,
        )
        for p in ps:
            g.graph["param_bytes"][p] = 1000
    for a, b in edges:
        g.add_edge(a, b, bytes=acts[a])
    return g


def random_dag(rng: random.Random, n: int) -> nx.DiGraph:
    names = [f"op{i}" for i in range(n)]
    edges = [(names[i - 1], names[i]) for i in range(1, n) if rng.random() < 0.6]
    edges += [
        (names[i], names[j]) for i in range(n) for j in range(i + 2, n) if rng.random() < 0.12
    ]
    times = {m: rng.uniform(0.5, 4.0) for m in names}
    acts = {m: rng.choice([100, 1000, 20000]) for m in names}
    return synthetic(edges, times, acts)


def random_branchy(rng: random.Random) -> nx.DiGraph:
    """Layers in series; each layer one op or 2-4 parallel chains; an occasional skip edge."""
    edges: list[tuple[str, str]] = []
    prev_ends: list[str] = []
    names: list[str] = []
    for layer in range(rng.randint(2, 4)):
        chains = (
            [[f"l{layer}b0o0"]]
            if rng.random() < 0.4
            else [
                [f"l{layer}b{b}o{o}" for o in range(rng.randint(1, 3))]
                for b in range(rng.randint(2, 4))
            ]
        )
        for chain in chains:
            names += chain
            edges += list(itertools.pairwise(chain))
            edges += [(end, chain[0]) for end in prev_ends]
        if prev_ends and rng.random() < 0.3:
            edges.append((rng.choice(names[: -sum(map(len, chains))]), chains[0][-1]))
        prev_ends = [chain[-1] for chain in chains]
    times = {n: rng.uniform(0.5e-3, 4e-3) for n in names}
    acts = {n: rng.choice([1000, 10000]) for n in names}
    g = synthetic(edges, times, acts)
    g.graph["param_bytes"] = dict.fromkeys(g.graph["param_bytes"], 1_000_000)
    return g


def cost(micro_batches: int = 4, budget: float | None = None, bandwidth: float = 1e6) -> CostModel:
    return CostModel(
        micro_batch_size=1,
        micro_batches=micro_batches,
        link=LinkModel(bandwidth=bandwidth, latency=1e-4),
        memory=MemoryModel(budget=budget),
    )


def chain_plan(stages: int, micro_batches: int, latency: float = 1e-4) -> Plan:
    """S equal stages in a chain (1 ms forward, 2 ms backward each), every one with an input
    half as in the papers (F = I = W: the first stage's input is taken to need its
    gradient, where a model's data input does not: `Stage.input_half`)."""
    names = [f"op{i}" for i in range(stages)]
    g = synthetic(
        list(itertools.pairwise(names)), dict.fromkeys(names, 3e-3), dict.fromkeys(names, 1000)
    )
    c = CostModel(1, micro_batches, LinkModel(bandwidth=1e12, latency=latency))
    config = PlanConfig(
        devices=stages, micro_batches=micro_batches, replication=False, partitioner="sequential"
    )
    plan = partition_op_graph(g, c, config, "chain")
    assert len(plan.stages) == stages
    assert [s.input_half for s in plan.stages] == [False] + [True] * (stages - 1)
    return replace(plan, stages=tuple(replace(s, input_half=True) for s in plan.stages))


def random_plan(seed: int) -> Plan:
    """A plan of a random stage DAG (branchy on odd seeds; replicated stages allowed on
    seeds divisible by 3), with a random M and device count."""
    rng = random.Random(seed)
    g = random_branchy(rng) if seed % 2 else random_dag(rng, rng.randint(6, 14))
    m = rng.choice([1, 2, 4, 8])
    config = PlanConfig(
        devices=rng.randint(2, min(8, g.number_of_nodes())),
        micro_batches=m,
        replication=seed % 3 == 0,
        layouts=("one",),  # one stage per device: every generator's input
    )
    return partition_op_graph(g, cost(micro_batches=m, bandwidth=1e9), config, "x")


def zoo_plans() -> list[tuple[str, Plan]]:
    """Chains, random stage DAGs (fan-out, fan-in, skips) and replicated stages."""
    plans = [("chain4", chain_plan(4, 8)), ("chain2", chain_plan(2, 1))]
    return plans + [(f"seed{seed}", random_plan(seed)) for seed in range(24)]


def placed_plan(devices: int, per_device: int, m: int, placement: str) -> Plan:
    """A chain of devices x per_device equal stages folded onto the devices, every one with
    an input half as in the papers (see `chain_plan`)."""
    names = [f"op{i}" for i in range(devices * per_device)]
    g = synthetic(
        list(itertools.pairwise(names)), dict.fromkeys(names, 3e-3), dict.fromkeys(names, 1000)
    )
    config = PlanConfig(
        devices=devices,
        micro_batches=m,
        pins={name: i for i, name in enumerate(names)},
        partitioner="manual",
        virtual_stages=per_device,
        placement=placement,
    )
    plan = partition_op_graph(g, CostModel(1, m, LinkModel(bandwidth=1e12)), config, "chain")
    return replace(plan, stages=tuple(replace(s, input_half=True) for s in plan.stages))


def placed_plans(name: str) -> list[tuple[str, Plan]]:
    """Chains folded for `name`'s placement; on a V also M = 12 and 16 (dualpipev needs
    M >= 2N)."""
    v_shaped = SCHEDULES[name].placement == "v"
    plans = []
    for n in (2, 3, 4):
        for m in (1, 2, 4, 6, 8, *((12, 16) if v_shaped else ())):
            if v_shaped:
                plans.append((f"v n={n} m={m}", placed_plan(n, 2, m, "v")))
            elif m % n == 0:
                plans += [(f"loop{v} n={n} m={m}", placed_plan(n, v, m, "loop")) for v in (2, 3)]
    return plans


def folded_plans() -> list[tuple[str, Plan]]:
    """The zoo's unreplicated stage DAGs, each folded every way onto fewer devices (and once
    unfolded: one stage per device is a placement too)."""
    plans = []
    for label, plan in zoo_plans():
        if any(s.replicas > 1 for s in plan.stages):
            continue
        plans.append((label, plan))
        count = len(plan.stages)
        for devices in sorted({max(1, count // 2), count - 1} - {0}):
            for how, assignment in foldings(plan, devices).items():
                if len(set(assignment)) == devices:
                    plans.append(
                        (f"{label} {how} on {devices}", place_graph(plan, devices, assignment))
                    )
    return plans
