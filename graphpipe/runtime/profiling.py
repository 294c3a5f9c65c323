"""Measured timelines from torch.profiler: the executor's `graphpipe::` ranges as Spans.

While a profiler records, the executor wraps every compute and update action in
`torch.profiler.record_function(f"graphpipe::{action}")` (outside one it does not: the ranges
cost host time per action). Under a profiler those ranges, and
the GPU work launched inside them, become a Timeline of what each rank's device did:

    with profile_actions(pm.device) as prof:
        pm.step(*inputs, target=target)
    spans = spans_from_profiler(prof, pm.rank)        # gather over ranks, then
    timeline = Timeline(tuple(spans), num_ranks, "measured")

Where the time comes from. On the CPU an action's span is its host range. On CUDA it is the
device range of the work the action launched: from the start of the first kernel, copy or
memset launched inside the host range to the end of the last one. A launch is placed in a
range by the host time of its CUDA runtime call (`cudaLaunchKernel`, ...), linked to the
device event by CUPTI's correlation id, so work launched from any thread counts, the autograd
engine's device thread (backward) included. Kineto's own `gpu_user_annotation` events are
not used: CUPTI keeps the annotation stack per thread and attributes a kernel only to the
innermost user range, so they miss the backward's kernels and give the optimizer's kernels to
`Optimizer.step#...`. An action that launched no device work keeps its host range.

Clock: kineto stamps every event, host and device (CUPTI timestamps are converted by the
profiler), in nanoseconds since the Unix epoch, the clock of `time.time_ns()`. Spans are in
seconds on that clock (float64: about 0.25 µs resolution), so the spans of all processes of
a machine line up. (The executor's own `record` spans use `time.perf_counter`: do not mix the
two in one Timeline.)
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.profiler import ProfilerActivity

from graphpipe._torch import ProfilerEvent, kineto_events
from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import Action, ActionKind, Span

__all__ = ["PREFIX", "profile_actions", "spans_from_profiler"]

PREFIX = "graphpipe::"  # record_function names of the executor's actions
_DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # kineto activity types
_LAUNCHES = frozenset({"cuda_runtime", "cuda_driver"})  # host calls that launch device work
_HOST_OPS = frozenset({"cpu_op", "user_annotation"})  # torch's own ranges

_Range = tuple[int, int, str]  # start ns, end ns, action text


@contextlib.contextmanager
def profile_actions(device: torch.device | str) -> Iterator[torch.profiler.profile]:
    """Profile the block: CPU activity, and CUDA activity when `device` is a CUDA device.

    Leaving the block synchronises the device (the profiler does), so every kernel launched
    inside is measured.

    Args:
        device: The device the pipeline runs on (`PipelinedModel.device`).

    Yields:
        The running profiler; pass it to `spans_from_profiler` after the block.

    Example:
        >>> with profile_actions("cpu") as prof:
        ...     with torch.profiler.record_function("graphpipe::0F0"):
        ...         _ = torch.ones(4) * 2
        >>> [s.action for s in spans_from_profiler(prof, rank=0)]
        ['0F0']
    """
    with torch.profiler.profile(activities=_activities(torch.device(device))) as prof:
        yield prof


def _activities(device: torch.device) -> list[ProfilerActivity]:
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


def spans_from_profiler(
    prof: torch.profiler.profile, rank: int, *, device_side: bool = True
) -> list[Span]:
    """The `graphpipe::` ranges of a finished profiler run, as Spans in seconds.

    Ranges whose name after the prefix is not a compute or update action (`2F0`, `0B3`,
    `1I2`, `1W2`, `0U`, ...) are ignored, as are ranges without the prefix. Time
    O(E log A) for E profiler events and A actions.

    Args:
        prof: A profiler whose run has ended (after its `with` block).
        rank: The rank the spans are for.
        device_side: Use the device range of each action where it launched device work
            (see the module docstring); False gives the host ranges.

    Returns:
        One Span per annotated action, ordered by start, times in seconds since the Unix
        epoch.

    Raises:
        ConfigError: the profiler has not run, or is still running.
    """
    events = _kineto_events(prof)
    ranges = _host_ranges(events)
    if device_side:
        ranges = _device_ranges(ranges, events)
    ranges.sort()
    return [Span(rank, action, start / 1e9, end / 1e9) for start, end, action in ranges]


def _kineto_events(prof: torch.profiler.profile) -> list[ProfilerEvent]:
    """The kineto events of a finished run.

    Raises:
        ConfigError: the profiler has not run, or is still running.
    """
    events = kineto_events(prof)
    if events is None:
        raise ConfigError(
            "the profiler has no results yet: call spans_from_profiler after its with-block"
        )
    return events


def _action(name: str) -> str | None:
    """The action text of a `graphpipe::` range name, or None for any other range."""
    if not name.startswith(PREFIX):
        return None
    try:
        action = Action.parse(name[len(PREFIX) :])
    except ScheduleError:
        return None
    timed = action.kind.is_compute or action.kind == ActionKind.U  # what the executor annotates
    return str(action) if timed else None


def _host_ranges(events: Sequence[ProfilerEvent]) -> list[_Range]:
    """The annotated actions' host ranges, ordered by start."""
    ranges = []
    for e in events:
        action = _action(e.name)
        if action is not None and e.on_cpu:
            ranges.append((e.start_ns, e.end_ns, action))
    return sorted(ranges)


def _device_ranges(ranges: list[_Range], events: Sequence[ProfilerEvent]) -> list[_Range]:
    """Each range replaced by the device range of the work launched inside it, if any."""
    starts = [start for start, _, _ in ranges]
    first: dict[int, int] = {}  # range index -> first device start, ns
    last: dict[int, int] = {}  # range index -> last device end, ns
    for launch, start, end in _device_work(events):
        i = bisect.bisect_right(starts, launch) - 1
        if i < 0 or launch > ranges[i][1]:
            continue  # launched outside every action (communication, set-up)
        first[i] = min(first.get(i, start), start)
        last[i] = max(last.get(i, end), end)
    return [
        (first[i], last[i], action) if i in first else (start, end, action)
        for i, (start, end, action) in enumerate(ranges)
    ]


def _device_work(events: Sequence[ProfilerEvent]) -> list[tuple[int, int, int]]:
    """Every kernel, copy and memset: (host time of its launch, device start, device end), ns.

    The launch is the runtime call with the same CUPTI correlation id; failing that, the
    torch op the work is linked to. Work with neither is left out.
    """
    calls = {e.correlation_id: e.start_ns for e in events if e.activity in _LAUNCHES}
    ops = {e.correlation_id: e.start_ns for e in events if e.activity in _HOST_OPS}
    work = []
    for e in events:
        if e.activity not in _DEVICE_WORK:
            continue
        launch = calls.get(e.correlation_id) or ops.get(e.linked_correlation_id)
        if launch:
            work.append((launch, e.start_ns, e.end_ns))
    return work
