"""The communication rule: which messages a compute action awaits and which it sends.

A forward F(j) of stage s awaits the activations of j on every edge into s and sends its own
on every edge out of s; a backward (B or I) goes the other way: it awaits the gradients of j
on every edge out of s that carries some back (`StageEdge.backward_message`) and sends its
input gradients on every such edge into s. W and U exchange nothing.

    awaits(plan, Action(2, "F", 0))    # on a chain: [Message("F", 1, 2, 0)], received by 2RF0<1
    sends(plan, Action(2, "B", 0))     # [Message("B", 2, 1, 0)], sent by 2SB0>1

The generators, the lowering, the dry run, the simulator and the executor all ask these
functions; none writes the rule again. A message may repeat (an asynchronous run's calls, a
hand-made schedule): `Occurrences` numbers the repeats, the k-th send of a message pairing
with its k-th receive.
"""

from __future__ import annotations

from collections import defaultdict

from graphpipe.ir.actions import Action, ActionKind, Message
from graphpipe.ir.plan import Plan, transfer_time

__all__ = ["Occurrences", "awaits", "message_time", "sends", "with_messages"]


def awaits(plan: Plan, a: Action) -> list[Message]:
    """The messages compute action `a` waits for, in the plan's edge order (none for W, U)."""
    direction, j = _flow(a)
    return [Message(direction, peer, a.stage, j) for peer in _peers(plan, a, incoming=True)]


def sends(plan: Plan, a: Action) -> list[Message]:
    """The messages compute action `a` sends once done, in the plan's edge order."""
    direction, j = _flow(a)
    return [Message(direction, a.stage, peer, j) for peer in _peers(plan, a, incoming=False)]


def _flow(a: Action) -> tuple[str, int]:
    """The direction and micro-batch of `a`'s messages (W's and U's are never used)."""
    return a.kind.direction or "", -1 if a.mb is None else a.mb


def _peers(plan: Plan, a: Action, *, incoming: bool) -> list[int]:
    """The stages `a`'s messages come from (`incoming`) or go to: activations flow along the
    edges, gradients against them and only on edges that carry a backward message."""
    if a.kind == ActionKind.F:
        if incoming:
            return [e.src for e in plan.edges if e.dst == a.stage]
        return [e.dst for e in plan.edges if e.src == a.stage]
    if a.kind.is_backward:
        if incoming:
            return [e.dst for e in plan.edges if e.src == a.stage and e.backward_message]
        return [e.src for e in plan.edges if e.dst == a.stage and e.backward_message]
    return []


def with_messages(plan: Plan, a: Action) -> list[Action]:
    """`a` between the receives of what it awaits and the sends of what it sends."""
    return [m.receive for m in awaits(plan, a)] + [a] + [m.send for m in sends(plan, a)]


def message_time(plan: Plan, m: Message) -> float:
    """Seconds `m` takes to cross its edge (`graphpipe.ir.plan.transfer_time`)."""
    assert m.direction in ("F", "B")
    return transfer_time(plan, plan.edge(*m.edge), m.direction)


class Occurrences:
    """Numbers the repeats of each message on one side, in the order they are shown.

    The k-th send of a message pairs with its k-th receive: number the sends of a run, and
    the receives, each with its own `Occurrences` (or one per rank) to pair them.

    Example:
        >>> seen = Occurrences()
        >>> [seen.number(Action.parse(t)) for t in ("0SF0>1", "0SF0>1", "1RF0<0")]
        [0, 1, 0]
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[Message, bool], int] = defaultdict(int)

    def number(self, a: Action) -> int:
        """How many times `a`'s message was shown before on `a`'s side (send or receive)."""
        key = (a.message, a.kind.is_send)
        k = self._seen[key]
        self._seen[key] = k + 1
        return k
