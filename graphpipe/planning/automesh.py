"""Automesh: the whole mesh planned. pp x dp x tp, M, FSDP2's resharding, the schedule and
recompute chosen together, by planning and simulating each candidate on the same costs.

    plan = plan_mesh(model, x, devices=64, node="h100x8", tp_plan=model_tp_plan(model))
    plan.dims      # ParallelDims(pp=2, dp=4, tp=8): the mesh chosen; plan.micro_batches its M
    print(plan)    # the choice, then the runners-up and what bound each

Index letters: N devices, G devices per node, t tp, k dp, p pp (N = p k t), M micro-batches,
B the mini-batch's rows, r = B / (M k) the rows one dp rank runs per micro-batch.

The space (`candidates`): t divides G (tp on the node's link, never across nodes) and is 1
without a tp plan; k divides N / t; p = N / (k t); M is a power of two (or the given M) with
r a whole number >= 1; p is at most the graph's ops, and at most 2 T / u (T: the time of one
micro-batch of one rank, u: its largest op group that no cut may split, `fold.folded_groups`):
past it a stage is under half that group, so at least half of a deep pipeline's devices idle.

Each candidate is planned as `graphpipe.plan(..., devices=N, dp=k, tp=t, micro_batches=M)`
plans it (`partition.partition_op_graph` on one rank's op graph: one stage per pp rank, the
graph partitioner's cut), on the node's links (`devices.Node.mesh_links`). Its siblings
(the same p, k, t at the other M) are cut at their own rows too, and their cuts, assembled
on the candidate's rank graph and costs, are tried beside its own where they fit: the
partitioner's objective is its estimate, not the simulated step, and a cut made at other
rows can simulate faster (at 32 devices the 0.9 B Llama's pp 4 x dp 8, M 4: 63.5 ms on its
own cut, 56.4 on its sibling's). Every cut is made once (by candidate; a chain by (t, p,
rows)) and is a function of its candidate alone, so a candidate's plan depends on nothing
planned before it: the search and the brute-force grid plan every mesh the same way
whatever the order, and the choice is the grid's best. Then:

    layout       one stage per pp rank, or a chain of 2p stages folded loop or v
                 (`layouts.even_chain` at the candidate's rows and its siblings', run by
                 interleaved, interleaved_zb, zbv or dualpipev) where the config's layouts
                 allow it, the fastest simulated kept

    resharding   FSDP2 keeps the gathered parameters over the step
                 (reshard_after_forward=False, as torchtitan runs FSDP under a pipeline: one
                 all-gather per step); where that does not fit the budget, True (two gathers
                 per micro-batch, one block unsharded at a time)
    recompute    where no plan fits the budget, the plan without it with every device over
                 the budget recomputing (`recompute.choose_recompute(plan, "auto")`)
    schedule     1f1b and zb (ZB-H1: 1F1B's memory, about a third of its bubble; with
                 reshard_after_forward=False only), the faster simulated step kept

and its step simulated. The fastest step within the budget wins; ties keep the fewer pp
ranks, then the fewer tp ranks.

Pruning (branch and bound): each candidate has lower bounds, cheap to compute from its op
graph without planning it, that no plan of it can beat:

    compute      M max(T / p, u): the busiest pp rank runs at least its share of M
                 micro-batches, and at least the largest group M times
    path         the longest forward-and-backward path of the op graph (one micro-batch)
    dp link      (M T + reduce_scatter(P, k)) / p: every stage reduce-scatters its gradients
                 once per step after its compute (P: one tp rank's parameter bytes)
    memory       every rank holds at least 1 / p of the sharded state and the gathered
                 parameters and gradient (`CostModel.weights` of P / p)

The bounds hold for folded layouts too (a rank holds at least one group, and the busiest
at least 1 / p of the work). Candidates are planned in the order of an estimate (the bound
with 1F1B's bubble, (M + p - 1) / M, and a median edge's transfer both ways across p - 1
cuts), and one whose bound is at least the best step found is not planned. The bounds hold
for every plan made here, so pruning never drops the best: the choice equals the best of
the whole grid planned the same way (`tests/test_automesh.py`, `python -m
benchmarks.autoplan`).

Once a candidate is cut, each of its plans (own, siblings', folded chains) has a floor
(`scheduling.floor.step_floor`: per rank, the forward path into its stages, their M
micro-batches' compute, the gradients' round trip, every backward after the first return
of gradients, and its update), a lower bound on its step under every flushed schedule. A
plan whose floor is over the best step found so far is not simulated: it cannot win. Where
every plan of a candidate is so skipped and one of them fits the budget whatever the
schedule holds, the candidate is recorded as pruned (it would have had a step, over the
best); where none surely fits, it is simulated whole, as the grid would. Where the layouts'
choice falls on a plan of one stage per rank whose step is over the best while folded plans
were skipped, the grid might have chosen a skipped one (its step over the best too); the
candidate is planned again, nothing skipped, only where zb brings that plan within the best
step. So the choice is still the grid's; a runner-up's step can be that of its plans
simulated, not of all.

Workers (`MeshSearch.workers`, the `search_workers` option): the candidates are planned
on forked processes, a family at a time each (the same p, k, t at every M: its cuts are
shared by its siblings, so no two workers make the same cut), each family against the best
step known when it starts; the first families by estimate, then the deepest pipelines (the
dearest to cut). A best step learnt later only prunes less, so the choice is the serial
search's; the runners-up recorded can differ. The garbage collector is paused while the
search runs (`_collector_paused`).

What bound each runner-up (`info["mesh"]["runners_up"]`, `print(plan)`):

    memory       it needed recompute or reshard_after_forward=True to fit, or fits no plan
    bubble       its pipeline idles a quarter of the step or more (1 - M bottleneck / step)
    dp link      its all-gathers and reduce-scatter are half its slowest stage or more
    tp link      tp's all-reduces are a quarter of its compute or more
    compute      else: its per-rank compute is more
    pruned       its lower bound (which one) is at least the chosen step: not planned; or
                 every plan's floor is over the best step then found: cut, not simulated
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import cache, partial
from multiprocessing import get_all_start_methods, get_context
from typing import Any

import networkx as nx
import numpy as np
import torch
from torch import fx, nn

from graphpipe.errors import ConfigError, PlanError, ScheduleError
from graphpipe.ir import DEFAULT_SCHEDULE, Plan, over_budget, schedule_spec
from graphpipe.ir.cost import CostModel, LinkModel
from graphpipe.ir.dims import ParallelDims
from graphpipe.planning.assemble import assemble
from graphpipe.planning.devices import Node, node_preset
from graphpipe.planning.fold import folded_groups
from graphpipe.planning.layouts import choose as choose_layout
from graphpipe.planning.layouts import even_chain, folded_chain, layout_schedules
from graphpipe.planning.mesh import mesh_info, per_rank_graph, tp_rank_graph
from graphpipe.planning.opgraph import graph_hash, input_shapes, op_graph
from graphpipe.planning.partition import PlanConfig, cost_model, partition_op_graph
from graphpipe.planning.profile import Profile, ProfileConfig, noted, profile
from graphpipe.planning.recompute import choose_recompute
from graphpipe.planning.validate import validate_plan
from graphpipe.scheduling.floor import step_floor
from graphpipe.scheduling.rules import check
from graphpipe.scheduling.simulate import simulate
from graphpipe.tracing.bind import batch_of, normalise, split_of
from graphpipe.tracing.tracer import flat_inputs, trace

__all__ = ["Candidate", "MeshSearch", "Scored", "candidates", "choose", "grid", "plan_mesh"]

ZB = "zb"  # the zero-bubble schedule tried beside 1f1b on one stage per pp rank
RUNNERS_UP = 5  # runners-up recorded in the plan
_FAST = LinkModel(bandwidth=1e30, latency=0.0)  # a free link: tp's op times without collectives


@dataclass(frozen=True)
class MeshSearch:
    """What the mesh search may choose, besides the PlanConfig it plans each candidate with.

    Attributes:
        node: The node (`devices.NODES` name or a `devices.Node`); its links replace the
            config's (tp inside a node, dp and pp across nodes where their groups do).
            None: one node of all N devices on the config's links (`link`, `dp_link`,
            `tp_link`).
        micro_batches: "auto" (every power of two dividing the rows) or one M.
        reshard: The reshard_after_forward values tried, in order: the next only where the
            previous fits no plan (False first: one gather per step).
        workers: Processes that plan candidates at once (forked from this one, which
            needs the fork start method: Linux); 1 plans them here. The choice is the same
            either way.
    """

    node: Node | str | None = None
    micro_batches: int | str = "auto"
    reshard: tuple[bool, ...] = (False, True)
    workers: int = 1

    def problems(self, devices: int, batch: int | None = None) -> list[str]:
        """Every problem with the fields, naming the values (empty when they are fine)."""
        found = []
        m = self.micro_batches
        if m != "auto" and not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
            found.append(f"micro_batches must be an int >= 1 or 'auto', got {m!r}")
        elif isinstance(m, int) and batch is not None and batch % m:
            found.append(f"micro_batches={m} does not divide the mini-batch of {batch} rows")
        if self.node is not None:
            try:
                node = node_preset(self.node)
            except ConfigError as exc:
                found.append(str(exc))
            else:
                if devices % node.gpus and devices > node.gpus:
                    found.append(
                        f"devices={devices} is not a whole number of {node.name} nodes "
                        f"({node.gpus} devices each)"
                    )
        if not self.reshard or any(not isinstance(r, bool) for r in self.reshard):
            found.append(f"reshard must be a non-empty tuple of bools, got {self.reshard!r}")
        w = self.workers
        if not (isinstance(w, int) and not isinstance(w, bool) and w >= 1):
            found.append(f"workers must be an int >= 1, got {w!r}")
        elif w > 1 and "fork" not in get_all_start_methods():
            found.append(f"workers={w} needs the fork start method, which this OS lacks; use 1")
        return found

    def check(self, devices: int, batch: int | None = None) -> None:
        """Raise every problem at once.

        Raises:
            ConfigError: naming each bad value.
        """
        problems = self.problems(devices, batch)
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass(frozen=True, order=True)
class Candidate:
    """One mesh: p x k x t ranks, M micro-batches."""

    pp: int
    dp: int
    tp: int
    micro_batches: int

    @property
    def dims(self) -> ParallelDims:
        """The layout it is: pp x dp x tp (FSDP2-sharded dp)."""
        return ParallelDims(pp=self.pp, dp=self.dp, tp=self.tp)

    def __str__(self) -> str:
        return f"pp {self.pp} x dp {self.dp} x tp {self.tp}, M {self.micro_batches}"


@dataclass(frozen=True)
class Scored:
    """A candidate planned (or pruned): its plan, simulated step and what bound it."""

    candidate: Candidate
    plan: Plan | None = None
    step: float = math.inf
    bound: str = ""  # for a runner-up, what bound it (filled once the best is known)
    lower: float = 0.0  # its lower bound (seconds)
    which: str = ""  # the bound's name: compute, path, dp link, memory
    tp_share: float = 0.0  # tp's collectives' share of its compute

    def record(self) -> dict[str, Any]:
        """Its JSON-able entry in `info["mesh"]["runners_up"]`."""
        entry: dict[str, Any] = asdict(self.candidate)
        entry["step"] = self.step if math.isfinite(self.step) else None
        if self.plan is not None:
            entry["schedule"] = self.plan.schedule
            entry["reshard_after_forward"] = self.plan.cost_model.dp.reshard_after_forward
        entry["bound"] = self.bound
        return entry


def candidates(
    devices: int, batch: int, gpus: int, tp: bool, micro_batches: int | str = "auto"
) -> list[Candidate]:
    """Every (p, k, t, M) of the module docstring's space, before the depth cap.

    Args:
        devices: N.
        batch: B, the mini-batch's rows.
        gpus: G, devices per node (t divides it).
        tp: Whether the model has a tp plan (else t = 1).
        micro_batches: "auto" or one M.

    Example:
        >>> [str(c) for c in candidates(2, 2, 8, tp=False)]
        ['pp 2 x dp 1 x tp 1, M 1', 'pp 2 x dp 1 x tp 1, M 2', 'pp 1 x dp 2 x tp 1, M 1']
    """
    out = []
    for t in _divisors(math.gcd(gpus, devices)) if tp else [1]:
        for k in _divisors(devices // t):
            for m in _micro_batches(batch // k if batch % k == 0 else 0, micro_batches):
                out.append(Candidate(devices // (t * k), k, t, m))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(rows: int, given: int | str) -> list[int]:
    """The M that split `rows` (one dp rank's share of the mini-batch) into whole rows."""
    if rows < 1:
        return []
    if given != "auto":
        return [int(given)] if rows % int(given) == 0 else []
    return [m for m in (2**i for i in range(rows.bit_length())) if rows % m == 0]


# -- one rank's op graph and its bounds ---------------------------------------------------


@dataclass(frozen=True)
class RankGraph:
    """One rank's op graph for a (rows, t) and the facts the bounds read."""

    g: nx.DiGraph
    total: float  # T: forward + backward of every op, one micro-batch
    largest: float  # u: the largest folded group's time
    path: float  # the longest forward + backward path
    param_bytes: float  # P: every parameter and buffer of one tp rank
    collectives: float  # tp's all-reduces and all-gathers in T
    hop_bytes: float = 0.0  # the median edge's bytes: what a cut sends (the estimate's)


def rank_graph(g: nx.DiGraph, whole: nx.DiGraph | None = None) -> RankGraph:
    """`g` with its bound facts; `whole`: the same graph without tp's collectives."""
    times = {n: d["forward"] + d["backward"] for n, d in g.nodes(data=True)}
    total = sum(times.values())
    groups = folded_groups(g)
    largest = max((sum(times[n] for n in grp) for grp in groups), default=0.0)
    longest: dict[str, float] = {}
    for n in nx.topological_sort(g):
        longest[n] = times[n] + max((longest[p] for p in g.predecessors(n)), default=0.0)
    bare = (
        total
        if whole is None
        else sum(d["forward"] + d["backward"] for _, d in whole.nodes(data=True))
    )
    return RankGraph(
        g,
        total,
        largest,
        max(longest.values(), default=0.0),
        float(sum(g.graph["param_bytes"].values())),
        max(0.0, total - bare),
        float(np.median([b for *_, b in g.edges(data="bytes", default=0.0)] or [0.0])),
    )


def lower_bound(c: Candidate, rg: RankGraph, cost: CostModel) -> tuple[float, str]:
    """The largest of the module docstring's time bounds, and its name."""
    m, p = c.micro_batches, c.pp
    scatter = cost.dp_link.reduce_scatter(rg.param_bytes, c.dp) if c.dp > 1 else 0.0
    bounds = {
        "compute": m * max(rg.total / p, rg.largest),
        "path": rg.path,
        "dp link": (m * rg.total + scatter) / p,
    }
    which = max(bounds, key=lambda k: bounds[k])
    return bounds[which], which


def memory_floor(c: Candidate, rg: RankGraph, cost: CostModel) -> float:
    """Bytes some rank holds at least (module docstring: memory)."""
    return cost.weights(rg.param_bytes / c.pp)


# -- the search -----------------------------------------------------------------------------


@dataclass
class _Search:
    """The state of one search: the config, the links, the rank graphs by (rows, t)."""

    graph_at: Callable[[float], nx.DiGraph]  # rows -> one dp rank's op graph (tp whole)
    config: PlanConfig
    links: Callable[[int, int, int], tuple[LinkModel, LinkModel, LinkModel]]  # (p, k, t)
    gpus: int  # G: t divides it
    node: str  # the node's name, or "" for the config's links
    batch: int  # B
    digest: str
    costs: tuple[str, str] = ("flops", "cpu")  # the profile's mode and device
    micro_batches: int | str = "auto"  # the M tried (`MeshSearch.micro_batches`)

    def __post_init__(self) -> None:
        self.ranks = cache(self._rank)
        self.own: dict[tuple[Candidate, bool], Plan | str] = {}  # (c, reshard) -> `_own`
        self.chains: dict[tuple[int, int, float], list[tuple[frozenset[str], int]] | str] = {}

    def _rank(self, rows: float, t: int) -> RankGraph:
        g = self.graph_at(rows)
        if t == 1:
            return rank_graph(g)
        plan = self.config.tp_plan or {}
        tp_link = self.links(1, 1, t)[2]
        return rank_graph(tp_rank_graph(g, t, plan, tp_link), tp_rank_graph(g, t, plan, _FAST))

    def rows(self, c: Candidate) -> float:
        return self.batch / (c.micro_batches * c.dp)

    def cost(self, c: Candidate, reshard: bool) -> CostModel:
        """The cost model of candidate `c`: the config's, on the mesh's links."""
        pp_link, dp_link, tp_link = self.links(c.pp, c.dp, c.tp)
        config = replace(self.config, micro_batches=c.micro_batches, tp=c.tp)
        base = cost_model(config, self.batch // c.micro_batches, *self.costs, dp=c.dp)
        return replace(
            base,
            link=pp_link,
            dp=replace(base.dp, link=dp_link, reshard_after_forward=reshard),
            tp=replace(base.tp, link=tp_link),
        )

    def evaluate(self, c: Candidate, reshards: tuple[bool, ...], beat: float = math.inf) -> Scored:
        """Plan and simulate `c` (module docstring), or say why it has no plan.

        A plan whose floor (`step_floor`) is over `beat` (the best step found so far) is not
        simulated: the Scored is c's where its step is within `beat`; else a step over
        `beat` or c recorded as pruned (either way c cannot win)."""
        rg = self.ranks(self.rows(c), c.tp)
        why = "memory: no plan fits the budget"
        beat = beat if self._flushed() else math.inf
        for reshard in reshards:
            cost = self.cost(c, reshard)
            ones = self._one_plans(c, rg.g, cost, reshard)
            if isinstance(ones, str):
                why = ones
                continue
            over: list[Plan] = []  # the plans not simulated: floor over `beat`
            unsure = False  # whether layouts.choose might have chosen a skipped plan instead
            if not reshard and c.pp > 1:
                folded = self._folded_or(ones, c, rg.g, cost, beat, over)
                if folded is None:  # layouts.choose would have chosen a skipped plan, or none
                    return _beyond(c, rg.g, over, beat) or self.evaluate(c, reshards)
                ones, unsure = folded
            runs = [self._scheduled(x, reshard) for x in ones if _under(x, beat, over)]
            plan, step = min(runs, key=lambda x: x[1], default=(None, math.inf))
            if plan is None and over:  # c's step is over `beat`, or unknown: plan it all
                return _beyond(c, rg.g, over, beat) or self.evaluate(c, reshards)
            if unsure and step <= beat:  # c might win, on a step a skipped plan would change
                return self.evaluate(c, reshards)
            if plan is None:
                why = "memory: its simulated peak is over the budget"
                continue
            note = mesh_info(c.pp * c.dp, c.dp, False, c.tp)
            info = {**plan.info, "mesh": {**note, "micro_batches": c.micro_batches}}
            share = rg.collectives / rg.total if rg.total > 0 else 0.0
            return Scored(c, replace(plan, info=info), step, tp_share=share)
        return Scored(c, bound=why)

    def siblings(self, c: Candidate) -> list[Candidate]:
        """The candidates of c's (p, k, t) at every M the search tries, c's own M first."""
        rows = self.batch // c.dp
        others = [m for m in _micro_batches(rows, self.micro_batches) if m != c.micro_batches]
        return [c] + [replace(c, micro_batches=m) for m in others]

    def _own(self, c: Candidate, reshard: bool) -> Plan | str:
        """c's own plan of one stage per pp rank (`_planned` on its rank graph), made once."""
        key = (c, reshard)
        if key not in self.own:
            g = self.ranks(self.rows(c), c.tp).g
            self.own[key] = self._planned(c, g, self.cost(c, reshard))
        return self.own[key]

    def _one_plans(
        self, c: Candidate, g: nx.DiGraph, cost: CostModel, reshard: bool
    ) -> list[Plan] | str:
        """c's own plan, then the cuts of its siblings (the same mesh at another M, cut at
        their rows) assembled on c's rank graph and costs where they fit; or why c has no
        plan. Each cut is a function of its own candidate, so c's plans are c's alone."""
        own = self._own(c, reshard)
        plans = [] if isinstance(own, str) else [own]
        seen = {_groups(x) for x in plans}
        for sibling in self.siblings(c)[1:]:
            made = self._own(sibling, reshard)
            if isinstance(made, str) or _groups(made) in seen:
                continue
            seen.add(_groups(made))
            groups = [(frozenset(st.nodes), 1) for st in made.stages]
            plan = assemble(g, groups, cost, c.pp, self.config.partitioner, self.digest)
            try:
                validate_plan(plan, g)
            except PlanError:
                continue  # over the budget at c's rows
            plans.append(plan)
        return plans or str(own)  # own is why when there is no plan

    def _planned(self, c: Candidate, g: nx.DiGraph, cost: CostModel) -> Plan | str:
        """The plan of one stage per pp rank, recomputing where nothing else fits; or why
        there is none."""
        config = replace(
            self.config, devices=c.pp, micro_batches=c.micro_batches, dp=1, tp=1,
            replication=False, layouts=("one",),
        )  # fmt: skip
        try:
            return partition_op_graph(g, cost, config, self.digest)
        except PlanError as exc:
            if cost.memory.budget is None:
                return f"infeasible: {str(exc).splitlines()[0]}"
        free = replace(cost, memory=replace(cost.memory, budget=None))
        try:
            loose = partition_op_graph(g, free, replace(config, memory_budget=None), self.digest)
        except PlanError as exc:
            return f"infeasible: {str(exc).splitlines()[0]}"
        plan = choose_recompute(replace(loose, cost_model=cost), "auto")
        return plan if not over_budget(plan) else "memory: over the budget even recomputing"

    def _folded_or(
        self,
        ones: list[Plan],
        c: Candidate,
        g: nx.DiGraph,
        cost: CostModel,
        beat: float = math.inf,
        over: list[Plan] | None = None,
    ) -> tuple[list[Plan], bool] | None:
        """The fastest of `ones` (one stage per pp rank) and the chains of 2p stages folded
        loop or v where the config's layouts allow it (`layouts.choose`); a chain cut at
        the rows of c and of each sibling, assembled on c's rank graph and costs. With it,
        whether the choice is unsure (below).

        A plan whose floor is over `beat` is not simulated (it joins `over`); None where
        `layouts.choose` then has no plan (whether it would have chosen a skipped one is not
        known). Where it chooses a plan of one stage per rank whose step (its default
        schedule's) is over `beat` while some were skipped, the choice is unsure: that plan
        is then simulated under zb too (`_scheduled`), and a skipped plan, whose step is
        over `beat` too (its floor is), might have been chosen before it. c's step is then
        over `beat` either way unless zb brings that plan within it (`evaluate` then plans
        c again, nothing skipped)."""
        allowed: list[str] = [x for x in ("loop", "v") if x in self.config.layouts]
        plain = [x for x in ones if not any(s.recompute for s in x.stages)]
        if not allowed or not plain:
            return ones, False
        skipped = [] if over is None else over
        before = len(skipped)
        keep = partial(_kept, beat=beat, over=skipped)
        builders = self._layout_builders(plain, allowed, c, g, cost, keep)
        try:
            chosen = choose_layout(builders, g, None, self.config.split_backward)
        except PlanError:
            return None if len(skipped) > before else (ones, False)
        unsure = len(skipped) > before and chosen.layout == "one" and _chosen_step(chosen) > beat
        return [chosen], unsure

    def _layout_builders(
        self,
        plain: list[Plan],
        allowed: list[str],
        c: Candidate,
        g: nx.DiGraph,
        cost: CostModel,
        keep: Callable[[list[Plan]], list[Plan]],
    ) -> dict[str, Callable[[], Plan | list[Plan]]]:
        """`layouts.choose`'s builders: `plain` for one stage per rank, and per placement
        of `allowed` the chains folded that way; each list through `keep`."""
        cuts = [self._chain_groups(sibling) for sibling in self.siblings(c)]
        unique = [x for i, x in enumerate(cuts) if x not in cuts[:i]]  # equal cuts, equal plans
        chains = [partial(self._chain, c, groups, g, cost) for groups in unique]

        def folded(placement: str) -> list[Plan]:
            made = []
            for chain in chains:
                try:
                    made.append(folded_chain(chain, c.pp, placement))
                except PlanError:
                    continue
            if not made:
                raise PlanError(f"no chain of {2 * c.pp} stages")
            return keep(made)

        builders: dict[str, Callable[[], Plan | list[Plan]]] = {"one": lambda: keep(plain)}
        builders.update({x: partial(folded, x) for x in allowed})
        return builders

    def _chain_groups(self, at: Candidate) -> list[tuple[frozenset[str], int]] | str:
        """The chain of 2p stages cut at the rows of `at` (`layouts.even_chain`: by the op
        times alone, made once per (t, p, rows)), as groups; or why there is none."""
        key = (at.tp, at.pp, self.rows(at))
        if key not in self.chains:
            rank = self.ranks(self.rows(at), at.tp).g
            cost = self.cost(at, False)  # even_chain cuts by the op times alone
            try:
                made = even_chain(rank, cost, 2 * at.pp, self.config.max_units, self.digest)
                self.chains[key] = [(frozenset(st.nodes), 1) for st in made.stages]
            except PlanError as exc:
                self.chains[key] = str(exc)
        return self.chains[key]

    def _chain(
        self,
        c: Candidate,
        groups: list[tuple[frozenset[str], int]] | str,
        g: nx.DiGraph,
        cost: CostModel,
    ) -> Plan:
        """A chain's groups (`_chain_groups`) assembled on c's rank graph `g` and costs."""
        if isinstance(groups, str):
            raise PlanError(groups)
        return assemble(g, groups, cost, 2 * c.pp, "sequential", self.digest)

    def _flushed(self) -> bool:
        """Whether every schedule tried is flushed (what `step_floor` bounds)."""
        name = self.config.schedule
        return name is None or not schedule_spec(name, training=False).asynchronous

    def _scheduled(self, plan: Plan, reshard: bool) -> tuple[Plan | None, float]:
        """`plan` under the fastest schedule whose simulated peak fits (module docstring)."""
        if plan.layout != "one":  # folded: the schedule and its step `layouts.choose` kept
            return plan, _chosen_step(plan)
        names = [self.config.schedule or DEFAULT_SCHEDULE]
        if self.config.schedule is None and self.config.split_backward and not reshard:
            names.append(ZB)
        budget = plan.cost_model.memory.budget
        best: tuple[Plan | None, float] = (None, math.inf)
        for name in names:
            try:
                run = simulate(plan, name)
            except ScheduleError:
                continue
            if budget is not None and max(run.peak_memory, default=0) > budget:
                continue
            if run.iteration_time < best[1]:
                best = (replace(plan, schedule=name), run.iteration_time)
        return best


def choose(gm: fx.GraphModule, prof: Profile, config: PlanConfig, search: MeshSearch) -> Plan:
    """The fastest mesh's plan (module docstring), recording the choice and the runners-up
    in `info["mesh"]`.

    Args:
        gm: The traced model.
        prof: Its profile, at micro-batch size b (any: the graphs are re-costed per r).
        config: What to plan each candidate with; `config.devices` is N, its `tp_plan`
            enables tp, its dp, tp and micro_batches are the search's to choose.
        search: The node and the M to try.

    Returns:
        The plan of the best candidate, its search time the whole search's.

    Raises:
        ConfigError: a bad search field (each named).
        PlanError: no candidate has a plan, naming why each did not.
    """
    b = prof.micro_batch_size
    batch = b * config.micro_batches
    search.check(config.devices, batch)
    start = time.perf_counter()
    with _collector_paused():
        state = _state(gm, prof, config, search, batch)
        found = _branch_and_bound(state, _space(state, search), search.reshard, search.workers)
    chosen = _chosen(found, state, time.perf_counter() - start)
    shapes = {k: (batch // chosen.micro_batches, *v[1:]) for k, v in input_shapes(gm).items()}
    return noted(replace(chosen, input_shapes=shapes), prof)


def grid(gm: fx.GraphModule, prof: Profile, config: PlanConfig, search: MeshSearch) -> list[Scored]:
    """Every candidate of the space planned, none pruned: the brute force `choose` is
    checked against (the same costs, the same planning of each candidate)."""
    batch = prof.micro_batch_size * config.micro_batches
    with _collector_paused():
        state = _state(gm, prof, config, search, batch)
        return [state.evaluate(c, search.reshard) for c in _space(state, search)]


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the search, as it was after: the search
    makes some 350,000 short-lived objects in cycles (the 0.9 B Llama at 512 devices), and
    each full collection they set off walks the whole heap, the traced model's included (a
    sixth of that search's time). What they hold is freed at the next collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _state(
    gm: fx.GraphModule, prof: Profile, config: PlanConfig, search: MeshSearch, batch: int
) -> _Search:
    g, b = op_graph(gm, prof, config.precision), prof.micro_batch_size

    @cache  # one profile per rows, shared by every t
    def graph_at(rows: float) -> nx.DiGraph:
        if rows == b:
            return g
        if prof.mode == "roofline" and float(rows).is_integer():
            sliced = profile(gm, (), int(rows), ProfileConfig(mode="roofline", preset=prof.device))
            return op_graph(gm, sliced, config.precision)
        return per_rank_graph(g, b / rows)  # linear in the rows (`planning.mesh`)

    links: Callable[[int, int, int], tuple[LinkModel, LinkModel, LinkModel]]
    if search.node is None:  # one node of every device, on the config's links
        dp_link, tp_link = config.dp_link or config.link, config.tp_link or config.link

        def same(p: int, k: int, t: int) -> tuple[LinkModel, LinkModel, LinkModel]:
            return config.link, dp_link, tp_link

        links = same

        gpus, name = config.devices, ""
    else:
        node = node_preset(search.node)
        links, gpus, name = node.mesh_links, node.gpus, node.name
    costs = (prof.mode, prof.device)
    digest = graph_hash(gm)
    return _Search(graph_at, config, links, gpus, name, batch, digest, costs, search.micro_batches)


def _space(state: _Search, search: MeshSearch) -> list[Candidate]:
    """The candidates within the depth cap (module docstring)."""
    tp = bool(state.config.tp_plan)
    ops = sum(1 for n in state.graph_at(state.batch) if n != "output")
    out = []
    for c in candidates(state.config.devices, state.batch, state.gpus, tp, search.micro_batches):
        rg = state.ranks(state.rows(c), c.tp)
        if c.pp <= ops and (c.pp == 1 or c.pp <= 2 * rg.total / max(rg.largest, 1e-30)):
            out.append(c)
    return out


def _branch_and_bound(
    state: _Search, space: list[Candidate], reshards: tuple[bool, ...], workers: int = 1
) -> list[Scored]:
    """Every candidate, planned in the estimate's order unless its bound cannot win; on
    `workers` forked processes, a family (the same p, k, t: one cut per M, shared by
    its siblings) at a time each (`_forked`)."""
    bounded = _bounded(state, space, reshards)
    if workers > 1:
        return _forked(state, bounded, reshards, workers)
    return _family(bounded, reshards, math.inf, state)


_Bounded = tuple[float, float, Candidate, str]  # (estimate, lower bound, c, the bound's name)


def _bounded(state: _Search, space: list[Candidate], reshards: tuple[bool, ...]) -> list[_Bounded]:
    """The candidates with their bounds, in the order they are planned: the estimate's."""
    bounded = []
    for c in space:
        rg = state.ranks(state.rows(c), c.tp)
        cost = state.cost(c, reshards[-1])
        budget = cost.memory.budget
        if budget is not None and memory_floor(c, rg, cost) > budget:
            bounded.append((math.inf, math.inf, c, "memory"))
            continue
        lower, which = lower_bound(c, rg, cost)
        estimate = _estimate(c, rg, cost, lower)
        bounded.append((estimate, lower, c, which))
    bounded.sort(key=lambda x: (x[0], x[2].pp, x[2].tp, x[2]))
    return bounded


def _family(
    bounded: list[_Bounded], reshards: tuple[bool, ...], best: float, state: _Search | None = None
) -> list[Scored]:
    """`bounded` in order, each planned unless its bound is at least the best step found
    (from `best` on); in a worker, on the state it was forked with (`_FORKED`)."""
    state = state if state is not None else _FORKED
    assert state is not None  # set before the workers fork
    out = []
    for _, lower, c, which in bounded:
        if which == "memory":
            scored = Scored(
                c, lower=lower, which=which, bound="memory: over the budget at any plan"
            )
        elif lower >= best:
            scored = Scored(c, lower=lower, which=which)
        else:
            scored = state.evaluate(c, reshards, best)
            if scored.which != "floor":
                scored = replace(scored, lower=lower, which=which)
        best = min(best, scored.step)
        out.append(scored)
    return out


_FORKED: _Search | None = None  # the search the workers of `_forked` inherit


def _dealt(families: list[list[_Bounded]], workers: int) -> list[list[_Bounded]]:
    """The order families are handed out: the first `workers` by estimate (one of them
    most likely holds the best step, which prunes the rest), then the deepest pipelines
    first (the dearest to cut: the DP's tables grow with p), so that no long family is
    left to run alone at the end."""
    first, rest = families[:workers], families[workers:]
    return first + sorted(rest, key=lambda items: -items[0][2].pp)  # stable: estimate order


def _forked(
    state: _Search, bounded: list[_Bounded], reshards: tuple[bool, ...], workers: int
) -> list[Scored]:
    """The branch and bound on forked worker processes: the families in the order of their
    first candidate's estimate, each planned whole by one worker against the best step
    known when it starts (`_family`). A family's cuts are its own (`_Search.siblings`), so
    no two workers cut the same; a best step learnt late only prunes less, never the best,
    so the choice is the serial search's (the runners-up can differ: more are planned)."""
    global _FORKED
    families: dict[tuple[int, int, int], list[_Bounded]] = {}
    for item in bounded:
        families.setdefault((item[2].pp, item[2].dp, item[2].tp), []).append(item)
    queue, best = _dealt(list(families.values()), workers), math.inf
    found: dict[Candidate, Scored] = {}
    _FORKED = state
    try:
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            running: set[Future[list[Scored]]] = set()
            while queue or running:
                while queue and len(running) < workers:
                    items = queue.pop(0)
                    if all(x[3] == "memory" or x[1] >= best for x in items):  # none can win
                        found.update(
                            (s.candidate, s) for s in _family(items, reshards, best, state)
                        )
                        continue
                    running.add(pool.submit(_family, items, reshards, best))
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    for scored in future.result():
                        found[scored.candidate] = scored
                        best = min(best, scored.step)
    except BrokenProcessPool as exc:
        raise PlanError(
            f"a worker of the mesh search (workers={workers}) died: {exc}; plan with workers=1"
        ) from exc
    finally:
        _FORKED = None
    return [found[item[2]] for item in bounded]


def _estimate(c: Candidate, rg: RankGraph, cost: CostModel, lower: float) -> float:
    """The step the search expects of c, to order the candidates by (not a bound): its bound
    with 1F1B's bubble, (M + p - 1) / M, and a median edge's transfer each way across the
    p - 1 cuts of the first micro-batch's path."""
    p, m = c.pp, c.micro_batches
    return lower * (m + p - 1) / m + 2 * (p - 1) * cost.link.transfer(rg.hop_bytes)


def _chosen(found: list[Scored], state: _Search, seconds: float) -> Plan:
    planned = [s for s in found if s.plan is not None]
    if not planned:
        reasons = "; ".join(f"{s.candidate}: {s.bound or 'pruned'}" for s in found[:8])
        raise PlanError(f"no mesh of {state.config.devices} devices has a plan: {reasons}")
    best = min(planned, key=lambda s: (s.step, s.candidate.pp, s.candidate.tp, s.candidate))
    assert best.plan is not None
    ranked = sorted((s for s in found if s is not best), key=lambda s: (s.step, s.lower))
    runners = [replace(s, bound=_why_not(s, best)) for s in ranked[:RUNNERS_UP]]
    c = best.candidate
    note = {
        **best.plan.info.get("mesh", {}),
        "pp": c.pp,
        "dp": c.dp,
        "tp": c.tp,
        "micro_batches": c.micro_batches,
        "reshard_after_forward": best.plan.cost_model.dp.reshard_after_forward,
        "node": state.node,
        "chosen_by": "auto",
        "candidates": len(found),
        "planned": len(planned) + sum(1 for s in found if s.plan is None and s.bound),
        "pruned": sum(1 for s in found if s.plan is None and not s.bound),
        "runners_up": [s.record() for s in runners],
    }
    return replace(best.plan, search_time=seconds, info={**best.plan.info, "mesh": note})


def _why_not(s: Scored, best: Scored) -> str:
    """What bound a runner-up (module docstring)."""
    if s.plan is None:
        return s.bound or f"pruned: its {s.which} bound {s.lower * 1e3:.4g} ms >= the chosen step"
    plan, cost = s.plan, s.plan.cost_model
    if any(st.recompute for st in plan.stages) or (
        cost.dp.reshard_after_forward and cost.dims.dp > 1
    ):
        return "memory: fits only recomputing or resharding after the forward"
    bubble = 1 - plan.micro_batches * plan.bottleneck / s.step if s.step > 0 else 0.0
    link = max(
        cost.gather_time(st.param_bytes) + cost.dp_sync_time(st.param_bytes) / plan.micro_batches
        for st in plan.stages
    )
    if link > 0 and link >= 0.5 * plan.bottleneck:
        return f"dp link: {link * 1e3:.3g} ms of gathers and reduce-scatter per micro-batch"
    if s.tp_share >= 0.25:
        return f"tp link: its all-reduces are {s.tp_share:.0%} of its compute"
    if bubble >= 0.25:
        return f"bubble: {bubble:.0%} of the step idle"
    return "compute: more per rank"


def _under(plan: Plan, beat: float, over: list[Plan]) -> bool:
    """Whether `plan`'s floor is within `beat` (a margin for rounding); else it joins
    `over`. Within, not under: a plan that ties the best may still win on fewer pp ranks."""
    if math.isinf(beat) or step_floor(plan) * (1 - 1e-9) <= beat:
        return True
    over.append(plan)
    return False


def _kept(plans: list[Plan], beat: float, over: list[Plan]) -> list[Plan]:
    """The plans whose floor is within `beat` (`_under`)."""
    return [x for x in plans if _under(x, beat, over)]


def _beyond(c: Candidate, g: nx.DiGraph, over: list[Plan], beat: float) -> Scored | None:
    """c recorded as pruned where one of the plans skipped for their floors (`over`) fits
    whatever the schedule: c's step is then one of theirs or less, all over `beat`; None
    where none surely fits (c's step unknown)."""
    if not any(_fits_any_schedule(x, g) for x in over):
        return None
    floor = min(step_floor(x) for x in over)
    return Scored(c, bound=_over_bound(floor, beat), lower=floor, which="floor")


def _fits_any_schedule(plan: Plan, g: nx.DiGraph) -> bool:
    """Whether `plan` is valid, a schedule of its layout runs it, and it fits its budget
    whatever the schedule holds: every rank its stages' weights and all M micro-batches'
    activations of each (so a plan not simulated for its floor would have had a step)."""
    try:
        validate_plan(plan, g)
    except PlanError:
        return False
    if not any(_rule_holds(plan, name) for name in layout_schedules(plan.layout, None)):
        return False
    cost, m = plan.cost_model, plan.micro_batches
    for rank in range(plan.num_devices):
        held = sum(
            cost.weights(s.param_bytes, frozen=s.frozen_bytes) + s.activation_bytes * m
            for s in plan.stages_on(rank)
        )
        if not cost.memory.fits(held):
            return False
    return True


def _rule_holds(plan: Plan, name: str) -> bool:
    """Whether schedule `name`'s rule runs `plan` (`scheduling.rules.check`)."""
    try:
        check(plan, name)
    except ScheduleError:
        return False
    return True


def _over_bound(floor: float, beat: float) -> str:
    return f"pruned: every plan's floor (at least {floor * 1e3:.4g} ms) is over {beat * 1e3:.4g} ms"


def _chosen_step(plan: Plan) -> float:
    """The simulated step `layouts.choose` recorded for the layout it chose."""
    note = plan.info["layouts"]
    return float(next(x["step"] for x in note["considered"] if x["layout"] == note["chosen"]))


def _groups(plan: Plan) -> tuple[frozenset[str], ...]:
    return tuple(frozenset(st.nodes) for st in plan.stages)


def plan_mesh(
    model: nn.Module,
    example_inputs: torch.Tensor | tuple[torch.Tensor, ...] | Mapping[str, Any],
    devices: int,
    *,
    node: Node | str | None = None,
    micro_batches: int | str = "auto",
    workers: int = 1,
    **options: Any,
) -> Plan:
    """Trace, profile and plan a model over the mesh the planner chooses (module docstring).

    Args:
        model: The model (the meta device is fine: its op times are then estimated).
        example_inputs: One mini-batch, dim 0 the batch.
        devices: N.
        node: The node preset or `Node` (see `MeshSearch.node`).
        micro_batches: "auto" or one M.
        workers: Processes planning candidates at once (`MeshSearch.workers`).
        **options: Any other `PlanConfig` field (memory_budget, profile, tp_plan, ...);
            `tp_plan` lets the search use tp (e.g. `graphpipe.runtime.tp.model_tp_plan`).

    Returns:
        The chosen plan; `plan.dims` names the mesh, `print(plan)` lists the runners-up.

    Raises:
        ConfigError: a bad option or search field, each named.
        PlanError: no mesh has a plan.

    Example:
        >>> import torch.nn as nn
        >>> m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        >>> p = plan_mesh(m, torch.randn(8, 16), devices=2, profile=ProfileConfig("flops"))
        >>> p.dims.devices
        2
    """
    args, kwargs = normalise(example_inputs)
    config = PlanConfig(devices=devices, micro_batches=1, **options)
    split = split_of(args, kwargs, config.input_split)
    batch = batch_of(args, kwargs, split)
    search = MeshSearch(node=node, micro_batches=micro_batches, workers=workers)
    search.check(devices, batch)
    gm = trace(
        model, example_inputs, config.leaf_modules, micro_batch_size=batch, input_split=split
    )
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    prof = profile(gm, flat_inputs(gm, *args, **tensors), batch, config.profile)
    return choose(gm, prof, config, search)
