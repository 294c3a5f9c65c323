"""Mesh: the planner's joint choice (graph pipeline x dp) against pure PP and pure FSDP.

    python -m benchmarks.mesh                       # the table in BENCHMARKS.md (about 3 minutes)
    python -m benchmarks.mesh --measure 8 16        # also emulate the 16-device rows (slow)
    python -m benchmarks.mesh --measure             # simulated only
    python -m benchmarks.mesh --auto 8              # mesh="auto" and two hand meshes, emulated

The model: the paper's MMT (models.mmt, 4 transformer towers x 8 layers, hidden 1024, 414 M
parameters) at a mini-batch of 2048, M = 16 micro-batches of 128 rows, op times from the A100
roofline, 3 GiB per device: a device memory where the activations of pure pipelining's
in-flight micro-batches (8 devices) or FSDP's gathered copy and unsharded gradient (both N)
do not fit. Per N (8 and 16) and device link, three plans of the same N devices, each
`plan(model, x, devices=N, micro_batches=16, replication=False, dp=...)`:

    joint      dp="auto": the planner's graph pipeline x dp (`graphpipe.planning.mesh`)
    pure PP    dp=1: the graph pipeline over N devices
    pure FSDP  dp=N: one stage, FSDP2 over N ranks (pp = 1)

each planned within the budget, or, where nothing fits, without it (marked: over budget).

Two device links: the paper's 100 Gb/s (12.5 GB/s, 10 us), simulated only, and an
NVLink-class 200 GB/s per device, simulated and measured (emulated).

Columns: the plan (pp x dp, stages, depth), the simulated step (1f1b), the simulated peak
memory per device, the binding constraint, the ratio of the step to the best step of its N
and link that fits, then the measured step and its ratio against the best measured of its N
among the plans that fit.
Binding, in this order:

    memory      over the budget; or the budget forced a slower plan (the unlimited plan's
                step is named)
    dp link     its all-gathers and reduce-scatter are at least half of its slowest stage
                (`CostModel.gather_time`, `dp_sync_time`)
    bubble      fill, drain and waits are at least a quarter of the step (1 - M x
                bottleneck / step)
    stage       else: its slowest stage (or link) per micro-batch

Measured (emulated, `graphpipe.runtime.emulate`): every rank a process whose stages wait the
plan's compute times x `time_scale` instead of computing; values crossing stages and FSDP2's
weight stand-ins (sharded over dp, all-gathered before each forward and backward,
reduce-scattered after the last backward) are the plan's bytes / `byte_scale`, over gloo on
this machine. The loopback bandwidth per rank is measured at the start with N processes
all-gathering at once (the ranks share 2 cores, so a pair's ping-pong would overstate it);
`byte_scale` = 200 GB/s / (time_scale x that bandwidth), so the emulated devices' link is
200 GB/s in their own time. The measured step is the slowest rank's median over `--steps`
steps after a warm-up, divided by `time_scale` (device seconds); "err" is it against the
simulator's step for the emulated run (compute x time_scale, the loopback link x byte_scale).
Host work (`--host`, `Emulate.host`): "overlapped" (the default) stands for a GPU, whose
host runs ahead of the device: an action takes max(its host work, its device time), so an
emulated stage's FSDP2 all-gathers (host work on gloo) overlap its compute as FSDP2's
prefetch overlaps them on a GPU, which is what the cost model assumes (max(compute,
gathers)). "serial" stands for a CPU device, whose compute is the host's: the stand-in is one
FSDP unit and its gathers run before its wait, not behind it, so a dp-heavy mesh measures
above its simulation there (pp 2 x dp 4: 1.24x, where overlapped reads 1.01x). Host memory is
unlimited, so a plan over budget runs anyway.

`--auto N` (issue 38's measured check): `plan(..., mesh="auto")` at N devices on the same
model, M, budget and 200 GB/s link (the search chooses pp x dp, the layout, the schedule and
FSDP2's resharding), and two hand meshes, pp N x dp 1 and pp N/4 x dp 4 (`HANDS`, planned as
the table plans them), each emulated on N ranks under its own schedule and resharding; per
plan its simulated step, and the measured and simulated steps of the emulated run (wall
seconds) and their ratio.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from tabulate import tabulate

from benchmarks._common import log, machine, zero_target
from benchmarks.emulated import KEEP_FREED, emulated_plan
from graphpipe._units import format_bytes
from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import PlanError
from graphpipe.ir import DEFAULT_SCHEDULE, Plan
from graphpipe.ir.cost import LinkModel
from graphpipe.planning.api import plan as gp_plan
from graphpipe.planning.partition import plan
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.emulate import HOST_MODES, Emulate
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.workload import Workload, load_workload

GIB = 1 << 30
MODEL = ("models.mmt", "paper", {"batch": 2048})  # module, preset, options
MICRO_BATCHES = 16
BUDGET = 3 * GIB
DEVICES = (8, 16)
MEASURED = (8,)
LINKS = {  # name -> the device link (pp and dp)
    "100 Gb/s": LinkModel(bandwidth=12.5e9, latency=10e-6),
    "200 GB/s": LinkModel(bandwidth=200e9, latency=10e-6),
}
EMULATED_LINK = "200 GB/s"
HOST = "overlapped"  # the emulated host work (`Emulate.host`): a GPU's, the cost model's
STRATEGIES = (("joint", "auto"), ("pure PP", 1), ("pure FSDP", -1))  # -1: dp = N
HEADERS = [
    "N",
    "link",
    "strategy",
    "pp x dp / stages / depth",
    "sim step s",
    "sim peak",
    "binding",
    "sim ratio",
    "measured s",
    "measured ratio",
    "err",
]


def workload() -> Workload:
    """The benchmark's model."""
    module, preset, options = MODEL
    return load_workload(module, preset, **options)


# -- simulated -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One strategy on N devices and a link: its plan and what the simulator says of it."""

    n: int
    link: str
    strategy: str
    plan: Plan
    step: float  # simulated seconds per step
    peak: float  # simulated peak bytes on the fullest device
    unlimited: float  # the simulated step of the same strategy planned without a budget

    @property
    def fits(self) -> bool:
        """Within the memory budget."""
        return self.peak <= BUDGET


def _plan(w: Workload, n: int, dp: int | str, link: LinkModel, budget: float | None) -> Plan:
    """One stage per device (the table's 1f1b runs no folded layout)."""
    profile = ProfileConfig(mode="roofline", preset="a100")
    return plan(
        w.model,
        w.example_inputs,
        devices=n,
        micro_batches=MICRO_BATCHES,
        dp=dp,
        replication=False,
        link=link,
        memory_budget=budget,
        profile=profile,
        layouts=("one",),
    )


def _simulated(p: Plan) -> tuple[float, float]:
    run = simulate(p, DEFAULT_SCHEDULE)
    return run.iteration_time, max(run.peak_memory, default=0.0)


def planned(w: Workload, n: int, link: str, strategy: str, dp: int | str) -> Row:
    """A strategy's plan within the budget (or without it when nothing fits), simulated."""
    unlimited = _plan(w, n, dp, LINKS[link], None)
    try:
        p = _plan(w, n, dp, LINKS[link], BUDGET)
    except PlanError:
        p = unlimited
    step, peak = _simulated(p)
    return Row(n, link, strategy, p, step, peak, _simulated(unlimited)[0])


def binding(row: Row) -> str:
    """What bound the row (see the module docstring)."""
    p, cost = row.plan, row.plan.cost_model
    if not row.fits:
        return f"memory: {format_bytes(row.peak)} over {format_bytes(BUDGET)}"
    if row.step > row.unlimited * 1.01:
        return f"memory: {row.unlimited:.3f} s unlimited"
    link = max(
        cost.gather_time(s.param_bytes) + cost.dp_sync_time(s.param_bytes) / p.micro_batches
        for s in p.stages
    )
    if link >= 0.5 * p.bottleneck:
        return f"dp link: {link / p.bottleneck:.0%} of the slowest stage"
    bubble = 1 - p.micro_batches * p.bottleneck / row.step
    if bubble >= 0.25:
        return f"bubble: {bubble:.0%} of the step"
    return f"stage: {p.bottleneck * 1e3:.1f} ms per micro-batch"


def _shape(p: Plan) -> str:
    dp = p.cost_model.dims.dp
    return f"{p.num_devices} x {dp} / {len(p.stages)} / {p.depth}"


# -- measured (emulated) ---------------------------------------------------------------------


def _gather_seconds(sizes: Sequence[int], repeats: int) -> dict[int, float]:
    """On each rank: the slowest rank's median seconds of an all-gather of each size (the
    gathered bytes), the same on every rank."""
    world, out = dist.get_world_size(), {}
    for size in sizes:
        whole = torch.zeros(size // world * world, dtype=torch.uint8)
        mine = torch.zeros(size // world, dtype=torch.uint8)
        times = []
        for i in range(repeats + 2):  # the first two set the connections up
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(whole, mine)
            if i >= 2:
                times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(slowest, dist.ReduceOp.MAX)
        out[size] = float(slowest)
    return out


def loopback() -> LinkModel:
    """On each rank: each rank's link when all ranks all-gather at once over gloo on this
    machine (ring: (n-1)/n x bytes / bandwidth + (n-1) latency), from two sizes."""
    n, small, large = dist.get_world_size(), 1 << 12, 16 << 20
    t = _gather_seconds([small, large], 5)
    share = (n - 1) / n
    bandwidth = share * (large - small) / max(t[large] - t[small], 1e-9)
    latency = max(t[small] - share * small / bandwidth, 0.0) / (n - 1)
    return LinkModel(bandwidth=bandwidth, latency=latency)


def scales(loop: LinkModel, time_scale: float, host: str = HOST) -> Emulate:
    """The scales that make the loopback a 200 GB/s link in the emulated devices' time;
    `host`: `Emulate.host` ("overlapped": a GPU's, the host running ahead of the device)."""
    byte_scale = LINKS[EMULATED_LINK].bandwidth / (time_scale * loop.bandwidth)
    return Emulate(time_scale=time_scale, byte_scale=byte_scale, host=host)


def _steps(p: Plan, emulate: Emulate, steps: int, own: bool = False) -> float:
    """On each rank: the median seconds of `steps` emulated steps of `p` (after a warm-up);
    `own`: under the plan's own schedule and FSDP2 resharding (a mesh search's choice),
    else under 1f1b and compile's resharding (the table's rows)."""
    w = workload()
    # inputs no stand-in reads: one zero, broadcast (micro-batches are views of it)
    inputs = [torch.zeros((), dtype=x.dtype).expand(x.shape) for x in w.example_inputs]
    target = zero_target(w)
    dp = p.cost_model.dims.dp
    schedule, options = DEFAULT_SCHEDULE, {}
    if own:
        schedule = p.schedule or DEFAULT_SCHEDULE
        if dp > 1:
            options["reshard_after_forward"] = p.cost_model.dp.reshard_after_forward
    pm = gp_compile(
        w.model,
        w.example_inputs,
        loss_fn=w.loss_fn,
        optimizer=functools.partial(torch.optim.SGD, lr=0.0),
        micro_batches=p.micro_batches,
        schedule=schedule,
        plan=p,
        dp=dp if dp > 1 else None,
        runtime=RuntimeConfig(timeout=600, emulate=emulate),
        **options,
    )
    pm.step(*inputs, target=target)  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pm.step(*inputs, target=target)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _emulated(
    plans: list[str], time_scale: float, steps: int, own: bool = False, host: str = HOST
) -> tuple[LinkModel, list[float]]:
    """On each rank: the loopback, then each plan's median step seconds, one after another."""
    loop = loopback()
    emulate = scales(loop, time_scale, host)
    return loop, [_steps(Plan.from_json(p), emulate, steps, own) for p in plans]


def measured(
    plans: Sequence[Plan], time_scale: float, steps: int, own: bool = False, host: str = HOST
) -> tuple[LinkModel, list[float]]:
    """The loopback of N ranks and the seconds per step of each plan emulated on them (the
    slowest rank's median), in one launch of N processes.

    Args:
        plans: Plans of the same N = pp x dp ranks.
        time_scale: Waits are the plans' compute times x this.
        steps: Timed steps per plan.
        own: Run each plan's own schedule and resharding (`_steps`).
        host: `Emulate.host`.
    """
    ranks = plans[0].num_devices * plans[0].cost_model.dims.dp
    args = ([p.to_json() for p in plans], time_scale, steps, own, host)
    # the fork server (launch's default) starts at this process's first launch, with these
    # set: its glibc reads them at start, and the ranks fork from it
    with mock.patch.dict(os.environ, KEEP_FREED):
        results = launch(_emulated, ranks, args=args, timeout=1200)
    seconds = [max(r[1][i] for r in results) for i in range(len(plans))]
    return results[0][0], seconds


# -- mesh="auto" beside hand meshes, measured (issue 38, item 4) -----------------------------

HANDS = (1, 4)  # the dp degrees of the hand meshes beside the auto choice: pp N x dp 1, N/4 x 4


def emulated_step(p: Plan, emulate: Emulate, loop: LinkModel) -> float:
    """The simulated step of `p`'s emulated run under its own schedule: compute x
    time_scale, the pp link and the dp link (where the plan names one) the loopback x
    byte_scale (`emulated_plan`)."""
    return simulate(emulated_plan(p, emulate, loop), p.schedule or DEFAULT_SCHEDULE).iteration_time


def _hand(w: Workload, n: int, dp: int, link: LinkModel) -> Plan:
    """The hand mesh of N / dp x dp as the table's rows plan it (one stage per device, 1f1b),
    within the budget or, where nothing fits, without it."""
    try:
        return _plan(w, n, dp, link, BUDGET)
    except PlanError:
        return _plan(w, n, dp, link, None)


def auto_rows(
    n: int, time_scale: float, steps: int, host: str = HOST
) -> tuple[list[list[Any]], str]:
    """mesh="auto" at N devices (M, the budget and the 200 GB/s link of the table; the search
    chooses pp x dp, the layout, the schedule and the resharding) and the hand meshes of
    `HANDS` (planned as the table's rows: `plan(..., dp=k)`, `_hand`), each emulated on N ranks
    under its own schedule and `host` mode: measured and simulated steps of the same
    emulated run."""
    w, link = workload(), LINKS[EMULATED_LINK]
    auto = gp_plan(
        w.model,
        w.example_inputs,
        devices=n,
        mesh="auto",
        micro_batches=MICRO_BATCHES,
        replication=False,
        link=link,
        memory_budget=BUDGET,
        profile=ProfileConfig(mode="roofline", preset="a100"),
    )
    hands = [_hand(w, n, k, link) for k in HANDS]
    plans = [auto, *hands]
    start = time.perf_counter()
    loop, walls = measured(plans, time_scale, steps, own=True, host=host)
    emulate = scales(loop, time_scale, host)
    note = (
        f"N={n}: loopback {loop.bandwidth / 1e9:.3f} GB/s and {loop.latency * 1e6:.0f} us per "
        f"rank, time x {time_scale:g}, bytes / {emulate.byte_scale:.1f}, host {host}, "
        f"{time.perf_counter() - start:.0f} s"
    )
    table = []
    for name, p, wall in zip(["auto", "hand", "hand"], plans, walls, strict=True):
        sim, own = emulated_step(p, emulate, loop), simulate(p, p.schedule).iteration_time
        shape = f"pp {p.num_devices} x dp {p.cost_model.dims.dp}, M {p.micro_batches}"
        table.append(
            [name, shape, f"{p.layout}/{p.schedule}", f"{own:.3f}", f"{wall:.3f}",
             f"{sim:.3f}", f"{wall / sim:.3f}"]
        )  # fmt: skip
    return table, note


AUTO_HEADERS = ["mesh", "pp x dp, M", "layout/schedule", "sim step s (200 GB/s)",
                "measured s", "simulated s", "measured / simulated"]  # fmt: skip


# -- the table -------------------------------------------------------------------------------


def _ratios(values: dict[str, float], among: Sequence[str]) -> dict[str, float]:
    best = min(values[s] for s in among) if among else float("nan")
    return {s: v / best for s, v in values.items()}


def block(
    w: Workload,
    n: int,
    link: str,
    measure: bool,
    time_scale: float,
    steps: int,
    host: str = HOST,
) -> tuple[list[list[Any]], str]:
    """The rows of N devices on one link, and a line on the emulation (if measured)."""
    rows = [planned(w, n, link, s, n if dp == -1 else dp) for s, dp in STRATEGIES]
    sims = _ratios({r.strategy: r.step for r in rows}, [r.strategy for r in rows if r.fits])
    times: dict[str, float] = {}
    errors: dict[str, float] = {}
    note = ""
    if measure:
        start = time.perf_counter()
        loop, walls = measured([r.plan for r in rows], time_scale, steps, host=host)
        emulate = scales(loop, time_scale, host)
        note = (
            f"N={n}: loopback {loop.bandwidth / 1e9:.3f} GB/s and {loop.latency * 1e6:.0f} us "
            f"per rank (all-gather of {n}), time x {time_scale:g}, bytes / "
            f"{emulate.byte_scale:.1f}"
        )
        log(f"{note} ({time.perf_counter() - start:.0f} s)")
        for r, wall in zip(rows, walls, strict=True):
            times[r.strategy] = wall / time_scale
            sim = simulate(emulated_plan(r.plan, emulate, loop), DEFAULT_SCHEDULE)
            errors[r.strategy] = wall / sim.iteration_time - 1
            log(f"  {r.strategy}: {wall:.2f} s measured, {sim.iteration_time:.2f} s simulated")
    meas = _ratios(times, [r.strategy for r in rows if r.fits]) if times else {}
    table = [
        [
            n,
            link,
            r.strategy,
            _shape(r.plan),
            f"{r.step:.3f}",
            format_bytes(r.peak) + ("" if r.fits else " (over)"),
            binding(r),
            f"{sims[r.strategy]:.2f}x",
            f"{times[r.strategy]:.3f}" if times else "-",
            f"{meas[r.strategy]:.2f}x" if times else "-",
            f"{errors[r.strategy]:+.0%}" if times else "-",
        ]
        for r in rows
    ]
    return table, note


def report(
    devices: Sequence[int] = DEVICES,
    measure: Sequence[int] = MEASURED,
    time_scale: float = 8.0,
    steps: int = 2,
    command: str = "python -m benchmarks.mesh",
    host: str = HOST,
) -> str:
    """The benchmark as a markdown section."""
    w = workload()
    table, notes = [], []
    for n in devices:
        for link in LINKS:
            log(f"N={n}, {link}")
            measure_it = link == EMULATED_LINK and n in measure
            rows, note = block(w, n, link, measure_it, time_scale, steps, host)
            table.extend(rows)
            notes.extend([note] if note else [])
    emulated = "; ".join(notes) if notes else "none (simulated only)"
    return (
        "## Mesh: graph pipeline x dp against pure PP and pure FSDP (simulated, emulated)\n\n"
        f"{machine()}\n\nCommand: `{command}`. MMT paper preset at a mini-batch of "
        f"{w.batch_size}, M = {MICRO_BATCHES}, A100 roofline, {format_bytes(BUDGET)} per "
        f"device, replication off, schedule {DEFAULT_SCHEDULE}. Ratios: step / the best step "
        "of the same N and link among the plans within the budget; measured: "
        f"emulated, device seconds, {steps} steps after a warm-up, the slowest rank's median; "
        f"err: measured over simulated for the emulated run. Emulated (host {host}): "
        f"{emulated}.\n\n"
        f"{tabulate(table, headers=HEADERS, tablefmt='github')}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
    parser.add_argument("--measure", nargs="*", type=int, default=list(MEASURED), help="N emulated")
    parser.add_argument("--time-scale", type=float, default=8.0, help="waits x plan times")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument(
        "--auto", type=int, default=None, help="mesh='auto' and two hand meshes on N ranks"
    )
    parser.add_argument(
        "--host",
        choices=HOST_MODES,
        default=HOST,
        help="emulated host work: serial (a CPU's) or overlapped (a GPU's, ahead of the device)",
    )
    args = parser.parse_args(argv)
    if args.auto:
        table, note = auto_rows(args.auto, args.time_scale, args.steps, args.host)
        print(f"{note}\n\n{tabulate(table, headers=AUTO_HEADERS, tablefmt='github')}")
        return
    print(report(args.devices, args.measure, args.time_scale, args.steps, host=args.host))


if __name__ == "__main__":
    main()
