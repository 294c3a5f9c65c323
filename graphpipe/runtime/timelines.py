"""Timelines: recording each action's span on every rank, and gathering them.

With `RuntimeConfig.timer` "host" (CPU's default) the executor times its own actions on
`time.perf_counter`'s clock; with "profiler" (CUDA's default) a step runs under
torch.profiler and a span is the device range of the work its action launched
(`graphpipe.runtime.profiling`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from graphpipe.ir import Timeline
from graphpipe.runtime.collectives import Collectives
from graphpipe.runtime.pieces import Place, Run
from graphpipe.runtime.profiling import profile_actions, spans_from_profiler

__all__ = ["Recorder"]


class Recorder:
    """Whether and how this rank records its actions, and the gathered timeline.

    Args:
        run: The rank's run (its executor keeps the spans; the plan and schedule name them).
        place: The rank's place (its rank and device).
        collectives: Gathers the timeline.
        timer: "host" or "profiler" (`RuntimeConfig.timer`); None: the device's default.
        record: Start recording at once (`RuntimeConfig.record`).
    """

    def __init__(
        self, run: Run, place: Place, collectives: Collectives, timer: str | None, record: bool
    ) -> None:
        self.executor, self.rank, self.device = run.executor, place.rank, place.device
        self.devices, self.schedule = run.plan.num_devices, run.schedule.name
        self.collectives = collectives
        self.timer = timer or ("profiler" if place.device.type == "cuda" else "host")
        self._on = False
        self.recording = record

    @property
    def recording(self) -> bool:
        """Whether every action's start and end are being recorded."""
        return self._on

    @recording.setter
    def recording(self, on: bool) -> None:
        self._on = on
        if self.executor is not None:  # the executor's own host ranges
            self.executor.record = on and self.timer == "host"

    @property
    def comm_seconds(self) -> dict[str, float]:
        """While recording (host timer), this rank's seconds outside compute actions since
        the last cleared `timeline()`: "wait" and "post"."""
        return {} if self.executor is None else dict(self.executor.clock)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Record the block's actions with torch.profiler when that is the timer."""
        executor = self.executor
        if executor is None or not (self._on and self.timer == "profiler"):
            yield
            return
        with profile_actions(self.device) as prof:
            yield
        executor.spans.extend(spans_from_profiler(prof, self.rank))

    def timeline(self, clear: bool = True) -> Timeline:
        """The actions every rank recorded (a collective).

        Args:
            clear: Forget the recorded actions afterwards.
        """
        executor = self.executor
        spans = [] if executor is None else executor.spans
        gathered = self.collectives.gather(spans, "the timeline")
        if clear and executor is not None:
            executor.spans = []
            executor.clock = dict.fromkeys(executor.clock, 0.0)
        every = sorted((s for part in gathered for s in part), key=lambda s: s.start)
        return Timeline(tuple(every), self.devices, "measured", self.schedule)
