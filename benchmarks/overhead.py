"""The runtime's own cost per action and per message, on emulated ranks.

    python -m benchmarks.overhead                       # about 2 minutes on 2 cores
    python -m benchmarks.overhead --profile prof/       # and each rank's cProfile, by schedule

A chain of 2N layers on N = 4 emulated ranks (`graphpipe.runtime.emulate`), M = 8
micro-batches of a 32-row batch, every schedule of issue 28 (gpipe, 1f1b, zb on one stage per
rank; interleaved, zbv on two). Two layer costs:
- zero: F = I = W = 0, so a step is nothing but the runtime's own work (posting and waiting
  for messages, Python per action, autograd's bookkeeping, the optimizer step);
- equal: F = I = W = 10 ms a layer (`benchmarks.peers`' setting), where a step is the order's
  simulated step plus that work.
Each figure is each rank's median of `--steps` steps (one warm-up, each step started by a
barrier), the slowest rank. Overhead: the measured step minus the simulated step of the same
order on the same plan (graphpipe's simulator; its links carry the emulated bytes, which take
microseconds here). Per action: the overhead over the busiest rank's compute actions (F, B,
I, W, U); per message: over its sends and receives. Both spread one total over two counts:
they bound, not split, what each costs. CPU ms: the busiest rank's median CPU time per step
(`time.process_time`, every thread of the process), which other jobs on the machine disturb
less than the wall time.

A last line times one wait handed to the watch's waiter thread (`graphpipe.runtime.failures`),
alone and as one of 32 handed over together, and a stage's backward per micro-batch in one
process: whole, graphpipe's input and weight halves, torch's (`split_backward`).

With `--host overlapped` the emulated devices run ahead of the host as a GPU does
(`graphpipe.runtime.emulate`): what is left per action is what the host cannot hide (posting
and waiting for messages, the step's start and end). The default, serial, is what a CPU run
pays.

With `--profile DIR`, every rank runs its timed steps under cProfile and writes
`DIR/<costs>-<schedule>-rank<r>.prof` (read with `python -m pstats`).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate

from benchmarks._common import log, machine
from benchmarks.peers import BATCH, WIDTH, M, chain_model, chain_plan
from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.ir import Action, Plan
from graphpipe.ir.program import Comm, Program
from graphpipe.runtime.emulate import HOST_MODES, Emulate
from graphpipe.runtime.failures import FailureBoard, Watch
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.simulate import simulate

COSTS = {"zero": (0.0, 0.0, 0.0), "equal": (0.010, 0.010, 0.010)}  # F, I, W a layer, seconds
SCHEDULES = {"gpipe": None, "1f1b": None, "zb": None, "interleaved": "loop", "zbv": "v"}
HEADERS = [
    "costs",
    "schedule",
    "stages",
    "simulated ms",
    "measured ms",
    "/ simulated",
    "CPU ms",
    "actions",
    "messages",
    "per action ms",
    "per message ms",
]


def timed_plan(ranks: int, costs: str, placement: str | None) -> Plan:
    """The chain of 2N layers cut into N (or 2N, folded `placement`) stages, with the
    setting's times (`benchmarks.peers.chain_plan`)."""
    return chain_plan(ranks, COSTS[costs], placement)


def counts(program: Program) -> tuple[int, int]:
    """The busiest rank's compute actions and messages (sends and receives)."""
    actions = max(sum(isinstance(op, Action) for op in ops) for ops in program.ranks)
    messages = max(
        sum(len(op.actions) for op in ops if isinstance(op, Comm)) for ops in program.ranks
    )
    return actions, messages


def _timed_steps(step: Any, steps: int, profile: Path | None) -> tuple[float, float]:
    """This rank's median step over `steps` steps after one warm-up, each after a barrier,
    and its median CPU seconds per step (every thread of the process: gloo's included)."""
    step()
    profiler = cProfile.Profile() if profile is not None else None
    times, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        if profiler is not None:
            profiler.enable()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if profiler is not None:
            profiler.disable()
    if profiler is not None and profile is not None:
        profiler.dump_stats(str(profile))
    return statistics.median(times), statistics.median(cpu)


def _worker(
    plans: dict[str, dict[str | None, Plan]], steps: int, profile: str | None, host: str
) -> dict[tuple[str, str], dict[str, Any]]:
    """Every setting and schedule: this rank's median step and the program's counts."""
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for costs, by_placement in plans.items():
        for name, placement in SCHEDULES.items():
            p = by_placement[placement]
            pm = gp_compile(
                chain_model(2 * dist.get_world_size()),
                x,
                loss_fn=F.mse_loss,
                optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
                schedule=name,
                plan=p,
                runtime=RuntimeConfig(timeout=120, emulate=Emulate(host=host)),
            )
            where = None
            if profile is not None:
                where = Path(profile) / f"{costs}-{name}-rank{dist.get_rank()}.prof"
            step, cpu = _timed_steps(lambda pm=pm: pm.step(x, target=y), steps, where)
            out[(costs, name)] = {"step": step, "cpu": cpu, "counts": counts(pm.program)}
    return out


def handoff() -> tuple[float, float]:
    """Seconds per wait handed to the watch's waiter thread for a call already complete:
    alone (`Watch.wait`), and as one of 32 handed over together (`Watch.wait_each`, as a
    step's sends are); the best of 5 rounds, in one process on a board with no store."""
    watch = Watch(FailureBoard(0, 1, None), 60.0)

    def done() -> int:
        return 1

    def best(run: Any, waits: int, rounds: int = 5) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) / waits)
        return min(times)

    alone = best(lambda: [watch.wait(done, [1], "a send") for _ in range(2000)], 2000)
    batch = [(done, [1], "a send")] * 32
    together = best(lambda: [watch.wait_each(batch) for _ in range(100)], 3200)
    return alone, together


def split_backward(width: int = 1024, rows: int = 32, layers: int = 4) -> dict[str, float]:
    """Microseconds per micro-batch of a stage's backward, in one process, one thread: the
    stage is `layers` x (Linear(width) + ReLU) with an input that requires grad, as the
    runtime's second chain stage. Whole: one `torch.autograd.backward`; graphpipe: its
    input and weight halves (`graphpipe.runtime.backward`); torch: `stage_backward_input`
    then `stage_backward_weight` (torch.distributed.pipelining's zero bubble). Each is
    timed in turn, forward excluded, the median of 60 rounds after 5; the gradients are
    zeroed every M rounds, so most rounds add into them, as a step's micro-batches do."""
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    from graphpipe.runtime import backward

    torch.set_num_threads(1)
    torch.manual_seed(0)
    stage = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
            for _ in range(layers)
        ]
    )
    params = list(stage.parameters())
    x0, seed = torch.randn(rows, width), torch.randn(rows, width)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_()
        return x, stage(x)

    def whole(x: torch.Tensor, y: torch.Tensor) -> None:
        backward.full([y], [seed])

    def ours(x: torch.Tensor, y: torch.Tensor) -> None:
        _, half = backward.input_half([y], [seed], [x], params)
        backward.weight_half(half)

    def theirs(x: torch.Tensor, y: torch.Tensor) -> None:
        _, groups = stage_backward_input([y], [seed], [x], iter(params))
        stage_backward_weight(iter(params), groups)

    runs = {"whole": whole, "graphpipe I+W": ours, "torch I+W": theirs}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(65):
        for name, run in runs.items():
            x, y = forward()
            start = time.perf_counter()
            run(x, y)
            if i >= 5:
                times[name].append(time.perf_counter() - start)
            if i % M == M - 1:  # a step's M micro-batches add into the gradients
                stage.zero_grad()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def rows(ranks: int, steps: int, profile: str | None, host: str = "serial") -> list[list[str]]:
    """One row per setting and schedule."""
    plans = {c: {p: timed_plan(ranks, c, p) for p in (None, "loop", "v")} for c in COSTS}
    if profile is not None:
        Path(profile).mkdir(parents=True, exist_ok=True)
    log(f"N={ranks}: {len(COSTS) * len(SCHEDULES)} runs")
    results = launch(_worker, ranks, args=(plans, steps, profile, host), timeout=900)
    table = []
    for costs in COSTS:
        for name, placement in SCHEDULES.items():
            step = max(r[(costs, name)]["step"] for r in results)
            cpu = max(r[(costs, name)]["cpu"] for r in results)
            actions, messages = results[0][(costs, name)]["counts"]
            ideal = simulate(plans[costs][placement], name).iteration_time
            over = step - ideal
            stages = f"{ranks}" if placement is None else f"{2 * ranks} ({placement})"
            table.append(
                [
                    costs,
                    name,
                    stages,
                    f"{ideal * 1e3:.1f}",
                    f"{step * 1e3:.1f}",
                    f"{step / ideal:.3f}" if ideal > 1e-3 else "-",
                    f"{cpu * 1e3:.1f}",
                    str(actions),
                    str(messages),
                    f"{over / actions * 1e3:.3f}",
                    f"{over / messages * 1e3:.3f}",
                ]
            )
    return table


def report(
    ranks: int = 4, steps: int = 10, profile: str | None = None, host: str = "serial"
) -> str:
    """The table as a markdown section."""
    alone, together = handoff()
    split = split_backward()
    return (
        "## Runtime overhead per action and per message, emulated ranks\n\n"
        f"{machine()}\n\nCommand: `python -m benchmarks.overhead --ranks {ranks} --steps "
        f"{steps}{'' if host == 'serial' else ' --host ' + host}`. A chain of 2N layers on "
        f"N = {ranks} ranks, M = {M}, batch {BATCH}; layer "
        "costs (F, I, W) in ms: "
        + ", ".join(f"{k} {tuple(round(t * 1e3) for t in v)}" for k, v in COSTS.items())
        + f"; measured: each rank's median of {steps} steps, the slowest rank. Actions and "
        "messages: the busiest rank's compute actions, and its sends and receives; per "
        "action / per message: (measured - simulated) over them; CPU ms: the busiest rank's "
        "median CPU time per step, all its threads (the emulated waits' last 0.3 ms spin "
        "included, `graphpipe.runtime.emulate.wait_until`).\n\n"
        + tabulate(rows(ranks, steps, profile, host), headers=HEADERS, tablefmt="github")
        + f"\n\nA wait handed to the watch's waiter thread (`graphpipe.runtime.failures`), "
        f"for a call already complete: {alone * 1e6:.1f} us alone, {together * 1e6:.1f} us "
        "each when 32 are handed over together (`Watch.wait_each`, as a step's sends are).\n\n"
        "A stage's backward per micro-batch (4 x (Linear(1024) + ReLU), 32 rows, an input "
        "that requires grad; one thread, `split_backward`): "
        + ", ".join(f"{k} {v:.0f} us" for k, v in split.items())
        + ".\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", default=None, help="a folder for each rank's cProfile")
    parser.add_argument("--host", choices=HOST_MODES, default="serial", help="Emulate's host")
    args = parser.parse_args(argv)
    print(report(args.ranks, args.steps, args.profile, args.host))


if __name__ == "__main__":
    main()
