"""One stage's actions on one device: host time per action against device time.

    python -m benchmarks.actions                  # CUDA when present (NCCL), else the CPU
    python -m benchmarks.actions --device cpu --width 256 --steps 3    # a quick look

On a GPU the defaults are width 4096 and 4096 rows (512 a micro-batch), on the CPU 1024 and
256 (`benchmarks.runtime`'s chain).

Issue 37, item 5: on a GPU the host launches an action's kernels and runs ahead; the pipeline
is host-bound where an action's host time exceeds its kernels' time. A chain of `--layers` x
(Linear(width) + ReLU) is compiled as one stage on one device of a world of one, M = `--m`
micro-batches of `--batch` rows, SGD, under the schedules 1f1b and zb (zb's backward split
into its input and weight halves, I and W). Per schedule, two warm-up steps, then `--steps`
steps twice:

- host: each action's host span with no profiler running (`RuntimeConfig(timer="host")`,
  the executor's `perf_counter` spans, `pm.recording`): its Python, the dispatch and the
  kernel launches; on CUDA the host moves on before the kernels end;
- device: each action's device span under torch.profiler (`graphpipe.runtime.profiling`):
  from the start of the first kernel it launched to the end of the last; on the CPU the
  host range again, with the profiler's own cost in it.

Per action kind (F, B, I, W, U): actions per step, the median host and device microseconds,
and host / device (below 1: the device is the bottleneck, the host runs ahead; above 1: the
host is). Per schedule: the median step (wall, step() returns the loss: the device is
synchronised once a step), and the device's busy share under the profiler (its spans' sum
over the profiled steps' wall).
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate

from benchmarks._common import log, machine
from benchmarks.runtime import mlp
from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.ir import Span
from graphpipe.planning.partition import plan
from graphpipe.runtime.launch import launch
from graphpipe.runtime.profiling import profile_actions, spans_from_profiler

SCHEDULES = ("1f1b", "zb")
KINDS = ("F", "B", "I", "W", "U")
HEADERS = ["schedule", "action", "per step", "host us", "device us", "host / device"]
WARMUP = 2


def kind(action: str) -> str:
    """An action's kind from its text ("0F3" -> "F", "0U" -> "U")."""
    found = re.match(r"\d+([A-Z]+)", action)
    if found is None:
        raise ValueError(f"not an action's text: {action!r}")
    return found.group(1)


def _one_schedule(
    schedule: str, device: str, width: int, layers: int, rows: int, m: int, steps: int
) -> dict[str, Any]:
    """This rank's host and device spans of `steps` steps of one schedule, and their walls."""
    model = mlp(width, layers)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    pm = gp_compile(
        model,
        x,
        loss_fn=F.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
        schedule=schedule,
        plan=plan(model, x, devices=1, micro_batches=m),
        runtime=RuntimeConfig(device=device, timer="host"),
    )
    x, y = x.to(pm.device), y.to(pm.device)
    for _ in range(WARMUP):
        pm.step(x, target=y)
    pm.timeline()  # clears
    pm.recording = True
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        pm.step(x, target=y)  # returns a float: the device is synchronised
        walls.append(time.perf_counter() - start)
    host = [s for s in pm.timeline().spans if s.rank == pm.rank]
    pm.recording = False
    profiled = []
    with profile_actions(pm.device) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            pm.step(x, target=y)
            profiled.append(time.perf_counter() - start)
    kernels = spans_from_profiler(prof, pm.rank)
    return {"host": host, "device": kernels, "walls": walls, "profiled": profiled}


def _worker(
    device: str, width: int, layers: int, rows: int, m: int, steps: int
) -> dict[str, dict[str, Any]]:
    out = {}
    for schedule in SCHEDULES:
        log(f"{schedule} on {device}: {steps} steps, twice")
        out[schedule] = _one_schedule(schedule, device, width, layers, rows, m, steps)
    return out


def _by_kind(spans: Sequence[Span]) -> dict[str, list[float]]:
    """Each action kind's span lengths, in seconds."""
    seconds: dict[str, list[float]] = {}
    for s in spans:
        seconds.setdefault(kind(s.action), []).append(s.end - s.start)
    return seconds


def table_of(result: dict[str, dict[str, Any]], steps: int) -> tuple[list[list[str]], list[str]]:
    """The table's rows, and a line per schedule on its step and the device's busy share."""
    table, lines = [], []
    for schedule, run in result.items():
        host, device = _by_kind(run["host"]), _by_kind(run["device"])
        for k in KINDS:
            if k not in host:
                continue
            h, d = statistics.median(host[k]), statistics.median(device.get(k, [0.0]))
            table.append(
                [
                    schedule,
                    k,
                    str(len(host[k]) // steps),
                    f"{h * 1e6:.0f}",
                    f"{d * 1e6:.0f}",
                    f"{h / d:.2f}" if d > 0 else "-",
                ]
            )
        wall, profiled = statistics.median(run["walls"]), sum(run["profiled"])
        busy = sum(s.end - s.start for s in run["device"]) / profiled
        lines.append(
            f"{schedule}: step {wall * 1e3:.2f} ms (median); under the profiler the device "
            f"busy {busy:.0%} of the steps"
        )
    return table, lines


def report(
    device: str, width: int = 1024, layers: int = 8, batch: int = 256, m: int = 8, steps: int = 10
) -> str:
    """The section: the command, the table and the steps."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    args = (device, width, layers, batch, m, steps)
    result = launch(_worker, 1, args=args, backend=backend, timeout=600)[0]
    table, lines = table_of(result, steps)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "the CPU"
    return (
        "## One stage's actions: host time against device time\n\n"
        f"{machine()}; device: {name}\n\n"
        f"Command: `python -m benchmarks.actions --device {device} --width {width} --layers "
        f"{layers} --batch {batch} --m {m} --steps {steps}`. One stage of {layers} x "
        f"(Linear({width}) + ReLU) on one device, M = {m} micro-batches of {batch // m} rows, "
        f"SGD; {steps} steps after {WARMUP} warm-up steps. Host: each action's host span, no "
        "profiler running; device: its kernels' span under torch.profiler (on the CPU its "
        "host range under the profiler); medians.\n\n"
        + tabulate(table, headers=HEADERS, tablefmt="github")
        + "\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda:0" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help=f"default: {default}")
    parser.add_argument("--width", type=int, default=None, help="default: GPU 4096, CPU 1024")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--batch", type=int, default=None, help="rows of a mini-batch; default: GPU 4096, CPU 256"
    )
    parser.add_argument("--m", type=int, default=8, help="micro-batches")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.width = args.width or (4096 if gpu else 1024)
    args.batch = args.batch or (4096 if gpu else 256)
    if args.batch % args.m:
        parser.error(f"--batch {args.batch} is not a multiple of --m {args.m}")
    print(report(args.device, args.width, args.layers, args.batch, args.m, args.steps))


if __name__ == "__main__":
    main()
