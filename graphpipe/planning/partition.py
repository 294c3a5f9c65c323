"""Partition: cut a traced, profiled op graph into a graph of stages (a `Plan`).

    cfg = PlanConfig(devices=8, micro_batches=8, partitioner="graph")
    plan = partition(gm, prof, cfg)

Partitioners:
    graph       GraphPipe: DP over the series-parallel tree (`search`), branches become
                concurrent stages on disjoint devices. The sequential plan is computed too and
                kept when it is better under the same cost model, so "graph" is never worse.
    sequential  PipeDream: the same DP over one series of all units in topological order.
    manual      `PlanConfig.pins` place modules or ops on stages (`manual`).

Steps: the ops of the op graph (`opgraph.op_graph`) that must share a stage (a non-tensor
value and its users) or had better (a dead end, such as an assert, and its producer; a
constant, such as a mask, and its first consumer) are folded into groups
(`fold.folded_groups`); the groups are coarsened into units (`sptree.coarsen`, merging
chain links while a unit stays within 1/(2N) of the model's time), decomposed
(`sptree.decompose`, or `linearise`), merged further along the tree while more than
`PlanConfig.max_units` units remain (`sptree.condense`), searched (`search.search`) and
assembled into a Plan (`assemble.assemble`), which is then validated.

Layouts: by default the graph partitioner also considers several stages per device (a chain
of 2N stages folded loop or v, finer stage DAGs folded onto the devices) beside its plan of
one stage per device, simulates each and keeps the fastest (`layouts`, `PlanConfig.layouts`,
`PlanConfig.schedule`); with a dp dimension, one stage per device.

Only single tensors cross stages: every partitioner keeps a non-tensor value (a tuple, an
int from a size query, None) in the stage of all its users; pins that would split one are a
`PlanError` naming it (`manual`), and `Plan.validate` rejects a plan that cuts one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir import ANY_PLACEMENT, DEFAULT_SCHEDULE, Plan, schedule_spec
from graphpipe.ir.cost import CostModel, DataParallel, LinkModel, MemoryModel, TensorParallel
from graphpipe.ir.dims import ParallelDims
from graphpipe.ir.registry import POLICIES, SCHEDULES, policy_spec
from graphpipe.planning.assemble import assemble
from graphpipe.planning.fold import coarse_units
from graphpipe.planning.interleave import interleavings
from graphpipe.planning.layouts import (
    LAYOUTS,
    choose,
    even_chain,
    finer_dags,
    folded_chain,
    made_for,
    usable,
)
from graphpipe.planning.manual import groups_from_pins
from graphpipe.planning.mesh import (
    check_rows,
    check_tp_plan,
    choose_mesh,
    dp_degrees,
    mesh_info,
    per_rank_graph,
    tp_rank_graph,
)
from graphpipe.planning.opgraph import graph_hash, input_shapes, op_graph, wire_bytes
from graphpipe.planning.options import (
    Memory,
    Numerics,
    OptionGroup,
    Parallelism,
    Planning,
    default,
    field_default,
    joined,
    split,
    unknown_option,
)
from graphpipe.planning.place import PLACEMENTS, place_stages
from graphpipe.planning.profile import Profile, ProfileConfig, noted, profile
from graphpipe.planning.schedule_memory import held_floor
from graphpipe.planning.search import search
from graphpipe.planning.sptree import condense, decompose, linearise
from graphpipe.planning.validate import validate_plan
from graphpipe.scheduling.simulate import simulate
from graphpipe.tracing.bind import batch_of, normalise, split_of
from graphpipe.tracing.tracer import LeafSpec, flat_inputs, trace

__all__ = [
    "PlanConfig",
    "cost_model",
    "micro_batch_size",
    "partition",
    "partition_mesh",
    "partition_op_graph",
    "plan",
    "plan_options",
    "planner_config",
]

PARTITIONERS = ("graph", "sequential", "manual")


@dataclass(frozen=True)
class PlanConfig:
    """What to plan for: the planner's options (`graphpipe.planning.options`, where each is
    defined once, under the same name as in compile and on the command line), resolved.
    Every field but `devices` has a default: the option's, where the option's is not
    "decided later" (None: M, the partitioner and the weight versions are resolved here)."""

    devices: int  # N: devices (ranks) to spread the model over
    micro_batches: int = 4  # M: micro-batches per mini-batch (the option's None: 4)
    partitioner: str = "graph"  # "graph", "sequential" or "manual" (needs pins)
    memory_budget: float | None = default("memory_budget")  # bytes per device; None: unlimited
    weight_versions: int = 1  # weight copies the weight policy keeps (flush 1, 2bw 2)
    optimizer_slots: int = default("optimizer_slots")  # optimizer state tensors per parameter
    link: LinkModel = field(default_factory=LinkModel)  # bandwidth and latency between devices
    replication: bool = default("replication")  # allow data-parallel stages (replicas > 1)
    objective: str = default("objective")  # "pipeline": least (M+depth-1)*bottleneck, or least
    pins: Mapping[str, int] | None = default("pins")  # manual: op or module path -> stage
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # how op times are obtained
    leaf_modules: Sequence[LeafSpec] = default("leaf_modules")  # types/paths traced as one node
    # input -> its split rule where dim 0 is not the batch (graphpipe.tracing.split)
    input_split: Mapping[Any, Any] | None = default("input_split")
    max_units: int = default("max_units")  # the most units the DP searches (at least 4N)
    virtual_stages: int = default("virtual_stages")  # stages per device (a chain, folded)
    placement: str = default("placement")  # with virtual_stages > 1: "loop" or "v" (ZB-V)
    interleave: bool = default("interleave")  # graph: also finer DAGs folded onto the devices
    # graph: the layouts tried (planning.layouts), the fastest simulated one kept
    layouts: tuple[str, ...] = default("layouts")
    schedule: str | None = default("schedule")  # the schedule the run names: its layouts only
    split_backward: bool = default("split_backward")  # no schedule named: zero bubble may win
    precision: str | None = default("precision")  # "bf16"/"fp16": values cross in 2 bytes
    # the mesh (planning.mesh): devices = pp x dp; each stage FSDP-sharded over dp ranks
    dp: int | str = 1  # k: ranks per stage on the "dp" dim, or "auto" (the planner chooses)
    dp_shard: bool = default("dp_shard")  # dp shards parameters, gradients, optimizer state
    reshard_after_forward: bool = True  # FSDP2's option: parameters gathered again for B
    dp_link: LinkModel | None = default("dp_link")  # the dp dimension's link; None: `link`
    # tensor parallelism (planning.mesh): devices = pp x dp x tp; tp_plan's layers split
    tp: int = 1  # t: ranks per stage on the "tp" dim, splitting the layers of `tp_plan`
    tp_plan: Mapping[str, str] | None = default("tp_plan")  # module path -> style
    tp_link: LinkModel | None = default("tp_link")  # the tp dimension's link; None: `link`

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        """Every problem with the fields, each naming its values (empty when they are fine).
        Each check is independent, so one bad field does not hide another."""
        found = [problem for problem in self._field_problems() if problem]
        for check in (self._check_mesh, self._check_layouts):
            try:
                check()
            except ConfigError as exc:
                found.append(str(exc))
        return found

    def _field_problems(self) -> list[str | None]:
        """One entry per field rule: its problem, or None."""
        budget = self.memory_budget
        return [
            _unless(
                _positive_int(self.devices), f"devices must be an int >= 1, got {self.devices!r}"
            ),
            _unless(
                _positive_int(self.micro_batches),
                f"micro_batches must be an int >= 1, got {self.micro_batches!r}",
            ),
            _unless(
                self.partitioner in PARTITIONERS,
                f"partitioner must be one of {PARTITIONERS}, got {self.partitioner!r}",
            ),
            _unless(
                self.objective in ("pipeline", "bottleneck"),
                f"objective must be 'pipeline' or 'bottleneck', got {self.objective!r}",
            ),
            _unless(
                _positive_int(self.max_units), f"max_units must be >= 1, got {self.max_units!r}"
            ),
            _unless(
                budget is None or (isinstance(budget, (int, float)) and budget > 0),
                f"memory_budget must be a positive number of bytes or None, got {budget!r}",
            ),
            _unless(
                _positive_int(self.virtual_stages),
                f"virtual_stages must be an int >= 1, got {self.virtual_stages!r}",
            ),
            _unless(
                self.placement in PLACEMENTS,
                f"placement must be one of {PLACEMENTS}, got {self.placement!r}",
            ),
            _unless(
                self.precision in (None, "bf16", "fp16"),
                f"precision must be 'bf16', 'fp16' or None, got {self.precision!r}",
            ),
            _unless(
                not self.interleave or (self.partitioner == "graph" and self.virtual_stages == 1),
                "interleave=True folds the graph partitioner's stage DAGs onto the devices: "
                f"it needs partitioner='graph' and virtual_stages=1, got "
                f"{self.partitioner!r} and {self.virtual_stages}",
            ),
            _unless(
                self.partitioner != "manual" or bool(self.pins),
                "partitioner='manual' needs pins: {module path or op: stage}",
            ),
            _unless(
                not self.pins or self.partitioner == "manual",
                f"pins={dict(self.pins or {})} place stages by hand, which needs "
                f"partitioner='manual' (or none), not {self.partitioner!r}",
            ),
        ]

    def _check_mesh(self) -> None:
        if not _positive_int(self.devices):
            return  # said by _field_problems
        if self.dp != "auto" and not isinstance(self.dp, int):
            raise ConfigError(f"dp must be an int or 'auto', got {self.dp!r}")
        self.dims.on(self.devices, f"devices={self.devices}")  # the layout's one check
        check_tp_plan(self.tp, self.tp_plan)

    @property
    def dims(self) -> ParallelDims:
        """The layout asked for, pp open (dp 1 while it is "auto").

        Raises:
            ConfigError: a bad size (`ParallelDims.problems`).
        """
        dp = self.dp if isinstance(self.dp, int) else 1
        return ParallelDims(pp=None, dp=dp, tp=self.tp, dp_shard=self.dp_shard)

    def _check_layouts(self) -> None:
        if self.partitioner != "graph" or self.virtual_stages > 1 or self.interleave:
            return  # the layout is the partitioner's, or asked for
        unknown = [x for x in self.layouts if x not in LAYOUTS]
        if unknown or not self.layouts:
            raise ConfigError(
                f"layouts must be a non-empty subset of {LAYOUTS}, got {self.layouts}"
            )
        if self.schedule is not None:
            schedule_spec(self.schedule)  # an unknown name is a ConfigError naming the known
            if not usable(self.layouts, self.schedule, self.split_backward):
                raise ConfigError(
                    f"schedule {self.schedule!r} runs none of the layouts {self.layouts}"
                )

    @classmethod
    def build(cls, devices: int, **options: Any) -> PlanConfig:
        """`PlanConfig(devices, **options)`, naming any unknown option."""
        problems = cls.problems_of(devices, **options)
        if problems:
            raise ConfigError("; ".join(problems))
        if options.get("pins") and "partitioner" not in options:
            options["partitioner"] = "manual"
        return cls(devices=devices, **options)

    @classmethod
    def problems_of(cls, devices: int, **options: Any) -> list[str]:
        """Every problem `build(devices, **options)` would raise, at once: unknown names
        (with the closest known one), then the known fields' values."""
        known = {f.name for f in fields(cls)}
        problems = [unknown_option(name, known) for name in sorted(set(options) - known)]
        given = {k: v for k, v in options.items() if k in known}
        if given.get("pins") and "partitioner" not in given:
            given["partitioner"] = "manual"
        try:
            config = object.__new__(cls)  # the fields set, the checks run without raising
            for f in fields(cls):
                value = given.get(f.name, field_default(f)) if f.name != "devices" else devices
                object.__setattr__(config, f.name, value)
            problems.extend(config.problems())
        except (TypeError, ValueError) as exc:  # a value of the wrong type
            problems.append(f"plan options {given}: {exc}")
        return problems


def _positive_int(value: Any) -> bool:
    """An int >= 1 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _unless(ok: bool, problem: str) -> str | None:
    """`problem` where a rule does not hold, else None."""
    return None if ok else problem


def plan(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any],
    devices: int | None = None,
    *,
    planning: Planning | None = None,
    parallelism: Parallelism | None = None,
    numerics: Numerics | None = None,
    memory: Memory | None = None,
    **options: Any,
) -> Plan:
    """Trace, profile and partition a model: the whole planner in one call.

    Args:
        model: The model.
        example_inputs: One mini-batch (a tensor, a tuple, or a dict of keyword inputs);
            dim 0 is the batch and must split into `micro_batches` equal micro-batches. The
            model is traced at the micro-batch size.
        devices: N, the number of devices: pp x dp x tp with `dp=k` and `tp=t` (see
            `graphpipe.planning.mesh`); or `parallelism.devices`.
        planning, parallelism, numerics, memory: Option groups
            (`graphpipe.planning.options`), the same values compile takes.
        **options: Any option by name (micro_batches, partitioner, memory_budget, dp, ...),
            routed to its group. `dp=k` plans the stages over N / k pp coordinates, each
            stage sharded over k dp ranks that take 1/k of every micro-batch's rows;
            `dp="auto"` tries every k dividing N and the rows and keeps the fastest
            simulated step under the memory budget, recording what bound the others in
            `plan.info["mesh"]`. dp is uniform over the stages; with dp > 1 replication
            inside the pp dimension is turned off (said in `plan.info["mesh"]`). `tp=t` with
            `tp_plan={module path: style}` splits the plan's layers over t ranks of every
            stage, costed as Megatron-LM's (its all-reduces in the stage times).

    Returns:
        A validated `Plan`.

    Raises:
        ConfigError: an unknown option, a batch that does not split into micro-batches, a
            dp that does not divide N or the micro-batch's rows, a tp that does not divide
            N, or tp > 1 without a tp_plan.
        TraceError: the model cannot be traced.
        PlanError: no plan meets the constraints, or pins split a value that is not a single
            tensor from its users.

    Example:
        >>> import torch.nn as nn
        >>> m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        >>> p = plan(m, torch.randn(8, 16), devices=2, micro_batches=4)
        >>> len(p.stages) <= 2
        True
    """
    config = planner_config(
        devices, dict(planning=planning, parallelism=parallelism, numerics=numerics, memory=memory),
        options,
    )  # fmt: skip
    args, kwargs = normalise(example_inputs)
    split = split_of(args, kwargs, config.input_split)
    b = micro_batch_size(batch_of(args, kwargs, split), config.micro_batches)
    gm = trace(model, example_inputs, config.leaf_modules, micro_batch_size=b, input_split=split)
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    prof = profile(gm, flat_inputs(gm, *args, **tensors), b, config.profile)
    return partition(gm, prof, config)


_PLAN_FIELDS = frozenset(f.name for f in fields(PlanConfig)) - {"devices"}
PLAN_GROUPS = (Planning, Parallelism, Numerics, Memory)  # the option groups plan() takes
# options plan() does not take, and why
PLAN_ELSEWHERE: Mapping[str, str] = {
    "max_shapes": "is compile's; plan() plans at the example's shapes",
    "checkpoint": "is compile's (a meta model's weights)",
    "init_weights": "is compile's (a meta model's weights)",
}


def planner_config(
    devices: int | None,
    groups: Mapping[str, OptionGroup | None],
    options: Mapping[str, Any],
) -> PlanConfig:
    """The PlanConfig of plan()'s arguments: the groups with the keywords routed into them,
    resolved (`plan_options`), every problem found at once.

    Raises:
        ConfigError: every problem, naming the values.
    """
    got, problems = split(groups, options, PLAN_GROUPS, elsewhere=PLAN_ELSEWHERE)
    n = devices if devices is not None else got["parallelism"].devices  # type: ignore[attr-defined]
    mesh = got["parallelism"].mesh  # type: ignore[attr-defined]
    if mesh is not None:
        problems.append(
            f"mesh={mesh!r}: the planner takes mesh='auto' (graphpipe.plan) or dp= and tp=; "
            "a DeviceMesh of running ranks is compile's"
        )
    if n is None:
        problems.append("devices= is needed: the number of devices to plan for")
    kwargs = plan_options(got)
    if not problems:
        problems.extend(PlanConfig.problems_of(n, **kwargs))
    if problems:
        raise ConfigError(joined(problems))
    return PlanConfig(devices=n, **kwargs)


def plan_options(groups: Mapping[str, OptionGroup]) -> dict[str, Any]:
    """PlanConfig's fields (but devices) from the option groups, each under its one name,
    with what the options leave open resolved: M None is 4; no partitioner is manual with
    pins, else graph; no weight_versions is the policy's (2 for a policy without a flush);
    no dp or tp is 1; reshard_after_forward None is True but False under a zero-bubble
    schedule."""
    values = {f.name: getattr(g, f.name) for g in groups.values() for f in fields(g)}  # type: ignore[arg-type]
    out = {k: v for k, v in values.items() if k in _PLAN_FIELDS and v is not None}
    out.setdefault("partitioner", "manual" if values.get("pins") else "graph")
    weights = values.get("weights", "flush")
    if values.get("weight_versions") is None and weights in POLICIES:
        out["weight_versions"] = 1 if policy_spec(weights).replicas else 2
    schedule = values.get("schedule")
    named = schedule_spec(schedule) if schedule in SCHEDULES else None
    if values.get("reshard_after_forward") is None:
        out["reshard_after_forward"] = not (named is not None and named.split_backward)
    return out


def micro_batch_size(batch: int, micro_batches: int) -> int:
    """batch / M, which must be a whole number."""
    if batch % micro_batches:
        raise ConfigError(
            f"a batch of {batch} does not split into {micro_batches} equal micro-batches"
        )
    return batch // micro_batches


def partition(gm: fx.GraphModule, prof: Profile, config: PlanConfig) -> Plan:
    """Cut a traced and profiled graph into a validated Plan (see the module docstring).

    Args:
        gm: A graph made by `graphpipe.tracing.tracer`.
        prof: Its profile for one micro-batch size.
        config: What to plan for.

    Returns:
        The plan, validated against `gm`.

    Raises:
        PlanError: more devices than ops, nothing fits the memory budget, or pins split a
            value that is not a single tensor from its users.
    """
    g, b = op_graph(gm, prof, config.precision), prof.micro_batch_size
    graph_at = None
    if prof.mode == "roofline":  # re-costed at b / k rows: a small slice pays its weight reads

        def graph_at(k: int) -> nx.DiGraph:
            sliced = profile(gm, (), b // k, ProfileConfig(mode="roofline", preset=prof.device))
            return op_graph(gm, sliced, config.precision)

    made = partition_mesh(g, b, config, graph_hash(gm), prof.mode, prof.device, graph_at)
    return noted(replace(made, input_shapes=input_shapes(gm)), prof)


def partition_mesh(
    g: nx.DiGraph,
    micro_batch_size: int,
    config: PlanConfig,
    digest: str,
    profile: str = "flops",
    device: str = "cpu",
    graph_at: Callable[[int], nx.DiGraph] | None = None,
) -> Plan:
    """`partition_op_graph` over the mesh `config` names: its dp degree, or each one that
    divides the devices and the rows when `config.dp` is "auto", and its tp degree and plan
    (`planning.mesh`).

    Args:
        g: The op graph of a whole micro-batch.
        micro_batch_size: b, the rows of a micro-batch (all dp ranks together).
        config: What to plan for; `config.devices` is N = pp x dp x tp.
        digest: The traced graph's hash, recorded in the plan.
        profile: Where the op times came from, recorded in the cost model.
        device: The device the op times are for.
        graph_at: k -> the op graph of one dp rank (b / k rows), for k > 1; by default
            `per_rank_graph(g, k)` (times and bytes linear in the rows).

    Returns:
        The plan over N / (k t) pp coordinates, validated against the per-rank op graph.

    Raises:
        ConfigError: a dp that does not divide the micro-batch's rows.
        PlanError: as `partition_op_graph`; with "auto", when no k has a plan.
    """

    t, n = config.tp, config.devices // config.tp  # n: pp x dp

    def plan_at(k: int) -> Plan:
        replace(config.dims, dp=k).on(config.devices, f"devices={config.devices}")
        check_rows(k, micro_batch_size)
        cost = cost_model(config, micro_batch_size, profile, device, dp=k)
        sliced = g if k == 1 else graph_at(k) if graph_at is not None else per_rank_graph(g, k)
        if t > 1:
            assert config.tp_plan is not None  # checked by PlanConfig
            sliced = tp_rank_graph(sliced, t, config.tp_plan, cost.tp_link)
        if k == 1 and t == 1:
            return partition_op_graph(g, cost, replace(config, dp=1), digest)
        pp = replace(  # one stage per device, as compile runs a mesh
            config, devices=n // k, dp=1, tp=1, replication=False, layouts=("one",)
        )
        made = partition_op_graph(sliced, cost, pp, digest)
        note = mesh_info(n, k, config.replication, t)
        return replace(made, info={**made.info, "mesh": note})

    if config.dp != "auto":
        assert isinstance(config.dp, int)  # checked by PlanConfig
        return plan_at(config.dp)
    ops = sum(1 for op in g if op != "output")
    degrees = dp_degrees(n, micro_batch_size)
    return choose_mesh(plan_at, n, degrees, config.memory_budget, ops)


def partition_op_graph(g: nx.DiGraph, cost: CostModel, config: PlanConfig, digest: str) -> Plan:
    """`partition` on the networkx op graph (`opgraph.op_graph`) with an explicit cost model.

    Args:
        g: The op graph.
        cost: The cost model.
        config: What to plan for.
        digest: The traced graph's hash, recorded in the plan.

    Returns:
        The plan, validated against `g`.

    Raises:
        PlanError: more devices than ops, nothing fits the memory budget, or pins split a
            value that is not a single tensor from its users.
    """
    if config.virtual_stages > 1:
        chain = replace(
            config,
            devices=config.devices * config.virtual_stages,
            virtual_stages=1,
            replication=False,
            layouts=("one",),
            schedule=None,
            partitioner="manual" if config.partitioner == "manual" else "sequential",
        )
        result = place_stages(
            partition_op_graph(g, cost, chain, digest), config.devices, config.placement
        )
        validate_plan(result, g)
        return made_for(result, config.schedule)
    ops = sum(1 for n in g if n != "output")
    if config.devices > ops:
        raise PlanError(
            f"{config.devices} devices for a graph of only {ops} ops; use at most {ops}"
        )
    if config.partitioner == "manual":
        assert config.pins is not None  # checked by PlanConfig
        result = assemble(
            g, groups_from_pins(g, config.pins), cost, config.devices, "manual", digest
        )
    elif config.partitioner == "sequential":
        result = _for_schedule(
            lambda floor: _searched(g, cost, config, "sequential", digest, floor), config
        )
    elif config.interleave:
        base = _best_of_graph_and_sequential(g, cost, config, digest)
        result = _interleaved_or(base, g, cost, config, digest)
    else:
        result = _chosen_layout(g, cost, config, digest)
    validate_plan(result, g)
    return made_for(result, config.schedule)


def _chosen_layout(g: nx.DiGraph, cost: CostModel, config: PlanConfig, digest: str) -> Plan:
    """The graph partitioner's plan in the fastest simulated layout (`planning.layouts`); with
    one stage per device the only layout left, the plan of the search, unsimulated."""
    layouts = usable(config.layouts, config.schedule, config.split_backward)
    if layouts == ["one"] or (config.devices == 1 and "one" in layouts):
        return _for_schedule(
            lambda floor: _best_of_graph_and_sequential(g, cost, config, digest, floor), config
        )
    start = time.perf_counter()
    n = config.devices
    single = replace(config, replication=False, layouts=("one",), schedule=None)

    @functools.cache
    def chain() -> Plan:
        return even_chain(g, cost, 2 * n, config.max_units, digest)

    def finer(devices: int) -> Plan:  # the DP's stage DAG: finer chains fold better as loop/v
        return _searched(g, cost, replace(single, devices=devices), "graph", digest)

    builders: dict[str, Callable[[], Plan | list[Plan]]] = {
        "one": lambda: _best_of_graph_and_sequential(g, cost, config, digest),
        "loop": lambda: folded_chain(chain, n, "loop"),
        "v": lambda: folded_chain(chain, n, "v"),
        "graph": lambda: finer_dags(g, finer, n),
    }
    chosen = choose({x: builders[x] for x in layouts}, g, config.schedule, config.split_backward)
    return replace(chosen, partitioner=config.partitioner, search_time=time.perf_counter() - start)


def _for_schedule(make: Callable[[int], Plan], config: PlanConfig) -> Plan:
    """`make(0)` (the search at graph 1F1B's in-flight counts), searched again with
    `held_floor` where the run's named schedule holds more micro-batches than fit the
    memory budget (`schedule_memory.held_floor`), until the count stops growing (a deeper
    plan can hold more under zb; at most 3 searches). compile checks the plan it runs.

    Raises:
        PlanError: no plan fits when every stage holds what the schedule's order holds,
            naming the schedule and the count.
    """
    plan, floor = make(0), 0
    for _ in range(2):
        more = held_floor(plan, config.schedule)
        if more <= floor:
            break
        floor = more
        try:
            plan = make(floor)
        except PlanError as exc:
            raise PlanError(
                f"schedule {config.schedule!r} holds {floor} micro-batches in flight per "
                f"stage, and at that count {exc} Or run schedule='1f1b' (fewer in flight)."
            ) from exc
    return plan


def _interleaved_or(
    base: Plan, g: nx.DiGraph, cost: CostModel, config: PlanConfig, digest: str
) -> Plan:
    """`base`, or the fastest graph interleaving (`interleave`) when its simulated step under
    graph_interleaved beats base's under 1f1b."""
    start = time.perf_counter()

    def finer(devices: int) -> Plan:
        return _best_of_graph_and_sequential(
            g, cost, replace(config, devices=devices, replication=False, interleave=False), digest
        )

    base_time = simulate(base, DEFAULT_SCHEDULE).iteration_time
    best, best_time = base, base_time
    ops = sum(1 for n in g if n != "output")
    tried = 0
    for candidate in interleavings(finer, config.devices, ops):
        try:
            validate_plan(candidate, g)  # e.g. the stages of a device over the memory budget
        except PlanError:
            continue
        tried += 1
        t = simulate(candidate, ANY_PLACEMENT).iteration_time
        if t < best_time:
            best, best_time = candidate, t
    note = {
        "unfolded_step": base_time,
        "interleaved_step": best_time if best is not base else None,
        "foldings_tried": tried,
    }
    return replace(
        best,
        search_time=base.search_time + time.perf_counter() - start,
        info={**best.info, "interleave": note},
    )


def cost_model(
    config: PlanConfig,
    micro_batch_size: int,
    profile: str = "flops",
    device: str = "cpu",
    dp: int | None = None,
) -> CostModel:
    """The CostModel a PlanConfig implies for micro-batches of `micro_batch_size`, with dp
    degree `dp` (by default `config.dp`, 1 when it is "auto")."""
    k = dp if dp is not None else (config.dp if isinstance(config.dp, int) else 1)
    return CostModel(
        micro_batch_size=micro_batch_size,
        micro_batches=config.micro_batches,
        link=config.link,
        memory=MemoryModel(config.memory_budget, config.weight_versions, config.optimizer_slots),
        profile=profile,
        device=device,
        dims=ParallelDims(pp=None, dp=k, tp=config.tp, dp_shard=config.dp_shard),
        dp=DataParallel(config.reshard_after_forward, link=config.dp_link),
        tp=TensorParallel(config.tp_link),
    )


def _searched(
    g: nx.DiGraph,
    cost: CostModel,
    config: PlanConfig,
    kind: str,
    digest: str,
    held_floor: int = 0,
    coarse: nx.DiGraph | None = None,
    guess: float | None = None,
) -> Plan:
    """The DP's plan on `g`'s units (`coarse`, else coarsened here) under the `kind` tree;
    `guess` is where its least bottleneck likely lies (`search.search`), its own
    recorded in `info["least_bottleneck"]`."""
    start = time.perf_counter()
    units = coarse_units(g, config.devices) if coarse is None else coarse
    tree = decompose(units) if kind == "graph" else linearise(units)
    units, tree = condense(g, units, tree, max(config.max_units, 4 * config.devices))
    units.graph["tensor_bytes"] = {n: wire_bytes(g, n) for n in g}
    limit = config.devices if config.replication else 1
    result = search(
        units,
        tree,
        cost,
        config.devices,
        max_replicas=limit,
        objective=config.objective,
        chain=kind == "sequential",
        held_floor=held_floor,
        guess=guess,
    )
    groups = [(frozenset(n for u in p.units for n in u), p.replicas) for p in result.pieces]
    info = {
        "units": units.number_of_nodes(),
        "dp_bottleneck": result.tau,
        "least_bottleneck": result.least,
        "candidates": result.candidates,
        "iterations": result.iterations,
    }
    return assemble(
        g,
        groups,
        cost,
        config.devices,
        kind,
        digest,
        search_time=time.perf_counter() - start,
        info=info,
    )


def score(plan: Plan, objective: str) -> tuple[float, int]:
    """What the partitioners minimise: the flushed-pipeline step estimate (M + depth - 1) x
    bottleneck for "pipeline", the bottleneck for "bottleneck"; then the depth."""
    if objective == "pipeline":
        return (plan.micro_batches + plan.depth - 1) * plan.bottleneck, plan.depth
    return plan.bottleneck, plan.depth


def _best_of_graph_and_sequential(
    g: nx.DiGraph, cost: CostModel, config: PlanConfig, digest: str, held_floor: int = 0
) -> Plan:
    coarse = coarse_units(g, config.devices)  # one for both searches
    graph_plan = _searched(g, cost, config, "graph", digest, held_floor, coarse)
    least = graph_plan.info["least_bottleneck"]  # the sequential one's is seldom far above
    try:
        seq_plan = _searched(g, cost, config, "sequential", digest, held_floor, coarse, least)
    except PlanError as exc:  # a graph plan can fit where no sequential one does
        return replace(
            graph_plan,
            info={**graph_plan.info, "chosen": "graph", "sequential": f"infeasible: {exc}"},
        )
    total_time = graph_plan.search_time + seq_plan.search_time
    if score(seq_plan, config.objective) < score(graph_plan, config.objective):
        note = (
            f"the sequential plan scores {score(seq_plan, config.objective)[0]:.4g} s, the "
            f"series-parallel search {score(graph_plan, config.objective)[0]:.4g} s; "
            "the sequential one is kept"
        )
        return replace(
            seq_plan,
            partitioner="graph",
            search_time=total_time,
            info={**seq_plan.info, "chosen": "sequential", "note": note},
        )
    return replace(
        graph_plan,
        search_time=total_time,
        info={
            **graph_plan.info,
            "chosen": "graph",
            "sequential_bottleneck": seq_plan.bottleneck,
            "sequential_depth": seq_plan.depth,
        },
    )
