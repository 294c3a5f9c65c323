"""The exception hierarchy. Every error graphpipe raises on purpose is a `GraphPipeError`.

    GraphPipeError
    ├── ConfigError     bad arguments: a wrong device count, a batch that does not split, ...
    ├── TraceError      the model could not be turned into an fx graph
    ├── PlanError       no plan meets the constraints, or a plan is malformed or invalid
    ├── ScheduleError   a schedule is malformed or would deadlock
    └── PipelineError   something failed while running: a timeout, a dead peer rank

Errors that find several problems at once carry them all in `problems` and list them in the
message, so one run shows everything that is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence


class GraphPipeError(Exception):
    """Base class of every error graphpipe raises on purpose.

    Args:
        message: What went wrong, naming the offending values.
        problems: Individual problems when several were found at once.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class ConfigError(GraphPipeError, ValueError):
    """An argument or configuration value is invalid."""


class TraceError(GraphPipeError):
    """The model could not be traced into an fx graph, or running the graph failed."""


class PlanError(GraphPipeError):
    """No plan meets the constraints, or a plan is malformed or invalid."""


class ScheduleError(GraphPipeError):
    """A schedule is malformed, incomplete or would deadlock."""


class PipelineError(GraphPipeError):
    """A failure while executing a pipeline: a timeout, a dead peer, a bad step input."""
