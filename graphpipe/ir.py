"""Shared plain-data types: the Plan (where ops run) and the Schedule (when), read by every phase.

Both are frozen and round-trip through JSON/text, so they can be computed once, written to a
file, sent to every rank and checked again there. Index letters used throughout graphpipe:

    s, t  stages        j  micro-batch        r  replicas of a stage
    S     #stages       M  micro-batches      N  devices (= ranks)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx

from graphpipe._units import format_bytes, format_time
from graphpipe.cost import CostModel
from graphpipe.errors import PlanError, ScheduleError

__all__ = ["KINDS", "Action", "Plan", "Schedule", "Span", "Stage", "StageEdge", "Timeline"]

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

    @property
    def backward_message(self) -> bool:
        """Whether backward sends a message back along this edge: gradients, or, for a
        dependency-only edge (no tensors; sequential chains), an empty token."""
        return bool(self.grads) or not self.tensors


@dataclass(frozen=True)
class Plan:
    """A graph of stages: which ops run where, and what the cost model predicts for it.

    Attributes:
        stages: The stages, in a topological order of the stage graph.
        edges: Stage-graph edges with the tensors they carry.
        num_devices: Devices (ranks) the plan is for; a plan may leave some idle.
        cost_model: The assumptions behind the predictions.
        partitioner: "graph", "sequential" or "manual".
        bottleneck: Predicted seconds per micro-batch of the slowest stage or link.
        search_time: Seconds the partitioner spent.
        graph_hash: Digest of the traced graph the plan is for (`opgraph.graph_hash`).
        input_shapes: Each model input's shape per micro-batch, as traced for the plan
            (`opgraph.input_shapes`); empty in plans written before it was recorded.
        info: Free-form facts about the search, for people (JSON-able).
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
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def micro_batches(self) -> int:
        """M: micro-batches per mini-batch."""
        return self.cost_model.micro_batches

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch."""
        return self.cost_model.micro_batch_size

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

    def validate(self, graph: Any = None) -> None:
        """Check the plan; see `graphpipe.validate.validate_plan`."""
        from graphpipe.validate import validate_plan

        validate_plan(self, graph)

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
        lines += [
            f"  S{s.index} dev{list(s.devices)} {len(s.nodes)} ops "
            f"{format_time(s.time)} {format_bytes(s.memory_bytes)}"
            for s in self.stages
        ]
        lines += [
            f"  S{e.src}->S{e.dst} {format_bytes(e.bytes)} {list(e.tensors)}" for e in self.edges
        ]
        return "\n".join(lines)

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)


def _plan_from_dict(data: dict[str, Any]) -> Plan:
    stages = tuple(
        Stage(**{**s, "nodes": tuple(s["nodes"]), "devices": tuple(s["devices"])})
        for s in data["stages"]
    )
    edges = tuple(
        StageEdge(**{**e, "tensors": tuple(e["tensors"]), "grads": tuple(e["grads"])})
        for e in data["edges"]
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
        info=dict(data.get("info", {})),
    )


# -- schedules ---------------------------------------------------------------------------------

KINDS = {
    "F": "forward",
    "B": "full backward (input and weight gradients)",
    "I": "input-gradient half of the backward (zero bubble)",
    "W": "weight-gradient half of the backward (zero bubble)",
    "SF": "send activations to the peer stage",
    "RF": "receive activations from the peer stage",
    "SB": "send gradients to the peer stage",
    "RB": "receive gradients from the peer stage",
    "U": "optimizer update (after micro-batch j for per-micro-batch policies)",
}
COMPUTE = frozenset({"F", "B", "I", "W"})
_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|I|W|U)(\d+)?(?:([<>])(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: `2F0` is stage 2's forward of micro-batch 0.

    Text forms: `{stage}{kind}{mb}` for compute (`2F0`, `2B0`, `2I0`, `2W0`), `2SF0>3` and
    `3RF0<2` for activations sent from stage 2 to stage 3 and received there, `3SB0>2` and
    `2RB0<3` for gradients going back, `2U` for a flushed optimizer update and `2U5` for an
    update after micro-batch 5.
    """

    stage: int
    kind: str
    mb: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; known: {sorted(KINDS)}")
        if (self.kind in COMPUTE or self.kind[0] in "SR") and self.mb is None:
            raise ScheduleError(f"a {KINDS[self.kind]} action needs a micro-batch")
        if (self.kind[0] in "SR") != (self.peer is not None):
            raise ScheduleError(f"{self.kind}: sends and receives, and only they, name a peer")

    @property
    def is_compute(self) -> bool:
        """F, B, I or W."""
        return self.kind in COMPUTE

    def __str__(self) -> str:
        mb = "" if self.mb is None else str(self.mb)
        if self.peer is None:
            return f"{self.stage}{self.kind}{mb}"
        arrow = ">" if self.kind[0] == "S" else "<"
        return f"{self.stage}{self.kind}{mb}{arrow}{self.peer}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str()`.

        Raises:
            ScheduleError: `text` is not an action.

        Example:
            >>> Action.parse("2SF0>3")
            Action(stage=2, kind='SF', mb=0, peer=3)
        """
        m = _ACTION.match(text.strip())
        if not m:
            raise ScheduleError(f"not an action: {text!r} (examples: 2F0, 2SF0>3, 3RB1<4, 2U)")
        stage, kind, mb, arrow, peer = m.groups()
        if arrow and arrow != (">" if kind[0] == "S" else "<"):
            raise ScheduleError(f"{text!r}: sends point '>' at their peer, receives '<'")
        return cls(
            int(stage), kind, None if mb is None else int(mb), None if peer is None else int(peer)
        )


@dataclass(frozen=True)
class Schedule:
    """For every rank, its ordered actions for one or more `step()` calls.

    Attributes:
        name: The generator that made it ("gpipe", "1f1b", "zb", "async", "2bw").
        micro_batches: M, micro-batches per `step()` call.
        ranks: ranks[r] is rank r's action list; idle ranks have none.
        calls: How many `step()` calls the lists cover. Flushed schedules restart micro-batch
            ids at 0 every call; asynchronous ones number them on (call c holds c*M..).
    """

    name: str
    micro_batches: int
    ranks: tuple[tuple[Action, ...], ...]
    calls: int = 1

    def __str__(self) -> str:
        width = max((len(str(a)) for actions in self.ranks for a in actions), default=2)
        return "\n".join(
            f"rank {r}: " + " ".join(f"{a!s:<{width}}" for a in actions)
            for r, actions in enumerate(self.ranks)
        )

    def compute_only(self) -> list[list[str]]:
        """Each rank's compute and update actions as text: the shape of a schedule at a glance."""
        return [
            [str(a) for a in actions if a.kind in COMPUTE or a.kind == "U"]
            for actions in self.ranks
        ]

    def to_json(self) -> str:
        """Serialise (actions as their text forms)."""
        return json.dumps(
            {
                "name": self.name,
                "micro_batches": self.micro_batches,
                "calls": self.calls,
                "ranks": [[str(a) for a in actions] for actions in self.ranks],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Inverse of `to_json`.

        Raises:
            ScheduleError: malformed text, naming the problem.
        """
        try:
            data = json.loads(text)
            return cls(
                str(data["name"]),
                int(data["micro_batches"]),
                parse_ranks(data["ranks"]),
                int(data.get("calls", 1)),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"malformed schedule: {type(exc).__name__}: {exc}") from exc


def parse_ranks(ranks: Sequence[Sequence[str] | str]) -> tuple[tuple[Action, ...], ...]:
    """Per-rank action texts (lists, or space-separated strings) -> actions."""
    return tuple(
        tuple(Action.parse(t) for t in (r.split() if isinstance(r, str) else r)) for r in ranks
    )


# -- timelines ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One action on one rank, from start to end (seconds from the start of the run)."""

    rank: int
    action: str  # the Action's text, e.g. "2F0"
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What every rank did when: simulated from a Schedule, or measured by the runtime."""

    spans: tuple[Span, ...]
    num_ranks: int
    source: str  # "simulated" or "measured"
    title: str = ""

    @property
    def makespan(self) -> float:
        """From the first start to the last end."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def to_json(self) -> str:
        """Serialise to JSON."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        """Inverse of `to_json`."""
        data = json.loads(text)
        spans = tuple(Span(**s) for s in data.pop("spans"))
        return cls(spans=spans, **data)
