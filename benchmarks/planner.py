"""Planner benchmark: graph vs sequential plans of the paper presets, 4 to 32 devices.

    python -m benchmarks.planner                      # the full table (about two minutes)
    python -m benchmarks.planner --models mmt --devices 8 16

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
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tabulate import tabulate

from benchmarks._common import log, machine, ratio
from graphpipe._units import format_bytes
from graphpipe.ir import Plan
from graphpipe.planning.partition import PlanConfig, partition
from graphpipe.planning.profile import profile
from graphpipe.scheduling.simulate import SimResult
from graphpipe.tools.cli import best_schedule
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

MODELS = ("mmt", "dlrm", "candle_uno", "nbranch")
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
                kind: partition(gm, prof, PlanConfig(n, w.micro_batches, kind))
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
    """The benchmark as a markdown section."""
    table = tabulate(rows(models, devices), headers=HEADERS, tablefmt="github")
    return (
        f"## Planner: graph vs sequential (simulated)\n\n{machine()}\n\n"
        f"Command: `python -m benchmarks.planner`. Both planners at a fixed M = 8 with "
        f"unlimited memory and FLOP-estimated costs, linear in the micro-batch size: a "
        f"comparison of the two searches, not of the best each strategy can do (a deep chain "
        f"pays a bubble a user would shrink with more micro-batches). For that, see the fair "
        f"protocol below.\n\n{table}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--devices", nargs="+", type=int, default=DEVICES)
    args = parser.parse_args(argv)
    print(report(args.models, args.devices))


if __name__ == "__main__":
    main()
