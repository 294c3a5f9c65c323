"""Fair planner benchmark: graph vs sequential, each choosing M, layout and schedule under memory.

    python -m benchmarks.fair                        # 4 models x 4, 8, 16, 32 devices
    python -m benchmarks.fair --quick                # M in 1, 4, 16, 64; 8 and 32 devices
    python -m benchmarks.fair --models dlrm --devices 32 --preset h100
    python -m benchmarks.fair --layouts one           # one stage per device on both sides

The protocol is `benchmarks.protocol` (GraphPipe's, ASPLOS'25 section 6): the paper presets at
their mini-batch B; op times from the roofline of an A100 (`--preset`) at each micro-batch
size B / M; every strategy picks M (powers of two up to 64 dividing B), its layout (one stage per
device; a chain of 2N stages folded loop or v, on both sides; graph: its finer stage DAGs
folded), its variant (with and without replication, objective "pipeline" and "bottleneck")
and its schedule (one per device: the flushed gpipe, 1f1b, zb, zb2; the folded layouts': those
that run them) to minimise the simulated step within 80 GiB per device (`--budget`). Columns:

    graph, sequential   M / layout / schedule / depth / peak memory / step time of each
                        side's choice (graph: "seq" when the graph side's best plan is a chain)
    ratio               graph / sequential throughput (B fixed: sequential step / graph step)
    binding             above the paper's 1.6x, what holds the sequential plan back: memory
                        (unlimited memory would be this much faster), depth (the fill/drain
                        share of its pipeline) or all-reduce (its slowest stage's share)
    search s            seconds for the whole fair search of the row (both sides, every M,
                        layout, variant and schedule; the binding analysis excluded)
    plan s              seconds for one `partition(graph)` call at the chosen M, the
                        planner choosing its layout (item 4: target < 1 s at 32 devices)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from tabulate import tabulate
from torch import fx

from benchmarks._common import log, machine
from benchmarks.protocol import GIB, Choice, FairConfig, compare
from graphpipe._units import format_bytes, format_time
from graphpipe.planning.layouts import LAYOUTS
from graphpipe.planning.opgraph import graph_hash, op_graph
from graphpipe.planning.partition import PlanConfig, cost_model, partition_op_graph
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.tools.workload import Workload, load_workload
from graphpipe.tracing.tracer import trace

MODELS = ("mmt", "dlrm", "candle_uno", "nbranch")
DEVICES = (4, 8, 16, 32)
QUICK_DEVICES = (8, 32)
QUICK_MICRO_BATCHES = (1, 4, 16, 64)
PAPER_RATIO = 1.6
HEADERS = ["model", "N", "graph", "sequential", "ratio", "binding", "search s", "plan s"]


def _side(choice: Choice) -> str:
    kind = "" if choice.strategy == "sequential" or choice.stage_dag else " (seq)"
    return (
        f"{choice.micro_batches} / {choice.layout} / {choice.schedule} / {choice.depth} / "
        f"{format_bytes(choice.peak_memory)} / {format_time(choice.step_time)}{kind}"
    )


def _plan_time(w: Workload, gm: fx.GraphModule, n: int, m: int, rules: FairConfig) -> float:
    """Seconds of one graph-partitioner call (roofline costs, M = m, unlimited memory), the
    planner choosing among the protocol's layouts."""
    b, preset = w.batch_size // m, rules.preset
    prof = profile(gm, w.example_inputs, b, ProfileConfig(mode="roofline", preset=preset))
    config = PlanConfig(n, m, layouts=rules.layouts)
    g, cost, digest = op_graph(gm, prof), cost_model(config, b, "roofline", preset), graph_hash(gm)
    start = time.perf_counter()
    partition_op_graph(g, cost, config, digest)
    return time.perf_counter() - start


def rows(models: Sequence[str], devices: Sequence[int], config: FairConfig) -> list[list[str]]:
    """One table row per model and device count."""
    table = []
    for name in models:
        w = load_workload(f"models.{name}", "paper")
        gm = trace(w.model, w.example_inputs, w.leaf_modules)
        for n in devices:
            log(f"{name} on {n} devices")
            start = time.perf_counter()
            result = compare(gm, w.example_inputs, n, config, explain_above=PAPER_RATIO)
            log(f"  {time.perf_counter() - start:.1f} s, ratio {result.ratio:.2f}")
            plan_s = _plan_time(w, gm, n, result.graph.micro_batches, config)
            table.append(
                [
                    name,
                    n,
                    _side(result.graph),
                    _side(result.sequential),
                    f"{result.ratio:.2f}x",
                    result.binding or "-",
                    f"{result.graph.search_time:.1f}",
                    f"{plan_s:.2f}",
                ]
            )
    return table


def report(
    models: Sequence[str] = MODELS,
    devices: Sequence[int] = DEVICES,
    config: FairConfig | None = None,
    command: str = "python -m benchmarks.fair",
) -> str:
    """The benchmark as a markdown section."""
    config = config or FairConfig()
    table = tabulate(rows(models, devices, config), headers=HEADERS, tablefmt="github")
    budget = "unlimited" if config.budget is None else format_bytes(config.budget)
    return (
        f"## Fair planner protocol: graph vs sequential, each at its best M (simulated)\n\n"
        f"{machine()}\n\nCommand: `{command}`. Roofline preset {config.preset}, "
        f"{budget} per device, M in {config.micro_batches}, layouts {config.layouts}. Each side: "
        f"M / layout / schedule / depth / peak memory / step.\n\n{table}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--devices", nargs="+", type=int, default=None)
    parser.add_argument("--preset", default="a100", help="roofline device preset")
    parser.add_argument("--budget", type=float, default=80, help="GiB per device")
    parser.add_argument("--quick", action="store_true", help="fewer M values and device counts")
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, choices=LAYOUTS)
    args = parser.parse_args(argv)
    devices = args.devices or (QUICK_DEVICES if args.quick else DEVICES)
    counts = QUICK_MICRO_BATCHES if args.quick else FairConfig.micro_batches
    config = FairConfig(
        budget=args.budget * GIB,
        preset=args.preset,
        micro_batches=counts,
        layouts=tuple(args.layouts),
    )
    words = sys.argv[1:] if argv is None else list(argv)
    print(report(args.models, devices, config, " ".join(["python -m benchmarks.fair", *words])))


if __name__ == "__main__":
    main()
