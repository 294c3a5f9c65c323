"""Fold the static inputs of an exported graph: what is computed from them becomes literals.

    folded = fold_static(gm, {node: value})     # the static placeholders, now without users

A `Static` input (`graphpipe.tracing.split`) is a small integer tensor the model reads back
to the host to make shapes: Qwen2-VL's `image_grid_thw`, whose `.tolist()` sizes the blocks
of its vision attention (`torch.split(q, lengths.tolist())`). torch.export cannot trace a
shape made from values, so `trace` exports such a model with `torch.export.draft_export`,
which runs real values beside the fake ones and records every decision it took from them.
This module then evaluates, on the example's values, every node computed from the static
inputs alone, and puts its value where the rest of the graph reads it: an int for a
read-back (`aten.item`), a constant tensor for a tensor. The static placeholders are left
without users. Every decision draft_export took from values must have been about static
values; one about another input's values (a branch on the data) is refused by name, since
the graph would be right for this example only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import fx

from graphpipe.errors import TraceError

__all__ = ["fold_static", "specialised"]

_VALUE_SHAPED = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)

_UNBACKED = re.compile(r"\bu\d+\b")


def fold_static(gm: fx.GraphModule, values: Mapping[fx.Node, torch.Tensor]) -> None:
    """Replace every node computed from `values`' placeholders alone by its value.

    Args:
        gm: An exported graph (changed in place, recompiled).
        values: Each static placeholder and its value at the traced micro-batch.

    Raises:
        TraceError: a folded node whose value the rest of the graph reads is neither a
            tensor nor a number, naming it.
    """
    known, constant = _evaluate(gm, values)
    numbers = {n: v for n, v in constant.items() if isinstance(v, bool | int | float)}
    folded = {**known, **numbers}
    for node, value in folded.items():
        outside = [u for u in node.users if u not in folded]
        if outside:
            _replace(node, _literal(gm, node, value), outside)
    for node in reversed(list(gm.graph.nodes)):  # users before what they read
        if (node in known or node in constant) and node.op != "placeholder" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _replace(node: fx.Node, literal: Any, users: Iterable[fx.Node]) -> None:
    """`users` read `literal` where they read `node`."""
    for user in users:
        user.args, user.kwargs = fx.node.map_arg(
            (user.args, user.kwargs), lambda n: literal if n is node else n
        )


def specialised(
    gm: fx.GraphModule,
    decisions: Iterable[tuple[str, str]],
    is_check: Callable[[fx.Node], bool],
) -> str | None:
    """Where the folded graph `gm` holds a decision taken from another input's values, or
    None.

    After `fold_static` no read-back (`item`) or value-shaped op (`nonzero`) of the static
    inputs is left, so any left is about other inputs. draft_export decided from values:
    - a question about a symbol such an op still binds (`u2 > 0`, a branch on its value);
    - a read-back it specialised, whose symbol it replaced by the example's value (no
      binding left), unless it is only a check (`is_check`), which still runs as an assert.
    A check of the model's own (`torch._check`) is no decision: it stays a check.

    Args:
        gm: The graph after `fold_static`, before its checks are rewritten.
        decisions: (expression, where) of each decision draft_export reported.
        is_check: Whether a read-back's uses are only a check on its value.
    """
    bound: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
        if not any(t in tags for t in _VALUE_SHAPED):
            continue
        symbols = {str(s): node for s in node.meta.get("unbacked_bindings") or {}}
        if not symbols and not is_check(node):
            return f"{node.name} ({node.target}) at {_where(node)}"
        bound.update(symbols)
    for expr, where in decisions:
        hit = sorted(set(_UNBACKED.findall(expr)) & set(bound))
        if hit:
            return f"{expr} (read back by {bound[hit[0]].name}) at {where or '?'}"
    return None


def _where(node: fx.Node) -> str:
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    return lines[-1].strip() if lines else "?"


def _evaluate(
    gm: fx.GraphModule, values: Mapping[fx.Node, torch.Tensor]
) -> tuple[dict[fx.Node, Any], dict[fx.Node, Any]]:
    """The value of every node computed from static inputs and constants alone (in graph
    order): those with a static input among their ancestors, and those without. Constants:
    torch.export's lifted tensors (`torch.tensor([2])` in forward; plain attributes,
    neither parameters nor buffers) and deterministic ops without inputs (`arange`). Run on
    copies: an in-place op of the graph (`detach_`, `add_`) changes neither the caller's
    example nor the graph's own constants."""
    state = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    known: dict[fx.Node, Any] = {n: v.clone() for n, v in values.items()}
    constant: dict[fx.Node, Any] = {}  # computed from constants only: left as they are
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr":
            value = _attribute(gm, str(node.target))
            if isinstance(value, torch.Tensor) and id(value) not in state:
                constant[node] = value.clone()
            continue
        if node.op != "call_function" or not all(n in known or n in constant for n in inputs):
            continue
        if not inputs and not _deterministic(node.target):
            continue
        args, kwargs = fx.node.map_arg(
            (node.args, node.kwargs), lambda n: known[n] if n in known else constant[n]
        )
        value = node.target(*args, **kwargs)
        if any(n in known for n in inputs):
            known[node] = value
        else:
            constant[node] = value
    return known, constant


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    owner: Any = gm
    for part in target.split("."):
        owner = getattr(owner, part, None)
    return owner


def _deterministic(target: Any) -> bool:
    """An op whose value is the same on every call (no random number drawn)."""
    tags = getattr(target, "tags", None)
    return tags is not None and torch.Tag.nondeterministic_seeded not in tags


def _literal(gm: fx.GraphModule, node: fx.Node, value: Any) -> Any:
    """What the graph reads instead of `node`: a number as it is, a tensor as a constant."""
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, torch.Tensor):
        name = f"_gp_static_{node.name}"
        setattr(gm, name, value.detach().clone())
        with gm.graph.inserting_before(node):
            constant = gm.graph.get_attr(name)
        constant.meta.update(node.meta)
        return constant
    raise TraceError(
        f"node {node.name} ({node.target}) is computed from static inputs only and read by "
        f"{[u.name for u in node.users]}, but its value is a {type(value).__name__}, which "
        "cannot be a constant of the graph"
    )
