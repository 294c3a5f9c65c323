"""Graph interleaving benchmark (simulated): the graph plan with and without folding a finer
stage DAG onto the devices, on the paper presets.

    python -m benchmarks.interleave                    # about a minute
    python -m benchmarks.interleave --models mmt --devices 8

Both plans come from the graph partitioner with replication off (interleaving folds
single-device stages; with replication on, a data-parallel plan of the whole model often
wins on these cost models and nothing is folded). The unfolded plan runs its best flushed
schedule (gpipe, 1f1b, zb); the interleaved one runs graph_interleaved when the planner
folded it. Columns: simulated step times, their ratio, the stages per device, the folding
the planner chose and its extra planning time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import replace

from tabulate import tabulate

from benchmarks._common import log, machine, ratio
from graphpipe.planning.partition import PlanConfig, partition
from graphpipe.planning.profile import profile
from graphpipe.tools.cli import best_schedule
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

MODELS = ("mmt", "dlrm", "candle_uno", "nbranch")
DEVICES = (4, 8)
HEADERS = ["model", "N", "unfolded ms", "interleaved ms", "speed-up", "stages", "folding", "plan s"]


def rows(models: Sequence[str], devices: Sequence[int]) -> list[list[str]]:
    """One row per model and device count."""
    table = []
    for name in models:
        w = load_workload(f"models.{name}", "paper")
        gm = trace(w.model, w.example_inputs, w.leaf_modules)
        m = w.micro_batches
        prof = profile(gm, w.example_inputs, w.batch_size // m)
        for n in devices:
            log(f"{name} on {n} devices")
            config = PlanConfig(devices=n, micro_batches=m, replication=False, layouts=("one",))
            plain = partition(gm, prof, config)
            start = time.perf_counter()
            folded = partition(gm, prof, replace(config, interleave=True))
            seconds = time.perf_counter() - start
            _, plain_run = best_schedule(plain, "best")
            _, folded_run = best_schedule(folded, "best")
            table.append(
                [
                    name,
                    n,
                    f"{plain_run.iteration_time * 1e3:.1f}",
                    f"{folded_run.iteration_time * 1e3:.1f}",
                    ratio(plain_run.iteration_time, folded_run.iteration_time),
                    f"{len(folded.stages)} on {n}",
                    folded.info.get("placement", "none (unfolded is faster)"),
                    f"{seconds:.2f}",
                ]
            )
    return table


def report(models: Sequence[str] = MODELS, devices: Sequence[int] = DEVICES) -> str:
    """The table as a markdown section."""
    table = tabulate(rows(models, devices), headers=HEADERS, tablefmt="github")
    return (
        "## Graph interleaving (simulated)\n\n"
        f"{machine()}\n\nCommand: `python -m benchmarks.interleave`. Paper presets, "
        "replication off; the unfolded graph plan with its best flushed schedule vs the "
        "planner's interleaving (`PlanConfig(interleave=True)`) under graph_interleaved.\n\n"
        f"{table}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
    args = parser.parse_args(argv)
    print(report(args.models, args.devices))


if __name__ == "__main__":
    main()
