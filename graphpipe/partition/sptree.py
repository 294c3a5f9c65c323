"""Series-parallel decomposition of the op graph, and the coarsening that precedes it.

Units. Before decomposing, `coarsen` merges chain links u -> v (u's only successor is v and
v's only predecessor is u) while the merged unit stays under a time limit, so a long run of
cheap ops (a Linear and its ReLU) becomes one unit. A unit is a tuple of op names.

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

Complexity: each level computes ancestor sets as bitsets, O(n^2 / 64) word operations, and
there are at most n levels.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import networkx as nx

__all__ = ["Leaf", "Parallel", "SPNode", "Series", "coarsen", "decompose", "linearise"]

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


def coarsen(g: nx.DiGraph, max_time: float) -> nx.DiGraph:
    """Merge chain links whose combined forward+backward time stays within `max_time`.

    Args:
        g: The op graph (`graphpipe.opgraph.op_graph`).
        max_time: Largest time a merged unit may have.

    Returns:
        A DiGraph whose nodes are units (tuples of op names, in graph order) with the summed
        attributes forward, backward and act (all the unit's outputs: its activation memory),
        params (union) and order (of the first op). An edge carries `tensors`, the op names
        whose outputs cross it, and their `bytes`, each tensor counted once.
    """
    unit_of: dict[str, Unit] = {n: (n,) for n in g}
    for v in sorted(g, key=lambda n: g.nodes[n]["order"]):
        preds = list(g.predecessors(v))
        if len(preds) != 1 or g.out_degree(preds[0]) != 1:
            continue
        merged = unit_of[preds[0]] + unit_of[v]
        if _unit_time(g, merged) <= max_time:
            for n in merged:
                unit_of[n] = merged
    return _quotient(g, set(unit_of.values()))


def _unit_time(g: nx.DiGraph, unit: Iterable[str]) -> float:
    return sum(g.nodes[n]["forward"] + g.nodes[n]["backward"] for n in unit)


def _quotient(g: nx.DiGraph, units: set[Unit]) -> nx.DiGraph:
    q = nx.DiGraph(**g.graph)
    unit_of = {n: u for u in units for n in u}
    for u in units:
        q.add_node(
            u,
            forward=sum(g.nodes[n]["forward"] for n in u),
            backward=sum(g.nodes[n]["backward"] for n in u),
            act=sum(g.nodes[n]["act"] for n in u),
            params=frozenset().union(*(g.nodes[n]["params"] for n in u)),
            order=min(g.nodes[n]["order"] for n in u),
        )
    for a, b in g.edges:
        ua, ub = unit_of[a], unit_of[b]
        if ua != ub:
            tensors = q.edges[ua, ub]["tensors"] | {a} if q.has_edge(ua, ub) else frozenset({a})
            q.add_edge(ua, ub, tensors=tensors, bytes=sum(g.nodes[t]["act"] for t in tensors))
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
