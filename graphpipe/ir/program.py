"""The Program: a Schedule lowered to what each rank issues, its messages fused into groups.

A rank's program is an ordered list of compute actions (F, B, I, W, U) and communication
groups (`Comm`): every send and receive that falls between the same two compute actions,
issued together as one `batch_isend_irecv`. Text form: `0F1 [0SF1>1 0RB0<1] 0B0`;
`Program.from_json` and `parse_ops` read it back. `graphpipe.scheduling.program.lower` makes
one from a Schedule; the runtime runs it and nothing else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from graphpipe.errors import ScheduleError
from graphpipe.ir.actions import Action

__all__ = ["Comm", "Op", "Program", "parse_ops"]


@dataclass(frozen=True)
class Comm:
    """One communication group: sends and receives issued together."""

    actions: tuple[Action, ...]

    def __post_init__(self) -> None:
        bad = [str(a) for a in self.actions if not a.kind.is_message]
        if bad or not self.actions:
            raise ScheduleError(f"a communication group holds sends and receives only, got {bad}")

    def __str__(self) -> str:
        return "[" + " ".join(str(a) for a in self.actions) + "]"

    @property
    def receives(self) -> tuple[Action, ...]:
        """The group's receives."""
        return tuple(a for a in self.actions if a.kind.is_receive)


Op = Action | Comm  # a compute or update action, or a communication group


@dataclass(frozen=True)
class Program:
    """What every rank issues for one or more step() calls.

    Attributes:
        name: The schedule's generator.
        micro_batches: M.
        ranks: ranks[r] is rank r's ordered operations.
        calls: step() calls covered (as the Schedule's).
        prefetch: Whether every receive is posted in a first group (`lower`).
    """

    name: str
    micro_batches: int
    ranks: tuple[tuple[Op, ...], ...]
    calls: int = 1
    prefetch: bool = False

    def __str__(self) -> str:
        return "\n".join(
            f"rank {r}: " + " ".join(str(op) for op in ops) for r, ops in enumerate(self.ranks)
        )

    def groups(self, rank: int) -> list[Comm]:
        """Rank `rank`'s communication groups, in issue order."""
        return [op for op in self.ranks[rank] if isinstance(op, Comm)]

    def to_json(self) -> str:
        """Serialise (each rank's program as its text)."""
        return json.dumps(
            {
                "name": self.name,
                "micro_batches": self.micro_batches,
                "calls": self.calls,
                "prefetch": self.prefetch,
                "ranks": [" ".join(str(op) for op in ops) for ops in self.ranks],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Program:
        """Inverse of `to_json`.

        Raises:
            ScheduleError: malformed text, naming the problem.
        """
        try:
            data = json.loads(text)
            return cls(
                str(data["name"]),
                int(data["micro_batches"]),
                tuple(parse_ops(r) for r in data["ranks"]),
                int(data.get("calls", 1)),
                bool(data.get("prefetch", False)),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"malformed program: {type(exc).__name__}: {exc}") from exc


_TOKEN = re.compile(r"\[|\]|[^\s\[\]]+")


def parse_ops(text: str) -> tuple[Op, ...]:
    """One rank's program from its text form (`0F0 [0SF0>1 0RB0<1] 0B0`).

    Raises:
        ScheduleError: an unknown action or unbalanced brackets.

    Example:
        >>> [str(op) for op in parse_ops("0F0 [0SF0>1] 0B0")]
        ['0F0', '[0SF0>1]', '0B0']
    """
    ops: list[Op] = []
    group: list[Action] | None = None
    for token in _TOKEN.findall(text):
        if token == "[":
            if group is not None:
                raise ScheduleError(f"nested '[' in program text {text!r}")
            group = []
        elif token == "]":
            if group is None:
                raise ScheduleError(f"']' without '[' in program text {text!r}")
            ops.append(Comm(tuple(group)))
            group = None
        elif group is not None:
            group.append(Action.parse(token))
        else:
            ops.append(Action.parse(token))
    if group is not None:
        raise ScheduleError(f"unclosed '[' in program text {text!r}")
    return tuple(ops)
