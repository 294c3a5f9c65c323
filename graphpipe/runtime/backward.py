"""Backward passes of one stage and micro-batch: whole (B), or split for zero bubble (I, W).

    full(roots, grads)                                  parameter and input gradients at once
    grads, half = input_half(roots, grads, inputs, params)   input gradients now (I) ...
    weight_half(half, on_grad)                          ... parameter gradients later (W)

The split works on the autograd graph, at any granularity. Its nodes fall in two regions:

- N, the nodes from which a stage input's gradient accumulator can be reached. The input half
  runs exactly these (`torch.autograd.grad` with the inputs as targets).
- D, every other node that leads to a parameter: its work only serves weight gradients.

Every path from a root to a parameter enters D once: at a root whose node is in D, or along an
edge p -> c from a *boundary* node p in N to a child c in D. So the weight gradient is

    sum over D-roots of (seed pushed through D) + sum over boundary edges of (p's share to c
    pushed through D),

and each term is counted once if the second stage pushes all of them through D in one engine
call, which sums at shared nodes as the whole backward would. The input half captures the
gradient at each boundary node's outputs (already computed, since p is in N). The weight half
first turns each into p's share for its D children (running p's backward for those edges
only), then makes the one call from the D-roots, with their original seeds, and the boundary
edges, with those shares. Deferring roots with their own seeds, not the gradient arriving at
their node, is what keeps a stage that sends both b and f(b) from counting f's path twice.

A boundary node's share for a D slot is read by the engine at that slot, which is exact
only when the slot has no other parent: the engine sums there everything arriving from the
node's outputs, also along other paths (through N and back into D, as a decoder's residual
`h + cross_attention(layer_norm(h))` reaches h's node both directly and through the query's
projection; or one Linear applied twice, its bias accumulator fed twice), and the weight half
pushes those paths' own shares again. A boundary node with a D slot that has several parents
is therefore called directly, which recomputes its input gradients too; such slots are the
residual stream's adds and reused weights, whose own backward is cheap or rare.

Most boundaries need no sum with others: a Linear's weight and bias are reached from its own
matmul's node alone. Such a boundary owns its region's parameters (`_claim`), and the weight
half runs it alone, from its captured gradients to those parameters, adding them into `.grad`
before the next boundary's are computed; the rest share the one call above. One call for
all held every layer's weight gradient at once: 16 MB for 4 x Linear(1024), which glibc gives
back to the system when freed and faults in again at the next micro-batch.

A stage none of whose inputs needs a gradient (a first stage) has no N and no boundary: its
weight half is its whole backward, run as one engine call that accumulates into `.grad` as
the whole backward does.

Cost: the input half does the N work, the weight half the D work; nothing runs twice except
the boundary nodes' own backward (a matmul's weight gradient is computed once, in W), and the
direct calls above. Analysing the graph is linear in its size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

import graphpipe._torch as _torch

__all__ = ["WeightHalf", "full", "input_half", "weight_half"]

Slot = tuple[Any, int]  # (autograd node, input number): where a gradient enters a node


def full(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """One backward through the stage: gradients land in `.grad` of parameters and inputs."""
    if roots:
        torch.autograd.backward(list(roots), list(grads))


@dataclass
class _Boundary:
    """A node in N with children in D: its output gradients and the D slots it feeds."""

    node: Any
    slots: list[tuple[int, Slot]]  # (index in node.next_functions, D slot)
    direct: bool = False  # call the node itself (see the module docstring)
    grads: list[torch.Tensor | None] = field(default_factory=list)  # per output of node
    own: list[int] = field(default_factory=list)  # its own parameters' indices (`_claim`)


@dataclass
class WeightHalf:
    """What the weight half needs: the D-roots with their seeds, the boundary nodes with
    their output gradients, and the parameters to accumulate into."""

    roots: list[torch.Tensor] = field(default_factory=list)
    seeds: list[torch.Tensor | None] = field(default_factory=list)
    boundaries: list[_Boundary] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


def _post_order(roots: Sequence[torch.Tensor]) -> list[Any]:
    """Autograd nodes below `roots`, children before parents (iterative, for deep graphs)."""
    order: list[Any] = []
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


def _reaches(order: list[Any], targets: set[int]) -> set[int]:
    """Ids of the nodes in `order` from which an accumulator of a tensor in `targets` is
    reachable (the accumulators included)."""
    hit: set[int] = set()
    for node in order:
        variable = _torch.accumulated(node)
        if (variable is not None and id(variable) in targets) or any(
            id(c) in hit for c, _ in node.next_functions if c is not None
        ):
            hit.add(id(node))
    return hit


def _split(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> WeightHalf:
    """Find the D-roots and the boundary nodes (see the module docstring)."""
    order = _post_order(roots)
    in_n = _reaches(order, {id(x) for x in inputs})
    to_param = _reaches(order, {id(p) for p in params})
    half = WeightHalf(params=list(params))
    for r, g in zip(roots, grads, strict=True):
        if r.grad_fn is not None and id(r.grad_fn) not in in_n and id(r.grad_fn) in to_param:
            half.roots.append(r)
            half.seeds.append(g)
    for node in order:
        if id(node) not in in_n:
            continue
        slots = [
            (k, (c, nr))
            for k, (c, nr) in enumerate(node.next_functions)
            if c is not None and id(c) not in in_n and id(c) in to_param
        ]
        if slots:
            half.boundaries.append(_Boundary(node, slots))
    _mark_direct(half.boundaries, order)
    _claim(half, in_n, to_param)
    return half


def _claim(half: WeightHalf, in_n: set[int], to_param: set[int]) -> None:
    """Give each boundary the parameters of a D region no other source reaches.

    A source is a boundary (through its D slots) or a D-root. A boundary whose region of D
    (the nodes its D slots reach) meets no other source's, and which is not `direct`, owns
    the parameters in it: no other path reaches them, so one engine call from the boundary's
    output gradients to those parameters alone is exact (`weight_half`), and their gradients
    are added and freed before the next boundary's are computed. A Linear's weight and bias
    are such a region. The other boundaries and the D-roots share one call.
    """
    owner: dict[int, int] = {}  # D node -> the first source that reached it
    shared: set[int] = set()
    reached: dict[int, set[int]] = {}  # source -> its region's parameters (indices)
    at = {id(p): k for k, p in enumerate(half.params)}
    sources = [[c for _, (c, _) in b.slots] for b in half.boundaries]
    sources += [[r.grad_fn] for r in half.roots]
    for i, starts in enumerate(sources):
        stack = list(starts)
        while stack:
            node = stack.pop()
            first = owner.setdefault(id(node), i)
            if first != i:
                shared.update((first, i))
                continue  # the first source's walk went on below it
            variable = _torch.accumulated(node)
            if variable is not None and id(variable) in at:
                reached.setdefault(i, set()).add(at[id(variable)])
            stack.extend(
                c
                for c, _ in node.next_functions
                if c is not None and id(c) not in in_n and id(c) in to_param
                if owner.get(id(c)) != i
            )
    for i, b in enumerate(half.boundaries):
        if not b.direct and i not in shared:
            b.own = sorted(reached.get(i, ()))


def _mark_direct(boundaries: list[_Boundary], order: list[Any]) -> None:
    """Mark the boundary nodes with a D slot that has more than one parent in the graph
    (see the module docstring): the engine's reading at such a slot is not theirs alone."""
    parents: dict[tuple[int, int], int] = {}
    for node in order:
        for c, nr in node.next_functions:
            if c is not None:
                parents[(id(c), nr)] = parents.get((id(c), nr), 0) + 1
    for b in boundaries:
        b.direct = any(parents[(id(c), nr)] > 1 for _, (c, nr) in b.slots)


def _outputs(node: Any) -> int:
    """How many gradients `node` takes: one per output of its forward."""
    return len(_torch.grad_inputs(node))


def input_half(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightHalf]:
    """Input gradients now (added into `inputs[i].grad`), parameter gradients deferred.

    Args:
        roots: The stage's loss and the outputs whose gradients arrived.
        grads: Their seeds (None for the loss).
        inputs: The received values that require grad.
        params: The stage's parameters.

    Returns:
        The gradients of `inputs`, and what `weight_half` needs.
    """
    if not inputs:  # no N, no boundary: the weight half is the whole backward (no analysis)
        half = WeightHalf(params=[p for p in params if p.requires_grad])
        for r, g in zip(roots, grads, strict=True):
            if r.grad_fn is not None:  # the engine skips what reaches no parameter
                half.roots.append(r)
                half.seeds.append(g)
        return [], half
    half = _split(roots, grads, inputs, [p for p in params if p.requires_grad])
    edges = [GradientEdge(b.node, k) for b in half.boundaries for k in range(_outputs(b.node))]
    if not roots:
        return [None] * len(inputs), half
    wrt: list[Any] = [*inputs, *edges]
    results = torch.autograd.grad(
        list(roots),
        wrt,
        list(grads),
        retain_graph=bool(half.roots or half.boundaries),
        allow_unused=True,
    )
    input_grads: list[torch.Tensor | None] = list(results[: len(inputs)])
    for x, g in zip(inputs, input_grads, strict=True):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g
    captured = iter(results[len(inputs) :])
    for b in half.boundaries:
        b.grads = [next(captured) for _ in range(_outputs(b.node))]
    return input_grads, half


def _shares(b: _Boundary) -> list[torch.Tensor | None]:
    """What boundary node `b` passes to each of its D slots, given its output gradients."""
    if all(g is None for g in b.grads):
        return [None] * len(b.slots)
    if b.direct:
        seeds = [
            g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
            for g, m in zip(b.grads, _torch.grad_inputs(b.node), strict=True)
        ]
        out = b.node(*seeds)
        out = out if isinstance(out, tuple) else (out,)
        return [_fit(out[k], _torch.grad_inputs(c)[nr]) for k, (c, nr) in b.slots]
    live = [(k, g) for k, g in enumerate(b.grads) if g is not None]
    return list(
        torch.autograd.grad(
            [GradientEdge(b.node, k) for k, _ in live],
            [GradientEdge(c, nr) for _, (c, nr) in b.slots],
            [g for _, g in live],
            retain_graph=True,
            allow_unused=True,
        )
    )


def _fit(grad: torch.Tensor | None, meta: _torch.GradMeta) -> torch.Tensor | None:
    """Reduce a gradient over broadcast dimensions, as the engine does between nodes."""
    if grad is None or tuple(grad.shape) == tuple(meta.shape):
        return grad
    return grad.sum_to_size(meta.shape)


def weight_half(half: WeightHalf, on_grad: Callable[[torch.Tensor], None] | None = None) -> None:
    """Parameter gradients from the deferred roots and boundary edges, added into `.grad`.

    A boundary that owns its parameters (`_claim`) runs alone: one engine call from its
    output gradients to them, added and freed before the next. The rest make one call from
    the D-roots and the other boundaries' shares. So a chain of Linears holds one weight
    gradient at a time, as the whole backward does, not every layer's at once (the host's
    allocator then reuses one block; tens of MB freed at once are given back to the system
    and faulted in again at the next micro-batch).

    Args:
        half: What `input_half` deferred.
        on_grad: Called with each parameter right after its gradient was added (the
            by-hand counterpart of a post-accumulate-grad hook).
    """
    if not half.params:
        return
    if not half.boundaries and _through_engine(half, on_grad):
        return
    # tensors a caller still holds: the received gradients, and those captured by the input
    # half (one may be an input's gradient, sent to the peer); the shares are this call's own
    held = _Held([*half.seeds, *(g for b in half.boundaries for g in b.grads)])
    owned: set[int] = set()
    for b in half.boundaries:
        owned.update(b.own)
        live = [(k, g) for k, g in enumerate(b.grads) if g is not None]
        if b.own and live:
            params = [half.params[k] for k in b.own]
            edges = [GradientEdge(b.node, k) for k, _ in live]
            # freed here, before the next layer's are computed
            arriving = [g for _, g in live]
            grads = torch.autograd.grad(edges, params, arriving, allow_unused=True)
            _add(params, grads, held, on_grad)
            del grads
    totals: dict[tuple[int, int], tuple[GradientEdge, torch.Tensor]] = {}
    for b in half.boundaries:
        if b.own:
            continue
        for (_, (c, nr)), share in zip(b.slots, _shares(b), strict=True):
            if share is None:
                continue
            key = (id(c), nr)
            total = totals[key][1] + share if key in totals else share
            totals[key] = (GradientEdge(c, nr), total)
    outputs: list[Any] = [*half.roots, *(edge for edge, _ in totals.values())]
    seeds: list[Any] = [*half.seeds, *(g for _, g in totals.values())]
    rest = [p for k, p in enumerate(half.params) if k not in owned]
    if outputs and rest:
        results = torch.autograd.grad(outputs, rest, seeds, allow_unused=True)
        _add(rest, results, held, on_grad)


def _through_engine(half: WeightHalf, on_grad: Callable[[torch.Tensor], None] | None) -> bool:
    """A weight half with no boundary (its parameters are reached from the D-roots alone: all
    of a stage none of whose inputs needs a gradient, a first stage) is a plain backward from
    those roots: run it as the engine runs the whole backward, accumulating into `.grad` as
    each gradient is made (AccumulateGrad's own rules on taking a gradient's memory), with
    `on_grad` as the parameters' post-accumulate-grad hooks for the call. One
    `torch.autograd.grad` for all would hold every parameter's gradient at once before the
    adds (issue 37: 9-12% slower than the whole backward for 8 x Linear(1024) and 32 rows,
    64% without glibc keeping freed blocks). Returns False, running nothing, when a
    parameter is not a leaf (no hook can be put on it)."""
    if not all(p.is_leaf for p in half.params):
        return False
    hooks = (
        []
        if on_grad is None
        else [p.register_post_accumulate_grad_hook(on_grad) for p in half.params]
    )
    try:
        if half.roots:
            torch.autograd.backward(list(half.roots), list(half.seeds), inputs=list(half.params))
    finally:
        for hook in hooks:
            hook.remove()
    return True


def _add(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    held: _Held,
    on_grad: Callable[[torch.Tensor], None] | None,
) -> None:
    """Add each gradient into its parameter's `.grad` (`_accumulate`), then tell `on_grad`."""
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        _accumulate(p, g, held)
        if on_grad is not None:
            on_grad(p)


class _Held:
    """The memory of tensors that must not become a parameter's `.grad` as they are: plain
    tensors by their storage (a view shares its base's), tensor subclasses (a DTensor) by
    identity."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self.storages: set[int] = set()
        self.ids: set[int] = set()
        for t in tensors:
            if t is not None:
                self.add(t)

    def add(self, t: torch.Tensor) -> None:
        if type(t) is torch.Tensor:
            self.storages.add(t.untyped_storage().data_ptr())
        else:
            self.ids.add(id(t))

    def shares(self, t: torch.Tensor) -> bool:
        """Whether `t` may share memory with a held tensor (a subclass's view: always)."""
        if type(t) is torch.Tensor:
            return t.untyped_storage().data_ptr() in self.storages
        return id(t) in self.ids or _torch.is_view(t)


def _accumulate(p: torch.Tensor, g: torch.Tensor, held: _Held) -> None:
    """Add `g` into `p.grad` in place, as autograd's own accumulation does.

    The first gradient becomes `p.grad` as it is when it shares no memory with a held
    tensor and has the parameter's strides, as AccumulateGrad takes it (a Linear's weight
    gradient is a view of the matmul's result, laid out as the weight: taken). Otherwise it
    is copied into the parameter's layout: the engine returns the very same tensor for
    every parameter a node passes one gradient to (`a + b`), and a seed or a view of one
    where a parameter's path is a view, so an in-place add, a clip or an unscale of one
    `.grad` never writes into another or into a seed.

    Args:
        p: The parameter (or the version of it the backward ran on).
        g: Its gradient from this weight half.
        held: The tensors held elsewhere; `g` is added to them once taken.
    """
    if p.grad is not None:
        p.grad.add_(g)
        return
    if held.shares(g) or (type(g) is torch.Tensor and g.stride() != p.stride()):
        g = (
            g.new_empty_strided(p.shape, p.stride()).copy_(g)
            if type(g) is torch.Tensor
            else g.clone()
        )
    held.add(g)
    p.grad = g
