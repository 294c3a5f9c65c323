"""Backward passes of one stage and micro-batch: whole (B), or split for zero bubble (I, W).

    full(roots, grads)                            parameter and input gradients at once
    split = input_half(roots, grads, inputs, params)   input gradients now (I) ...
    weight_half(split)                            ... parameter gradients later (W)

The split works on the autograd graph, at any granularity: the "consumers" of a parameter are
the autograd nodes that feed its gradient accumulator (e.g. a matmul's backward). The input
half asks autograd for the stage inputs' gradients and for the gradient arriving at every
consumer (a `GradientEdge` on its output), keeping the graph. The weight half then runs only
the consumers' parameter branches from those gradients. Nothing is computed twice except what
a consumer's own backward recomputes for its weight gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightHalf", "full", "input_half", "weight_half"]


def full(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """One backward through the stage: gradients land in `.grad` of parameters and inputs."""
    if roots:
        torch.autograd.backward(list(roots), list(grads))


@dataclass
class WeightHalf:
    """What the weight half needs: per consumer, its edge, its gradient, its parameters."""

    parts: list[tuple[GradientEdge, torch.Tensor, list[torch.Tensor]]]


def _consumers(
    roots: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> list[tuple[GradientEdge, list[torch.Tensor]]]:
    """Where each parameter's gradient branch splits off from the rest of the backward.

    A node is "weight-only" when everything below it accumulates into `params` (a transpose
    feeding a weight's accumulator is). A consumer is a node that is not weight-only but has
    weight-only children, like the matmul of a Linear: deferring the gradient at its output
    defers exactly the weight-gradient work. A root whose whole graph is weight-only (no input
    needs a gradient) is its own consumer. Returns each consumer with the parameters below
    its weight-only children.
    """
    wanted = {id(p) for p in params}
    order = _post_order(roots)
    below: dict[int, list[torch.Tensor] | None] = {}  # weight-only node -> its parameters
    for node in order:
        variable = getattr(node, "variable", None)
        if variable is not None:
            below[id(node)] = [variable] if id(variable) in wanted else None
            continue
        kids = [below[id(c)] for c, _ in node.next_functions if c is not None]
        pure = bool(kids) and all(k is not None for k in kids)
        below[id(node)] = [p for k in kids for p in k or []] if pure else None
    found = []
    for node in order:
        if below[id(node)] is not None:
            continue
        mine = [p for c, _ in node.next_functions if c is not None for p in below[id(c)] or []]
        if mine:
            found.append((GradientEdge(node, 0), _unique(mine)))
    for r in roots:  # a root whose whole graph is weight-only is deferred whole
        if r.grad_fn is not None and below[id(r.grad_fn)]:
            found.append((get_gradient_edge(r), _unique(below[id(r.grad_fn)] or [])))
    return found


def _unique(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(p): p for p in params}.values())


def _post_order(roots: Sequence[torch.Tensor]) -> list:
    """Autograd nodes below `roots`, children before parents (iterative, for deep graphs)."""
    order: list = []
    seen: set[int] = set()
    stack = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend(
            (c, False) for c, _ in node.next_functions if c is not None and id(c) not in seen
        )
    return order


def input_half(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightHalf]:
    """Input gradients now (added into `inputs[i].grad`), parameter gradients deferred.

    Returns:
        The gradients of `inputs`, and what `weight_half` needs.
    """
    consumers = _consumers(roots, [p for p in params if p.requires_grad])
    edges = [edge for edge, _ in consumers]
    if not roots or not (inputs or edges):
        return [None] * len(inputs), WeightHalf([])
    wrt: list[Any] = [*inputs, *edges]
    results = torch.autograd.grad(
        list(roots), wrt, list(grads), retain_graph=bool(edges), allow_unused=True
    )
    input_grads: list[torch.Tensor | None] = list(results[: len(inputs)])
    for x, g in zip(inputs, input_grads, strict=True):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g
    parts = [
        (edge, g, ps)
        for (edge, ps), g in zip(consumers, results[len(inputs) :], strict=True)
        if g is not None
    ]
    return input_grads, WeightHalf(parts)


def weight_half(half: WeightHalf) -> None:
    """Parameter gradients from each consumer's gradient, added into `.grad`."""
    for edge, grad, params in half.parts:
        results = torch.autograd.grad([edge], params, [grad], retain_graph=True, allow_unused=True)
        for p, g in zip(params, results, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
