"""The exception hierarchy. Every error graphpipe raises on purpose is a `GraphPipeError`.

    GraphPipeError
    ├── ConfigError     bad arguments: a wrong device count, a batch that does not split, ...
    ├── TraceError      the model could not be turned into an fx graph
    ├── PlanError       no plan meets the constraints, or a plan is malformed or invalid
    ├── ScheduleError   a schedule is malformed or would deadlock
    ├── CheckpointError a checkpoint that could not be written, or is damaged on disk
    └── PipelineError   something failed while running: a timeout, a dead peer rank

Errors that find several problems at once carry them all in `problems` and list them in the
message, so one run shows everything that is wrong.

A `PipelineError` says what happened in `kind`, a `FailureKind`, and who was involved in
fields of its own (`rank`, `peers`, `stage`, `micro_batch`, and for an echo `origin`, `cause`
and `quoted`); code that reacts to a failure reads those, never the message text:

    try:
        pm.step(x, target=y)
    except PipelineError as err:
        if err.kind is FailureKind.ECHO and err.cause is FailureKind.DIED:
            print(f"rank {err.origin} died: {err.quoted}")
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any


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


class CheckpointError(GraphPipeError):
    """A checkpoint could not be written (no space, no permission: raised on every rank, the
    previous checkpoint left as it was), or one on disk is not as it was saved (a file
    missing, truncated or changed, an edited graphpipe.json, files of another save): the
    message names the file and what is wrong with it.

    Args:
        message: What went wrong, naming the checkpoint.
        problems: One line per file (or per rank, for a failed save).
        path: The checkpoint directory.
    """

    def __init__(self, message: str, problems: Sequence[str] = (), path: str = "") -> None:
        super().__init__(message, problems)
        self.message, self.path = message, path

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle with the problems and the path (an exception pickles only its `args`)."""
        return (type(self), (self.message, self.problems, self.path))


class FailureKind(enum.Enum):
    """What happened when a pipeline failed (`PipelineError.kind`).

    The value is the word a failure board post carries (`graphpipe.runtime.failures`).
    """

    DIED = "died"
    """A rank's process ended without finishing: killed, exited, or it closed its connection
    (`peers` names it). Raised by the watch on the rank that saw the connection close, and by
    `launch` for a worker that died."""
    TIMED_OUT = "timed_out"
    """A wait ran past `RuntimeConfig.timeout` (`peers` names the ranks at the end of the wait
    chain), or `launch`'s own deadline passed."""
    ECHO = "echo"
    """This rank stopped because another rank failed first: `origin` is that rank, `cause`
    its kind and `quoted` its message. Raised by the watch on every survivor."""
    RAISED = "raised"
    """An exception on a rank: a stage's code, a loss_fn, a collective's own error, or user
    code under `launch`."""
    BAD_INPUT = "bad_input"
    """A rank refused an input: a step's input only its stage could check (a `ConfigError`,
    e.g. a loss that is not a scalar), or under `launch` any ConfigError a rank raised."""
    NONFINITE = "nonfinite"
    """`nan_check` found a non-finite loss or gradient (`stage`, `micro_batch`); every rank
    raises it alike."""
    STOPPED = "stopped"
    """`launch` stopped a rank that was still running after another failed or at its
    deadline."""
    BROKEN = "broken"
    """One of graphpipe's own consistency checks failed (e.g. a gradient changed after its
    all-reduce was launched): a bug in graphpipe or in a custom weight policy."""


class PipelineError(GraphPipeError):
    """A failure while executing a pipeline: a timeout, a dead peer, a bad step input.

    Args:
        message: What went wrong, naming the ranks and the action.
        problems: One line per rank (`launch`'s summary).
        kind: What happened.
        rank: The rank that raised it (None: the launcher, or no process group).
        peers: The other ranks involved: the dead peer, the ranks a timeout blames, the
            ranks of a failed collective, or under `launch` the ranks that failed.
        stage: The stage where it happened, when known.
        micro_batch: The micro-batch, when known.
        origin: For an echo, the rank whose failure is relayed; under `launch`, the rank that
            failed first.
        cause: For an echo (or `launch`'s summary), the kind of the relayed failure.
        quoted: For an echo, the relayed message, as its rank posted it.
    """

    def __init__(
        self,
        message: str,
        problems: Sequence[str] = (),
        *,
        kind: FailureKind = FailureKind.RAISED,
        rank: int | None = None,
        peers: Sequence[int] = (),
        stage: int | None = None,
        micro_batch: int | None = None,
        origin: int | None = None,
        cause: FailureKind | None = None,
        quoted: str | None = None,
    ) -> None:
        super().__init__(message, problems)
        self.message = message
        self.kind = kind
        self.rank = rank
        self.peers: tuple[int, ...] = tuple(peers)
        self.stage, self.micro_batch = stage, micro_batch
        self.origin, self.cause, self.quoted = origin, cause, quoted

    def fields(self) -> dict[str, Any]:
        """The structured fields, as keyword arguments of the constructor."""
        return {
            "kind": self.kind,
            "rank": self.rank,
            "peers": self.peers,
            "stage": self.stage,
            "micro_batch": self.micro_batch,
            "origin": self.origin,
            "cause": self.cause,
            "quoted": self.quoted,
        }

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle with the fields (an exception pickles only its `args` by default)."""
        return (_rebuild, (type(self), self.message, self.problems, self.fields()))


def _rebuild(
    cls: type[PipelineError], message: str, problems: Sequence[str], fields: dict[str, Any]
) -> PipelineError:
    return cls(message, problems, **fields)
