"""Routes: a rank's program resolved once, so that running it looks nothing up.

A program (`graphpipe.ir.program`) names each message by its stages and micro-batch. To issue
one, the executor needs the peer's device, the tag, the stage edge and the names of the values
it carries; to run an action, its handler's label and whether it is a stage's last backward
before an update. `compiled` works all of these out once per program: a flushed schedule runs
the same program every call, so a step does only the work that depends on the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from graphpipe.errors import PipelineError
from graphpipe.ir import Action, Message, Plan
from graphpipe.ir.program import Comm, Op
from graphpipe.runtime.comm import tag_for
from graphpipe.runtime.sync import final_backwards

__all__ = ["Route", "Step", "compiled"]


@dataclass(frozen=True)
class Route:
    """One send or receive of a communication group, resolved.

    Attributes:
        action: The send or receive.
        message: What it carries (`Action.message`).
        local: Between two stages of this rank (a copy, no transport).
        edge: The index of its stage edge in `plan.edges`.
        names: The values it carries: the edge's tensors forward, its gradients backward.
        peer: The plan device of the peer stage for its micro-batch.
        tag: Its transport tag (`graphpipe.runtime.comm.tag_for`).
        what: The action as text, for errors.
    """

    action: Action
    message: Message
    local: bool
    edge: int
    names: tuple[str, ...]
    peer: int
    tag: int
    what: str


@dataclass(frozen=True)
class Step:
    """One operation of a program with what running it needs.

    Attributes:
        op: The action or communication group.
        routes: A group's messages, in its order (empty for an action).
        label: The profiler's name for an action ("graphpipe::<op>").
        text: The operation as text (spans, errors).
        awaits: An action that reads messages (wait for them first).
        final: A stage's last backward before its update (`sync.final_backwards`).
    """

    op: Op
    routes: tuple[Route, ...]
    label: str
    text: str
    awaits: bool
    final: bool


def compiled(plan: Plan, device: int, ops: Sequence[Op]) -> list[Step]:
    """The steps of plan device `device`'s operations `ops`.

    Raises:
        PipelineError: a message on a stage edge the plan does not have.
    """
    edges = {(e.src, e.dst): i for i, e in enumerate(plan.edges)}
    finals = final_backwards(ops)
    steps = []
    for i, op in enumerate(ops):
        text = str(op)
        if isinstance(op, Comm):
            routes = tuple(_route(plan, device, edges, a) for a in op.actions)
            steps.append(Step(op, routes, "", text, False, False))
            continue
        awaits = op.mb is not None and op.kind.communicates
        steps.append(Step(op, (), f"graphpipe::{text}", text, awaits, i in finals))
    return steps


def _route(plan: Plan, device: int, edges: dict[tuple[int, int], int], a: Action) -> Route:
    assert a.mb is not None and a.peer is not None
    message = a.message
    edge = edges.get(message.edge)
    if edge is None:
        src, dst = message.edge
        raise PipelineError(f"no stage edge S{src}->S{dst} in the plan")
    forward = a.kind.direction == "F"
    e = plan.edges[edge]
    peer = plan.stages[a.peer].device_for(a.mb)
    return Route(
        a,
        message,
        peer == device,
        edge,
        tuple(e.tensors if forward else e.grads),
        peer,
        tag_for(edge, not forward, a.mb),
        str(a),
    )
