"""The Timeline: what every rank did when, simulated from a Schedule or measured by the runtime."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["Span", "Timeline"]

# -- timelines ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One action on one rank, from start to end (seconds from the start of the run)."""

    rank: int
    action: str  # the Action's text, e.g. "2F0"
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What every rank did when: simulated from a Schedule, or measured by the runtime."""

    spans: tuple[Span, ...]
    num_ranks: int
    source: str  # "simulated" or "measured"
    title: str = ""

    @property
    def makespan(self) -> float:
        """From the first start to the last end."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def to_json(self) -> str:
        """Serialise to JSON."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        """Inverse of `to_json`."""
        data = json.loads(text)
        spans = tuple(Span(**s) for s in data.pop("spans"))
        return cls(spans=spans, **data)
