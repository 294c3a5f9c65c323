"""Shared plain-data types: the Plan that partitioning produces and every later phase reads.

A Plan is frozen and round-trips through JSON, so it can be computed once, written to a file,
sent to every rank and checked again there. Index letters used throughout graphpipe:

    s, t  stages        j  micro-batch        r  replicas of a stage
    S     #stages       M  micro-batches      N  devices (= ranks)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx

from graphpipe._units import format_bytes, format_time
from graphpipe.cost import CostModel
from graphpipe.errors import PlanError

__all__ = ["Plan", "Stage", "StageEdge"]

PLAN_FORMAT = "graphpipe-plan/1"


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
        """The stage a rank holds a replica of, or None for an idle rank."""
        return next((s for s in self.stages if rank in s.devices), None)

    def devices_used(self) -> int:
        """Devices that hold a stage."""
        return sum(s.replicas for s in self.stages)

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
    edges = tuple(StageEdge(**{**e, "tensors": tuple(e["tensors"])}) for e in data["edges"])
    return Plan(
        stages=stages,
        edges=edges,
        num_devices=int(data["num_devices"]),
        cost_model=CostModel.from_dict(data["cost_model"]),
        partitioner=str(data["partitioner"]),
        bottleneck=float(data["bottleneck"]),
        search_time=float(data["search_time"]),
        graph_hash=str(data["graph_hash"]),
        info=dict(data.get("info", {})),
    )
