"""Search: a DP over the series-parallel tree, inside a binary search on the bottleneck.

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
    series:   the node's units in topological order are positions 0..n-1; a child occupies a
              contiguous block of them. G(n, x) = 0 if x >= k; F = G(0, d), where G(p, x) is
              the least, over k <= y < x, of
                r(positions p..q-1, y + 1) + G(q, y)          (one stage, any q > p)
                F(child, y, x) + G(q, y)                      (a child starting at p and
                                                               ending before q, recursively)
                Fpre(child, y + 1, x) + r(cheap + p'..q-1, y + 1) + G(q, y)
                                                              (a parallel child ending at p'
                                                               whose cheapest branches join
                                                               the stage that follows it)
              and the cut before q must transfer within tau. Cutting anywhere in the order is
              what a sequential pipeline does; recursing into a child is what keeps parallel
              branches apart. So every sequential plan is in the search space. The third
              option lets N branches share N devices with the work after them (the cheapest
              branches take the tail), which a series-parallel tree alone cannot express;
              Fpre is F over the parallel child's branches but its a cheapest.
    parallel: children sorted by time, split into contiguous groups; a group of one child
              costs F(child, k, d), a larger group is one stage costing r(group, k + 1);
              F is the least sum over the splits.

Cut transfers count each tensor once (fan-out to several consumer stages is not multiplied);
the assembled Plan counts every stage edge, so its bottleneck can differ slightly from tau.

Without a memory budget r does not depend on the in-flight count, so F(node, k, d) =
F(node, 0, d - k) and one table per node suffices.

The outer loop binary-searches tau over the sorted candidate values (every stage time of every
piece and replica count, and every cut time, at least the perfect-balance bound): the optimum
is one of them, so the result is exact for this cost model. At the smallest feasible tau it
keeps the smallest d with F(root, 0, d) <= N: GraphPipe's objective ("bottleneck"). The
default objective, "pipeline", then probes larger taus, where a shallower stage graph may
fit, and keeps the least (M + d - 1) * tau: the step time of a flushed pipeline, whose fill
and drain grow with the depth.

Complexity per tau: O(sum over series nodes of n^2 D + L D^2, plus sum over parallel nodes of
L^2 D), times D with a memory budget; n is a series node's unit count and L a node's child
count. There are O(log #candidates) values of tau.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

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
    g: nx.DiGraph,
    tree: SPNode,
    cost: CostModel,
    devices: int,
    max_replicas: int | None = None,
    objective: str = "pipeline",
    chain: bool = False,
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
        objective: "bottleneck" (GraphPipe): the least tau, then the fewest micro-batches in
            flight. "pipeline": the least (M + depth - 1) * tau, the step time of a flushed
            pipeline, trading a slower bottleneck for a shallower graph where that pays.
        chain: The stages will form a chain (the sequential baseline), so a plan's depth is
            its number of stages.

    Returns:
        The optimal `SearchResult` for this tree and cost model.

    Raises:
        PlanError: no stage graph fits the memory budget, even with every device in use.
    """
    return _Search(g, tree, cost, devices, max_replicas or devices, chain).run(objective)


@dataclass
class _SeriesInfo:
    """A series node laid out as positions: its units in topological order."""

    positions: tuple[Unit, ...]
    children: dict[
        int, tuple[Series | Parallel, int]
    ]  # start position -> (non-leaf child, end position)
    cut_times: list[float]  # transfer time across the cut before position q (0..n)


class _Search:
    def __init__(
        self,
        g: nx.DiGraph,
        tree: SPNode,
        cost: CostModel,
        devices: int,
        max_replicas: int,
        chain: bool,
    ) -> None:
        self.g, self.cost, self.n, self.chain = g, cost, devices, chain
        self.iterations = 0
        self.tree = tree if isinstance(tree, Series) else Series((tree,))
        self.max_replicas = min(max_replicas, devices)
        self.depth_bound = devices
        self.budgeted = cost.memory.budget is not None
        self.pieces: dict[Key, tuple[_Stats, tuple[Unit, ...]]] = {}
        self.series: dict[int, _SeriesInfo] = {}
        self.sorted_children: dict[int, tuple[SPNode, ...]] = {}
        self.rank = {
            u: i
            for i, u in enumerate(
                nx.lexicographical_topological_sort(g, key=lambda u: g.nodes[u]["order"])
            )
        }
        self._prepare(self.tree)
        self.tau = INF
        self.memo: dict[Key, Any] = {}
        self.r_cache: dict[Key, float] = {}

    # -- preparation: piece statistics and cut times -------------------------------------

    def _register_ranges(self, kind: str, node: SPNode, blocks: list[list[Unit]]) -> None:
        """Stats of every contiguous run of `blocks`, as pieces (kind, id(node), a, b)."""
        sizes = self.g.graph["param_bytes"]
        for a in range(len(blocks)):
            params: set[str] = set()
            time = act = pbytes = 0.0
            units: list[Unit] = []
            for b in range(a, len(blocks)):
                for u in blocks[b]:
                    data = self.g.nodes[u]
                    time += data["forward"] + data["backward"]
                    act += data["act"]
                    new = data["params"] - params
                    pbytes += sum(sizes.get(p, 0) for p in new)
                    params |= new
                units += blocks[b]
                self.pieces[(kind, id(node), a, b)] = (_Stats(time, act, pbytes), tuple(units))

    def _prepare(self, node: SPNode) -> None:
        if isinstance(node, Leaf):
            self._register_ranges("leaf", node, [[node.unit]])
            return
        for child in node.children:
            self._prepare(child)
        if isinstance(node, Parallel):
            kids = sorted(node.children, key=lambda c: -self._time(units_of(c)))
            self.sorted_children[id(node)] = tuple(kids)
            self._register_ranges("group", node, [units_of(c) for c in kids])
            return
        positions = sorted(units_of(node), key=self.rank.__getitem__)
        self._register_ranges("range", node, [[u] for u in positions])
        at = {u: i for i, u in enumerate(positions)}
        children = {}
        for child in node.children:
            if not isinstance(child, Leaf):
                spots = sorted(at[u] for u in units_of(child))
                assert spots == list(range(spots[0], spots[-1] + 1)), "child not contiguous"
                children[spots[0]] = (child, spots[-1] + 1)
        for p, (child, q) in children.items():
            if isinstance(child, Parallel):
                ordered = self.sorted_children[id(child)]
                for a in range(1, len(ordered)):  # the a cheapest branches join the next stage
                    cheapest = [u for kid in ordered[len(ordered) - a :] for u in units_of(kid)]
                    for q2 in range(q + 1, len(positions) + 1):
                        units = cheapest + positions[q:q2]
                        stats = self._unit_stats(units)
                        self.pieces[("absorb", id(node), p, a, q2)] = (stats, tuple(units))
        self.series[id(node)] = _SeriesInfo(tuple(positions), children, self._cuts(at))

    def _unit_stats(self, units: list[Unit]) -> _Stats:
        params: set[str] = set()
        time = act = 0.0
        for u in units:
            data = self.g.nodes[u]
            time += data["forward"] + data["backward"]
            act += data["act"]
            params |= data["params"]
        return _Stats(time, act, sum(self.g.graph["param_bytes"].get(p, 0) for p in params))

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

    def candidates(self) -> list[float]:
        """Every value the optimal bottleneck can take, from the perfect-balance bound up."""
        floor = self._time(list(self.g.nodes)) / self.n * (1 - 1e-9)  # rounding margin
        values = {t for info in self.series.values() for t in info.cut_times if t >= floor}
        for stats, _ in self.pieces.values():
            for r in range(1, self.max_replicas + 1):
                t = self.cost.stage_time(stats.time, stats.pbytes, r)
                if t >= floor:
                    values.add(t)
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
            if isinstance(node, Leaf):
                self.memo[key] = self._leaf_table(node, k)
            elif isinstance(node, Series):
                self.memo[key] = self._series_table(node, k)
            else:
                self.memo[key] = self._parallel_table(node, k)
        return self.memo[key]

    def _leaf_table(self, node: Leaf, k: int) -> tuple[list[float], None]:
        r = self.replicas(("leaf", id(node), 0, 0), k + 1)
        return [r if d >= k + 1 else INF for d in range(self.depth_bound + 1)], None

    def _series_table(self, node: Series, k: int) -> tuple[list[float], Any]:
        info, top, limit = self.series[id(node)], self.depth_bound, self.tau * (1 + 1e-12)
        n = len(info.positions)
        cut_ok = [q == n or t <= limit for q, t in enumerate(info.cut_times)]
        g_tab = [[INF] * (top + 1) for _ in range(n + 1)]
        choice: list[list[Any]] = [[None] * (top + 1) for _ in range(n + 1)]
        g_tab[n] = [0 if x >= k else INF for x in range(top + 1)]
        for p in reversed(range(n)):
            merged: dict[int, tuple[float, Any]] = {
                q: (INF, None) for q in self._reachable(node, p, n) if cut_ok[q]
            }
            child, end = info.children.get(p, (None, 0))
            absorb = self._absorb_ends(node, p, child, end, cut_ok)
            parallel = child if isinstance(child, Parallel) else None
            for x in range(top + 1):
                best, pick = INF, cast(Any, None)
                if child is not None and cut_ok[end]:
                    for y in range(k, x):
                        c = self.f(child, y, x) + g_tab[end][y]
                        if c < best:
                            best, pick = c, ("child", end, y)
                    if parallel is not None:
                        c, absorbed = self._absorbing(node, parallel, p, absorb, k, x, g_tab)
                        if c < best:
                            best, pick = c, absorbed
                y = x - 1
                for q, (held, held_pick) in merged.items():
                    if y >= k:
                        c = self.replicas(("range", id(node), p, q - 1), y + 1) + g_tab[q][y]
                        if c < held:
                            held, held_pick = c, ("merge", q, y)
                            merged[q] = (held, held_pick)
                    if held < best:
                        best, pick = held, held_pick
                g_tab[p][x], choice[p][x] = best, pick
        return g_tab[0], choice

    def _absorbing(
        self,
        node: Series,
        parallel: Parallel,
        p: int,
        options: list[tuple[int, int]],
        k: int,
        x: int,
        g_tab: list[list[float]],
    ) -> tuple[float, Any]:
        """The best way for the parallel child at p to hand branches to the next stage."""
        best, pick = INF, cast(Any, None)
        for a, q2 in options:
            for y in range(k, x - 1):
                c = (
                    self._prefix(parallel, y + 1, x, len(parallel.children) - a)
                    + self.replicas(("absorb", id(node), p, a, q2), y + 1)
                    + g_tab[q2][y]
                )
                if c < best:
                    best, pick = c, ("absorb", q2, y, a)
        return best, pick

    def _absorb_ends(
        self, node: Series, p: int, child: SPNode | None, end: int, cut_ok: list[bool]
    ) -> list[tuple[int, int]]:
        """(a, q2): merge a parallel child's a cheapest branches with positions end..q2-1."""
        if not isinstance(child, Parallel):
            return []
        options = []
        for a in range(1, len(child.children)):
            for q2 in range(end + 1, len(cut_ok)):
                stats = self.pieces[("absorb", id(node), p, a, q2)][0]
                if stats.time / self.max_replicas > self.tau * (1 + 1e-12):
                    break
                if cut_ok[q2]:
                    options.append((a, q2))
        return options

    def _reachable(self, node: Series, p: int, n: int) -> list[int]:
        """Ends q of the ranges p..q-1 whose compute could meet tau on the most replicas."""
        ends = []
        for q in range(p + 1, n + 1):
            stats = self.pieces[("range", id(node), p, q - 1)][0]
            if stats.time / self.max_replicas > self.tau * (1 + 1e-12):
                break
            ends.append(q)
        return ends

    def _parallel_table(self, node: Parallel, k: int) -> tuple[list[float], Any]:
        """Per d: fewest devices for the sorted children, and for every prefix of them.

        h[e] covers children 0..e-1; the last group of that cover starts at start[e].
        """
        kids = self.sorted_children[id(node)]
        size, top = len(kids), self.depth_bound
        table: list[float] = [INF] * (top + 1)
        choices: list[tuple[list[float], list[int]]] = []
        for d in range(top + 1):
            h, start = [0.0] + [INF] * size, [0] * (size + 1)
            for e in range(1, size + 1):
                for j in range(e):
                    if e - j == 1:
                        c = self.f(kids[j], k, d)
                    elif d >= k + 1:
                        c = self.replicas(("group", id(node), j, e - 1), k + 1)
                    else:
                        c = INF
                    if h[j] + c < h[e]:
                        h[e], start[e] = h[j] + c, j
            table[d] = h[size]
            choices.append((h, start))
        return table, choices

    def _prefix(self, node: Parallel, k: int, d: int, count: int) -> float:
        """Fewest devices for the `count` most expensive children of `node` (as F does)."""
        if not self.budgeted:
            k, d = 0, d - k
        if d <= k:
            return INF
        return self._table(node, k)[1][min(d, self.depth_bound)][0][count]

    # -- reconstruction -------------------------------------------------------------------

    def build(self, node: SPNode, k: int, d: int) -> list[Piece]:
        """The pieces of the solution F(node, k, d) (which must be finite)."""
        if not self.budgeted:
            k, d = 0, d - k
        d = min(d, self.depth_bound)
        if isinstance(node, Leaf):
            return [self._piece(("leaf", id(node), 0, 0), k + 1)]
        if isinstance(node, Parallel):
            return self._build_parallel(node, k, d, len(node.children))
        return self._build_series(node, d, self._table(node, k)[1])

    def _piece(self, key: Key, in_flight: int) -> Piece:
        return Piece(self.pieces[key][1], int(self.replicas(key, in_flight)))

    def _build_series(self, node: Series, d: int, choice: Any) -> list[Piece]:
        info = self.series[id(node)]
        pieces: list[Piece] = []
        p, x = 0, d
        while p < len(info.positions):
            kind, q, y, *absorbed = choice[p][x]
            child = info.children[p][0] if kind != "merge" else None
            if kind == "child":
                pieces += self.build(info.children[p][0], y, x)
            elif isinstance(child, Parallel):  # the dearer branches, then the merged stage
                a = absorbed[0]
                pieces += self._build_prefix(child, y + 1, x, len(child.children) - a)
                pieces.append(self._piece(("absorb", id(node), p, a, q), y + 1))
            else:
                pieces.append(self._piece(("range", id(node), p, q - 1), y + 1))
            p, x = q, y
        return pieces

    def _build_parallel(self, node: Parallel, k: int, d: int, count: int) -> list[Piece]:
        """The pieces covering the `count` most expensive children of `node` (k, d normalised)."""
        kids = self.sorted_children[id(node)]
        _, start = self._table(node, k)[1][d]
        pieces: list[Piece] = []
        e = count
        while e > 0:
            j = start[e]
            if e - j == 1:
                pieces += self.build(kids[j], k, d)
            else:
                pieces.append(self._piece(("group", id(node), j, e - 1), k + 1))
            e = j
        return pieces

    def _build_prefix(self, node: Parallel, k: int, d: int, count: int) -> list[Piece]:
        if not self.budgeted:
            k, d = 0, d - k
        return self._build_parallel(node, k, min(d, self.depth_bound), count)

    # -- the outer loop -------------------------------------------------------------------

    def feasible(self, tau: float) -> int | None:
        """The smallest source in-flight d with F(root, 0, d) <= N at `tau`, or None."""
        self.tau, self.memo, self.r_cache = tau, {}, {}
        self.iterations += 1
        for d in range(1, self.depth_bound + 1):
            if self.f(self.tree, 0, d) <= self.n:
                return d
        return None

    def _pipeline_time(self, tau: float, pieces: list[Piece]) -> float:
        """A flushed pipeline's step: (M + depth - 1) micro-batch slots of tau, with the depth
        of the stage graph the pieces really form (merged ranges may run side by side)."""
        return (self.cost.micro_batches + self._depth(pieces) - 1) * tau

    def _depth(self, pieces: list[Piece]) -> int:
        if self.chain:
            return len(pieces)
        stage_of = {u: i for i, p in enumerate(pieces) for u in p.units}
        g = nx.DiGraph()
        g.add_nodes_from(range(len(pieces)))
        g.add_edges_from(
            (stage_of[a], stage_of[b]) for a, b in self.g.edges if stage_of[a] != stage_of[b]
        )
        return nx.dag_longest_path_length(g) + 1

    def run(self, objective: str = "pipeline", probes: int = 16) -> SearchResult:
        """Search; "bottleneck" minimises tau (then depth), "pipeline" the step estimate."""
        self.iterations = 0
        values = self.candidates()
        if not values or self.feasible(values[-1]) is None:
            raise PlanError(_infeasible_message(self))
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.feasible(values[mid]) is not None:
                hi = mid
            else:
                lo = mid + 1
        tau, d, pieces = self._solution(values[lo])
        if objective == "pipeline":
            tau, d, pieces = self._trade_bottleneck_for_depth(values, lo, (tau, d, pieces), probes)
        return SearchResult(tuple(pieces), tau, d, len(values), self.iterations)

    def _solution(self, tau: float) -> tuple[float, int, list[Piece]]:
        d = self.feasible(tau)
        assert d is not None  # only called on feasible taus
        return tau, d, self.build(self.tree, 0, d)

    def _trade_bottleneck_for_depth(
        self, values: list[float], first: int, best: tuple[float, int, list[Piece]], probes: int
    ) -> tuple[float, int, list[Piece]]:
        """Probe larger taus, where shallower plans fit; keep the least (M + depth - 1) tau.

        No tau beyond step(best) / M can win: even a one-stage pipeline takes M slots.
        """
        score = self._pipeline_time(best[0], best[2])
        ceiling = score / self.cost.micro_batches
        top = next((i for i in range(first, len(values)) if values[i] > ceiling), len(values))
        step = max(1, (top - 1 - first) // probes)
        for i in range(first + step, top, step):
            candidate = self._solution(values[i])
            candidate_score = self._pipeline_time(candidate[0], candidate[2])
            if candidate_score < score:
                best, score = candidate, candidate_score
        return best


def _infeasible_message(s: _Search) -> str:
    budget = s.cost.memory.budget
    smallest = min(
        (s.cost.stage_memory(stats.pbytes, stats.act, 1, 1) for stats, _ in s.pieces.values()),
        default=0.0,
    )
    return (
        f"no stage graph on {s.n} devices fits the memory budget of {budget:.4g} bytes per "
        f"device (the smallest op unit alone, one micro-batch in flight, needs {smallest:.4g}). "
        "Raise the budget, "
        "use more devices or more micro-batches (smaller micro-batches), or trace with finer "
        "leaf modules."
    )
