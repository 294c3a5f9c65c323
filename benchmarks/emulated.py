"""Emulated devices: graph vs sequential step times measured with the real runtime, 4 and 8 ranks.

    python -m benchmarks.emulated                        # the table in BENCHMARKS.md
    python -m benchmarks.emulated --configs nbranch4 --devices 4 --steps 2

Each rank is a process whose stages sleep the plan's op times instead of computing
(`graphpipe.runtime.emulate`), so 8 "devices" run on a 2-core machine without contending for
the cores; the schedule lowered to programs, the fused point-to-point groups, the replicas'
all-reduces and the optimizer steps are the real ones.

Protocol, per model and N:
1. Scale. The fair planner protocol (`benchmarks.protocol.compare`: the paper preset of the model,
   built on the meta device; op times from the A100 roofline at each micro-batch size; every
   M in 1..64 dividing B, every variant and flushed schedule; 80 GiB per device) is run on
   the paper's link (100 Gb/s). `time_scale` stretches compute so that its graph step lasts
   `--step-seconds` (default 4 s: a stage action then lasts milliseconds, well above the
   host's per-action overhead). Its ratio is the "paper" column.
2. The emulated devices. Values cross stages at their real sizes over gloo on this
   machine's loopback (measured at the start by a ping-pong), so in the devices' own time
   their link is the loopback `time_scale` times faster: a few hundred GB/s, NVLink-class,
   not the paper's 12.5 GB/s. (Shrinking time_scale to keep the paper's link would leave
   host overhead dominant; inflating messages, tried, made the host copy on contended cores:
   +480% on a 32-micro-batch gpipe run.) Both sides choose again by the fair protocol for
   these devices and this link; those choices are run.
   Without replication: a replicated stage's gradient all-reduce is host arithmetic here
   (gloo sums on the CPU; the whole of nbranch4's 810 MB of weights over 4 processes on 2
   cores took 6 s more than the link model's time, +156% on the step), which waits cannot
   stand for. Both comparisons use the protocol's variants without replication; the
   simulated fair table above has them all.
3. Host memory as device memory. A device's caching allocator hands the same blocks back
   step after step; glibc by default returns freed blocks of this size to the operating
   system (its trim threshold follows its mmap threshold), so each message of tens of MB
   arrived in new memory, every page faulted in and zeroed: measured, 13,312 page faults per
   step on the rank receiving candle_uno's 29 MB concatenation at 8 ranks, host work on 2
   cores shared by 8 processes that no device does (the sequential side then measured +10%
   over the simulator). The emulated ranks start with glibc's MALLOC_MMAP_THRESHOLD_ at 32 MiB
   and MALLOC_TRIM_THRESHOLD_ at 4 GiB (`KEEP_FREED`): no page faults on that rank, and
   errors of a few percent. (Set by `mallopt` after start-up instead, measured, the faults
   stay: 23,551.)
4. Both sides run `--steps` timed steps after a warm-up step, on the same machine, one after
   the other, each step started by a barrier; the step time is the slowest rank's median.
5. The simulator's prediction for the same runs: each side's plan with its compute times x
   `time_scale` on the loopback link, simulated under its schedule and M.

Columns: each side's choice (M / schedule / depth), the time scale, measured step seconds of
each side, the measured ratio (sequential / graph step: above 1 the graph plan is faster),
the simulated ratio of the same runs, the paper-link ratio of step 1, and each side's error
of measured over simulated step time. Where both sides chose the same plan, schedule and M
(a chain wins on the graph side too) it is measured once and the ratio is 1 by construction.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from tabulate import tabulate

from benchmarks._common import log, machine, zero_target
from benchmarks.protocol import Choice, Comparison, FairConfig, compare
from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.ir import Plan
from graphpipe.ir.cost import LinkModel
from graphpipe.runtime.emulate import Emulate
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

VLM_CPU: dict[str, Any] = dict(
    images=8, patches=64, patch_dim=48, vision_hidden=64, vision_heads=4, vision_ffn=128,
    vision_layers=4, merge=16, hidden=64, heads=4, ffn=128, layers=4, vocab=256, text=32,
    batch=16, micro_batches=4,
)  # fmt: skip
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (model, options)
    "nbranch4": ("nbranch", {"branches": 4}),
    "nbranch8": ("nbranch", {"branches": 8}),
    "mmt2": ("mmt", {"branches": 2}),
    "mmt4": ("mmt", {"branches": 4}),
    "candle_uno": ("candle_uno", {}),
    # models.vlm at the cpu preset's widths (the paper's activations, GBs a step, would be
    # host copies on 2 cores), 8 images a sample pooled 16 patches a token: the encoder over
    # 20% of the FLOPs; trained and frozen: `--configs vlm8 vlm8-frozen --devices 4`
    "vlm8": ("vlm", VLM_CPU),
    "vlm8-frozen": ("vlm", {**VLM_CPU, "frozen": True}),
}
DEFAULT_CONFIGS = ("nbranch4", "nbranch8", "mmt2", "mmt4", "candle_uno")  # BENCHMARKS.md's
DEVICES = (4, 8)
UNREPLICATED = ((False, "pipeline"), (False, "bottleneck"))  # the fair variants emulated
HEADERS = [
    "config",
    "N",
    "graph M/sched/depth",
    "seq M/sched/depth",
    "time x",
    "graph s",
    "seq s",
    "measured",
    "simulated",
    "paper",
    "graph err",
    "seq err",
]


# -- the loopback link -----------------------------------------------------------------------


def _exchange(buf: torch.Tensor) -> None:
    """One round trip of `buf` between ranks 0 and 1."""
    if dist.get_rank() == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _ping_pong(sizes: Sequence[int], repeats: int) -> dict[int, float]:
    """Seconds for one message of each size between ranks 0 and 1 (half a round trip)."""
    out = {}
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8)
        for _ in range(3):  # the first messages also set the pair's connection up
            _exchange(buf)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _exchange(buf)
            times.append((time.perf_counter() - start) / 2)
        out[size] = statistics.median(times)
    return out


def loopback_link() -> LinkModel:
    """Latency and bandwidth of gloo over this machine's loopback, from two message sizes."""
    small, large = 1024, 16 << 20
    seconds = launch(_ping_pong, 2, args=([small, large], 20), timeout=120)[0]
    bandwidth = (large - small) / max(seconds[large] - seconds[small], 1e-9)
    return LinkModel(bandwidth=bandwidth, latency=max(seconds[small] - small / bandwidth, 0.0))


# -- one measured run ------------------------------------------------------------------------


def _steps(config: str, plan_json: str, schedule: str, emulate: Emulate, steps: int) -> float:
    """On each rank: the median seconds of `steps` steps of the emulated run (after a warm-up)."""
    model, options = CONFIGS[config]
    w = load_workload(f"models.{model}", "paper", **options)
    inputs = [torch.zeros(x.shape, dtype=x.dtype) for x in w.example_inputs]
    target = zero_target(w)
    plan = Plan.from_json(plan_json)
    pm = gp_compile(
        w.model,
        w.example_inputs,
        loss_fn=w.loss_fn,
        optimizer=functools.partial(torch.optim.SGD, lr=0.0),
        micro_batches=plan.micro_batches,
        schedule=schedule,
        plan=plan,
        runtime=RuntimeConfig(timeout=600, emulate=emulate),
    )
    pm.step(*inputs, target=target)  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pm.step(*inputs, target=target)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# glibc, told at start-up to keep freed blocks of up to 32 MiB and never trim its heap: host
# memory then behaves as a device's caching allocator does (see the module docstring)
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def measured(config: str, choice: Choice, emulate: Emulate, steps: int) -> float:
    """Seconds per step of a fair choice run emulated on its devices (the slowest rank's
    median)."""
    args = (config, choice.plan.to_json(), choice.schedule, emulate, steps)
    with mock.patch.dict(os.environ, KEEP_FREED):  # spawned ranks' glibc reads it at start
        ranks = choice.plan.num_devices
        return max(launch(_steps, ranks, args=args, timeout=1800, start_method="spawn"))


# -- the simulator's prediction --------------------------------------------------------------


def emulated_plan(plan: Plan, emulate: Emulate, link: LinkModel) -> Plan:
    """`plan` as the emulation runs it: compute x time_scale on the link, bytes / byte_scale.
    Every link the plan names is the loopback: the pp link, and the dp link where it names
    one (a mesh search's plan)."""
    scaled = LinkModel(bandwidth=link.bandwidth * emulate.byte_scale, latency=link.latency)
    stages = tuple(
        dataclasses.replace(
            s,
            forward_time=s.forward_time * emulate.time_scale,
            backward_time=s.backward_time * emulate.time_scale,
            update_time=s.update_time * emulate.time_scale,
        )
        for s in plan.stages
    )
    cost = dataclasses.replace(plan.cost_model, link=scaled)
    if cost.dp.link is not None:
        cost = dataclasses.replace(cost, dp=dataclasses.replace(cost.dp, link=scaled))
    return dataclasses.replace(plan, stages=stages, cost_model=cost)


def simulated(choice: Choice, emulate: Emulate, link: LinkModel) -> float:
    """Simulated seconds per step of the emulated run of `choice`."""
    return simulate(emulated_plan(choice.plan, emulate, link), choice.schedule).iteration_time


def emulated_link(loopback: LinkModel, time_scale: float) -> LinkModel:
    """The link the emulated devices have, in their own (unscaled) time: the loopback, whose
    seconds count `time_scale` times less (values cross at their real sizes)."""
    return LinkModel(
        bandwidth=loopback.bandwidth * time_scale, latency=loopback.latency / time_scale
    )


def choices(
    gm: Any, inputs: Sequence[torch.Tensor], n: int, loopback: LinkModel, step_seconds: float
) -> tuple[Comparison, Comparison, Emulate]:
    """The paper-scale fair comparison, the fair comparison for the emulated devices, and
    the scales: `time_scale` makes the paper-scale graph step last `step_seconds`."""
    one = ("one",)  # one stage per device: the protocol this table was measured under
    paper = compare(gm, inputs, n, FairConfig(variants=UNREPLICATED, layouts=one))
    time_scale = step_seconds / paper.graph.step_time
    link = emulated_link(loopback, time_scale)
    rules = FairConfig(link=link, variants=UNREPLICATED, layouts=one)
    return paper, compare(gm, inputs, n, rules), Emulate(time_scale=time_scale)


# -- the table -------------------------------------------------------------------------------


def _same(a: Choice, b: Choice) -> bool:
    """The same run: schedule, M and stages (a chain found by both searches differs only in
    the plan's notes on how it was found)."""
    same_plan = a.plan.stages == b.plan.stages and a.micro_batches == b.micro_batches
    return a.schedule == b.schedule and same_plan


def _side(choice: Choice) -> str:
    return f"{choice.micro_batches} / {choice.schedule} / {choice.depth}"


def row(config: str, n: int, link: LinkModel, step_seconds: float, steps: int) -> list[Any]:
    """Measure one configuration: both sides' fair choices, emulated on n ranks."""
    model, options = CONFIGS[config]
    w = load_workload(f"models.{model}", "paper", **options)
    gm = trace(w.model, w.example_inputs, w.leaf_modules)
    start = time.perf_counter()
    paper, result, emulate = choices(gm, w.example_inputs, n, link, step_seconds)
    log(
        f"{config} N={n}: fair choices in {time.perf_counter() - start:.0f} s, ratio "
        f"{paper.ratio:.2f} on the paper's link, {result.ratio:.2f} on the emulated one"
    )
    times: dict[str, float] = {}
    sims: dict[str, float] = {}
    for side, choice in (("graph", result.graph), ("sequential", result.sequential)):
        sims[side] = simulated(choice, emulate, link)
        if side == "sequential" and _same(result.graph, choice):
            times[side] = times["graph"]
            continue
        start = time.perf_counter()
        times[side] = measured(config, choice, emulate, steps)
        log(
            f"  {side} {_side(choice)}: measured {times[side]:.3f} s, simulated "
            f"{sims[side]:.3f} s ({time.perf_counter() - start:.0f} s)"
        )
    return [
        config,
        n,
        _side(result.graph),
        _side(result.sequential),
        f"{emulate.time_scale:.0f}",
        f"{times['graph']:.3f}",
        f"{times['sequential']:.3f}",
        f"{times['sequential'] / times['graph']:.2f}x",
        f"{sims['sequential'] / sims['graph']:.2f}x",
        f"{paper.ratio:.2f}x",
        f"{times['graph'] / sims['graph'] - 1:+.1%}",
        f"{times['sequential'] / sims['sequential'] - 1:+.1%}",
    ]


def report(
    configs: Sequence[str] = DEFAULT_CONFIGS,
    devices: Sequence[int] = DEVICES,
    step_seconds: float = 4.0,
    steps: int = 5,
    command: str = "python -m benchmarks.emulated",
) -> str:
    """The benchmark as a markdown section."""
    link = loopback_link()
    log(f"loopback: {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us")
    table = [row(config, n, link, step_seconds, steps) for config in configs for n in devices]
    return (
        "## Emulated devices: graph vs sequential measured at 4 and 8 ranks\n\n"
        f"{machine()}\n\nCommand: `{command}`. Fair protocol (one stage per device) on the "
        "A100 roofline, 80 GiB per "
        f"device; loopback {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us; "
        f"the paper-link graph step scaled to {step_seconds} s; {steps} timed steps after a "
        "warm-up, the slowest rank's median. Ratios: sequential step / graph step (measured; "
        "simulated for the same runs; the fair protocol on the paper's link); errors: "
        "measured over simulated step.\n\n"
        f"{tabulate(table, headers=HEADERS, tablefmt='github')}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS)
    )
    parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
    parser.add_argument("--step-seconds", type=float, default=4.0, help="graph step, scaled")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    args = parser.parse_args(argv)
    print(report(args.configs, args.devices, args.step_seconds, args.steps))


if __name__ == "__main__":
    main()
