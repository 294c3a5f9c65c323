"""Manual plans: pin modules or ops to stages, like split points in PyTorch's pipelining.

    pins = {"towers.0": 0, "towers.1": 1, "head": 2}

A key is an op name or a module path; a module path pins every op inside that module (the
longest matching path wins). An op without a pin joins the latest stage among its inputs
(stage 0 when it has none), so everything after a split point follows it, as in a sequential
split. Each stage gets one device. The result is assembled and validated like any plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from graphpipe.errors import ConfigError

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
    """
    negative = {k: v for k, v in pins.items() if not isinstance(v, int) or v < 0}
    if negative:
        raise ConfigError(f"pin stage indices must be integers >= 0, got {negative}")
    used: set[str] = set()
    stage: dict[str, int] = {}
    for n in sorted(g, key=lambda n: g.nodes[n]["order"]):
        key = _pin_for(n, g.nodes[n]["module"], pins)
        if key is not None:
            used.add(key)
            stage[n] = pins[key]
        else:
            stage[n] = max((stage[p] for p in g.predecessors(n)), default=0)
    unused = sorted(set(pins) - used)
    if unused:
        raise ConfigError(f"pins match no op or module path: {unused}")
    count = max(stage.values()) + 1
    groups = [frozenset(n for n, s in stage.items() if s == i) for i in range(count)]
    empty = [i for i, nodes in enumerate(groups) if not nodes]
    if empty:
        raise ConfigError(f"stages {empty} get no op from the pins {dict(pins)}")
    return [(nodes, 1) for nodes in groups]


def _pin_for(op: str, module: str, pins: Mapping[str, int]) -> str | None:
    if op in pins:
        return op
    best = None
    for key in pins:
        inside = module == key or module.startswith(key + ".")
        if inside and (best is None or len(key) > len(best)):
            best = key
    return best
