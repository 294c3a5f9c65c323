"""Fold: group the ops that must, or had better, share a stage, before anything is cut.

Bound groups (`bound_groups`) are a rule of correctness, kept by every partitioner. The
runtime sends only single tensors between stages, so an op whose output is anything else (a
tuple read by `getitem`, a torch.Size or an int from a size query, a bool, None; the op
graph's `tensor` attribute is False) shares a stage with all its users. A size query thus
goes with its consumers, and its input tensor is what crosses. A group is then closed under
paths: an op on a path between two members joins it, so that it stays convex and the graph of
groups acyclic. (Joining every strongly connected component of the graph of groups does
exactly that.)

Folds (`folded_groups`) serve the search, for the graph and sequential partitioners:

- An op whose output tensor parallelism splits (`tp_split`, marked by
  `mesh.tp_rank_graph`: a column-wise layer's output and the ops up to the row-wise layer
  that reads it) joins its users, as Megatron-LM never cuts inside an attention block or an
  MLP: a cut there would gather the split value whole on both sides, and the ops after it
  would run whole. Pins (`manual`) may still cut there; the runtime runs it, correctly.

- A dead end, a group that nothing uses (an assert or a check: `torch._assert`,
  `aten._assert_scalar`, `aten._assert_tensor_metadata`, an unused `getitem`,
  `torch._C._log_api_usage_once`), joins its latest producer; the producer may become a dead
  end in turn, so a dead chain joins the op it hangs off. A dead end without inputs joins its
  neighbour in graph order. Unfolded, a dead end is an ancestor of nothing, so no series cut
  after it would exist, chains around it would not merge, and the decomposition would
  degrade to one long series. A graph without an "output" node (a hand-made one) has no
  dead ends: each of its sinks counts as an output.
- A constant read only by ops that depend on a model input joins its earliest consumer. A
  constant is a group that reads no model input (the op graph's `constant`: an `arange`, an
  attention mask or a rotary table built from it, a transposed weight); only the last ops
  of a constant chain move, so the rest of the chain stays free to go to any stage (its
  time counts as much as any op's). Unfolded, the view of a rotary table that each layer
  takes is neither before nor after the layers around it, so no series cut between layers
  would exist; the table itself comes before layer 0 and feeds every layer after it.

Either way the group joins a neighbour that keeps every group convex and the graph of groups
acyclic: a dead end its latest producer (a path out of the merged group and back would
enter the dead end from a producer after the latest), a constant its earliest consumer (a
path out and back would leave the constant for a consumer before the earliest).

Complexity: O(V + E) with union-find and one strongly connected components pass, plus
O(E log V) for the folds' topological order.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

import networkx as nx

from graphpipe.planning.sptree import Unit, coarsen

__all__ = ["bound_groups", "coarse_units", "folded_groups", "in_topological_order"]

K = TypeVar("K", bound=Hashable)


def bound_groups(g: nx.DiGraph) -> list[Unit]:
    """Groups of ops that must share a stage: non-tensor values with their users, convex.

    Args:
        g: The op graph (`graphpipe.planning.opgraph.op_graph`); a node without a `tensor` attribute
            counts as a tensor.

    Returns:
        Every op in exactly one group; a group's ops in graph order, groups by first op.

    Example:
        >>> g = nx.DiGraph([("x", "shape"), ("shape", "view"), ("y", "view")])
        >>> nx.set_node_attributes(g, {n: i for i, n in enumerate(g)}, "order")
        >>> g.nodes["shape"]["tensor"] = False
        >>> bound_groups(g)
        [('x',), ('shape', 'view'), ('y',)]
    """
    parent = {n: n for n in g}
    for n, data in g.nodes(data=True):
        if not data.get("tensor", True):
            for user in g.successors(n):
                _union(parent, n, user)
    return _convex(g, _groups(g, parent))


def folded_groups(g: nx.DiGraph) -> list[Unit]:
    """`bound_groups`, with dead ends and constants folded in (see the module docstring).

    Args:
        g: The op graph.

    Returns:
        Every op in exactly one group, ops in graph order, groups by first op. The graph of
        groups is acyclic; with an "output" node, that node's group is its only sink.

    Example:
        >>> g = nx.DiGraph([("a", "check"), ("a", "b"), ("b", "output")])
        >>> nx.set_node_attributes(g, {n: i for i, n in enumerate(g)}, "order")
        >>> folded_groups(g)
        [('a', 'check'), ('b',), ('output',)]
    """
    key = _structure(g)
    known = _FOLDED.get(key)
    if known is None:
        if len(_FOLDED) >= FOLDED_KEPT:
            _FOLDED.clear()
        known = _FOLDED[key] = _folded(g)
    return list(known)


def coarse_units(g: nx.DiGraph, parts: int) -> nx.DiGraph:
    """`g`'s folded groups coarsened (`sptree.coarsen`) to units of at most half of one of
    `parts` equal shares of its time: what the partitioners and `even_chain` cut."""
    total = sum(d["forward"] + d["backward"] for _, d in g.nodes(data=True))
    return coarsen(g, total / (2 * parts), folded_groups(g))


FOLDED_KEPT = 64  # graph structures whose folded groups are kept
_FOLDED: dict[tuple[object, ...], list[Unit]] = {}


def _structure(g: nx.DiGraph) -> tuple[object, ...]:
    """What `folded_groups` reads of `g`: every node with its order, tensor, constant and
    tp_split attributes, and every edge. The mesh search plans one graph at many row counts
    (`mesh.per_rank_graph`: the same structure, other times), each partitioner and layout
    folding it again; the groups are made once per structure."""
    nodes = tuple(
        (n, d.get("order"), d.get("tensor", True), bool(d.get("constant")), bool(d.get("tp_split")))
        for n, d in g.nodes(data=True)
    )
    return nodes, tuple(g.edges)


def _folded(g: nx.DiGraph) -> list[Unit]:
    groups = _tp_bound(g, bound_groups(g))
    if len(groups) == 1:
        return groups
    folding = _Folding(_group_graph(g, groups))
    if "output" in g:
        folding.dead_ends(next(i for i, unit in enumerate(groups) if "output" in unit))
    constant = {i for i, unit in enumerate(groups) if all(g.nodes[n].get("constant") for n in unit)}
    alive = {i for i in constant if folding.find(i) == i}
    folding.constants({i for i in alive if not folding.out[i] & constant})
    members: dict[int, list[str]] = {}
    for i in range(len(groups)):
        members.setdefault(folding.find(i), []).extend(groups[i])
    return _units(g, members.values())


def _tp_bound(g: nx.DiGraph, groups: list[Unit]) -> list[Unit]:
    """`groups` with every `tp_split` op joined to its users' groups, convex."""
    split = [n for n, data in g.nodes(data=True) if data.get("tp_split")]
    if not split:
        return groups
    parent = {n: unit[0] for unit in groups for n in unit}
    for n in split:
        for user in g.successors(n):
            _union(parent, n, user)
    return _convex(g, _groups(g, parent))


def in_topological_order(g: nx.DiGraph, groups: list[Unit]) -> list[Unit]:
    """Groups that cover `g` (as from `bound_groups`) in a topological order of the graph of
    groups, ties broken by graph order."""
    return [groups[i] for i in nx.lexicographical_topological_sort(_group_graph(g, groups))]


def _find(parent: dict[K, K], x: K) -> K:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def _union(parent: dict[K, K], a: K, b: K) -> None:
    ra, rb = _find(parent, a), _find(parent, b)
    if ra != rb:
        parent[rb] = ra


def _groups(g: nx.DiGraph, parent: dict[str, str]) -> list[Unit]:
    members: dict[str, list[str]] = {}
    for n in g:
        members.setdefault(_find(parent, n), []).append(n)
    return _units(g, members.values())


def _units(g: nx.DiGraph, groups: Iterable[Iterable[str]]) -> list[Unit]:
    """Groups as tuples in graph order, sorted by their first op."""
    units = [tuple(sorted(group, key=lambda n: g.nodes[n]["order"])) for group in groups]
    return sorted(units, key=lambda u: g.nodes[u[0]]["order"])


def _group_graph(g: nx.DiGraph, groups: list[Unit]) -> nx.DiGraph:
    """The graph of groups: node i is groups[i]; an edge where an op edge joins two groups."""
    index = {n: i for i, unit in enumerate(groups) for n in unit}
    q = nx.DiGraph()
    q.add_nodes_from(range(len(groups)))
    q.add_edges_from((index[a], index[b]) for a, b in g.edges if index[a] != index[b])
    return q


def _convex(g: nx.DiGraph, groups: list[Unit]) -> list[Unit]:
    """Join the groups on a common cycle of the graph of groups (paths out and back)."""
    q = _group_graph(g, groups)
    if nx.is_directed_acyclic_graph(q):
        return groups
    components = nx.strongly_connected_components(q)
    return _units(g, ([n for i in c for n in groups[i]] for c in components))


class _Folding:
    """Merges on the acyclic graph of groups, each into a neighbour that keeps it acyclic.

    Groups are visited against a topological order (`position`); a merged group keeps the
    position of the group it joins, which stays a topological order because a dead end
    joins its latest producer and a constant its earliest consumer.
    """

    def __init__(self, q: nx.DiGraph) -> None:
        self.order = list(nx.lexicographical_topological_sort(q))  # ties: graph order, as ids
        self.position = {i: p for p, i in enumerate(self.order)}
        self.parent = {i: i for i in q}
        self.into = {i: set(q.predecessors(i)) for i in q}
        self.out = {i: set(q.successors(i)) for i in q}

    def find(self, i: int) -> int:
        return _find(self.parent, i)

    def dead_ends(self, home: int) -> None:
        """Each group without successors but `home` joins its latest producer (or, without
        producers, its neighbour in the order); consumers first, so dead chains fold up."""
        for p in reversed(range(len(self.order))):
            dead = self.order[p]
            if self.out[dead] or dead == home:
                continue
            if self.into[dead]:
                target = max(self.into[dead], key=self.position.__getitem__)
            else:
                target = self.find(self.order[p - 1] if p > 0 else self.order[1])
            self._merge(dead, target)

    def constants(self, constant: set[int]) -> None:
        """Each group of `constant` that has consumers joins its earliest consumer."""
        for c in reversed(self.order):
            if c in constant and self.parent[c] == c and self.out[c]:
                self._merge(c, min(self.out[c], key=self.position.__getitem__))

    def _merge(self, a: int, b: int) -> None:
        """Group `a` joins group `b`, taking its edges along."""
        self.parent[a] = b
        for p in self.into.pop(a):
            self.out[p].discard(a)
            if p != b:
                self.out[p].add(b)
                self.into[b].add(p)
        for s in self.out.pop(a):
            self.into[s].discard(a)
            if s != b:
                self.into[s].add(b)
                self.out[b].add(s)
