"""Planner benchmark: graph vs sequential plans of the paper presets, 4 to 32 devices.

    python -m benchmarks.planner                      # the full table (about two minutes)
    python -m benchmarks.planner --models mmt --devices 8 16
    python -m benchmarks.planner --layouts            # the layout choice and its search time

For each model and device count, both partitioners plan the `paper` preset (FLOP-estimated op
times, the default cost model) and every flushed schedule (gpipe, 1f1b, zb) is simulated on
each plan; each plan keeps its best. Columns:

    bottleneck   sequential / graph predicted bottleneck (above 1: the graph plan's slowest
                 stage is faster)
    depth        stages on the longest path, graph / sequential
    search       planning seconds, graph / sequential (the graph search also runs the
                 sequential one, to keep it when it is better)
    throughput   simulated samples/s, graph / sequential, each with its best schedule
    devices      devices holding a stage, graph / sequential (a plan may leave some idle)
    bubble       the idle share of the busiest device (the one that sets the pace), graph /
                 sequential; light stages, like a fusion tail, idle more and matter less
    peak mem     the largest device's predicted peak memory, graph / sequential

Both partitioners plan one stage per device here (`layouts=("one",)`: GraphPipe's
comparison). `--layouts` prints instead, per model, what the default planner's layout choice
(`graphpipe.planning.layouts`) costs and finds: the graph plan's search seconds with one
stage per device and with every layout, the layout kept with its schedule, and the
simulated step of each layout considered. The models: a chain of 8 equal layers (Linear
512 x 512, batch 64, M = 8, FLOP costs at 10 GFLOP/s so that compute outweighs the node
overhead) and the `tiny` and `paper` presets of the branchy models.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch
from tabulate import tabulate

from benchmarks._common import log, machine, ratio
from graphpipe._units import format_bytes, format_time
from graphpipe.errors import PlanError
from graphpipe.ir import Plan
from graphpipe.planning.layouts import LAYOUTS
from graphpipe.planning.partition import PlanConfig, partition
from graphpipe.planning.profile import Profile, ProfileConfig, profile
from graphpipe.scheduling.simulate import SimResult
from graphpipe.tools.cli import best_schedule
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

MODELS = ("mmt", "dlrm", "candle_uno", "nbranch")
ONE = ("one",)  # one stage per device
LAYOUT_DEVICES = (2, 4, 8)
DEVICES = (4, 8, 16, 32)
HEADERS = [
    "model",
    "N",
    "bottleneck",
    "depth",
    "search s",
    "throughput",
    "schedules",
    "devices",
    "bubble",
    "peak mem",
]


def rows(models: Sequence[str], devices: Sequence[int]) -> list[list[str]]:
    """One table row per model and device count."""
    table = []
    for name in models:
        w = load_workload(f"models.{name}", "paper")
        gm = trace(w.model, w.example_inputs, w.leaf_modules)
        prof = profile(gm, w.example_inputs, w.batch_size // w.micro_batches)
        for n in devices:
            log(f"{name} on {n} devices")
            plans = {
                kind: partition(gm, prof, PlanConfig(n, w.micro_batches, kind, layouts=ONE))
                for kind in ("graph", "sequential")
            }
            runs = {kind: best_schedule(p, "best") for kind, p in plans.items()}
            g, s = plans["graph"], plans["sequential"]
            (g_name, g_run), (s_name, s_run) = runs["graph"], runs["sequential"]
            table.append(
                [
                    name,
                    n,
                    ratio(s.bottleneck, g.bottleneck),
                    f"{g.depth} / {s.depth}",
                    f"{g.search_time:.2f} / {s.search_time:.2f}",
                    ratio(g_run.throughput, s_run.throughput),
                    f"{g_name} / {s_name}",
                    f"{g.devices_used()} / {s.devices_used()}",
                    f"{_busiest_bubble(g, g_run):.0%} / {_busiest_bubble(s, s_run):.0%}",
                    " / ".join(format_bytes(max(r.peak_memory)) for r in (g_run, s_run)),
                ]
            )
    return table


def _busiest_bubble(plan: Plan, run: SimResult) -> float:
    return min(run.bubble[d] for stage in plan.stages for d in stage.devices)


def report(models: Sequence[str] = MODELS, devices: Sequence[int] = DEVICES) -> str:
    """The benchmark as markdown: graph vs sequential, then the layout choice."""
    table = tabulate(rows(models, devices), headers=HEADERS, tablefmt="github")
    return (
        f"## Planner: graph vs sequential (simulated)\n\n{machine()}\n\n"
        f"Command: `python -m benchmarks.planner`. Both planners at a fixed M = 8 with "
        f"unlimited memory and FLOP-estimated costs, linear in the micro-batch size: a "
        f"comparison of the two searches, not of the best each strategy can do (a deep chain "
        f"pays a bubble a user would shrink with more micro-batches). For that, see the fair "
        f"protocol below.\n\n{table}\n\n{layout_report()}"
    )


def _chain() -> tuple[torch.fx.GraphModule, Profile, int]:
    """8 equal layers, FLOP costs at 10 GFLOP/s: the layout example of the issue."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    x = torch.randn(64, 512)
    gm = trace(model, x, micro_batch_size=8)
    return gm, profile(gm, (x,), 8, ProfileConfig(mode="flops", device_flops=1e10)), 8


def _workload(name: str, preset: str) -> tuple[torch.fx.GraphModule, Profile, int]:
    w = load_workload(f"models.{name}", preset)
    gm = trace(w.model, w.example_inputs, w.leaf_modules)
    b = w.batch_size // w.micro_batches
    return gm, profile(gm, w.example_inputs, b, ProfileConfig(mode="flops")), w.micro_batches


def layout_rows(devices: Sequence[int]) -> list[list[str]]:
    """Per model and device count: search seconds with one layout and with all, the layout
    kept and each layout's simulated step (FLOP costs: the same every run)."""
    models = {"chain8": _chain}
    for name in ("nbranch", "candle_uno", "mmt"):
        for preset in ("tiny", "paper"):
            models[f"{name} {preset}"] = functools.partial(_workload, name, preset)
    table = []
    for label, make in models.items():
        gm, prof, m = make()
        for n in devices:
            log(f"{label} on {n} devices")
            try:
                one, every = (
                    partition(gm, prof, PlanConfig(n, m, replication=False, layouts=x))
                    for x in (ONE, LAYOUTS)
                )
            except PlanError as exc:  # more devices than ops
                log(f"{label} on {n} devices: {exc}")
                continue
            note = every.info.get("layouts", {})
            steps = ", ".join(
                f"{c['layout']} {format_time(c['step'])}" if c["step"] else f"{c['layout']} -"
                for c in note.get("considered", [])
            )
            kept = f"{note.get('chosen', 'one')} ({note.get('schedule', '1f1b')})"
            table.append(
                [label, n, f"{one.search_time:.2f}", f"{every.search_time:.2f}", kept, steps]
            )
    return table


def layout_report(devices: Sequence[int] = LAYOUT_DEVICES) -> str:
    """The layout choice's section (markdown)."""
    headers = ["model", "N", "search s, one", "search s, all", "kept", "simulated steps"]
    table = tabulate(layout_rows(devices), headers=headers, tablefmt="github")
    return (
        f"## Planner: the layout choice (replication off)\n\n{machine()}\n\n"
        "Command: `python -m benchmarks.planner --layouts`. The default graph planner "
        "considers one stage per device, a chain of 2N stages folded loop and v, and for a "
        "graph with branches finer stage DAGs folded onto the devices; it simulates each "
        'under its schedules and keeps the fastest. "search s, one": the graph plan with '
        '`layouts=("one",)` (the planner before the choice); "search s, all": the default. '
        "FLOP costs (chain8: 8 Linear 512 x 512 at 10 GFLOP/s, batch 64, M = 8; the models' "
        'tiny and paper presets at their own M); "-": the layout has no plan (a chain of 2N '
        "stages needs 2N units, each stage feeding the next (skips to later stages "
        "allowed), and loop a multiple of N micro-batches; folded DAGs need branches)."
        f"\n\n{table}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--devices", nargs="+", type=int, default=DEVICES)
    parser.add_argument("--layouts", action="store_true", help="the layout choice's table")
    args = parser.parse_args(argv)
    if args.layouts:
        print(layout_report(args.devices if tuple(args.devices) != DEVICES else LAYOUT_DEVICES))
        return
    print(report(args.models, args.devices))


if __name__ == "__main__":
    main()
