"""The fair planner protocol: graph vs sequential pipelines, each at its best under memory.

GraphPipe's comparison (Jeon et al., ASPLOS'25, section 6): the mini-batch B is fixed per
model; every strategy picks its own number of micro-batches M, its layout and its schedule to
minimise the step time, within a per-device memory budget. Here:

- M runs over the powers of two in 1..64 that divide B; the micro-batch size is b = B / M
  and op times are re-costed for b by the roofline (`ProfileConfig(mode="roofline")`: small
  micro-batches are less efficient). The traced graph is reused; only its costs change.
- Layouts (`FairConfig.layouts`, `planning.layouts`): "one" stage per device, and those with
  several stages per device, built as the planner builds them. Per M, one chain of 2N stages
  (`even_chain`, the slowest stage least) is folded "loop" (stage i on device i mod N) and
  "v" (device d holds d and 2N-1-d); a chain of stages is a sequential plan, so both
  strategies get both. "graph", the graph search's finer stage DAGs of N+1 and N+2 stages
  folded onto the N devices (`finer_dags`, for a graph with branches), goes to graph only.
  A layout with no plan (too few units, a chain for "graph") is left out.
- For each M, a strategy plans every variant of one stage per device (`VARIANTS`: with and
  without data-parallel replication, objective "pipeline" and "bottleneck"), simulates each
  plan under the schedules that run its layout (one per device: the flushed
  `FairConfig.schedules`; the others: `layout_schedules`, e.g. interleaved and interleaved_zb
  for loop, zbv and dualpipev for v) and drops the runs whose simulated peak memory on some
  device exceeds the budget. When no run of a one-per-device variant fits, it is planned
  again with the budget (the DP then keeps every stage within it at graph 1F1B's in-flight
  counts).
- sequential: PipeDream's DP (`partitioner="sequential"`), the best of its variants and of
  the loop and v chains. Its candidates also hold every chain the graph search returns (a
  chain of convex stages is a sequential plan, for some topological order): the DP's probes
  of the "pipeline" objective can miss, say, one replicated stage at M = 1 that the graph
  search finds.
- graph: GraphPipe's series-parallel search (`partitioner="graph"`), whose search space holds
  every sequential plan: its candidates are its own plans, the sequential ones (loop and v
  included) and its finer DAGs, and the fastest simulated run is kept (the partitioner keeps
  the sequential plan by its score too). So graph is never slower than sequential;
  `Choice.stage_dag` says whether a stage DAG (depth below the stage count) won,
  `Choice.layout` how its stages sit on the devices.

The step time is the simulated flushed step (`simulate`), so throughput is B / step.

Both strategies plan on the same mesh: with `FairConfig.dp` = k > 1 the N devices are pp = N / k
coordinates of k dp ranks each (`graphpipe.planning.mesh`), every stage FSDP-sharded over its
k ranks, each taking b / k rows of every micro-batch (re-costed by the roofline at b / k);
only the M whose micro-batch divides by k are tried, the replication variants are dropped
(dp replaces replication inside the pp dimension), and only the "one" layout is planned (the
mesh planner folds no stages onto a device).

    result = compare(gm, example_inputs, devices=8, config=FairConfig(budget=80 * GIB))
    result.ratio, result.graph.micro_batches, result.sequential.layout, result.binding

Cost per strategy and M: #variants searches (twice where over the budget), one linear
partition into 2N stages, for graph two more searches for the finer DAGs; a simulation per
plan and schedule.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

import networkx as nx
import torch
from torch import fx

from graphpipe.errors import ConfigError, PlanError, ScheduleError
from graphpipe.ir import Plan
from graphpipe.ir.cost import LinkModel
from graphpipe.ir.registry import schedule_names
from graphpipe.planning.layouts import (
    LAYOUTS,
    even_chain,
    finer_dags,
    folded_chain,
    layout_schedules,
)
from graphpipe.planning.opgraph import graph_hash, op_graph
from graphpipe.planning.partition import PlanConfig, cost_model, partition_mesh, partition_op_graph
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.scheduling.simulate import simulate
from graphpipe.tracing.annotate import trace_info

__all__ = ["GIB", "VARIANTS", "Choice", "Comparison", "FairConfig", "choose", "compare"]

GIB = 1024**3
VARIANTS = ((True, "pipeline"), (True, "bottleneck"), (False, "pipeline"), (False, "bottleneck"))
STRATEGIES = ("graph", "sequential")


@dataclass(frozen=True)
class FairConfig:
    """The rules both strategies play by."""

    budget: float | None = 80 * GIB  # bytes per device (None: unlimited)
    preset: str = "a100"  # roofline device preset (graphpipe.planning.devices.DEVICES)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # M tried, those dividing B
    # the flushed one-stage-per-device schedules tried: gpipe, 1f1b, zb
    schedules: tuple[str, ...] = tuple(
        schedule_names(training=True, asynchronous=False, placement=None)
    )
    link: LinkModel = field(default_factory=LinkModel)  # between devices
    variants: tuple[tuple[bool, str], ...] = VARIANTS  # (replication, objective) pairs
    dp: int = 1  # k: the mesh's dp degree (devices = pp x dp), the same for both strategies
    # the layouts tried (planning.layouts): with dp > 1 only "one" (the mesh plans no folds)
    layouts: tuple[str, ...] = LAYOUTS

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget <= 0:
            raise ConfigError(f"memory budget must be positive, got {self.budget}")
        if self.dp < 1:
            raise ConfigError(f"dp must be >= 1, got {self.dp}")
        unknown = [x for x in self.layouts if x not in LAYOUTS]
        if unknown or not self.layouts:
            raise ConfigError(
                f"layouts must be a non-empty subset of {LAYOUTS}, got {self.layouts}"
                + (f" (unknown: {unknown})" if unknown else "")
            )
        if self.dp > 1 and "one" not in self.layouts:
            raise ConfigError(
                f"with dp = {self.dp} only the layout 'one' is planned (the mesh planner folds "
                f"no stages), got layouts {self.layouts}"
            )
        if min(self.micro_batches, default=0) < 1 or not self.schedules or not self.variants:
            raise ConfigError(
                f"need micro_batches >= 1, schedules and variants, got "
                f"{self.micro_batches}, {self.schedules} and {self.variants}"
            )


@dataclass(frozen=True)
class Choice:
    """A strategy's best configuration: plain data, with the plan it came from."""

    strategy: str  # "graph" or "sequential"
    micro_batches: int  # M
    schedule: str
    layout: str  # "one", "loop", "v" or "graph" (planning.layouts)
    replication: bool
    objective: str
    depth: int  # stages on the longest path
    peak_memory: int  # bytes, the largest device's simulated peak
    step_time: float  # seconds per mini-batch, simulated
    plan: Plan
    runs: int  # simulated runs compared
    search_time: float  # seconds spent planning and simulating

    @property
    def stage_dag(self) -> bool:
        """Whether the plan is a stage DAG, not a chain (its depth is below its stage count)."""
        return _is_dag(self.plan)


@dataclass(frozen=True)
class Comparison:
    """Both strategies' choices, the throughput ratio and what holds the sequential one back."""

    graph: Choice
    sequential: Choice
    binding: str  # the constraint binding the sequential plan, with its figure

    @property
    def ratio(self) -> float:
        """Graph throughput over sequential throughput (B fixed: the step-time ratio)."""
        return self.sequential.step_time / self.graph.step_time


def micro_batch_counts(
    batch: int, candidates: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)
) -> list[int]:
    """The candidate micro-batch counts that divide `batch`, in increasing order.

    Example:
        >>> micro_batch_counts(48)
        [1, 2, 4, 8, 16]
    """
    return sorted(m for m in set(candidates) if batch % m == 0)


def choose(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    devices: int,
    strategy: str,
    config: FairConfig | None = None,
) -> Choice:
    """The fastest configuration of `strategy` on `devices` under the fair protocol.

    Args:
        gm: A graph made by `graphpipe.tracing.tracer` (any micro-batch size: only its per-sample
            statistics are used).
        example_inputs: Its inputs; dim 0 is the fixed mini-batch B.
        devices: N.
        strategy: "graph" or "sequential".
        config: The rules; 80 GiB per device on the A100 roofline by default.

    Returns:
        The fastest `Choice` whose simulated peak memory fits the budget on every device.

    Raises:
        ConfigError: an unknown strategy.
        PlanError: no M, variant and schedule fits the budget.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return _choose_all(gm, example_inputs, devices, config or FairConfig(), (strategy,))[0]


def compare(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    devices: int,
    config: FairConfig | None = None,
    explain_above: float = 0.0,
) -> Comparison:
    """Both strategies under the fair protocol, and the sequential plan's binding constraint.

    Sequential plans are searched once and shared: they are the sequential candidates and
    part of the graph ones. `binding` is computed when the ratio exceeds `explain_above`
    (e.g. the paper's 1.6), else left empty.
    """
    config = config or FairConfig()
    graph, seq = _choose_all(gm, example_inputs, devices, config, STRATEGIES)
    explain = seq.step_time / graph.step_time > explain_above
    why = binding(gm, example_inputs, devices, seq, config) if explain else ""
    return Comparison(graph, seq, why)


def binding(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    devices: int,
    seq: Choice,
    config: FairConfig,
) -> str:
    """What holds a sequential choice back, the largest of three figures:

    memory      the step it would reach with unlimited memory, as a speed-up (only
                computed when a budget is set: the whole search again, unbudgeted)
    depth       the fill and drain share of its pipeline, (depth - 1) / (M + depth - 1); for
                a chain folded v stages per device (loop, v), whose hops take 1/v of a
                device's work per micro-batch, (depth/v - 1) / (v M + depth/v - 1)
    all-reduce  its slowest stage's gradient all-reduce (with dp, and the reduce-scatter or
                all-reduce over the dp ranks: `CostModel.update_sync`), as a share of the step
    """
    cost, m = seq.plan.cost_model, seq.micro_batches
    v = 1 if seq.layout == "one" else len(seq.plan.stages) // seq.plan.num_devices
    figures = {"depth": (seq.depth / v - 1) / (v * m + seq.depth / v - 1)}
    allreduce = max(cost.update_sync(s.param_bytes, s.replicas) for s in seq.plan.stages)
    figures["all-reduce"] = allreduce / seq.step_time
    if config.budget is not None:
        free = choose(gm, example_inputs, devices, "sequential", replace(config, budget=None))
        figures["memory"] = seq.step_time / free.step_time - 1
    worst = max(figures, key=lambda k: figures[k])
    per = "" if v == 1 else f" ({v} per device)"
    notes = {
        "depth": f"depth: {seq.depth} stages{per} at M={m}, fill/drain {figures['depth']:.0%}",
        "all-reduce": f"all-reduce: {figures['all-reduce']:.0%} of the step",
        "memory": f"memory: unlimited is {figures.get('memory', 0) + 1:.2f}x faster",
    }
    return notes[worst]


def _choose_all(
    gm: fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    devices: int,
    config: FairConfig,
    strategies: Sequence[str],
) -> list[Choice]:
    batch = trace_info(gm).batch_size
    best: dict[str, Choice | None] = {s: None for s in strategies}
    start = time.perf_counter()
    runs = 0
    for m in micro_batch_counts(batch, config.micro_batches):
        if (batch // m) % config.dp:
            continue  # the micro-batch does not split over the dp ranks
        plans = _plans(gm, inputs, devices, m, config, strategies)
        simulated: dict[Hashable, list[Run]] = {}  # variants and strategies share plans
        for strategy in strategies:
            for candidate in plans[strategy]:
                for choice in _runs(candidate, strategy, config, simulated):
                    runs += 1
                    current = best[strategy]
                    if current is None or choice.step_time < current.step_time:
                        best[strategy] = choice
    chosen = []
    for strategy in strategies:
        found = best[strategy]
        if found is None:
            raise PlanError(
                f"no {strategy} configuration of M in {config.micro_batches} on {devices} "
                f"devices fits the memory budget of {config.budget} bytes per device"
            )
        chosen.append(replace(found, runs=runs, search_time=time.perf_counter() - start))
    return chosen


Variant = tuple[bool, str]
Candidate = tuple[Plan, Variant, str]  # a plan, its (replication, objective) and layout


def _plans(
    gm: fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    devices: int,
    m: int,
    config: FairConfig,
    strategies: Sequence[str],
) -> dict[str, list[Candidate]]:
    """Per strategy, its candidate plans at M = m: one stage per device of every variant
    (graph: its own and the sequential ones), then the folded layouts' (`_folded`)."""
    b, k = trace_info(gm).batch_size // m, config.dp
    roofline = ProfileConfig(mode="roofline", preset=config.preset)
    g, digest = op_graph(gm, profile(gm, inputs, b, roofline)), graph_hash(gm)
    sliced = g if k == 1 else op_graph(gm, profile(gm, inputs, b // k, roofline))
    at = _AtM(g, b, digest, devices, m, config, tuple(strategies))
    out: dict[str, list[Candidate]] = {"graph": [], "sequential": []}
    if "one" in config.layouts:
        out = _one_per_device(at, sliced)
    if k == 1:
        for strategy, found in _folded(at).items():
            out[strategy] += found
    return out


@dataclass(frozen=True)
class _AtM:
    """What one M's plans are made from: the op graph at micro-batch size b, its hash, the
    devices, M, the rules and the strategies compared."""

    g: nx.DiGraph
    b: int
    digest: str
    devices: int
    m: int
    config: FairConfig
    strategies: tuple[str, ...]


def _one_per_device(at: _AtM, sliced: nx.DiGraph) -> dict[str, list[Candidate]]:
    """The one-stage-per-device plans of every variant; a variant with no plan (too few ops,
    nothing fits) is left out. Planned without the budget, then within it if over."""
    g, b, digest, devices, m, config = at.g, at.b, at.digest, at.devices, at.m, at.config
    k = config.dp
    variants = (
        config.variants if k == 1 else tuple(dict.fromkeys((False, o) for _, o in config.variants))
    )
    out: dict[str, list[Candidate]] = {"graph": [], "sequential": []}
    for kind in ("sequential", "graph") if "graph" in at.strategies else ("sequential",):
        for variant in variants:
            for budget in (None, config.budget) if config.budget is not None else (None,):
                plan_config = PlanConfig(
                    devices,
                    m,
                    kind,
                    budget,
                    link=config.link,
                    replication=variant[0],
                    objective=variant[1],
                    dp=k,
                    layouts=("one",),  # the folded layouts are `_folded`'s
                )
                try:
                    plan = partition_mesh(
                        g, b, plan_config, digest, "roofline", config.preset, lambda _: sliced
                    )
                except PlanError:
                    continue
                out[kind].append((plan, variant, "one"))
                if _fits(plan, config.budget):  # else plan again within the budget
                    break
    out["sequential"] += [c for c in out["graph"] if not _is_dag(c[0])]
    out["graph"] += [c for c in out["sequential"] if c[0].partitioner == "sequential"]
    return out


def _folded(at: _AtM) -> dict[str, list[Candidate]]:
    """The plans of the folded layouts in `config.layouts`, as the planner builds them
    (`planning.layouts`): one chain of 2N stages (`even_chain`) folded "loop" and "v", for
    both strategies; the graph partitioner's finer stage DAGs (`finer_dags`), for graph only.
    A layout with no plan (too few units, a chain for "graph") is left out."""
    g, b, digest, devices, m, config = at.g, at.b, at.digest, at.devices, at.m, at.config
    out: dict[str, list[Candidate]] = {"graph": [], "sequential": []}
    if devices == 1 and "one" in config.layouts:
        return out  # one stage on the one device, as the planner keeps
    single = PlanConfig(devices, m, "graph", link=config.link, replication=False, layouts=("one",))
    cost = cost_model(single, b, "roofline", config.preset)
    chain = functools.cache(
        functools.partial(even_chain, g, cost, 2 * devices, single.max_units, digest)
    )

    def finer(n: int) -> Plan:  # as `_one_per_device`: within the budget only if over it
        plan = partition_op_graph(g, cost, replace(single, devices=n), digest)
        if _fits(plan, config.budget):
            return plan
        within = replace(single, devices=n, memory_budget=config.budget)
        return partition_op_graph(
            g, cost_model(within, b, "roofline", config.preset), within, digest
        )

    builders: dict[str, Callable[[], list[Plan]]] = {
        "loop": lambda: [folded_chain(chain, devices, "loop")],
        "v": lambda: [folded_chain(chain, devices, "v")],
        "graph": lambda: finer_dags(g, finer, devices),
    }
    graph_only = ("graph",) if "graph" in at.strategies else ()
    for layout in (x for x in config.layouts if x != "one"):
        owners = graph_only if layout == "graph" else ("graph", "sequential")
        if not owners:
            continue
        try:
            plans = builders[layout]()
        except PlanError:
            continue
        # a chain minimises its slowest stage; the finer DAGs the default objective
        variant = (False, "pipeline" if layout == "graph" else "bottleneck")
        for strategy in owners:
            out[strategy] += [(p, variant, layout) for p in plans]
    return out


def _is_dag(plan: Plan) -> bool:
    return plan.depth < len(plan.stages)


def _fits(plan: Plan, budget: float | None) -> bool:
    return budget is None or max(s.memory_bytes for s in plan.stages) <= budget


Run = tuple[str, int, float]  # a schedule, its simulated peak bytes and step seconds


def _runs(
    candidate: Candidate, strategy: str, config: FairConfig, simulated: dict[Hashable, list[Run]]
) -> list[Choice]:
    """The plan under every schedule that runs its layout within the budget, each simulated
    once per plan (`simulated`: the runs of the plans seen, by their stages and costs)."""
    plan, variant, layout = candidate
    key = (plan.stages, plan.edges, plan.num_devices, plan.cost_model, layout)
    if key not in simulated:
        simulated[key] = _simulated(plan, layout, config)
    return [
        Choice(
            strategy,
            plan.micro_batches,
            name,
            layout,
            variant[0],
            variant[1],
            plan.depth,
            peak,
            step,
            plan,
            0,
            0.0,
        )
        for name, peak, step in simulated[key]
    ]


def _simulated(plan: Plan, layout: str, config: FairConfig) -> list[Run]:
    """The plan under every schedule that runs its layout (one stage per device: the config's
    flushed schedules; the others: `layout_schedules`), those within the budget."""
    names = config.schedules if layout == "one" else layout_schedules(layout, None)
    runs = []
    for name in names:
        try:
            run = simulate(plan, name)
        except (ScheduleError, PlanError):
            continue  # a schedule the plan does not admit
        peak = max(run.peak_memory)
        if config.budget is None or peak <= config.budget:
            runs.append((name, peak, run.iteration_time))
    return runs
