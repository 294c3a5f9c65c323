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
fewest replicas that let piece P meet tau and memory with i in flight (with `held_floor`,
at least that many per replica: the count a zb, zb2 or gpipe order holds on every stage).

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
F(node, 0, d - k) and one table per node suffices; nor with a budget that the whole graph,
holding all M micro-batches on one replica, fits (no piece can then exceed it), so such a
budget is searched as none: the same values, D times fewer tables. With a budget that binds,
a replica still holds at most M micro-batches, so r is the same for every in-flight count
from M on and F(node, k, d) = F(node, M - 1, d - (k - M + 1)) for k >= M: tables are made
for k < min(M, D) only (`_normalised`; the depths this lets a sub-solution use past D need
more than N devices, so no feasible solution changes). Nor, at a given tau, with a budget
that binds only pieces slower than tau: below the least stage time of a piece over the
budget holding what it can hold at most (`_binding_tau`), every piece that meets tau fits
whatever its in-flight count, so such a tau is solved with the unbudgeted tables.

The outer loop binary-searches tau over the sorted candidate values (every stage time of every
piece and replica count, and every cut time, at least the perfect-balance bound): the optimum
is one of them, so the result is exact for this cost model. Given a guess (the graph
search's least tau, for the sequential search of the same units), it gallops out from the
guess first: the same tau (feasibility is monotone in tau), in fewer checks. At the
smallest feasible tau it keeps the smallest d with F(root, 0, d) <= N: GraphPipe's
objective ("bottleneck"). The default objective, "pipeline", then probes larger taus, where
a shallower stage graph may fit, and keeps the least (M + d - 1) * tau: the step time of a
flushed pipeline, whose fill and drain grow with the depth. A probe is not solved where
even the least depth a tau allows (the fewest runs of R tau that a path of units packs
into: every unit on a chain, else the longest path) cannot score less than the best.

Implementation: piece statistics and stage times are computed once (`pieces`). Per tau, a
series row G(p, .) takes its merge options for every end q at once, as array operations over
the stage times (without a memory budget r is the fewest replicas whose stage time meets
tau). Without a memory budget F(child, y, x) = F(child, 0, x - y), so a row's child and
absorbing options are min-plus convolutions of the child's table with G, one array operation
over the (x, y) grid each (`_convolve`). Only the value of G is tabulated, and a solution
is rebuilt by finding, at each step, the first option (in the order the rows consider them)
that reaches the tabulated value. With a memory budget the same rows run as array operations
too: r over every (end, y) at once (the memory of one replica is weights + act x held, held
an array over y), a child's option as the least over y of F(child, y, .) + G(end, y), and a
parallel node's splits over every d at once (the same sums and comparisons as the loops
they replace, in the same order, so the same values and the same solutions). The tables of
the last feasible tau are kept: the binary search ends on it.

Complexity per tau: O(sum over series nodes of n^2 D + L D^2, plus sum over parallel nodes of
L^2 D), times min(M, D) with a memory budget; n is a series node's unit count and L a node's child
count; the n^2 D part, and without a budget the D^2 part, run as array operations. There
are O(log #candidates) values of tau, plus the probes of the "pipeline" objective.
`sptree.condense` bounds n.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import networkx as nx
import numpy as np

from graphpipe.errors import PlanError
from graphpipe.ir.cost import CostModel
from graphpipe.planning.pieces import CandidateStages, Key, Stats
from graphpipe.planning.sptree import Leaf, Parallel, Series, SPNode, Unit

__all__ = ["Piece", "SearchResult", "search"]

INF = math.inf


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
        least: The least feasible bottleneck (the "bottleneck" objective's tau; "pipeline"
            may trade up from it): a search of the same units may start from it (`guess`).
    """

    pieces: tuple[Piece, ...]
    tau: float
    in_flight: int
    candidates: int
    iterations: int
    least: float = math.nan


@dataclass(frozen=True)
class _Splits:
    """A parallel node's splits for one k: `splits[d]` is (h, start) at d, h[e] the fewest
    devices covering its dearest e children and start[e] where the last group of that
    cover starts (`_Search._parallel_table`)."""

    h: np.ndarray  # [e, d]
    start: np.ndarray  # [e, d]

    def __getitem__(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        return self.h[:, d], self.start[:, d]


@dataclass(frozen=True)
class _SeriesTable:
    """A series node's DP table for one tau and downstream count k."""

    g: np.ndarray  # [p, x]: G(p, x), the fewest devices for positions p.. (INF: none)
    cut_ok: list[bool]  # [q]: whether the cut before position q transfers within tau
    cut_mask: np.ndarray  # cut_ok as an array
    k: int


def search(
    g: nx.DiGraph,
    tree: SPNode,
    cost: CostModel,
    devices: int,
    max_replicas: int | None = None,
    objective: str = "pipeline",
    chain: bool = False,
    held_floor: int = 0,
    guess: float | None = None,
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
        held_floor: Micro-batches each replica of every stage holds at least (capped by
            M / replicas), for a schedule whose order holds more than graph 1F1B's count
            (zb, zb2, gpipe); 0 costs graph 1F1B's count alone.
        guess: Where the least feasible tau is likely (e.g. another tree's `least` on the
            same units): the search gallops out from it instead of bisecting every
            candidate value. The result is the same either way (feasibility is monotone in
            tau); only the number of feasibility checks changes.

    Returns:
        The optimal `SearchResult` for this tree and cost model.

    Raises:
        PlanError: no stage graph fits the memory budget, even with every device in use.
    """
    found = _Search(g, tree, cost, devices, max_replicas or devices, chain, held_floor)
    return found.run(objective, guess=guess)


class _Search:
    def __init__(
        self,
        g: nx.DiGraph,
        tree: SPNode,
        cost: CostModel,
        devices: int,
        max_replicas: int,
        chain: bool,
        held_floor: int = 0,
    ) -> None:
        self.g, self.cost, self.n, self.chain = g, cost, devices, chain
        self.held_floor = held_floor
        self.iterations = 0
        self.tree = tree if isinstance(tree, Series) else Series((tree,))
        self.max_replicas = min(max_replicas, devices)
        self.depth_bound = devices
        self.top_k = max(0, cost.micro_batches - 1)  # the largest k a budgeted table is made for
        binds = cost.memory.budget is not None and not _budget_never_binds(g, cost)
        self.budgeted = binds  # at the tau being solved (`feasible`)
        self.pieces = CandidateStages(g, self.tree, cost, self.max_replicas)
        self.binding = self._binding_tau() if binds else INF
        self.tau = INF
        self.memo: dict[Key, Any] = {}
        self.r_cache: dict[Key, float] = {}
        self.facts: dict[Key, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # `_facts_by_end`
        self.held: dict[int, np.ndarray] = {}  # r -> `_held(r)`
        # the last feasible tau, with its d and tables: the binary search ends on it
        self.solved: tuple[float, int, dict[Key, Any], dict[Key, float], bool] | None = None

    def candidates(self) -> list[float]:
        """Every value the optimal bottleneck can take, from the perfect-balance bound up."""
        total = sum(d["forward"] + d["backward"] for _, d in self.g.nodes(data=True))
        return self.pieces.candidates(total / self.n * (1 - 1e-9))  # rounding margin

    def _binding_tau(self) -> float:
        """The least stage time, over every piece and replica count r, of a piece one of
        whose r replicas is over the budget holding the most it can (ceil(M / r)
        micro-batches: `_replicas` caps what it holds at M). Below it the budget binds no
        piece that meets tau, so r does not depend on the in-flight count there and the
        unbudgeted tables hold the same values (`feasible` solves such a tau without it)."""
        cost, m = self.cost, self.cost.micro_batches
        budget = cost.memory.budget
        assert budget is not None  # only made with a budget that binds somewhere
        least = INF
        for r in range(1, self.max_replicas + 1):
            held = math.ceil(m / r)
            for node_id, ranges in self.pieces.stats.ranges().items():
                weights = cost.weights(cast(float, ranges.pbytes))  # elementwise, as a float
                over = weights + ranges.act * held > budget  # [a, b]
                over &= np.triu(np.ones_like(over))  # b >= a: ranges that exist
                stage = self.pieces.series[node_id].stage[:, 1:, r - 1]  # [a, b]: range a..b
                least = min(least, float(stage[over].min(initial=INF)))
        for stats in self.pieces.stats.made().values():  # `_replicas`' memory, M held
            unfit = [
                r
                for r in range(1, self.max_replicas + 1)
                if not cost.memory.fits(cost.stage_memory(stats.pbytes, stats.act, m, r))
            ]
            if unfit:
                times = self.pieces.stage_times(stats)
                least = min(least, *(float(times[r - 1]) for r in unfit))
        return least

    # -- the DP for one tau ---------------------------------------------------------------

    def replicas(self, key: Key, in_flight: int) -> float:
        """r(P, i): the fewest replicas letting piece `key` meet tau and memory, or INF."""
        cache_key = (key, in_flight if self.budgeted else 0)
        if cache_key not in self.r_cache:
            self.r_cache[cache_key] = self._replicas(self.pieces.stats[key], in_flight)
        return self.r_cache[cache_key]

    def _replicas(self, stats: Stats, in_flight: int) -> float:
        limit = self.tau * (1 + 1e-12)
        for r in range(1, 2 if stats.stateful else self.max_replicas + 1):
            if self.cost.stage_time(stats.time, stats.pbytes, r) > limit:
                continue
            held = max(in_flight, min(self.cost.micro_batches, self.held_floor * r))
            memory = self.cost.stage_memory(stats.pbytes, stats.act, held, r)
            if self.cost.memory.fits(memory):
                return r
        return INF

    def _replica_rows(
        self,
        key_of: Callable[[int], Key],
        ends: np.ndarray,
        stage: np.ndarray,
        k: int,
        group: Key,
    ) -> np.ndarray:
        """[j, y]: r(key_of(ends[j]), y + 1) for k <= y < D (INF elsewhere); `stage` holds the
        pieces' stage times on 1..R replicas, so without a memory budget r is read off it;
        `group` (id(series), p[, a]) names the row of pieces `key_of` makes."""
        rows = np.full((len(ends), self.depth_bound + 1), INF)
        if not self.budgeted:  # r does not depend on the in-flight count
            ok = stage <= self.tau * (1 + 1e-12)
            first = np.where(ok.any(axis=1), ok.argmax(axis=1) + 1, INF)
            rows[:, k : self.depth_bound] = first[:, None]
            return rows
        if not len(ends) or k >= self.depth_bound:
            return rows
        weights, act, stateful = (column[ends] for column in self._facts_by_end(key_of, group))
        within = stage <= self.tau * (1 + 1e-12)  # [j, r - 1]
        budget = self.cost.memory.budget  # `MemoryModel.fits`
        undecided = np.ones((len(ends), self.depth_bound - k), dtype=bool)
        found = rows[:, k : self.depth_bound]
        for r in range(1, self.max_replicas + 1):
            held = self._held(r)[k : self.depth_bound]  # [y]: micro-batches one replica holds
            memory = weights[:, None] + act[:, None] * held[None, :]
            ok = within[:, r - 1 : r] & (memory <= budget) & undecided
            if r > 1:
                ok &= ~stateful[:, None]
            found[ok] = r
            undecided &= ~ok
            if not undecided.any():
                break
        return rows

    def _facts_by_end(
        self, key_of: Callable[[int], Key], group: Key
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[q]: (weight bytes, activation bytes, stateful) of the pieces `key_of(q)` of one
        row (`group` names it) for every end q that has one, as `_replicas` reads them:
        `stage_memory` is weights + act x held. Made once per search, not per tau."""
        if group not in self.facts:
            ends = range(self.pieces.series[group[0]].time.shape[1])
            stats = {q: self.pieces.stats.get(key_of(q)) for q in ends}
            weights = np.array([self.cost.weights(x.pbytes) if x else INF for x in stats.values()])
            act = np.array([x.act if x else INF for x in stats.values()])
            stateful = np.array([bool(x and x.stateful) for x in stats.values()])
            self.facts[group] = (weights, act, stateful)
        return self.facts[group]

    def _held(self, r: int) -> np.ndarray:
        """[y]: ceil(min(held, M) / r) with held = max(y + 1, min(M, held_floor r)) for
        y < D: what one of r replicas holds with y + 1 in flight (`_replicas`, as
        `CostModel.stage_memory` counts it)."""
        if r not in self.held:
            m = self.cost.micro_batches
            in_flight = np.arange(1, self.depth_bound + 1)
            held = np.maximum(in_flight, min(m, self.held_floor * r))
            self.held[r] = np.ceil(np.minimum(held, m) / r)
        return self.held[r]

    def _normalised(self, k: int, d: int) -> tuple[int, int]:
        """(k, d) as the tables are kept. Without a budget r does not depend on the
        in-flight count: F(node, k, d) = F(node, 0, d - k). With one, a replica holds at
        most M micro-batches, so r is the same for every in-flight count from M on:
        F(node, k, d) = F(node, M - 1, d - (k - M + 1)) for k > M - 1 (the depths beyond
        D this lets a sub-solution use need more than N devices, so no feasible solution
        and no value it is built from changes); the tables are made for k <= M - 1 only."""
        if not self.budgeted:
            return 0, d - k
        if k > self.top_k:
            return self.top_k, d - (k - self.top_k)
        return k, d

    def f(self, node: SPNode, k: int, d: int) -> float:
        """F(node, k, d): fewest devices (INF when impossible)."""
        k, d = self._normalised(k, d)
        if d <= k:
            return INF
        return self._table(node, k)[0][min(d, self.depth_bound)]

    def _f_row(self, node: SPNode, k: int) -> np.ndarray:
        """[d]: F(node, k, d) for d = 0..D, as `f` reads it off the table (INF for d <= k);
        kept with the tables of this tau."""
        key = ("row", id(node), k)
        if key not in self.memo:
            self.memo[key] = self._make_f_row(node, k)
        return self.memo[key]

    def _make_f_row(self, node: SPNode, k: int) -> np.ndarray:
        row = np.full(self.depth_bound + 1, INF)
        at, d = self._normalised(k, k + 1)  # the table F(node, k, k + 1 ..) is read from
        row[k + 1 :] = np.array(self._table(node, at)[0])[d : d + self.depth_bound - k]
        return row

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

    def _series_table(self, node: Series, k: int) -> tuple[list[float], _SeriesTable]:
        """G(p, x) for every position p, from the last one back (see the module docstring);
        which option reaches each value is found again when a solution is built."""
        info, limit = self.pieces.series[id(node)], self.tau * (1 + 1e-12)
        n = len(info.positions)
        cut_ok = [q == n or t <= limit for q, t in enumerate(info.cut_times)]
        g_tab = np.full((n + 1, self.depth_bound + 1), INF)
        g_tab[n, k:] = 0.0
        table = _SeriesTable(g_tab, cut_ok, np.array(cut_ok), k)
        for p in reversed(range(n)):
            g_tab[p] = np.minimum(self._child_row(node, p, table), self._merge_row(node, p, table))
        return g_tab[0].tolist(), table

    def _merge_row(self, node: Series, p: int, t: _SeriesTable) -> np.ndarray:
        """Per x: the least r(p..q-1, y + 1) + G(q, y) over ends q and k <= y < x."""
        row = np.full(self.depth_bound + 1, INF)
        reach = self._reachable(node, p)
        ends = np.arange(reach.start, reach.stop)[t.cut_mask[reach.start : reach.stop]]
        if not len(ends) or t.k >= self.depth_bound:
            return row
        stage = self.pieces.series[id(node)].stage[p, ends]
        key_of = partial(_range_key, id(node), p)
        rows = self._replica_rows(key_of, ends, stage, t.k, (id(node), p))
        best = (rows + t.g[ends]).min(axis=0)  # per y
        row[t.k + 1 :] = np.minimum.accumulate(best[t.k : self.depth_bound])
        return row

    def _child_row(self, node: Series, p: int, t: _SeriesTable) -> np.ndarray:
        """Per x: the best way to realise the non-leaf child starting at p, if any."""
        row = np.full(self.depth_bound + 1, INF)
        child, end = self.pieces.series[id(node)].children.get(p, (None, 0))
        if child is None or not t.cut_ok[end]:
            return row
        if self.budgeted:  # per x: the least F(child, y, x) + G(end, y) over k <= y < x
            top = self.depth_bound
            inner = np.array([self._f_row(child, y) for y in range(t.k, top)])  # [y - k, x]
            sums = inner + t.g[end, t.k : top, None]
            row[t.k + 1 :] = sums.min(axis=0)[t.k + 1 :]
        else:  # F(child, y, x) = F(child, 0, x - y): a min-plus convolution
            row = self._convolve(np.array(self._table(child, 0)[0]), t.g[end], t.k, 0)
        if isinstance(child, Parallel):
            row = np.minimum(row, self._absorb_row(node, child, p, t))
        return row

    def _absorb_row(self, node: Series, parallel: Parallel, p: int, t: _SeriesTable) -> np.ndarray:
        """Per x: the best way for the parallel child at p to hand its a cheapest branches
        to the stage that follows it (ending at q2): Fpre + r(absorb, y + 1) + G(q2, y)."""
        row = np.full(self.depth_bound + 1, INF)
        count = len(parallel.children)
        for a, ends in self._absorb_ends(node, p, t.cut_ok):
            stage = self.pieces.series[id(node)].absorb[(p, a)][1][ends]
            key_of = _absorb_key(node, p, a)
            rows = self._replica_rows(key_of, np.array(ends), stage, t.k, (id(node), p, a))
            best = (rows + t.g[ends]).min(axis=0)
            if not self.budgeted:  # Fpre(y + 1, x) = Fpre(0, x - y - 1)
                prefix = self._table(parallel, 0)[1]
                costs = np.array([prefix[d][0][count - a] for d in range(self.depth_bound + 1)])
                row = np.minimum(row, self._convolve(costs, best, t.k, 1))
                continue
            for x in range(t.k + 2, self.depth_bound + 1):
                c = min(
                    self._prefix(parallel, y + 1, x, count - a) + best[y] for y in range(t.k, x - 1)
                )
                row[x] = min(row[x], c)
        return row

    def _convolve(self, inner: np.ndarray, after: np.ndarray, k: int, gap: int) -> np.ndarray:
        """Per x: the least inner[x - y - gap] + after[y] over k <= y < x - gap, with
        inner[0] = INF (no in-flight room): the unbudgeted series recursions, as one array
        operation over the (x, y) grid (the same sums the loops form, so the same values)."""
        top = self.depth_bound
        xs, ys = np.arange(top + 1)[:, None], np.arange(top + 1)[None, :]
        span = xs - ys - gap
        valid = (ys >= k) & (span >= 1)
        sums = inner[np.clip(span, 0, top)] + after[None, :]
        row = np.where(valid, sums, INF).min(axis=1)
        row[: k + 1 + gap] = INF
        return row

    def _absorb_ends(self, node: Series, p: int, cut_ok: list[bool]) -> list[tuple[int, list[int]]]:
        """Per a: the ends q2 of absorbing pieces whose compute could meet tau."""
        info = self.pieces.series[id(node)]
        child, end = info.children[p]
        options = []
        for a in range(1, len(child.children)):
            times = info.absorb[(p, a)][0]
            ends = [q2 for q2 in self._within_reach(times, end + 1) if cut_ok[q2]]
            if ends:
                options.append((a, ends))
        return options

    def _reachable(self, node: Series, p: int) -> range:
        """Ends q of the ranges p..q-1 whose compute could meet tau on the most replicas."""
        return self._within_reach(self.pieces.series[id(node)].time[p], p + 1)

    def _within_reach(self, times: np.ndarray, first: int) -> range:
        """first..q-1, q the first index from `first` on whose time needs more than R
        replicas to meet tau."""
        over = np.flatnonzero(times[first:] / self.max_replicas > self.tau * (1 + 1e-12))
        return range(first, first + int(over[0]) if len(over) else len(times))

    def _parallel_table(self, node: Parallel, k: int) -> tuple[list[float], Any]:
        """Per d: fewest devices for the sorted children, and for every prefix of them.

        h[e] covers children 0..e-1; the last group of that cover starts at start[e].
        """
        kids = self.pieces.sorted_children[id(node)]
        size, top = len(kids), self.depth_bound
        # h[e, d] covers children 0..e-1 at d; the same sums and strict improvements in the
        # same order (j ascending) as a loop per d, over every d at once
        h = np.full((size + 1, top + 1), INF)
        h[0] = 0.0
        start = np.zeros((size + 1, top + 1), dtype=np.int64)
        has_room = np.arange(top + 1) >= k + 1
        for e in range(1, size + 1):
            for j in range(e):
                if e - j == 1:
                    c = self._f_row(kids[j], k)
                else:
                    r = self.replicas(("group", id(node), j, e - 1), k + 1)
                    c = np.where(has_room, r, INF)
                better = h[j] + c < h[e]
                h[e, better] = (h[j] + c)[better]
                start[e, better] = j
        return h[size].tolist(), _Splits(h, start)

    def _prefix(self, node: Parallel, k: int, d: int, count: int) -> float:
        """Fewest devices for the `count` most expensive children of `node` (as F does)."""
        k, d = self._normalised(k, d)
        if d <= k:
            return INF
        return self._table(node, k)[1][min(d, self.depth_bound)][0][count]

    # -- reconstruction -------------------------------------------------------------------

    def build(self, node: SPNode, k: int, d: int) -> list[Piece]:
        """The pieces of the solution F(node, k, d) (which must be finite)."""
        k, d = self._normalised(k, d)
        d = min(d, self.depth_bound)
        if isinstance(node, Leaf):
            return [self._piece(("leaf", id(node), 0, 0), k + 1)]
        if isinstance(node, Parallel):
            return self._build_parallel(node, k, d, len(node.children))
        return self._build_series(node, d, self._table(node, k)[1])

    def _piece(self, key: Key, in_flight: int) -> Piece:
        return Piece(self.pieces.units(key), int(self.replicas(key, in_flight)))

    def _build_series(self, node: Series, d: int, table: _SeriesTable) -> list[Piece]:
        info = self.pieces.series[id(node)]
        pieces: list[Piece] = []
        p, x, rows = 0, d, table.g.tolist()
        while p < len(info.positions):
            kind, q, y, *absorbed = self._series_choice(node, p, x, table, rows)
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

    def _series_choice(
        self, node: Series, p: int, x: int, t: _SeriesTable, g: list[list[float]]
    ) -> tuple[Any, ...]:
        """The option reaching G(p, x) (`g` is the table as lists): the first in the order
        the table's rows consider them (child by y; absorbing by a, q2, y; merge by q, y)."""
        target, k = g[p][x], t.k
        child, end = self.pieces.series[id(node)].children.get(p, (None, 0))
        if child is not None and t.cut_ok[end]:
            for y in range(k, x):
                if self.f(child, y, x) + g[end][y] == target:
                    return ("child", end, y)
            if isinstance(child, Parallel):
                count = len(child.children)
                for a, ends in self._absorb_ends(node, p, t.cut_ok):
                    for q2, y in itertools.product(ends, range(k, x - 1)):
                        r = self.replicas(("absorb", id(node), p, a, q2), y + 1)
                        if self._prefix(child, y + 1, x, count - a) + r + g[q2][y] == target:
                            return ("absorb", q2, y, a)
        for q in self._reachable(node, p):
            for y in range(k, x):
                r = self.replicas(("range", id(node), p, q - 1), y + 1)
                if t.cut_ok[q] and r + g[q][y] == target:
                    return ("merge", q, y)
        raise AssertionError(f"no option reaches G({p}, {x}) = {target}")

    def _build_parallel(self, node: Parallel, k: int, d: int, count: int) -> list[Piece]:
        """The pieces covering the `count` most expensive children of `node` (k, d normalised)."""
        kids = self.pieces.sorted_children[id(node)]
        _, start = self._table(node, k)[1][d]
        pieces: list[Piece] = []
        e = count
        while e > 0:
            j = int(start[e])
            if e - j == 1:
                pieces += self.build(kids[j], k, d)
            else:
                pieces.append(self._piece(("group", id(node), j, e - 1), k + 1))
            e = j
        return pieces

    def _build_prefix(self, node: Parallel, k: int, d: int, count: int) -> list[Piece]:
        k, d = self._normalised(k, d)
        return self._build_parallel(node, k, min(d, self.depth_bound), count)

    # -- the outer loop -------------------------------------------------------------------

    def feasible(self, tau: float) -> int | None:
        """The smallest source in-flight d with F(root, 0, d) <= N at `tau`, or None.

        The tables of the last tau found feasible are kept, to build its solution from."""
        if self.solved is not None and self.solved[0] == tau:
            self.tau, found, self.memo, self.r_cache, self.budgeted = self.solved
            return found
        self.tau, self.memo, self.r_cache = tau, {}, {}
        self.budgeted = tau * (1 + 1e-12) >= self.binding  # some piece within tau is over
        self.iterations += 1
        for d in range(1, self.depth_bound + 1):
            if self.f(self.tree, 0, d) <= self.n:
                self.solved = (tau, d, self.memo, self.r_cache, self.budgeted)
                return d
        return None

    def _pipeline_time(self, tau: float, pieces: list[Piece]) -> float:
        """A flushed pipeline's step: (M + depth - 1) micro-batch slots of tau, with the depth
        of the stage graph the pieces really form (merged ranges may run side by side)."""
        return (self.cost.micro_batches + self._depth(pieces) - 1) * tau

    def _least_pipeline_time(self, tau: float, path: list[float]) -> float:
        """A floor on `_pipeline_time` at `tau`: a stage's compute is within R tau (its
        stage time, within tau, is at least its compute over its replicas), and the units
        of a path (`path`, their times in order: `_path_times`) that share a stage are
        consecutive on it (stages are convex), each stage a step of the depth; so the depth
        is at least the fewest runs of the path within R tau each (greedy, first to last,
        is the fewest; a unit over R tau counts one run)."""
        reach = tau * self.max_replicas * (1 + 1e-9)
        depth, run = 1, 0.0
        for t in path:
            if run > 0.0 and run + t > reach:
                depth, run = depth + 1, 0.0
            run += t
        return (self.cost.micro_batches + depth - 1) * tau

    def _path_times(self) -> list[float]:
        """The unit times along the path `_least_pipeline_time` packs: on a chain every
        unit, in the order its stages are ranges of; else the longest forward + backward
        path of the unit graph."""
        times = {u: d["forward"] + d["backward"] for u, d in self.g.nodes(data=True)}
        if self.chain:
            return [times[u] for u in self.pieces.series[id(self.tree)].positions]
        longest: dict[Unit, tuple[float, Unit | None]] = {}
        for u in nx.topological_sort(self.g):
            before = max(((longest[p][0], p) for p in self.g.predecessors(u)), default=None)
            longest[u] = (times[u] + before[0], before[1]) if before else (times[u], None)
        end = max(longest, key=lambda u: longest[u][0], default=None)
        path: list[float] = []
        while end is not None:
            path.append(times[end])
            end = longest[end][1]
        return path[::-1]

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

    def run(
        self, objective: str = "pipeline", probes: int = 16, guess: float | None = None
    ) -> SearchResult:
        """Search; "bottleneck" minimises tau (then depth), "pipeline" the step estimate.
        `guess`: where to start looking for the least feasible tau (`search`)."""
        self.iterations = 0
        values = self.candidates()
        lo = self._least_feasible(values, guess) if values else 0
        if not values or self.feasible(values[lo]) is None:  # lo is last: none is feasible
            raise PlanError(_infeasible_message(self))
        tau, d, pieces = self._solution(values[lo])
        if objective == "pipeline":
            tau, d, pieces = self._trade_bottleneck_for_depth(values, lo, (tau, d, pieces), probes)
        return SearchResult(tuple(pieces), tau, d, len(values), self.iterations, values[lo])

    def _least_feasible(self, values: list[float], guess: float | None) -> int:
        """The index of the least feasible value, the last if none below it is (the last is
        not probed here: `run` checks it): a bisection of [lo, hi], which a guess first
        narrows by galloping (steps 1, 2, 4, ... down from it while feasible, or up while
        not). Every feasible probe lowers hi, so the last feasible one probed is values[hi]
        (its tables are kept: `feasible`)."""
        lo, hi = 0, len(values) - 1
        if guess is not None:
            at = min(bisect.bisect_left(values, guess), hi)
            lo, hi = self._gallop(values, at, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.feasible(values[mid]) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _gallop(self, values: list[float], at: int, hi: int) -> tuple[int, int]:
        """(lo, hi) bracketing the least feasible index, probing out from `at`: values[hi]
        feasible (or the last value, not probed), every index below lo infeasible."""
        step = 1
        if self.feasible(values[at]) is not None:
            hi, probe = at, at - 1
            while probe >= 0 and self.feasible(values[probe]) is not None:
                hi, step = probe, step * 2
                probe = hi - step
            return max(probe + 1, 0), hi
        lo = probe = min(at + 1, hi)
        while probe < hi and self.feasible(values[probe]) is None:
            lo, step = probe + 1, step * 2
            probe = min(lo - 1 + step, hi)
        return lo, probe

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
        path = self._path_times()
        for i in range(first + step, top, step):
            if self._least_pipeline_time(values[i], path) >= score:
                continue  # no plan at this tau can score less: not solved
            candidate = self._solution(values[i])
            candidate_score = self._pipeline_time(candidate[0], candidate[2])
            if candidate_score < score:
                best, score = candidate, candidate_score
        return best


def _budget_never_binds(g: nx.DiGraph, cost: CostModel) -> bool:
    """Whether every piece fits the memory budget whatever its in-flight count: the whole
    unit graph, one replica holding all M micro-batches, fits (a piece's parameters and
    activations are within the whole graph's, and a replica holds at most M). The DP is
    then the unbudgeted one (r independent of the in-flight count, one table per node):
    the same values and solutions, D times fewer tables."""
    params = float(sum(g.graph["param_bytes"].values()))
    act = sum(d["act"] for _, d in g.nodes(data=True))
    m = cost.micro_batches
    return cost.memory.fits(cost.stage_memory(params, act, m, 1))


def _range_key(node_id: int, p: int, q: int) -> Key:
    return ("range", node_id, p, q - 1)


def _absorb_key(node: Series, p: int, a: int) -> Callable[[int], Key]:
    return lambda q2: ("absorb", id(node), p, a, q2)


def _infeasible_message(s: _Search) -> str:
    budget = s.cost.memory.budget
    smallest = s.pieces.smallest_memory()
    return (
        f"no stage graph on {s.n} devices fits the memory budget of {budget:.4g} bytes per "
        f"device (the smallest op unit alone, one micro-batch in flight, needs {smallest:.4g}). "
        "Raise the budget, "
        "use more devices or more micro-batches (smaller micro-batches), or trace with finer "
        "leaf modules."
    )
