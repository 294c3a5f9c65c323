"""GPU tier: the pipeline on one CUDA device with NCCL; every test is skipped without one.

    pytest -q tests/test_cuda.py

One launched rank (a world of one, NCCL) runs everything that needs a process group, so
NCCL starts once; the launch has a hard timeout. With one rank there are no messages between
stages, so the event-based waits of `Transport` are tested with a message to itself (NCCL
allows send and receive to self inside one group; torch's own `batch_isend_irecv` tests do
it). Long kernels are `torch.cuda._sleep` spins, sized from a measured clock rate.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.profiler import record_function
from zoo import dict_loss, two_branch

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.ir import Span
from graphpipe.planning.partition import plan
from graphpipe.runtime.comm import Incoming, Outgoing, Transport
from graphpipe.runtime.launch import launch
from graphpipe.runtime.profiling import profile_actions, spans_from_profiler

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(),
    reason="needs a CUDA GPU and NCCL",
)

DEVICE = "cuda:0"
M, STEPS, LR = 4, 3, 0.1
SCHEDULES = ("gpipe", "1f1b", "zb")
PROFILED = ("1f1b", "zb")  # F, B, U and F, I, W, U
TIMEOUT = 300  # seconds for the whole launch
SLEEP = 0.2  # seconds of the long kernel the waits must not block on


# -- shared pieces -------------------------------------------------------------------------


def batch(step: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s mini-batch for the two-branch model: inputs (8, 16), target (8, 4)."""
    _, (x,) = two_branch()
    gen = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(x.shape, generator=gen)
    target = torch.randn(x.shape[0], 4, generator=gen)
    return inputs.to(device), target.to(device)


def _optimizer() -> functools.partial[torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)


def reference(device: str, steps: int = STEPS) -> list[float]:
    """The same model trained in one process on `device`: gradient accumulation over the
    same M micro-batches, one optimizer step per mini-batch."""
    model, _ = two_branch()
    model.to(device)
    opt = _optimizer()(model.parameters())
    losses = []
    for step in range(steps):
        x, target = batch(step, device)
        total = torch.zeros((), device=device)
        for xj, tj in zip(x.chunk(M), target.chunk(M), strict=True):
            loss = dict_loss(model(xj), tj)
            (loss / M).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / M)
    return losses


def pipeline(schedule: str, device: str, backend: str) -> Any:
    """The two-branch model compiled for one device (one stage) of a world of one."""
    model, inputs = two_branch()
    one_device = plan(model, inputs, devices=1, micro_batches=M)
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=_optimizer(),
        schedule=schedule,
        plan=one_device,
        runtime=RuntimeConfig(device=device, backend=backend),
    )


def train(pm: Any, device: str, steps: int = STEPS) -> list[float]:
    """`steps` pipelined steps with the mini-batches on `device`."""
    return [pm.step(x, target=t) for x, t in (batch(s, device) for s in range(steps))]


def profiled_step(schedule: str, device: str, backend: str) -> dict[str, Any]:
    """One profiled step (after a warm-up step): device and host spans, and the actions."""
    pm = pipeline(schedule, device, backend)
    train(pm, "cpu", steps=1)
    x, target = batch(1)
    with profile_actions(pm.device) as prof:
        pm.step(x, target=target)
    return {
        "device": spans_from_profiler(prof, pm.rank),
        "host": spans_from_profiler(prof, pm.rank, device_side=False),
        "actions": pm.schedule.compute_only()[pm.rank],
    }


def sleep_cycles(seconds: float) -> int:
    """Cycles of `torch.cuda._sleep` that spin about `seconds` on the current device."""
    torch.cuda._sleep(1000)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 10_000_000
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds / (start.elapsed_time(end) / 1e3))


# -- in the launched rank ------------------------------------------------------------------


def _self_exchange(transport: Transport, x: torch.Tensor) -> tuple[Any, float]:
    """Send `x` to this rank and receive it: the pending receive, and the seconds `wait`
    kept the host."""
    spec = (tuple(x.shape), x.dtype)
    (pending,) = transport.exchange(
        [Outgoing([x], 0, 1, "0SF0>1")], [Incoming([spec], 0, 1, "1RF0<0")]
    )
    start = time.perf_counter()
    (received,) = transport.wait(pending)
    return received, time.perf_counter() - start


def exchange_without_host_sync() -> dict[str, Any]:
    """A message to self queued behind a long kernel: does `wait` return before it ends?"""
    device = torch.device(DEVICE)
    transport = Transport(dist.get_rank(), timeout=60.0, device=device)
    x = torch.arange(4096, dtype=torch.float32, device=device)
    _self_exchange(transport, x)  # the first exchange creates NCCL's communicators
    transport.finish_sends()
    torch.cuda.synchronize()
    cycles = sleep_cycles(SLEEP)
    torch.cuda._sleep(cycles)
    y = x * 3  # made after the long kernel, on the compute stream
    received, waited = _self_exchange(transport, y)
    busy = not torch.cuda.current_stream().query()  # still sleeping: the host did not wait
    transport.finish_sends()
    torch.cuda.synchronize()
    return {
        "busy": busy,
        "waited": waited,
        "equal": torch.equal(received, x * 3),
        "device": received.device.type,
    }


def _gpu_rank() -> dict[str, Any]:
    """Everything the tests need from a rank of a one-rank NCCL world."""
    out: dict[str, Any] = {
        "losses": {s: train(pipeline(s, DEVICE, "nccl"), "cpu") for s in SCHEDULES},
        "cuda_inputs": train(pipeline("1f1b", DEVICE, "nccl"), DEVICE),
        "profiled": {s: profiled_step(s, DEVICE, "nccl") for s in PROFILED},
        "exchange": exchange_without_host_sync(),
    }
    return out


@pytest.fixture(scope="module")
def gpu_rank() -> dict[str, Any]:
    return launch(_gpu_rank, 1, backend="nccl", timeout=TIMEOUT)[0]


# -- (a) forward and backward of a stage on the GPU ------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_on_gpu_matches_one_process_training(
    gpu_rank: dict[str, Any], schedule: str
) -> None:
    assert gpu_rank["losses"][schedule] == pytest.approx(reference(DEVICE), rel=1e-4)


# -- (b) CPU inputs go through pinned memory without blocking ---------------------------------


def test_cpu_inputs_give_the_losses_of_cuda_inputs(gpu_rank: dict[str, Any]) -> None:
    assert gpu_rank["losses"]["1f1b"] == pytest.approx(gpu_rank["cuda_inputs"], rel=1e-6)


def test_pinned_copy_keeps_the_values() -> None:
    from graphpipe.runtime.batching import to_device as _to_device

    x = torch.randn(1 << 20)
    on_gpu = _to_device(x, torch.device(DEVICE))
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), x)


# -- (c) waits on CUDA are stream dependencies, not host waits ---------------------------------


def test_wait_returns_before_the_stream_is_done(gpu_rank: dict[str, Any]) -> None:
    result = gpu_rank["exchange"]
    assert result["busy"], "the compute stream had finished when wait() returned"
    assert result["waited"] < SLEEP / 2
    assert result["equal"] and result["device"] == "cuda"


# -- (d) measured timelines from the profiler --------------------------------------------------


@pytest.mark.parametrize("schedule", PROFILED)
def test_profiled_step_has_a_device_span_per_action(
    gpu_rank: dict[str, Any], schedule: str
) -> None:
    run = gpu_rank["profiled"][schedule]
    device: list[Span] = run["device"]
    host = {s.action: s for s in run["host"]}
    assert [s.action for s in device] == run["actions"]  # one stream: program order
    for s in device:
        assert s.end > s.start, s
        assert s.start >= host[s.action].start - 1e-3, (s, host[s.action])  # one clock
    for before, after in itertools.pairwise(device):
        assert before.end <= after.start + 1e-6  # kernels of one stream do not overlap


class _SleepyBackward(torch.autograd.Function):
    """Identity whose backward spins the GPU for `cycles` (launched by autograd's thread)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cycles: int) -> torch.Tensor:
        ctx.cycles = cycles
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        torch.cuda._sleep(ctx.cycles)
        return grad, None


def test_device_spans_cover_kernels_of_any_thread() -> None:
    device = torch.device(DEVICE)
    cycles = sleep_cycles(SLEEP)
    x = torch.ones(16, device=device, requires_grad=True)
    with profile_actions(device) as prof:
        with record_function("graphpipe::0F0"):
            torch.cuda._sleep(cycles)
            y = _SleepyBackward.apply(x, cycles)
        with record_function("graphpipe::0B0"):
            y.sum().backward()
        with record_function("graphpipe::0U"):
            pass  # no device work: keeps its host range
    on_device = {s.action: s for s in spans_from_profiler(prof, 0)}
    on_host = {s.action: s for s in spans_from_profiler(prof, 0, device_side=False)}
    for action in ("0F0", "0B0"):
        assert on_device[action].end - on_device[action].start > 0.8 * SLEEP
        assert on_host[action].end - on_host[action].start < 0.5 * SLEEP
    assert on_device["0U"] == on_host["0U"]
    assert torch.equal(x.grad, torch.ones_like(x))
