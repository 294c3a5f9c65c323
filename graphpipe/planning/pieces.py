"""CandidateStages: the search's candidate stages (pieces), their statistics computed once per tree.

A piece is a set of units that the DP (`search`) may make one stage, named by a key:

    ("leaf", id(leaf), 0, 0)          the leaf's unit
    ("range", id(series), a, b)       positions a..b of a series (its units in topological order)
    ("group", id(parallel), a, b)     children a..b of a parallel node, dearest first
    ("absorb", id(series), p, a, q)   the a cheapest branches of the parallel child starting at
                                      position p, with the positions from its end to q - 1

Each piece has its time, activation bytes and parameter bytes (`Stats`, shared parameters
counted once) and its stage time on 1..R replicas (`CostModel.stage_time`). A series node
also keeps them as arrays over the end position, which the DP reads once per bottleneck
value instead of piece by piece; a range's `Stats` is made only when something reads it
(`StatsTable`). Units of a piece are listed only when a solution is built.

Complexity: O(n^2 R) stage times per series node of n positions (every range, R replica
counts), O(L n R) per parallel child of L branches (absorbing pieces) and O(L^2 R) per
parallel node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import networkx as nx
import numpy as np

from graphpipe.ir.cost import CostModel
from graphpipe.planning.sptree import Leaf, Parallel, Series, SPNode, Unit, units_of

__all__ = ["CandidateStages", "Key", "SeriesInfo", "Stats", "StatsTable"]

Key = tuple[Any, ...]


class Stats(NamedTuple):
    time: float  # forward + backward seconds per micro-batch on one device
    act: float  # activation bytes per micro-batch
    pbytes: float  # parameter bytes (shared names counted once)
    stateful: bool = False  # it updates buffers in place (BatchNorm): never replicated


@dataclass
class SeriesInfo:
    """A series node laid out as positions: its units in topological order.

    Arrays are indexed [p, q] for the range of positions p..q-1 (entries with q <= p unused).
    """

    positions: tuple[Unit, ...]
    children: dict[int, tuple[Series | Parallel, int]]  # start -> (non-leaf child, end)
    cut_times: list[float]  # transfer time across the cut before position q (0..n)
    time: np.ndarray  # [p, q]: compute time of the range
    stage: np.ndarray  # [p, q, r - 1]: stage time of the range on r replicas
    # (p, a) -> ([q]: time, [q, r - 1]: stage time) of absorbing piece (p, a, q)
    absorb: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass
class _Ranges:
    """Every range a..b of a series' positions as arrays [a, b] (b >= a; the rest unused):
    running sums from each a, as `_Accumulator` adds them."""

    time: np.ndarray
    act: np.ndarray
    pbytes: np.ndarray
    stateful: np.ndarray

    def stats(self, a: int, b: int) -> Stats:
        return Stats(
            float(self.time[a, b]),
            float(self.act[a, b]),
            float(self.pbytes[a, b]),
            bool(self.stateful[a, b]),
        )


class StatsTable:
    """Key -> Stats, as a dict reads. A series of n positions has O(n^2) ranges, kept as
    arrays (`_Ranges`); a range's Stats is made the first time it is read, since the DP
    reads few of them (at 512 devices, making all of them was an eighth of the search)."""

    def __init__(self) -> None:
        self._made: dict[Key, Stats] = {}
        self._ranges: dict[int, _Ranges] = {}

    def add_ranges(self, node_id: int, ranges: _Ranges) -> None:
        """The ranges of series `node_id`: pieces ("range", node_id, a, b)."""
        self._ranges[node_id] = ranges

    def __setitem__(self, key: Key, stats: Stats) -> None:
        self._made[key] = stats

    def __getitem__(self, key: Key) -> Stats:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return found

    def __contains__(self, key: Key) -> bool:
        return self.get(key) is not None

    def get(self, key: Key) -> Stats | None:
        """The piece's Stats, or None for no such piece."""
        found = self._made.get(key)
        if found is not None or key[0] != "range" or len(key) != 4:
            return found
        ranges = self._ranges.get(key[1])
        a, b = key[2], key[3]
        if ranges is None or not 0 <= a <= b < ranges.time.shape[0]:
            return None
        found = self._made[key] = ranges.stats(a, b)
        return found

    def ranges(self) -> dict[int, _Ranges]:
        """The series kept as arrays: node id -> every range's running sums."""
        return self._ranges

    def made(self) -> dict[Key, Stats]:
        """The pieces whose Stats exist: every leaf, group and absorbing piece, and the
        ranges read so far (or all, for a series not kept as arrays)."""
        return self._made

    def least_memory(self, memory: Callable[[Stats], float]) -> float:
        """min over every piece of `memory(stats)`, for a `memory` that grows with the
        parameter and activation bytes: a series' ranges are each at least their last
        position alone (a..b holds b's parameters and activations), so only those count."""
        every = list(self._made.values())
        for ranges in self._ranges.values():
            every += [ranges.stats(b, b) for b in range(ranges.time.shape[0])]
        return min((memory(s) for s in every), default=0.0)


class CandidateStages:
    """Every piece of a series-parallel tree over a unit graph, with its statistics.

    Args:
        g: The unit graph (`sptree.coarsen`), with `tensor_bytes` and `param_bytes` graph
            attributes.
        tree: Its series-parallel tree.
        cost: The cost model.
        max_replicas: R, the most replicas a stage may have.
    """

    def __init__(self, g: nx.DiGraph, tree: SPNode, cost: CostModel, max_replicas: int) -> None:
        self.g, self.cost, self.max_replicas = g, cost, max_replicas
        self.stats = StatsTable()
        self.series: dict[int, SeriesInfo] = {}
        self.sorted_children: dict[int, tuple[SPNode, ...]] = {}
        self.leaves: dict[int, Leaf] = {}
        self.rank = {
            u: i
            for i, u in enumerate(
                nx.lexicographical_topological_sort(g, key=lambda u: g.nodes[u]["order"])
            )
        }
        self._prepare(tree)

    def units(self, key: Key) -> tuple[Unit, ...]:
        """The units of piece `key`."""
        kind, node_id, *rest = key
        if kind == "leaf":
            return (self.leaves[node_id].unit,)
        if kind == "group":
            a, b = rest
            kids = self.sorted_children[node_id][a : b + 1]
            return tuple(u for kid in kids for u in units_of(kid))
        info = self.series[node_id]
        if kind == "range":
            a, b = rest
            return info.positions[a : b + 1]
        p, a, q = rest
        child, end = info.children[p]
        return self._cheapest(child, a) + info.positions[end:q]

    def stage_times(self, stats: Stats) -> np.ndarray:
        """The stage time of a piece on 1..R replicas."""
        times = self.cost.stage_times(stats.time, stats.pbytes, self.max_replicas)
        if stats.stateful:  # never replicated
            times[1:] = np.inf
        return times

    def candidates(self, floor: float) -> list[float]:
        """Every stage time of every piece and replica count, and every cut time, >= floor."""
        chunks = [np.array(info.cut_times) for info in self.series.values()]
        for info in self.series.values():
            chunks += [info.stage[p, p + 1 :].ravel() for p in range(len(info.positions))]
            chunks += [stage.ravel() for _, stage in info.absorb.values()]
        chunks += [
            self.stage_times(stats)
            for key, stats in self.stats.made().items()
            if key[0] in ("leaf", "group")
        ]
        values = np.unique(np.concatenate(chunks))
        return values[(values >= floor) & np.isfinite(values)].tolist()

    def smallest_memory(self) -> float:
        """The least memory any piece needs, one micro-batch in flight, one replica."""
        return self.stats.least_memory(lambda s: self.cost.stage_memory(s.pbytes, s.act, 1, 1))

    # -- preparation -------------------------------------------------------------------------

    def _prepare(self, node: SPNode) -> None:
        if isinstance(node, Leaf):
            self.leaves[id(node)] = node
            self._register_ranges("leaf", node, [[node.unit]])
            return
        for child in node.children:
            self._prepare(child)
        if isinstance(node, Parallel):
            kids = sorted(node.children, key=lambda c: -self._time(units_of(c)))
            self.sorted_children[id(node)] = tuple(kids)
            self._register_ranges("group", node, [units_of(c) for c in kids])
            return
        self._prepare_series(node)

    def _prepare_series(self, node: Series) -> None:
        positions = sorted(units_of(node), key=self.rank.__getitem__)
        n = len(positions)
        time = np.full((n, n + 1), np.inf)
        stage = np.full((n, n + 1, self.max_replicas), np.inf)
        ranges = self._series_ranges(positions)
        if ranges is None:  # sizes whose sums depend on their order: added one by one
            for (_, _, a, b), stats in self._register_ranges(
                "range", node, [[u] for u in positions]
            ):
                time[a, b + 1] = stats.time
                stage[a, b + 1] = self._stage_row(stats)
        else:
            self.stats.add_ranges(id(node), ranges)
            for a in range(n):
                time[a, a + 1 :] = ranges.time[a, a:]
                self._stage_rows(ranges, a, stage[a])
        at = {u: i for i, u in enumerate(positions)}
        children = {}
        for child in node.children:
            if not isinstance(child, Leaf):
                spots = sorted(at[u] for u in units_of(child))
                assert spots == list(range(spots[0], spots[-1] + 1)), "child not contiguous"
                children[spots[0]] = (child, spots[-1] + 1)
        info = SeriesInfo(tuple(positions), children, self._cuts(at), time, stage)
        self.series[id(node)] = info
        for p, (child, _) in children.items():
            if isinstance(child, Parallel):
                for a in range(1, len(child.children)):  # the a cheapest join the next stage
                    info.absorb[(p, a)] = self._absorbing(node, info, p, a)

    def _absorbing(
        self, node: Series, info: SeriesInfo, p: int, a: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Stats of pieces (absorb, p, a, q) for every q after the parallel child at p."""
        child, end = info.children[p]
        n = len(info.positions)
        time = np.full(n + 1, np.inf)
        stage = np.full((n + 1, self.max_replicas), np.inf)
        acc = _Accumulator(self.g)
        for u in self._cheapest(child, a):
            acc.add(u)
        for q in range(end + 1, n + 1):
            acc.add(info.positions[q - 1])
            stats = acc.stats()
            self.stats[("absorb", id(node), p, a, q)] = stats
            time[q], stage[q] = stats.time, self.stage_times(stats)
        return time, stage

    def _cheapest(self, child: Series | Parallel, a: int) -> tuple[Unit, ...]:
        ordered = self.sorted_children[id(child)]
        return tuple(u for kid in ordered[len(ordered) - a :] for u in units_of(kid))

    def _stage_row(self, stats: Stats) -> np.ndarray | float:
        """`stage_times(stats)`; with R = 1 its one value, `CostModel.stage_time` on one
        replica (the same operations, without an array per piece)."""
        if self.max_replicas > 1:
            return self.stage_times(stats)
        return self.cost.stage_time(stats.time, stats.pbytes, 1)

    def _series_ranges(self, positions: list[Unit]) -> _Ranges | None:
        """Every range's stats as running sums from each start a (`np.cumsum` adds in
        `_Accumulator`'s order, so the same floats); a parameter counted at its first
        position from a on. None where a size is not a whole number of bytes (sums would
        then depend on their order: `_register_ranges` adds them one by one)."""
        facts = _unit_facts(self.g, positions)
        if facts is None:
            return None
        times, acts, stateful = facts
        n, sizes = len(positions), self.g.graph["param_bytes"]
        out = _Ranges(
            np.zeros((n, n)), np.zeros((n, n)), np.zeros((n, n)), np.zeros((n, n), dtype=bool)
        )
        first: dict[str, int] = {}  # parameter -> its first position from a on
        for a in reversed(range(n)):
            first.update(dict.fromkeys(self.g.nodes[positions[a]]["params"], a))
            new = np.zeros(n - a)
            for name, at in first.items():
                new[at - a] += sizes.get(name, 0)
            out.time[a, a:] = np.cumsum(times[a:])
            out.act[a, a:] = np.cumsum(acts[a:])
            out.pbytes[a, a:] = np.cumsum(new)
            out.stateful[a, a:] = np.logical_or.accumulate(stateful[a:])
        return out

    def _stage_rows(self, ranges: _Ranges, a: int, row: np.ndarray) -> None:
        """row[b + 1] = the stage time(s) of range a..b, for every b >= a (`_stage_row`)."""
        n = ranges.time.shape[0]
        if self.max_replicas > 1:
            for b in range(a, n):
                row[b + 1] = self.stage_times(ranges.stats(a, b))
            return
        times, pbytes = ranges.time[a, a:].tolist(), ranges.pbytes[a, a:].tolist()
        for b, (t, pb) in enumerate(zip(times, pbytes, strict=True), start=a):
            row[b + 1] = self.cost.stage_time(t, pb, 1)

    def _register_ranges(
        self, kind: str, node: SPNode, blocks: list[list[Unit]]
    ) -> list[tuple[Key, Stats]]:
        """Stats of every contiguous run of `blocks`, as pieces (kind, id(node), a, b)."""
        made = []
        for a in range(len(blocks)):
            acc = _Accumulator(self.g)
            for b in range(a, len(blocks)):
                for u in blocks[b]:
                    acc.add(u)
                key, stats = (kind, id(node), a, b), acc.stats()
                self.stats[key] = stats
                made.append((key, stats))
        return made

    def _time(self, units: list[Unit]) -> float:
        return sum(self.g.nodes[u]["forward"] + self.g.nodes[u]["backward"] for u in units)

    def _cuts(self, at: dict[Unit, int]) -> list[float]:
        """Transfer time across the cut before each position, for values made inside."""
        made: dict[str, int] = {}
        last_use: dict[str, int] = {}
        for a, b, data in self.g.edges(data=True):
            if a in at and b in at:
                for t in data["tensors"]:
                    made[t] = at[a]
                    last_use[t] = max(last_use.get(t, -1), at[b])
        crossing = [0.0] * (len(at) + 1)
        sizes = self.g.graph["tensor_bytes"]
        for t, start in made.items():
            for q in range(start + 1, last_use[t] + 1):
                crossing[q] += sizes[t]
        return [self.cost.link.transfer(x) for x in crossing]


def _unit_facts(g: nx.DiGraph, units: list[Unit]) -> tuple[np.ndarray, ...] | None:
    """Per unit: forward + backward time, activation bytes and stateful, as
    `_Accumulator.add` adds them; None where a parameter's size is not a whole number of
    bytes below 2^53 (parameter bytes then sum exactly in any order, as they must for a
    running sum to equal the accumulator's)."""
    sizes = g.graph["param_bytes"]
    names = {p for u in units for p in g.nodes[u]["params"]}
    values = [sizes.get(p, 0) for p in names]
    if any(float(v) != int(v) for v in values) or sum(abs(v) for v in values) >= 2**53:
        return None
    data = [g.nodes[u] for u in units]
    return (
        np.array([d["forward"] + d["backward"] for d in data], dtype=np.float64),
        np.array([d["act"] for d in data], dtype=np.float64),
        np.array([bool(d.get("stateful", False)) for d in data]),
    )


class _Accumulator:
    """Running stats of a growing set of units (parameters counted once)."""

    def __init__(self, g: nx.DiGraph) -> None:
        self.g, self.sizes = g, g.graph["param_bytes"]
        self.params: set[str] = set()
        self.time = self.act = self.pbytes = 0.0
        self.stateful = False

    def add(self, u: Unit) -> None:
        data = self.g.nodes[u]
        self.time += data["forward"] + data["backward"]
        self.act += data["act"]
        self.stateful = self.stateful or data.get("stateful", False)
        new = data["params"] - self.params
        self.pbytes += sum(self.sizes.get(p, 0) for p in new)
        self.params |= new

    def stats(self) -> Stats:
        return Stats(self.time, self.act, self.pbytes, self.stateful)
