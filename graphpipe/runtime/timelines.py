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
from graphpipe.runtime.profiling import profile_actions, spans_from_profiler
from graphpipe.runtime.wiring import Wiring

__all__ = ["Recorder"]


class Recorder:
    """Whether and how this rank records its actions, and the gathered timeline."""

    def __init__(self, w: Wiring, collectives: Collectives) -> None:
        self.w, self.collectives = w, collectives
        runtime = w.spec.runtime
        self.timer = runtime.timer or ("profiler" if w.device.type == "cuda" else "host")
        self._on = False
        self.recording = runtime.record

    @property
    def recording(self) -> bool:
        """Whether every action's start and end are being recorded."""
        return self._on

    @recording.setter
    def recording(self, on: bool) -> None:
        self._on = on
        if self.w.executor is not None:  # the executor's own host ranges
            self.w.executor.record = on and self.timer == "host"

    @property
    def comm_seconds(self) -> dict[str, float]:
        """While recording (host timer), this rank's seconds outside compute actions since
        the last cleared `timeline()`: "wait" and "post"."""
        return {} if self.w.executor is None else dict(self.w.executor.clock)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Record the block's actions with torch.profiler when that is the timer."""
        executor = self.w.executor
        if executor is None or not (self._on and self.timer == "profiler"):
            yield
            return
        with profile_actions(self.w.device) as prof:
            yield
        executor.spans.extend(spans_from_profiler(prof, self.w.rank))

    def timeline(self, clear: bool = True) -> Timeline:
        """The actions every rank recorded (a collective).

        Args:
            clear: Forget the recorded actions afterwards.
        """
        executor = self.w.executor
        spans = [] if executor is None else executor.spans
        gathered = self.collectives.gather(spans, "the timeline")
        if clear and executor is not None:
            executor.spans = []
            executor.clock = dict.fromkeys(executor.clock, 0.0)
        every = sorted((s for part in gathered for s in part), key=lambda s: s.start)
        return Timeline(tuple(every), self.w.plan.num_devices, "measured", self.w.schedule.name)
