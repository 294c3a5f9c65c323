"""profiling: the executor's `graphpipe::` ranges under torch.profiler become Spans (CPU tier).

The CUDA side (device ranges of the launched kernels) is tested in tests/test_cuda.py.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, record_function

from graphpipe.errors import ConfigError
from graphpipe.ir import Span, Timeline
from graphpipe.runtime.profiling import _activities, profile_actions, spans_from_profiler
from graphpipe.tools.timeline import chrome_trace, timeline_svg

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

ACTIONS = ("0F0", "0F1", "0B0", "0I1", "0W1", "0U")
# spans, and the host's view by name: (time.time() before, after, work inside, range outside)
Profiled = tuple[list[Span], dict[str, tuple[float, float, float, float]]]


def _work() -> None:
    """A few milliseconds of real tensor work."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    for _ in range(8):
        a = torch.tanh(a @ a / 256)


def _profiled(names: list[str]) -> Profiled:
    """Spans of `names` run one after another, and what the host saw for each range:
    (time.time() before, time.time() after, the work's time.perf_counter() duration inside the
    range, the range's duration as seen from outside it)."""
    seen = {}
    with profile_actions(torch.device("cpu")) as prof:
        for name in names:
            wall, start = time.time(), time.perf_counter()
            with record_function(name):
                inside = time.perf_counter()
                _work()
                work = time.perf_counter() - inside
            seen[name] = (wall, time.time(), work, time.perf_counter() - start)
    return spans_from_profiler(prof, rank=2), seen


@pytest.fixture(scope="module")
def profiled() -> Profiled:
    names = [f"graphpipe::{a}" for a in ACTIONS]
    noise = ["forward", "graphpipe::0SF0>1", "graphpipe::setup", "graphpipe0F9"]
    return _profiled([names[0], noise[0], *names[1:3], *noise[1:], *names[3:]])


def test_spans_are_the_annotated_actions_in_order(profiled: Profiled) -> None:
    spans, _ = profiled
    assert [s.action for s in spans] == list(ACTIONS)
    assert {s.rank for s in spans} == {2}
    for before, after in itertools.pairwise(spans):
        assert before.start < before.end <= after.start  # ordered, no overlap


def test_ranges_without_the_prefix_or_not_actions_are_ignored(profiled: Profiled) -> None:
    spans, seen = profiled
    assert len(seen) == len(ACTIONS) + 4
    assert not {s.action for s in spans} & {"forward", "0SF0>1", "setup", "0F9"}


def test_durations_match_the_host_clock(profiled: Profiled) -> None:
    spans, seen = profiled
    for s in spans:
        wall_start, wall_end, work, outside = seen[f"graphpipe::{s.action}"]
        # nested events: the range holds the work and lies within what was timed around it
        # (orderings, which a loaded host cannot break; 0.1 ms for the two clocks' ticks)
        assert work - 1e-4 <= s.end - s.start <= outside + 1e-4
        # seconds since the Unix epoch: inside what time.time() saw around the range
        assert wall_start - 5e-3 <= s.start and s.end <= wall_end + 5e-3


def test_device_side_keeps_host_ranges_without_device_work() -> None:
    with profile_actions("cpu") as prof, record_function("graphpipe::1F0"):
        _work()
    host = spans_from_profiler(prof, 0, device_side=False)
    assert spans_from_profiler(prof, 0) == host
    assert [s.action for s in host] == ["1F0"]


def test_timeline_of_profiled_spans_renders(profiled: Profiled) -> None:
    spans, _ = profiled
    other = [Span(0, s.action, s.start, s.end) for s in spans]  # a second rank, same times
    timeline = Timeline(tuple(other + spans), 3, "measured", "profiled")
    svg = timeline_svg(timeline)
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count("<title>0F1 ") == 2 and "profiled (measured)" in svg
    trace = chrome_trace(timeline)
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in boxes) == sorted(2 * list(ACTIONS))
    assert {e["pid"] for e in boxes} == {0, 2}
    assert all(e["dur"] > 0 for e in boxes)
    assert Timeline.from_json(timeline.to_json()) == timeline


def test_an_unfinished_profiler_is_refused() -> None:
    prof = torch.profiler.profile(activities=[ProfilerActivity.CPU])
    with pytest.raises(ConfigError, match="with-block"):
        spans_from_profiler(prof, 0)  # never started
    with prof, pytest.raises(ConfigError, match="with-block"):
        spans_from_profiler(prof, 0)  # still running


def test_cuda_devices_are_profiled_on_the_device_too() -> None:
    assert _activities(torch.device("cpu")) == [ProfilerActivity.CPU]
    assert _activities(torch.device("cuda", 1)) == [ProfilerActivity.CPU, ProfilerActivity.CUDA]


@dataclass
class _Event:
    """The parts of torch's `_KinetoEvent` that spans_from_profiler reads."""

    name_: str
    kind: str  # kineto's activity type
    start: int  # ns
    end: int
    corr: int  # torch's correlation id for its ops, CUPTI's for runtime calls and GPU work
    linked: int = 0

    def name(self) -> str:
        return self.name_

    def activity_type(self) -> str:
        return self.kind

    def device_type(self) -> torch.autograd.DeviceType:
        return CUDA if self.kind in ("kernel", "gpu_memcpy", "gpu_user_annotation") else CPU

    def start_ns(self) -> int:
        return self.start

    def end_ns(self) -> int:
        return self.end

    def correlation_id(self) -> int:
        return self.corr

    def linked_correlation_id(self) -> int:
        return self.linked


def test_device_ranges_come_from_the_work_launched_inside_each_action() -> None:
    """A CUDA run as kineto reports it, times in ns: host ranges, the runtime calls that
    launch work, and the work on the device."""
    events = [
        _Event("graphpipe::0F0", "user_annotation", 1000, 2000, 1),
        _Event("aten::mm", "cpu_op", 1100, 1200, 2),
        _Event("cudaLaunchKernel", "cuda_runtime", 1150, 1160, 501),
        _Event("gemm", "kernel", 2500, 2600, 501, linked=2),
        _Event("cudaMemcpyAsync", "cuda_runtime", 1500, 1510, 502),
        _Event("Memcpy DtoD", "gpu_memcpy", 2600, 2800, 502, linked=1),
        _Event("graphpipe::0F0", "gpu_user_annotation", 2400, 2700, 503, linked=1),  # unused
        _Event("graphpipe::0B0", "user_annotation", 3000, 4000, 7),
        _Event("cudaLaunchKernel", "cuda_runtime", 3100, 3110, 504),  # autograd's thread
        _Event("gemm_backward", "kernel", 4500, 9000, 504, linked=8),
        _Event("aten::mul", "cpu_op", 3200, 3300, 8),
        _Event("mul_kernel", "kernel", 9000, 9500, 505, linked=8),  # no runtime event kept
        _Event("ncclDevKernel_SendRecv", "kernel", 4600, 4700, 506),
        _Event("cudaLaunchKernelExC", "cuda_runtime", 4500, 4510, 506),  # between actions
        _Event("graphpipe::0U", "user_annotation", 5000, 6000, 9),  # no device work
    ]
    results = SimpleNamespace(events=lambda: events)
    prof: Any = SimpleNamespace(profiler=SimpleNamespace(kineto_results=results))
    assert spans_from_profiler(prof, 1) == [
        Span(1, "0F0", 2500 / 1e9, 2800 / 1e9),
        Span(1, "0B0", 4500 / 1e9, 9500 / 1e9),
        Span(1, "0U", 5000 / 1e9, 6000 / 1e9),
    ]
    host = spans_from_profiler(prof, 1, device_side=False)
    assert [(s.action, s.start) for s in host] == [("0F0", 1e-6), ("0B0", 3e-6), ("0U", 5e-6)]
