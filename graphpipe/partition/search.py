"""Search: a dynamic program over the series-parallel tree, inside a binary search on the bottleneck.

This follows GraphPipe (Jeon et al., "GraphPipe: Improving Performance and Scalability of DNN
Training with Graph Pipeline Parallelism", ASPLOS'25): a binary search on the target time per
micro-batch (equivalently time per sample) around a DP that, for a subgraph, a device count
and the downstream in-flight count, minimises the micro-batches in flight at the subgraph's
source. On the linearised tree (one series of all units) the same DP is PipeDream's (SOSP'19)
DP over contiguous ranges of a topological order, with data-parallel replication.

Letters: tau the target seconds per micro-batch; N devices; D = N, the most stages a path can
have; k the in-flight count the stages after a subtree need (0 after the sink); d a bound on
the in-flight count at the subtree's sources; L a node's number of children.

For a fixed tau, F(node, k, d) is the fewest devices that realise `node` as stages such that
every stage's time (`CostModel.stage_time`) and every series cut's transfer time is <= tau,
every replica fits in memory, and the subtree's sources keep <= d micro-batches in flight.
A stage with downstream k has k + 1 in flight (the graph 1F1B warm-up), and r(P, i) is the
fewest replicas that let piece P meet tau and memory with i in flight.

    leaf:     F = r(leaf, k + 1)                              if k + 1 <= d
    series:   G(L, x) = 0 if x >= k;  F = G(0, d), where G(j, x) is the least of
                F(c_j, y, x) + G(j + 1, y)                    (child j alone, recursively)
                r(c_j..c_e, y + 1) + G(e + 1, y)              (children j..e merged, e > j)
              over k <= y < x, and a cut after child j (or e) must transfer within tau
    parallel: children sorted by time, split into contiguous groups; a group of one child
              costs F(child, k, d), a larger group is one stage costing r(group, k + 1);
              F is the least sum over the splits.

Without a memory budget r does not depend on the in-flight count, so F(node, k, d) =
F(node, 0, d - k) and one table per node suffices.

The outer loop binary-searches tau over the sorted candidate values (every stage time of every
piece and replica count, and every cut time): the optimum is one of them, so the result is
exact for this cost model. At the smallest feasible tau it keeps the smallest d with
F(root, 0, d) <= N.

Complexity per tau: O(sum over series nodes of L^2 D + L D^2, plus sum over parallel nodes of
L^2 D), times D with a memory budget. There are O(log #candidates) values of tau.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import networkx as nx

from graphpipe.cost import CostModel
from graphpipe.errors import PlanError
from graphpipe.partition.sptree import Leaf, Parallel, Series, SPNode, Unit, units_of

__all__ = ["Piece", "SearchResult", "search"]

INF = math.inf
Key = tuple[Any, ...]


@dataclass(frozen=True)
class Piece:
    """One stage of a solution: its units and its data-parallel replica count."""

    units: tuple[Unit, ...]
    replicas: int


@dataclass(frozen=True)
class SearchResult:
    """The DP's answer.

    Attributes:
        pieces: The stages.
        tau: The optimal bottleneck under the DP's cost (stage times and cut transfers).
        in_flight: Micro-batches in flight at the source stages.
        candidates: Number of candidate bottleneck values searched.
        iterations: Feasibility checks run.
    """

    pieces: tuple[Piece, ...]
    tau: float
    in_flight: int
    candidates: int
    iterations: int


class _Stats(NamedTuple):
    time: float  # forward + backward seconds per micro-batch on one device
    act: float  # activation bytes per micro-batch
    pbytes: float  # parameter bytes (shared names counted once)


def search(
    g: nx.DiGraph, tree: SPNode, cost: CostModel, devices: int, max_replicas: int | None = None
) -> SearchResult:
    """Find the stage graph with the smallest bottleneck, then the fewest in-flight micro-batches.

    Args:
        g: The unit graph (`sptree.coarsen`), with `tensor_bytes` and `param_bytes` graph
            attributes.
        tree: Its series-parallel tree (`sptree.decompose`, or `sptree.linearise` for the
            sequential baseline).
        cost: The cost model.
        devices: N, the devices available.
        max_replicas: The most replicas one stage may have (default N; 1 forbids
            data-parallel stages).

    Returns:
        The optimal `SearchResult` for this tree and cost model.

    Raises:
        PlanError: no stage graph fits the memory budget, even with every device in use.
    """
    return _Search(g, tree, cost, devices, max_replicas or devices).run()


class _Search:
    def __init__(
        self, g: nx.DiGraph, tree: SPNode, cost: CostModel, devices: int, max_replicas: int
    ) -> None:
        self.g, self.tree, self.cost, self.n = g, tree, cost, devices
        self.max_replicas = min(max_replicas, devices)
        self.depth_bound = devices
        self.budgeted = cost.memory.budget is not None
        self.pieces: dict[Key, tuple[_Stats, tuple[Unit, ...]]] = {}
        self.cut_times: dict[int, list[float]] = {}
        self.sorted_children: dict[int, tuple[SPNode, ...]] = {}
        self._stats_of(tree)
        self.tau = INF
        self.memo: dict[Key, Any] = {}
        self.r_cache: dict[Key, float] = {}

    # -- preparation: piece statistics and cut times -------------------------------------

    def _unit_stats(self, units: list[Unit]) -> _Stats:
        params: set[str] = set()
        time = act = 0.0
        for u in units:
            data = self.g.nodes[u]
            time += data["forward"] + data["backward"]
            act += data["act"]
            params |= data["params"]
        pbytes = sum(self.g.graph["param_bytes"].get(p, 0) for p in params)
        return _Stats(time, act, pbytes)

    def _stats_of(self, node: SPNode) -> _Stats:
        """Register the pieces under `node` and return the stats of `node` itself."""
        if isinstance(node, Leaf):
            stats = self._unit_stats([node.unit])
            self.pieces[("leaf", id(node))] = (stats, (node.unit,))
            return stats
        for child in node.children:
            self._stats_of(child)
        children = node.children
        if isinstance(node, Parallel):
            children = tuple(sorted(children, key=lambda c: -self._unit_stats(units_of(c)).time))
            self.sorted_children[id(node)] = children
        else:
            self.cut_times[id(node)] = self._cuts(node)
        kind = "range" if isinstance(node, Series) else "group"
        for j in range(len(children)):
            units: list[Unit] = []
            for e in range(j, len(children)):
                units += units_of(children[e])
                self.pieces[(kind, id(node), j, e)] = (self._unit_stats(units), tuple(units))
        return self.pieces[(kind, id(node), 0, len(children) - 1)][0]

    def _cuts(self, node: Series) -> list[float]:
        """Transfer time across the boundary after each child, for values made inside node."""
        child_of = {u: i for i, c in enumerate(node.children) for u in units_of(c)}
        made_in: dict[str, int] = {}
        last_use: dict[str, int] = {}
        for a, b, data in self.g.edges(data=True):
            if a in child_of and b in child_of and child_of[a] < child_of[b]:
                for t in data["tensors"]:
                    made_in[t] = child_of[a]
                    last_use[t] = max(last_use.get(t, -1), child_of[b])
        sizes = self.g.graph["tensor_bytes"]
        crossing = [0.0] * len(node.children)
        for t, start in made_in.items():
            for j in range(start, last_use[t]):
                crossing[j] += sizes[t]
        return [self.cost.link.transfer(b) for b in crossing]

    def candidates(self) -> list[float]:
        """Every value the optimal bottleneck can take."""
        values = {
            self.cost.stage_time(stats.time, stats.pbytes, r)
            for stats, _ in self.pieces.values()
            for r in range(1, self.max_replicas + 1)
        }
        values.update(t for times in self.cut_times.values() for t in times)
        return sorted(values)

    # -- the DP for one tau ---------------------------------------------------------------

    def replicas(self, key: Key, in_flight: int) -> float:
        """r(P, i): the fewest replicas letting piece `key` meet tau and memory, or INF."""
        cache_key = (key, in_flight if self.budgeted else 0)
        if cache_key not in self.r_cache:
            self.r_cache[cache_key] = self._replicas(self.pieces[key][0], in_flight)
        return self.r_cache[cache_key]

    def _replicas(self, stats: _Stats, in_flight: int) -> float:
        limit = self.tau * (1 + 1e-12)
        for r in range(1, self.max_replicas + 1):
            if self.cost.stage_time(stats.time, stats.pbytes, r) > limit:
                continue
            memory = self.cost.stage_memory(stats.pbytes, stats.act, in_flight, r)
            if self.cost.memory.fits(memory):
                return r
        return INF

    def f(self, node: SPNode, k: int, d: int) -> float:
        """F(node, k, d): fewest devices (INF when impossible)."""
        if not self.budgeted:
            k, d = 0, d - k
        if d <= k:
            return INF
        return self._table(node, k)[0][min(d, self.depth_bound)]

    def _table(self, node: SPNode, k: int) -> Any:
        key = (id(node), k)
        if key not in self.memo:
            build: Callable[[Any, int], Any] = {
                Leaf: self._leaf_table, Series: self._series_table, Parallel: self._parallel_table
            }[type(node)]
            self.memo[key] = build(node, k)
        return self.memo[key]

    def _leaf_table(self, node: Leaf, k: int) -> tuple[list[float], None]:
        r = self.replicas(("leaf", id(node)), k + 1)
        return [r if d >= k + 1 else INF for d in range(self.depth_bound + 1)], None

    def _series_table(self, node: Series, k: int) -> tuple[list[float], Any]:
        kids, size, top = node.children, len(node.children), self.depth_bound
        cut_ok = [t <= self.tau * (1 + 1e-12) for t in self.cut_times[id(node)]]
        cut_ok[-1] = True  # the last child's outgoing values are the parent's business
        g_tab = [[INF] * (top + 1) for _ in range(size + 1)]
        choice: list[list[Any]] = [[None] * (top + 1) for _ in range(size + 1)]
        g_tab[size] = [0 if x >= k else INF for x in range(top + 1)]
        for j in reversed(range(size)):
            merged = {e: (INF, None) for e in range(j + 1, size) if cut_ok[e]}
            for x in range(top + 1):
                best, pick = INF, None
                if cut_ok[j]:
                    for y in range(k, x):
                        c = self.f(kids[j], y, x) + g_tab[j + 1][y]
                        if c < best:
                            best, pick = c, ("child", y)
                y = x - 1
                for e in merged:
                    if y >= k:
                        c = self.replicas(("range", id(node), j, e), y + 1) + g_tab[e + 1][y]
                        if c < merged[e][0]:
                            merged[e] = (c, ("merge", e, y))
                    if merged[e][0] < best:
                        best, pick = merged[e]
                g_tab[j][x], choice[j][x] = best, pick
        return g_tab[0], choice

    def _parallel_table(self, node: Parallel, k: int) -> tuple[list[float], Any]:
        kids = self.sorted_children[id(node)]
        size, top = len(kids), self.depth_bound
        table, choices = [INF] * (top + 1), [None] * (top + 1)
        for d in range(top + 1):
            h, split = [INF] * size + [0.0], [0] * size
            for j in reversed(range(size)):
                for e in range(j, size):
                    if e == j:
                        c = self.f(kids[j], k, d)
                    elif d >= k + 1:
                        c = self.replicas(("group", id(node), j, e), k + 1)
                    else:
                        c = INF
                    if c + h[e + 1] < h[j]:
                        h[j], split[j] = c + h[e + 1], e
            table[d], choices[d] = h[0], split
        return table, choices

    # -- reconstruction -------------------------------------------------------------------

    def build(self, node: SPNode, k: int, d: int) -> list[Piece]:
        """The pieces of the solution F(node, k, d) (which must be finite)."""
        if not self.budgeted:
            k, d = 0, d - k
        d = min(d, self.depth_bound)
        if isinstance(node, Leaf):
            return [self._piece(("leaf", id(node)), k + 1)]
        _, choice = self._table(node, k)
        if isinstance(node, Parallel):
            return self._build_parallel(node, k, d, choice[d])
        return self._build_series(node, d, choice)

    def _piece(self, key: Key, in_flight: int) -> Piece:
        return Piece(self.pieces[key][1], int(self.replicas(key, in_flight)))

    def _build_series(self, node: Series, d: int, choice: Any) -> list[Piece]:
        pieces: list[Piece] = []
        j, x = 0, d
        while j < len(node.children):
            pick = choice[j][x]
            if pick[0] == "child":
                pieces += self.build(node.children[j], pick[1], x)
                j, x = j + 1, pick[1]
            else:
                _, e, y = pick
                pieces.append(self._piece(("range", id(node), j, e), y + 1))
                j, x = e + 1, y
        return pieces

    def _build_parallel(self, node: Parallel, k: int, d: int, split: list[int]) -> list[Piece]:
        kids = self.sorted_children[id(node)]
        pieces: list[Piece] = []
        j = 0
        while j < len(kids):
            e = split[j]
            if e == j:
                pieces += self.build(kids[j], k, d)
            else:
                pieces.append(self._piece(("group", id(node), j, e), k + 1))
            j = e + 1
        return pieces

    # -- the outer loop -------------------------------------------------------------------

    def feasible(self, tau: float) -> int | None:
        """The smallest source in-flight d with F(root, 0, d) <= N at `tau`, or None."""
        self.tau, self.memo, self.r_cache = tau, {}, {}
        for d in range(1, self.depth_bound + 1):
            if self.f(self.tree, 0, d) <= self.n:
                return d
        return None

    def run(self) -> SearchResult:
        values = self.candidates()
        iterations = 1
        if self.feasible(values[-1]) is None:
            raise PlanError(_infeasible_message(self))
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            iterations += 1
            if self.feasible(values[mid]) is not None:
                hi = mid
            else:
                lo = mid + 1
        d = self.feasible(values[lo])
        assert d is not None  # values[lo] was found feasible
        pieces = self.build(self.tree, 0, d)
        return SearchResult(tuple(pieces), values[lo], d, len(values), iterations + 1)


def _infeasible_message(s: _Search) -> str:
    budget = s.cost.memory.budget
    smallest = min(
        (s.cost.stage_memory(stats.pbytes, stats.act, 1, 1) for stats, _ in s.pieces.values()),
        default=0.0,
    )
    return (
        f"no stage graph on {s.n} devices fits the memory budget of {budget:.4g} bytes per "
        f"device; the smallest single unit already needs {smallest:.4g} bytes. Raise the budget, "
        "use more devices or more micro-batches (smaller micro-batches), or trace with finer "
        "leaf modules."
    )
