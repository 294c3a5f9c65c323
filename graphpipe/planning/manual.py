"""Manual plans: pin modules or ops to stages, like split points in PyTorch's pipelining.

    pins = {"towers.0": 0, "towers.1": 1, "head": 2}

A key is an op name or a module path; a module path pins every op inside that module (the
longest matching path wins). An op without a pin joins the latest stage among its inputs
(stage 0 when it has none), so everything after a split point follows it, as in a sequential
split. Each stage gets one device. The result is assembled and validated like any plan.

Only single tensors cross stages, so the pins place whole bound groups (`fold.bound_groups`:
a non-tensor value, such as a tuple or an int from a size query, with all its users): a group
follows its pinned ops, or, with none pinned, the latest stage among its inputs. Pins that
put one group on two stages are an error naming the value.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from graphpipe.errors import ConfigError, PlanError
from graphpipe.planning.fold import bound_groups, in_topological_order
from graphpipe.planning.sptree import Unit

__all__ = ["groups_from_pins"]


def groups_from_pins(g: nx.DiGraph, pins: Mapping[str, int]) -> list[tuple[frozenset[str], int]]:
    """Stage groups (op names, 1 replica) from a pin map.

    Args:
        g: The op graph.
        pins: Op name or module path -> stage index.

    Returns:
        One group per stage index 0..max, in index order.

    Raises:
        ConfigError: a pin matches no op, a stage index is negative, or a stage index between
            0 and the largest gets no op.
        PlanError: the pins split a non-tensor value from one of its users (every such
            value is named).

    Example:
        >>> g = nx.DiGraph([("a", "b")])
        >>> nx.set_node_attributes(g, {"a": 0, "b": 1}, "order")
        >>> nx.set_node_attributes(g, {"a": "", "b": ""}, "module")
        >>> groups_from_pins(g, {"b": 1})
        [(frozenset({'a'}), 1), (frozenset({'b'}), 1)]
    """
    negative = {k: v for k, v in pins.items() if not isinstance(v, int) or v < 0}
    if negative:
        raise ConfigError(f"pin stage indices must be integers >= 0, got {negative}")
    groups = bound_groups(g)
    used: set[str] = set()
    stage: dict[str, int] = {}
    split: list[str] = []
    for unit in in_topological_order(g, groups):
        keys = {n: _pin_for(n, g.nodes[n]["module"], pins) for n in unit}
        pinned = {n: key for n, key in keys.items() if key is not None}
        used |= set(pinned.values())
        stages = {pins[key] for key in pinned.values()}
        if len(stages) > 1:
            split.append(_split_message(g, unit, {n: pins[k] for n, k in pinned.items()}))
        outside = (p for n in unit for p in g.predecessors(n) if p not in unit)
        s = min(stages) if stages else max((stage[p] for p in outside), default=0)
        stage.update(dict.fromkeys(unit, s))
    unused = sorted(set(pins) - used)
    if unused:
        raise ConfigError(f"pins match no op or module path: {unused}")
    if split:
        raise PlanError("the pins split values that are not single tensors:", split)
    count = max(stage.values()) + 1
    nodes = [frozenset(n for n, s in stage.items() if s == i) for i in range(count)]
    empty = [i for i, members in enumerate(nodes) if not members]
    if empty:
        raise ConfigError(f"stages {empty} get no op from the pins {dict(pins)}")
    return [(members, 1) for members in nodes]


def _split_message(g: nx.DiGraph, unit: Unit, stage_of: dict[str, int]) -> str:
    values = [
        f"{n!r} ({g.nodes[n].get('value', 'non-tensor')})"
        for n in unit
        if not g.nodes[n].get("tensor", True)
    ]
    return (
        f"{', '.join(values)} must share a stage with its users, but the pins put "
        f"{stage_of} on stages {sorted(set(stage_of.values()))}"
    )


def _pin_for(op: str, module: str, pins: Mapping[str, int]) -> str | None:
    if op in pins:
        return op
    best = None
    for key in pins:
        inside = module == key or module.startswith(key + ".")
        if inside and (best is None or len(key) > len(best)):
            best = key
    return best
