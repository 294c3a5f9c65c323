"""The Schedule: for every rank, its ordered actions (`2F0` = stage 2's forward of micro-batch 0).

Plain data with a text form and a JSON round trip, read by the simulator, the dry run, the
lowering to per-rank programs and the runtime. Index letters as in `graphpipe.ir`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import NamedTuple

from graphpipe.errors import ScheduleError

__all__ = [
    "COMPUTE",
    "KINDS",
    "Action",
    "ActionKind",
    "Message",
    "Schedule",
    "channel",
    "parse_ranks",
]

# -- schedules ---------------------------------------------------------------------------------


class ActionKind(StrEnum):
    """What an action does. A `str`, so `ActionKind.F == "F"` and text forms are the letters.

    F, B, I and W compute; SF and RF send and receive activations (direction "F"), SB and RB
    gradients (direction "B"); U updates the weights. The properties are computed once per
    kind (the simulator and the generators ask them for every action).
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 -- the zero-bubble papers' name for the input-gradient half
    W = "W"
    SF = "SF"
    RF = "RF"
    SB = "SB"
    RB = "RB"
    U = "U"

    def __repr__(self) -> str:
        return repr(self.value)  # an Action's repr reads as before: kind='SF'

    @property
    def description(self) -> str:
        """What the kind does, for people."""
        return KINDS[self]

    @cached_property
    def is_compute(self) -> bool:
        """F, B, I or W."""
        return self in COMPUTE

    @cached_property
    def is_send(self) -> bool:
        """SF or SB."""
        return self in (ActionKind.SF, ActionKind.SB)

    @cached_property
    def is_receive(self) -> bool:
        """RF or RB."""
        return self in (ActionKind.RF, ActionKind.RB)

    @cached_property
    def is_message(self) -> bool:
        """A send or a receive: names a peer and a message (`Action.message`)."""
        return self.is_send or self.is_receive

    @cached_property
    def is_backward(self) -> bool:
        """B or I: a backward that reads the gradients of its outputs and sends those of its
        inputs (W, the weight half, exchanges nothing)."""
        return self in (ActionKind.B, ActionKind.I)

    @cached_property
    def ends_backward(self) -> bool:
        """B or W: the last compute of a micro-batch on its stage."""
        return self in (ActionKind.B, ActionKind.W)

    @cached_property
    def communicates(self) -> bool:
        """F, B or I: a compute that awaits messages and sends its results on
        (`graphpipe.ir.messages`)."""
        return self == ActionKind.F or self.is_backward

    @cached_property
    def direction(self) -> str | None:
        """ "F" (activations: F, SF, RF) or "B" (gradients: B, I, W, SB, RB); None for U."""
        if self == ActionKind.U:
            return None
        return "F" if self in (ActionKind.F, ActionKind.SF, ActionKind.RF) else "B"

    @property
    def counterpart(self) -> ActionKind:
        """The other end of a message: SF <-> RF, SB <-> RB.

        Raises:
            ScheduleError: not a send or receive.
        """
        if not self.is_message:
            raise ScheduleError(f"{self} is not a send or receive, so it has no counterpart")
        direction = str(self.direction)
        return ActionKind.receive(direction) if self.is_send else ActionKind.send(direction)

    @classmethod
    def send(cls, direction: str) -> ActionKind:
        """SF for direction "F", SB for "B"."""
        return cls("S" + direction)

    @classmethod
    def receive(cls, direction: str) -> ActionKind:
        """RF for direction "F", RB for "B"."""
        return cls("R" + direction)


KINDS = {
    ActionKind.F: "forward",
    ActionKind.B: "full backward (input and weight gradients)",
    ActionKind.I: "input-gradient half of the backward (zero bubble)",
    ActionKind.W: "weight-gradient half of the backward (zero bubble)",
    ActionKind.SF: "send activations to the peer stage",
    ActionKind.RF: "receive activations from the peer stage",
    ActionKind.SB: "send gradients to the peer stage",
    ActionKind.RB: "receive gradients from the peer stage",
    ActionKind.U: "optimizer update (after micro-batch j for per-micro-batch policies)",
}
COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|I|W|U)(\d+)?(?:([<>])(\d+))?$")


class Message(NamedTuple):
    """One micro-batch's values crossing one stage edge: what a send and its receive carry.

    A named tuple (cheap to make and to hash: the simulator keys every message by it).

    Attributes:
        direction: "F" (activations, along the edge) or "B" (gradients, against it).
        src: The sending stage.
        dst: The receiving stage.
        mb: The micro-batch.
    """

    direction: str
    src: int
    dst: int
    mb: int

    @property
    def edge(self) -> tuple[int, int]:
        """The stage edge it crosses, as (from stage, to stage) of the forward graph."""
        return (self.src, self.dst) if self.direction == "F" else (self.dst, self.src)

    @property
    def send(self) -> Action:
        """The sender's action (`2SF0>3`)."""
        return Action(self.src, ActionKind.send(self.direction), self.mb, self.dst)

    @property
    def receive(self) -> Action:
        """The receiver's action (`3RF0<2`)."""
        return Action(self.dst, ActionKind.receive(self.direction), self.mb, self.src)

    def __str__(self) -> str:
        what = "activations" if self.direction == "F" else "gradients"
        return f"{what} of micro-batch {self.mb} from stage {self.src} to stage {self.dst}"


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: `2F0` is stage 2's forward of micro-batch 0.

    Text forms: `{stage}{kind}{mb}` for compute (`2F0`, `2B0`, `2I0`, `2W0`), `2SF0>3` and
    `3RF0<2` for activations sent from stage 2 to stage 3 and received there, `3SB0>2` and
    `2RB0<3` for gradients going back, `2U` for a flushed optimizer update and `2U5` for an
    update after micro-batch 5. `kind` may be given as its letters; it is held as an
    `ActionKind`.
    """

    stage: int
    kind: ActionKind
    mb: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if type(kind) is not ActionKind:  # given as letters: converted once
            try:
                kind = ActionKind(kind)
            except ValueError:
                raise ScheduleError(
                    f"unknown action kind {kind!r}; known: {sorted(KINDS)}"
                ) from None
            object.__setattr__(self, "kind", kind)
        if (kind.is_compute or kind.is_message) and self.mb is None:
            raise ScheduleError(f"a {kind.description} action needs a micro-batch")
        if kind.is_message != (self.peer is not None):
            raise ScheduleError(f"{kind}: sends and receives, and only they, name a peer")

    @property
    def is_compute(self) -> bool:
        """F, B, I or W."""
        return self.kind.is_compute

    @property
    def message(self) -> Message:
        """The message a send or receive is about.

        Raises:
            ScheduleError: the action is not a send or receive.
        """
        if self.peer is None or self.mb is None:
            raise ScheduleError(f"{self} is not a send or receive, so it carries no message")
        direction = str(self.kind.direction)
        if self.kind.is_send:
            return Message(direction, self.stage, self.peer, self.mb)
        return Message(direction, self.peer, self.stage, self.mb)

    def __str__(self) -> str:
        mb = "" if self.mb is None else str(self.mb)
        if self.peer is None:
            return f"{self.stage}{self.kind}{mb}"
        arrow = ">" if self.kind.is_send else "<"
        return f"{self.stage}{self.kind}{mb}{arrow}{self.peer}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str()`.

        Raises:
            ScheduleError: `text` is not an action.

        Example:
            >>> Action.parse("2SF0>3")
            Action(stage=2, kind='SF', mb=0, peer=3)
        """
        m = _ACTION.match(text.strip())
        if not m:
            raise ScheduleError(f"not an action: {text!r} (examples: 2F0, 2SF0>3, 3RB1<4, 2U)")
        stage, letters, mb, arrow, peer = m.groups()
        kind = ActionKind(letters)
        if arrow and arrow != (">" if kind.is_send else "<"):
            raise ScheduleError(f"{text!r}: sends point '>' at their peer, receives '<'")
        return cls(
            int(stage), kind, None if mb is None else int(mb), None if peer is None else int(peer)
        )


@dataclass(frozen=True)
class Schedule:
    """For every rank, its ordered actions for one or more `step()` calls.

    Attributes:
        name: The generator that made it ("gpipe", "1f1b", "zb", "async", "2bw").
        micro_batches: M, micro-batches per `step()` call.
        ranks: ranks[r] is rank r's action list; idle ranks have none.
        calls: How many `step()` calls the lists cover. Flushed schedules restart micro-batch
            ids at 0 every call; asynchronous ones number them on (call c holds c*M..).
    """

    name: str
    micro_batches: int
    ranks: tuple[tuple[Action, ...], ...]
    calls: int = 1

    def __str__(self) -> str:
        width = max((len(str(a)) for actions in self.ranks for a in actions), default=2)
        return "\n".join(
            f"rank {r}: " + " ".join(f"{a!s:<{width}}" for a in actions)
            for r, actions in enumerate(self.ranks)
        )

    def compute_only(self) -> list[list[str]]:
        """Each rank's compute and update actions as text: the shape of a schedule at a glance."""
        return [
            [str(a) for a in actions if a.kind.is_compute or a.kind == ActionKind.U]
            for actions in self.ranks
        ]

    def to_json(self) -> str:
        """Serialise (actions as their text forms)."""
        return json.dumps(
            {
                "name": self.name,
                "micro_batches": self.micro_batches,
                "calls": self.calls,
                "ranks": [[str(a) for a in actions] for actions in self.ranks],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Inverse of `to_json`.

        Raises:
            ScheduleError: malformed text, naming the problem.
        """
        try:
            data = json.loads(text)
            return cls(
                str(data["name"]),
                int(data["micro_batches"]),
                parse_ranks(data["ranks"]),
                int(data.get("calls", 1)),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"malformed schedule: {type(exc).__name__}: {exc}") from exc


def parse_ranks(ranks: Sequence[Sequence[str] | str]) -> tuple[tuple[Action, ...], ...]:
    """Per-rank action texts (lists, or space-separated strings) -> actions."""
    return tuple(
        tuple(Action.parse(t) for t in (r.split() if isinstance(r, str) else r)) for r in ranks
    )


def channel(a: Action) -> Message:
    """The message a send or receive is about (`Action.message`)."""
    return a.message
