"""Series-parallel decomposition of the op graph, and the coarsening that precedes it.

Units. Before decomposing, `coarsen` merges chain links u -> v (u's only successor is v and
v's only predecessor is u) while the merged unit stays under a time limit, so a long run of
cheap ops (a Linear and its ReLU) becomes one unit. A unit is a tuple of op names. It starts
from groups of ops that stay together (`fold.folded_groups`), one op each by default.

Tree. `decompose` returns a tree of `Leaf` (one unit), `Series` (children run one after the
other) and `Parallel` (children are independent). For a set of units in topological order:

1. Series cuts: position p is a cut when every unit before p is an ancestor of every unit from
   p on. Every edge then goes forward across the cut (skip connections included), so the
   segments between cuts are pipelined one after the other: `Series`.
2. A segment without cuts splits into its weakly connected components: `Parallel`. Each
   component is decomposed in turn.
3. A segment with no cut and one component is not series-parallel (e.g. the "N" graph
   a->c, a->d, b->d). It is linearised: its units become a `Series` in topological order.
   Every contiguous range of a topological order is convex, so any cut of it is a valid
   stage boundary; only the concurrency inside that segment is given up.

`linearise` gives the sequential baseline's view: one `Series` of all units in topological
order (PipeDream's setting).

Size. The search is quadratic in a series' units, so `condense` merges units along the tree
(whole small subtrees, runs of consecutive leaves) when more than a given number remain.

Complexity: each level computes ancestor sets as bitsets, O(n^2 / 64) word operations, and
there are at most n levels.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import networkx as nx

from graphpipe.planning.opgraph import wire_bytes

__all__ = [
    "Leaf",
    "Parallel",
    "SPNode",
    "Series",
    "coarsen",
    "condense",
    "decompose",
    "linearise",
]

Unit = tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Leaf:
    """One unit: ops that always share a stage."""

    unit: Unit


@dataclass(frozen=True, eq=False)
class Series:
    """Children in pipeline order; every edge between them goes forward."""

    children: tuple[SPNode, ...]


@dataclass(frozen=True, eq=False)
class Parallel:
    """Independent children: no edge and no path between any two of them."""

    children: tuple[SPNode, ...]


SPNode = Leaf | Series | Parallel


def units_of(node: SPNode) -> list[Unit]:
    """Every unit below `node`."""
    if isinstance(node, Leaf):
        return [node.unit]
    return [u for child in node.children for u in units_of(child)]


def coarsen(g: nx.DiGraph, max_time: float, groups: Iterable[Unit] | None = None) -> nx.DiGraph:
    """Merge chain links whose combined forward+backward time stays within `max_time`.

    Args:
        g: The op graph (`graphpipe.planning.opgraph.op_graph`).
        max_time: Largest time a merged unit may have.
        groups: Ops that stay together whatever their time (`fold.folded_groups`), covering `g`;
            default one op each. Chain links are followed between groups.

    Returns:
        A DiGraph whose nodes are units (tuples of op names, in graph order) with the summed
        attributes forward, backward and act (all the unit's outputs: its activation memory),
        params (union) and order (of the first op). An edge carries `tensors`, the op names
        whose outputs cross it, and their `bytes`, each tensor counted once.
    """
    start = _quotient(g, groups if groups is not None else [(n,) for n in g])
    return _quotient(g, _merge_chains(start, max_time))


def _merge_chains(q: nx.DiGraph, max_time: float) -> list[Unit]:
    """Units of `q` joined along chain links u -> v (u's only successor, v's only
    predecessor) while the joined time stays within `max_time`; O(V + E)."""
    head = {u: u for u in q}  # the first unit of the run each unit belongs to
    run: dict[Unit, list[Unit]] = {u: [u] for u in q}
    time = {u: q.nodes[u]["forward"] + q.nodes[u]["backward"] for u in q}
    for v in nx.lexicographical_topological_sort(q, key=lambda u: q.nodes[u]["order"]):
        preds = list(q.predecessors(v))
        if len(preds) != 1 or q.out_degree(preds[0]) != 1:
            continue
        first = head[preds[0]]
        if time[first] + time[v] <= max_time:
            time[first] += time.pop(v)
            run[first] += run.pop(v)
            head[v] = first
    return [tuple(n for u in units for n in u) for units in run.values()]


def _quotient(g: nx.DiGraph, units: Iterable[Unit]) -> nx.DiGraph:
    q = nx.DiGraph(**g.graph)
    unit_of: dict[str, Unit] = {}
    for unit in units:
        u = tuple(sorted(unit, key=lambda n: g.nodes[n]["order"]))
        unit_of.update(dict.fromkeys(u, u))
        q.add_node(
            u,
            forward=sum(g.nodes[n]["forward"] for n in u),
            backward=sum(g.nodes[n]["backward"] for n in u),
            act=sum(g.nodes[n]["act"] for n in u),
            params=frozenset().union(*(g.nodes[n]["params"] for n in u)),
            stateful=any(g.nodes[n].get("stateful", False) for n in u),
            order=g.nodes[u[0]]["order"],
        )
    crossing: dict[tuple[Unit, Unit], set[str]] = {}
    for a, b in g.edges:
        ua, ub = unit_of[a], unit_of[b]
        if ua != ub:
            crossing.setdefault((ua, ub), set()).add(a)
    for (ua, ub), tensors in crossing.items():
        q.add_edge(ua, ub, tensors=frozenset(tensors), bytes=sum(wire_bytes(g, t) for t in tensors))
    return q


def decompose(g: nx.DiGraph) -> SPNode:
    """Series-parallel tree of a unit graph (see the module docstring).

    Args:
        g: A DAG, typically from `coarsen`, with an `order` attribute on every node.

    Returns:
        The root of the tree.
    """
    return _decompose(g, _topo(g, g.nodes))


def linearise(g: nx.DiGraph) -> Series:
    """All units as one series, in topological order: the sequential pipeline's view."""
    return Series(tuple(Leaf(u) for u in _topo(g, g.nodes)))


def condense(
    g: nx.DiGraph, units: nx.DiGraph, tree: SPNode, max_units: int
) -> tuple[nx.DiGraph, SPNode]:
    """Merge units along the tree until at most `max_units` remain (the DP's size).

    Two merges keep a tree valid: a whole subtree becomes one leaf (its units are convex), and
    a run of consecutive leaf children of a series becomes one leaf (a contiguous range of a
    topological order is convex). Both are applied up to a time limit per merged unit, the
    smallest (by bisection) that leaves at most `max_units` units, so units stay as even as
    the tree allows; runs are merged greedily, first to last.

    Args:
        g: The op graph.
        units: The unit graph (`coarsen`), whose nodes are the tree's units.
        tree: Its tree (`decompose` or `linearise`).
        max_units: The most units to keep; a tree with no more is returned as it is.

    Returns:
        The unit graph and the tree over the merged units.

    Complexity: O(n) per bisection step, about 60 steps.
    """
    if units.number_of_nodes() <= max_units:
        return units, tree
    time: dict[int, float] = {}
    _subtree_times(units, tree, time)
    lo, hi = 0.0, time[id(tree)]
    for _ in range(60):
        mid = (lo + hi) / 2
        if _condensed_count(tree, mid, time) <= max_units:
            hi = mid
        else:
            lo = mid
    merged = _condensed(g, tree, hi, time)
    return _quotient(g, units_of(merged)), merged


def _subtree_times(units: nx.DiGraph, node: SPNode, time: dict[int, float]) -> float:
    if isinstance(node, Leaf):
        total = units.nodes[node.unit]["forward"] + units.nodes[node.unit]["backward"]
    else:
        total = sum(_subtree_times(units, child, time) for child in node.children)
    time[id(node)] = total
    return total


def _condensed(g: nx.DiGraph, node: SPNode, limit: float, time: dict[int, float]) -> SPNode:
    """`node` with every subtree within `limit` as one leaf, and runs of consecutive leaf
    children of a series merged while they stay within it."""
    if isinstance(node, Leaf) or time[id(node)] <= limit:
        return _leaf(g, units_of(node))
    children = [_condensed(g, child, limit, time) for child in node.children]
    if isinstance(node, Parallel):
        return Parallel(tuple(children))
    merged: list[SPNode] = []
    run: list[Unit] = []  # consecutive leaves, to merge while within the limit
    run_time = 0.0
    for child, old in zip(children, node.children, strict=True):
        t = time[id(old)]
        if isinstance(child, Leaf) and run and run_time + t <= limit:
            run.append(child.unit)
            run_time += t
            continue
        if run:
            merged.append(_leaf(g, run))
        if isinstance(child, Leaf):
            run, run_time = [child.unit], t
        else:
            run, run_time = [], 0.0
            merged.append(child)
    if run:
        merged.append(_leaf(g, run))
    return merged[0] if len(merged) == 1 else Series(tuple(merged))


def _condensed_count(node: SPNode, limit: float, time: dict[int, float]) -> int:
    """`len(units_of(_condensed(g, node, limit, time)))`, counted without building it: a
    subtree within `limit` is one unit, a series' runs of leaves merge as `_condensed`
    merges them."""
    if isinstance(node, Leaf) or time[id(node)] <= limit:
        return 1
    if isinstance(node, Parallel):
        return sum(_condensed_count(child, limit, time) for child in node.children)
    count, run_time, in_run = 0, 0.0, False
    for child in node.children:
        t = time[id(child)]
        if isinstance(child, Leaf) or t <= limit:  # `_condensed` makes it a leaf
            if in_run and run_time + t <= limit:
                run_time += t
                continue
            count, run_time, in_run = count + 1, t, True
        else:
            count, run_time, in_run = count + _condensed_count(child, limit, time), 0.0, False
    return count


def _leaf(g: nx.DiGraph, units: Iterable[Unit]) -> Leaf:
    return Leaf(tuple(sorted((n for u in units for n in u), key=lambda n: g.nodes[n]["order"])))


def _topo(g: nx.DiGraph, nodes: Iterable[Unit]) -> list[Unit]:
    sub = g.subgraph(nodes)
    return list(nx.lexicographical_topological_sort(sub, key=lambda n: g.nodes[n]["order"]))


def _decompose(g: nx.DiGraph, order: Sequence[Unit]) -> SPNode:
    if len(order) == 1:
        return Leaf(order[0])
    cuts = _series_cuts(g, order)
    if cuts:
        bounds = [0, *cuts, len(order)]
        return Series(tuple(_decompose(g, order[a:b]) for a, b in itertools.pairwise(bounds)))
    sub = g.subgraph(order)
    components = list(nx.weakly_connected_components(sub))
    if len(components) > 1:
        ranked = sorted(components, key=lambda c: min(g.nodes[n]["order"] for n in c))
        return Parallel(tuple(_decompose(g, _topo(g, c)) for c in ranked))
    return Series(tuple(Leaf(u) for u in order))


def _series_cuts(g: nx.DiGraph, order: Sequence[Unit]) -> list[int]:
    """Positions p where every unit of order[:p] is an ancestor of every unit of order[p:]."""
    index = {u: i for i, u in enumerate(order)}
    ancestors = [0] * len(order)  # bit i set: order[i] is an ancestor (within `order`)
    for i, u in enumerate(order):
        for p in g.predecessors(u):
            if p in index:
                ancestors[i] |= ancestors[index[p]] | (1 << index[p])
    # first_gap[i]: the first position not among the ancestors of order[i]
    first_gap = [(~a & (a + 1)).bit_length() - 1 for a in ancestors]
    cuts, suffix_min = [], len(order)
    for p in range(len(order) - 1, 0, -1):
        suffix_min = min(suffix_min, first_gap[p])
        if suffix_min >= p:
            cuts.append(p)
    return sorted(cuts)
