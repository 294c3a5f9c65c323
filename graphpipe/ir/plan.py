"""The Plan: where ops run (stages, their devices, the edges between them) and what each costs.

Both are frozen and round-trip through JSON/text, so they can be computed once, written to a
file, sent to every rank and checked again there. Index letters used throughout graphpipe:

    s, t  stages        j  micro-batch        r  replicas of a stage
    S     #stages       M  micro-batches      N  devices (= ranks)
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

import networkx as nx

from graphpipe._units import format_bytes, format_time
from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir.cost import CostModel
from graphpipe.ir.dims import ParallelDims
from graphpipe.ir.registry import ANY_PLACEMENT, DEFAULT_SCHEDULE, schedule_spec

__all__ = [
    "LAYOUTS",
    "LAYOUT_WORDS",
    "WEIGHT_SHARE",
    "Plan",
    "Stage",
    "StageEdge",
    "compute_time",
    "default_schedule",
    "device_of",
    "edges_to_sink",
    "freed",
    "input_halves",
    "layout_of",
    "placed",
    "transfer_time",
    "weight_share",
]

PLAN_FORMAT = "graphpipe-plan/1"


def edges_to_sink(g: nx.DiGraph) -> dict[int, int]:
    """For every node of a DAG, the edges on its longest path to a sink."""
    height: dict[int, int] = {}
    for s in reversed(list(nx.topological_sort(g))):
        height[s] = max((height[t] + 1 for t in g.successors(s)), default=0)
    return height


@dataclass(frozen=True)
class Stage:
    """One stage: a convex set of ops run on a group of devices (its data-parallel replicas)."""

    index: int
    nodes: tuple[str, ...]  # fx node names, in graph order
    devices: tuple[int, ...]  # ranks holding a replica; micro-batch j runs on devices[j % r]
    forward_time: float  # seconds per micro-batch on one device
    backward_time: float
    time: float  # seconds per micro-batch for the stage, replicas and all-reduce included
    param_bytes: int  # parameters and buffers held (shared ones counted in every holder)
    activation_bytes: int  # bytes kept for one micro-batch in flight
    in_flight: int  # micro-batches in flight under graph 1F1B (longest path to the sink)
    memory_bytes: int  # predicted peak bytes on one replica
    update_time: float = 0.0  # seconds of one optimizer step (0 unless calibrated)
    recompute: bool = False  # the backward re-runs the forward (activation checkpointing)
    # it receives values whose gradients it sends back; without any (a chain's first stage,
    # whose input is data) its backward has no input half: W is the whole backward
    input_half: bool = True
    # a backward runs through it; False: forward only (a frozen encoder: no trainable
    # parameter, no input that takes a gradient), so no B, I or W and no gradient messages
    backward: bool = True
    frozen_bytes: int = 0  # of param_bytes, the parameters that take no gradient

    @property
    def replicas(self) -> int:
        """Number of data-parallel replicas."""
        return len(self.devices)

    def device_for(self, j: int) -> int:
        """The rank that runs micro-batch `j` of this stage."""
        return self.devices[j % len(self.devices)]


@dataclass(frozen=True)
class StageEdge:
    """Values flowing from one stage to another, for every micro-batch."""

    src: int
    dst: int
    tensors: tuple[str, ...]  # names of the fx nodes whose outputs cross
    bytes: int  # bytes for one micro-batch
    grads: tuple[str, ...] = ()  # the tensors whose gradients flow back (floating point)
    grad_bytes: int = 0  # bytes of those gradients for one micro-batch
    # a dependency-only edge's backward token; False where either end runs forward only
    token_back: bool = True

    @property
    def backward_message(self) -> bool:
        """Whether backward sends a message back along this edge: gradients, or, for a
        dependency-only edge (no tensors; sequential chains), an empty token."""
        return bool(self.grads) or (not self.tensors and self.token_back)


@dataclass(frozen=True)
class Plan:
    """A graph of stages: which ops run where, and what the cost model predicts for it.

    Attributes:
        stages: The stages, in a topological order of the stage graph.
        edges: Stage-graph edges with the tensors they carry.
        num_devices: Devices (ranks) the plan is for; a plan may leave some idle. With a dp
            dimension (`cost_model.dp`, degree k) these are the pp coordinates: each is k
            ranks, and stage times, activation and edge bytes are those of one of them
            (1/k of every micro-batch's rows).
        cost_model: The assumptions behind the predictions.
        partitioner: "graph", "sequential" or "manual".
        bottleneck: Predicted seconds per micro-batch of the slowest stage or link.
        search_time: Seconds the partitioner spent.
        graph_hash: Digest of the traced graph the plan is for (`opgraph.graph_hash`).
        input_shapes: Each model input's shape per micro-batch, as traced for the plan
            (`opgraph.input_shapes`); empty in plans written before it was recorded.
        layout: How the stages sit on the devices, one of `LAYOUTS` ("one", "loop", "v",
            "graph"). Left empty, it is read from the placement (`layout_of`).
        schedule: The schedule the plan was made for (`graphpipe.ir.registry.SCHEDULES`),
            which `simulate(plan)` and `compile` run unless told otherwise. Left empty:
            `default_schedule(layout)`.
        info: Free-form facts about the search, for people (JSON-able).

    Raises:
        PlanError: an unknown layout or schedule.
    """

    stages: tuple[Stage, ...]
    edges: tuple[StageEdge, ...]
    num_devices: int
    cost_model: CostModel
    partitioner: str
    bottleneck: float
    search_time: float
    graph_hash: str
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    layout: str = ""
    schedule: str = ""
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        layout = self.layout or layout_of(self)
        if layout not in LAYOUTS:
            raise PlanError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        try:
            schedule = schedule_spec(self.schedule or default_schedule(layout), training=False)
        except ConfigError as exc:
            raise PlanError(f"the plan's schedule: {exc}") from exc
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "schedule", schedule.name)  # an alias named as itself
        dims = self.cost_model.dims
        if dims.pp != self.num_devices:  # the cost model's pp is the plan's devices
            cost = replace(self.cost_model, dims=replace(dims, pp=self.num_devices))
            object.__setattr__(self, "cost_model", cost)

    @property
    def micro_batches(self) -> int:
        """M: micro-batches per mini-batch."""
        return self.cost_model.micro_batches

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch."""
        return self.cost_model.micro_batch_size

    @property
    def dims(self) -> ParallelDims:
        """The parallel layout the plan is for: pp (its devices) x dp x tp
        (`graphpipe.ir.dims`); `str()` names every dimension."""
        return self.cost_model.dims

    @property
    def mesh_words(self) -> str:
        """The mesh in words with FSDP2's resharding, e.g. "pp 2 x dp 2 (sharded)"."""
        return f"pp {self.num_devices} x {self.cost_model.describe_mesh()}"

    @property
    def throughput(self) -> float:
        """Predicted samples per second in steady state."""
        return self.micro_batch_size / self.bottleneck if self.bottleneck > 0 else float("inf")

    @cached_property
    def stage_graph(self) -> nx.DiGraph:
        """The stage DAG as networkx (nodes are stage indices)."""
        g = nx.DiGraph()
        g.add_nodes_from(s.index for s in self.stages)
        g.add_edges_from((e.src, e.dst) for e in self.edges)
        return g

    @cached_property
    def _edges_by_ends(self) -> dict[tuple[int, int], StageEdge]:
        return {(e.src, e.dst): e for e in self.edges}

    def edge(self, src: int, dst: int) -> StageEdge:
        """The stage edge from stage `src` to stage `dst`.

        Raises:
            PlanError: the plan has no such edge.
        """
        found = self._edges_by_ends.get((src, dst))
        if found is None:
            raise PlanError(f"no stage edge S{src}->S{dst} in the plan")
        return found

    @property
    def depth(self) -> int:
        """Stages on the longest path through the stage graph."""
        return nx.dag_longest_path_length(self.stage_graph) + 1 if self.stages else 0

    @cached_property
    def stage_of(self) -> dict[str, int]:
        """fx node name -> stage index."""
        return {name: s.index for s in self.stages for name in s.nodes}

    def stage_on(self, rank: int) -> Stage | None:
        """The first stage a rank holds a replica of, or None for an idle rank."""
        return next((s for s in self.stages if rank in s.devices), None)

    def stages_on(self, rank: int) -> tuple[Stage, ...]:
        """Every stage a rank holds (several under an interleaved placement)."""
        return tuple(s for s in self.stages if rank in s.devices)

    def shared_devices(self) -> list[int]:
        """Devices that hold several stages (placed or folded plans)."""
        return [d for d in range(self.num_devices) if len(self.stages_on(d)) > 1]

    def devices_used(self) -> int:
        """Devices that hold a stage."""
        return len({d for s in self.stages for d in s.devices})

    def to_json(self) -> str:
        """Serialise to JSON text (see `from_json`)."""
        data = asdict(self)
        data["cost_model"] = self.cost_model.to_dict()
        data["format"] = PLAN_FORMAT
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse a plan written by `to_json`.

        Raises:
            PlanError: the text is not JSON, is not a graphpipe plan, or misses or mistypes
                a field. The message names what is wrong.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan file is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlanError(f"not a graphpipe plan: format is {found!r}, expected {PLAN_FORMAT!r}")
        try:
            return _plan_from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed plan file: {type(exc).__name__}: {exc}") from exc

    def __str__(self) -> str:
        lines = [
            f"Plan({self.partitioner}: {len(self.stages)} stages on {self.devices_used()}/"
            f"{self.num_devices} devices, depth {self.depth}, bottleneck "
            f"{format_time(self.bottleneck)}/micro-batch)"
        ]
        if self.dims.meshed:
            lines[0] = lines[0][:-1] + f", mesh {self.mesh_words})"
        lines.append(f"  costs: {self.costs}")
        measured = self.info.get("profile", {})  # planning.profile.Profile.summary
        failed = list(measured.get("fallbacks", {}).items())
        lines += [f"  {n}: estimated from its FLOPs, not measured ({why})" for n, why in failed[:5]]
        if len(failed) > 5:
            lines.append(f"  and {len(failed) - 5} more ops estimated from their FLOPs")
        if "spread" in measured:
            s = measured["spread"]
            lines.append(
                f"  noisy host: op runs took {s['weighted']:.0%} more than the least kept "
                f"(weighted by time; most: {s['op']}, {s['op_spread']:.0%})"
            )
        lines += [f"  {line}" for line in mesh_lines(self.info.get("mesh"))]
        note = self.info.get("layouts")
        lines += [f"  {line}" for line in _layout_lines(self.layout, self.schedule, note)]
        lines += [
            f"  S{s.index} dev{list(s.devices)} {len(s.nodes)} ops "
            f"{format_time(s.time)} {format_bytes(s.memory_bytes)}"
            for s in self.stages
        ]
        lines += [
            f"  S{e.src}->S{e.dst} {format_bytes(e.bytes)} {list(e.tensors)}" for e in self.edges
        ]
        return "\n".join(lines)

    @property
    def costs(self) -> str:
        """Where the op times came from, in words: "measured on cuda:0", "FLOPs estimate",
        "roofline of the a100 preset"."""
        how, device = self.cost_model.profile, self.cost_model.device
        if how == "measure":
            return f"measured on {device}"
        if how == "roofline":
            return f"roofline of the {device} preset"
        if how == "flops":
            return "FLOPs estimate (op times not measured)"
        return f"{how} on {device}"

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)


def layout_lines(note: dict[str, Any] | None) -> list[str]:
    """The planner's layout choice (`planning.layouts`, `plan.info["layouts"]`) in words: the
    layout kept and its schedule, then each layout considered with its simulated step or why
    it had no plan. Nothing when the planner considered one layout only."""
    if not note:
        return []
    return _layout_lines(note["chosen"], note["schedule"], note)


def _layout_lines(layout: str, schedule: str, note: dict[str, Any] | None) -> list[str]:
    """The layout and its schedule in words, and with the planner's `note` (`layout_lines`)
    each layout considered."""
    head = f"layout: {layout} ({LAYOUT_WORDS[layout]}), run by {schedule}"
    if not note:
        return [head]
    chosen = next(c for c in note["considered"] if c["layout"] == note["chosen"])
    lines = [
        f"{head}: the fastest simulated step ({format_time(chosen['step'])}) of those considered:"
    ]
    for c in note["considered"]:
        if c["step"] is None:
            lines.append(f"  {c['layout']:5s} no plan: {c.get('why', '')}")
        else:
            lines.append(f"  {c['layout']:5s} {c['schedule']:16s} {format_time(c['step'])}/step")
    return lines


def mesh_lines(note: dict[str, Any] | None) -> list[str]:
    """The mesh search's choice (`planning.automesh`, `plan.info["mesh"]`) in words: the
    mesh, then each runner-up with its simulated step and what bound it. Nothing for a mesh
    that was given."""
    if not note or "runners_up" not in note:
        return []
    on = f" on {note['node']} nodes" if note.get("node") else ""
    lines = [
        f"mesh: {_mesh_words(note)}{on}, chosen of {note['candidates']} meshes "
        f"({note['planned']} planned, "
        f"{note['pruned']} pruned by a lower bound); runners-up:"
    ]
    for r in note["runners_up"]:
        shape = _mesh_words(r)
        step = "not planned" if r["step"] is None else f"{format_time(r['step'])}/step"
        lines.append(f"  {shape:34s} {step:18s} {r['bound']}")
    return lines


def _mesh_words(entry: dict[str, Any]) -> str:
    """A mesh search entry's layout and M, e.g. "pp 2 x dp 4 (sharded), M 8"."""
    dims = ParallelDims(pp=entry["pp"], dp=entry["dp"], tp=entry["tp"])
    return f"{dims}, M {entry['micro_batches']}"


LAYOUTS = ("one", "loop", "v", "graph")  # how stages sit on devices (`planning.layouts`)
LAYOUT_WORDS = {
    "one": "one stage per device",
    "loop": "a chain folded round-robin, several stages per device",
    "v": "a chain folded in a V, 2 stages per device",
    "graph": "a stage DAG folded onto the devices",
}


def layout_of(plan: Plan) -> str:
    """How `plan`'s stages sit on its devices: "one" where no device holds two stages,
    "loop" or "v" for a chain placed so (`placed`), else "graph" (any other folding)."""
    if not plan.shared_devices():
        return "one"
    return next((p for p in ("loop", "v") if placed(plan, p)), "graph")


def placed(plan: Plan, placement: str) -> bool:
    """Whether `plan` is a chain (`chain_in_order`) of single-device stages, stage s on
    device `device_of(s, N, placement)`, with as many stages on every device (2 on a "v")."""
    n, count = plan.num_devices, len(plan.stages)
    per_device = count == 2 * n if placement == "v" else count > 0 and count % n == 0
    return (
        per_device
        and chain_in_order(plan)
        and all(s.devices == (device_of(s.index, n, placement),) for s in plan.stages)
    )


def default_schedule(layout: str) -> str:
    """The schedule a plan of `layout` runs when neither it nor the run names one: 1f1b on
    one stage per device, else the one that runs any placement (graph_interleaved)."""
    return DEFAULT_SCHEDULE if layout == "one" else ANY_PLACEMENT


def _plan_from_dict(data: dict[str, Any]) -> Plan:
    edges = tuple(
        StageEdge(**{**e, "tensors": tuple(e["tensors"]), "grads": tuple(e["grads"])})
        for e in data["edges"]
    )
    halves = input_halves(edges)  # files written before `input_half`: from the edges
    stages = tuple(
        Stage(
            **{
                "input_half": s["index"] in halves,
                **s,
                "nodes": tuple(s["nodes"]),
                "devices": tuple(s["devices"]),
            }
        )
        for s in data["stages"]
    )
    return Plan(
        stages=stages,
        edges=edges,
        num_devices=int(data["num_devices"]),
        cost_model=CostModel.from_dict(data["cost_model"]),
        partitioner=str(data["partitioner"]),
        bottleneck=float(data["bottleneck"]),
        search_time=float(data["search_time"]),
        graph_hash=str(data["graph_hash"]),
        input_shapes={
            str(k): tuple(int(d) for d in v) for k, v in data.get("input_shapes", {}).items()
        },
        **_made_for(data),
        info=dict(data.get("info", {})),
    )


def _made_for(data: dict[str, Any]) -> dict[str, str]:
    """The layout and schedule of a plan file; in files written before they were fields,
    the planner's note (`info["layouts"]`) where it chose them, else "" (derived)."""
    note = data.get("info", {}).get("layouts") or {}
    return {
        "layout": str(data.get("layout") or note.get("chosen") or ""),
        "schedule": str(data.get("schedule") or note.get("schedule") or ""),
    }


# -- cost primitives: what one action of a stage costs (the scheduler and simulator share them) --

WEIGHT_SHARE = 0.5  # share of a backward that is the weight gradient (zero bubble's W)


def weight_share(stage: Stage) -> float:
    """The share of the stage's backward (time and held activations) that belongs to W: all
    of it on a stage with no input half (`Stage.input_half`), none on one without weights."""
    if not stage.input_half:
        return 1.0
    return WEIGHT_SHARE if stage.param_bytes > 0 else 0.0


def input_halves(edges: Sequence[StageEdge]) -> frozenset[int]:
    """The stages whose backward has an input half: they receive a value whose gradient they
    send back (`StageEdge.grads`)."""
    return frozenset(e.dst for e in edges if e.grads)


def freed(stage: Stage, kind: str) -> float:
    """Activation units a compute action frees (negative: a forward takes one)."""
    share = weight_share(stage)
    return {"F": -1.0, "B": 1.0, "I": 1.0 - share, "W": share}[kind]


def compute_time(stage: Stage, kind: str) -> float:
    """Seconds for one compute action of `stage` on one micro-batch."""
    share = weight_share(stage)
    return {
        "F": stage.forward_time,
        "B": stage.backward_time,
        "I": stage.backward_time * (1 - share),
        "W": stage.backward_time * share,
    }[kind]


def transfer_time(plan: Plan, edge: StageEdge, direction: str) -> float:
    """Seconds one micro-batch's message takes along `edge` ("F" activations, "B" gradients):
    none between two stages of one device (the runtime copies it locally)."""
    src, dst = plan.stages[edge.src], plan.stages[edge.dst]
    if src.devices == dst.devices and len(src.devices) == 1:
        return 0.0
    return plan.cost_model.link.transfer(edge.bytes if direction == "F" else edge.grad_bytes)


def over_budget(plan: Plan) -> list[tuple[int, int]]:
    """(device, predicted bytes) for each device whose stages' predicted memory together
    exceed the plan's memory budget, in device order (none without a budget)."""
    budget = plan.cost_model.memory.budget
    if budget is None:
        return []
    used = [(d, sum(s.memory_bytes for s in plan.stages_on(d))) for d in range(plan.num_devices)]
    return [(d, b) for d, b in used if b > budget]


def chain_in_order(plan: Plan) -> bool:
    """Whether the stages form a chain in index order: stage i feeds stage i + 1 for every
    i, and every other edge goes forward (a skip: a residual, a mask or a tied weight's
    value read by a later stage). An order that runs stage i's forward after stage i - 1's
    and its backward after stage i + 1's then meets every edge's dependency, so the loop and
    v placements and their schedules take such plans.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> chain_in_order(NS(stages=(0, 1, 2), edges=[NS(src=0, dst=1), NS(src=1, dst=2)]))
        True
        >>> chain_in_order(NS(stages=(0, 1, 2), edges=[NS(src=0, dst=1), NS(src=0, dst=2)]))
        False
    """
    pairs = {(e.src, e.dst) for e in plan.edges}
    linked = all((i, i + 1) in pairs for i in range(len(plan.stages) - 1))
    return linked and all(src < dst for src, dst in pairs)


def device_of(stage: int, devices: int, placement: str) -> int:
    """The device of chain stage `stage` under a "loop" or "v" placement on `devices` devices
    (see `graphpipe.planning.place`)."""
    if placement == "loop":
        return stage % devices
    return stage if stage < devices else 2 * devices - 1 - stage
