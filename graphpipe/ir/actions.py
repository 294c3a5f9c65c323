"""The Schedule: for every rank, its ordered actions (`2F0` = stage 2's forward of micro-batch 0).

Plain data with a text form and a JSON round trip, read by the simulator, the dry run, the
lowering to per-rank programs and the runtime. Index letters as in `graphpipe.ir`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from graphpipe.errors import ScheduleError

__all__ = ["COMPUTE", "KINDS", "Action", "Schedule", "channel", "parse_ranks"]

# -- schedules ---------------------------------------------------------------------------------

KINDS = {
    "F": "forward",
    "B": "full backward (input and weight gradients)",
    "I": "input-gradient half of the backward (zero bubble)",
    "W": "weight-gradient half of the backward (zero bubble)",
    "SF": "send activations to the peer stage",
    "RF": "receive activations from the peer stage",
    "SB": "send gradients to the peer stage",
    "RB": "receive gradients from the peer stage",
    "U": "optimizer update (after micro-batch j for per-micro-batch policies)",
}
COMPUTE = frozenset({"F", "B", "I", "W"})
_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|I|W|U)(\d+)?(?:([<>])(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: `2F0` is stage 2's forward of micro-batch 0.

    Text forms: `{stage}{kind}{mb}` for compute (`2F0`, `2B0`, `2I0`, `2W0`), `2SF0>3` and
    `3RF0<2` for activations sent from stage 2 to stage 3 and received there, `3SB0>2` and
    `2RB0<3` for gradients going back, `2U` for a flushed optimizer update and `2U5` for an
    update after micro-batch 5.
    """

    stage: int
    kind: str
    mb: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; known: {sorted(KINDS)}")
        if (self.kind in COMPUTE or self.kind[0] in "SR") and self.mb is None:
            raise ScheduleError(f"a {KINDS[self.kind]} action needs a micro-batch")
        if (self.kind[0] in "SR") != (self.peer is not None):
            raise ScheduleError(f"{self.kind}: sends and receives, and only they, name a peer")

    @property
    def is_compute(self) -> bool:
        """F, B, I or W."""
        return self.kind in COMPUTE

    def __str__(self) -> str:
        mb = "" if self.mb is None else str(self.mb)
        if self.peer is None:
            return f"{self.stage}{self.kind}{mb}"
        arrow = ">" if self.kind[0] == "S" else "<"
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
        stage, kind, mb, arrow, peer = m.groups()
        if arrow and arrow != (">" if kind[0] == "S" else "<"):
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
            [str(a) for a in actions if a.kind in COMPUTE or a.kind == "U"]
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


def channel(a: Action) -> tuple[str, int, int, int]:
    """The message a send or receive is about: (direction, from stage, to stage, mb)."""
    assert a.peer is not None and a.mb is not None
    if a.kind == "SF":
        return ("F", a.stage, a.peer, a.mb)
    if a.kind == "RF":
        return ("F", a.peer, a.stage, a.mb)
    if a.kind == "SB":
        return ("B", a.stage, a.peer, a.mb)
    return ("B", a.peer, a.stage, a.mb)
