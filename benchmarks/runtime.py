"""Runtime benchmark on CPU: 2 processes, one thread each, gloo on 127.0.0.1.

    python -m benchmarks.runtime            # about five minutes on 2 cores
    python -m benchmarks.runtime --paired 5 # the chain, both sides interleaved, 5 runs
    python -m benchmarks.runtime --paired 5 --keep-freed  # glibc keeps freed blocks on both
    python -m benchmarks.runtime --same-launch 5 --keep-freed  # both sides in one launch

Two models, batch 256, M = 8 micro-batches, SGD; each figure is the median step time over
20 steps after 5 warm-up steps:

- chain: 8 x (Linear(1024) + ReLU);
- towers: two towers of 4 x (Linear(768) + ReLU) on the same input, concatenated, a light
  Linear(1536 -> 768) head.

Every schedule of each side runs on the same split:
- graphpipe: 1f1b and zb on 2 stages (the chain's halves; the towers' graph plan, from op
  times measured here), interleaved and zbv on the chain's 4 quarters, 2 per rank, and on
  the towers graph_interleaved: the planner's graph interleaving (`interleave=True`; it
  falls back to 1f1b on the graph plan when folding does not simulate faster);
- torch.distributed.pipelining: Schedule1F1B on 2 stages, ScheduleInterleaved1F1B,
  ScheduleZBVZeroBubble and ScheduleDualPipeV on 4 stages, 2 per rank. Its stages only read
  their predecessor, so the towers' sequential split passes x along (tower a | tower b and
  the head; in quarters: a's halves, then b's).
- one process with one thread, the whole batch at once (the most 2 processes can reach is
  twice its rate).

For each graphpipe run, 10 more steps are recorded: the per-action compute times measured
there feed the simulator (`calibrated`, with a ping-pong of the link), so "overhead" is the
measured step over the simulated one: what the runtime adds to the schedule's own critical
path. Two readings: each stage's mean time of each kind (one simulated step), and each
recorded step replayed with its actions' own times (`replayed`), which keeps the spread of
the steps (a backward slowed by the other process delays its successors in the simulated
step as it did in the measured one). "Where the time goes" splits each rank's step into
compute (the actions' spans), wait (for messages to arrive or sends to finish), post
(issuing sends and receives) and the rest (Python between actions, splitting the batch, the
loss all-reduce). Two processes on 2 cores also slow each other's matmuls: the contention
row times the chain in one process alone and then in two processes side by side.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from benchmarks._common import log, machine, ratio
from benchmarks.emulated import KEEP_FREED
from graphpipe.compile import compile as pipeline
from graphpipe.ir import Action
from graphpipe.planning.partition import plan
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.calibrate import calibrated, measure_link, replayed

BATCH, M, WARMUP, STEPS, RECORDED = 256, 8, 5, 20, 10
GRAPHPIPE = {
    "chain": ("1f1b", "zb", "interleaved", "zbv"),
    "towers": ("1f1b", "zb", "graph_interleaved"),
}
TORCH = ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
WIDTH = {"chain": 1024, "towers": 768}


def mlp(width: int = 1024, depth: int = 8) -> nn.Sequential:
    """The chain model."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])


class TwoTowers(nn.Module):
    """x -> tower a | tower b -> concatenate -> head."""

    def __init__(self, width: int = 768, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = mlp(width, depth)
        self.b = mlp(width, depth)
        self.head = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(x), self.b(x)], dim=-1))


def _model(name: str, width: int | None = None) -> nn.Module:
    return mlp(width or WIDTH[name]) if name == "chain" else TwoTowers()


def _data(name: str, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    width = width or WIDTH[name]
    return torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)


def _timed(step: Callable[[], Any]) -> float:
    times = []
    for _ in range(WARMUP + STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


# -- graphpipe -------------------------------------------------------------------------------


def _graphpipe_plan(name: str, schedule: str, model: nn.Module, x: torch.Tensor) -> Any:
    """The split: the chain's halves or quarters by pins, the towers' graph plan."""
    if name == "towers":
        measured = {"replication": False, "profile": ProfileConfig(mode="measure")}
        return {**measured, "interleave": schedule == "graph_interleaved"}
    if schedule in ("interleaved", "zbv"):
        pins = {str(i): i // 2 for i in range(8)}
        placement = "loop" if schedule == "interleaved" else "v"
        return {
            "plan": plan(
                model,
                x,
                devices=2,
                micro_batches=M,
                pins=pins,
                virtual_stages=2,
                placement=placement,
            )
        }
    pins = {str(i): i // 4 for i in range(8)}
    return {"plan": plan(model, x, devices=2, micro_batches=M, pins=pins)}


def _graphpipe_pipeline(name: str, schedule: str, width: int | None = None) -> Any:
    """The compiled pipeline of one schedule, with its batch (the chain `width` wide)."""
    model = _model(name, width)
    x, y = _data(name, width)
    pm = pipeline(
        model,
        x,
        loss_fn=F.mse_loss,
        micro_batches=M,
        schedule=None if schedule == "graph_interleaved" else schedule,
        optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
        **_graphpipe_plan(name, schedule, model, x),
    )
    return pm, x, y


def _graphpipe(name: str, schedule: str) -> dict[str, Any]:
    """Time one schedule, then record steps for the simulator and the time split."""
    pm, x, y = _graphpipe_pipeline(name, schedule)
    measured = _timed(lambda: pm.step(x, target=y))
    pm.timeline()  # clears
    pm.recording = True
    walls = []
    for _ in range(RECORDED):
        start = time.perf_counter()
        pm.step(x, target=y)
        walls.append(time.perf_counter() - start)
    comm = pm.comm_seconds
    timeline = pm.timeline()
    mine = [s for s in timeline.spans if s.rank == pm.rank]
    link = measure_link()
    # the mean span: the simulated actions add up to the compute these steps did (a skewed
    # spread of backward times, slowed while the other process computes, puts the median
    # below it)
    measured_plan = calibrated(pm.plan, timeline, link, statistics.mean)
    predicted = simulate(measured_plan, pm.schedule.name)
    # each recorded step replayed with its own actions' times: the steps' spread included
    replays = [
        simulate(measured_plan, pm.schedule.name, durations=times).iteration_time
        for times in replayed(timeline)
    ]
    wall = sum(walls)
    compute = sum(s.end - s.start for s in mine)
    split = {
        "compute": compute / wall,
        "wait": comm["wait"] / wall,
        "post": comm["post"] / wall,
        "rest": (wall - compute - comm["wait"] - comm["post"]) / wall,
    }
    return {
        "step": measured,
        "simulated": predicted.iteration_time,
        "recorded": wall / RECORDED,
        "replayed": sum(replays) / RECORDED,
        "split": split,
        "compute": compute / RECORDED,
        "ran": f"{pm.schedule.name} on {len(pm.plan.stages)} stages",
    }


# -- torch.distributed.pipelining --------------------------------------------------------------


class _Carry(nn.Module):
    """A sequential-split stage of the towers: runs `body` on one stream, passes the other.

    `which` is "first" (x -> (a(x), x)), "a" ((h, x) -> (a(h), x)), "b" ((h, x) -> (h, b(x)))
    or "b+head" ((h, g) -> head(cat(h, b(g)))). The `* 1.0` copies are the baseline's needs:
    PyTorch's pipelining refuses to send a stage's input back out, and cannot send the
    non-contiguous gradient that `cat` gives back over gloo.
    """

    def __init__(self, body: nn.Module, which: str, head: nn.Module | None = None) -> None:
        super().__init__()
        self.body, self.which, self.head = body, which, head

    def forward(self, h: torch.Tensor, x: torch.Tensor | None = None) -> Any:
        if self.which == "first":
            return self.body(h), h * 1.0
        assert x is not None
        if self.which == "a":
            return self.body(h), x * 1.0
        if self.which == "b":
            return h * 1.0, self.body(x)
        assert self.head is not None
        return self.head(torch.cat([h * 1.0, self.body(x)], dim=-1))


def _torch_parts(name: str, n: int, width: int | None = None) -> list[nn.Module]:
    """The same model cut into n sequential stages (n = 2 or 4)."""
    if name == "chain":
        model = mlp(width or WIDTH[name])
        size = 8 // n
        return [model[i * size : (i + 1) * size] for i in range(n)]
    towers = TwoTowers()
    if n == 2:
        return [_Carry(towers.a, "first"), _Carry(towers.b, "b+head", towers.head)]
    return [
        _Carry(towers.a[:2], "first"),
        _Carry(towers.a[2:], "a"),
        _Carry(towers.b[:2], "b"),
        _Carry(towers.b[2:], "b+head", towers.head),
    ]


def _torch_pipelining(name: str, schedule_name: str) -> dict[str, float]:
    return {"step": _timed(_torch_step(name, schedule_name))}


def _torch_step(
    name: str, schedule_name: str, width: int | None = None, group: Any = None
) -> Callable[[], None]:
    """One step of torch's `schedule_name` on the same split, and its optimizer's step
    (`group`: the process group its stages talk on, the default one if None)."""
    from torch.distributed import pipelining

    rank = dist.get_rank()
    n = 2 if schedule_name == "Schedule1F1B" else 4
    ids = {
        "Schedule1F1B": [rank],
        "ScheduleInterleaved1F1B": [rank, rank + 2],  # loop placement
    }.get(schedule_name, [rank, 3 - rank])  # V placement
    parts = _torch_parts(name, n, width)
    stages = [
        pipelining.PipelineStage(parts[i], i, n, torch.device("cpu"), group=group) for i in ids
    ]
    cls = getattr(pipelining, schedule_name)
    schedule = cls(stages[0] if n == 2 else stages, n_microbatches=M, loss_fn=F.mse_loss)
    x, y = _data(name, width)
    params = [p for i in ids for p in parts[i].parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    args = (x,) if 0 in ids else ()
    kwargs = {"target": y} if n - 1 in ids else {}

    def step() -> None:
        schedule.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()

    return step


# -- one process --------------------------------------------------------------------------------


def _single_process(name: str) -> float:
    torch.set_num_threads(1)
    model = _model(name)
    x, y = _data(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return _timed(step)


def _micro_batch_cost() -> tuple[float, float]:
    """Half the chain's forward and backward over the batch: in one pass, and as M passes."""
    torch.set_num_threads(1)
    half = mlp()[:4]
    x, y = _data("chain")

    def passes(m: int) -> Callable[[], None]:
        def run() -> None:
            for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
                F.mse_loss(half(xs), ys).backward()

        return run

    return _timed(passes(1)), _timed(passes(M))


def _side_by_side() -> float:
    """The chain in one process while another process does the same (no communication)."""
    dist.barrier()
    return _single_process("chain")


# -- report ---------------------------------------------------------------------------------------


def _measure() -> dict[str, Any]:
    results: dict[str, Any] = {"gp": {}, "torch": {}, "single": {}}
    for name, schedules in GRAPHPIPE.items():
        for s in schedules:
            log(f"{name}: graphpipe {s}")
            results["gp"][(name, s)] = launch(_graphpipe, 2, args=(name, s))
        for t in TORCH:
            log(f"{name}: torch.distributed.pipelining {t}")
            results["torch"][(name, t)] = launch(_torch_pipelining, 2, args=(name, t))[0]["step"]
        log(f"{name}: one process, one thread")
        results["single"][name] = _single_process(name)
    log("chain: two processes side by side")
    results["together"] = max(launch(_side_by_side, 2))
    log("chain: half the chain in one pass and in M micro-batches")
    results["micro"] = _micro_batch_cost()
    return results


def _speed_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, schedules in GRAPHPIPE.items():
        ours = {s: results["gp"][(name, s)][0]["step"] for s in schedules}
        theirs = {t: results["torch"][(name, t)] for t in TORCH}
        best_s, best = min(ours.items(), key=lambda kv: kv[1])
        best_t, peer = min(theirs.items(), key=lambda kv: kv[1])
        # no schedule on this split beats its busiest rank's compute (no bubble, no overhead)
        busiest = min(max(r["compute"] for r in results["gp"][(name, s)]) for s in schedules)
        rows.append(
            [
                name,
                ", ".join(f"{s} {v * 1e3:.0f}" for s, v in ours.items()),
                ", ".join(f"{t.removeprefix('Schedule')} {v * 1e3:.0f}" for t, v in theirs.items()),
                f"{results['single'][name] * 1e3:.0f}",
                f"{best_s}: {ratio(peer, best)} vs {best_t.removeprefix('Schedule')}",
                f"{busiest * 1e3:.0f} ms: {ratio(peer, busiest)}",
                ratio(results["single"][name], best),
            ]
        )
    return rows


def _overhead_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for (name, s), ranks in results["gp"].items():
        r = ranks[0]
        splits = " / ".join(
            "{compute:.0%} {wait:.0%} {post:.0%} {rest:.0%}".format(**rank["split"])
            for rank in ranks
        )
        rows.append(
            [
                f"{name} {s} ({r['ran']})",
                f"{r['step'] * 1e3:.1f}",
                f"{r['simulated'] * 1e3:.1f}",
                f"{r['step'] / r['simulated']:.2f}x",
                f"{r['recorded'] * 1e3:.1f}",
                f"{r['replayed'] * 1e3:.1f}",
                f"{r['recorded'] / r['replayed']:.2f}x",
                splits,
            ]
        )
    return rows


def report() -> str:
    """The tables as one markdown section."""
    results = _measure()
    alone, together = results["single"]["chain"], results["together"]
    whole, parts = results["micro"]
    return (
        f"## Runtime: 2 CPU processes, one thread each\n\n{machine()}\n\n"
        "Command: `python -m benchmarks.runtime`. Batch 256, M = 8, SGD; median step times in "
        "ms. Speed-up: graphpipe's best schedule over torch.distributed.pipelining's best on "
        "the same split, and over one process with one thread. Limit: the least compute per "
        "step of the busiest rank among graphpipe's runs (the sum of its action spans), and "
        "torch's best over it: the most any schedule on this split could reach, with no "
        "bubble and no overhead.\n\n"
        + tabulate(
            _speed_rows(results),
            headers=[
                "model",
                "graphpipe (ms)",
                "torch pipelining (ms)",
                "one process (ms)",
                "best vs best",
                "limit",
                "vs one process",
            ],
            tablefmt="github",
        )
        + "\n\nOverhead: the measured step over the simulator's, fed with the compute times "
        "measured in the same run (each stage's mean span of each kind). Replayed: each of "
        f"the {RECORDED} recorded steps simulated with every action's own measured time "
        "(`graphpipe.tools.calibrate.replayed`), against the same steps' mean wall time "
        "(recorded): "
        "a slow action delays its successors in both, so what is left is the runtime's own "
        "cost (posting and waiting for messages, Python between actions). Where the time "
        "goes, per rank (rank 0 / rank 1): compute, wait, post, rest.\n\n"
        + tabulate(
            _overhead_rows(results),
            headers=[
                "run",
                "measured ms",
                "simulated ms",
                "overhead",
                "recorded ms",
                "replayed ms",
                "overhead, replayed",
                "where the time goes",
            ],
            tablefmt="github",
        )
        + f"\n\nContention: the chain's step in one process takes {alone * 1e3:.0f} ms alone "
        f"and {together * 1e3:.0f} ms while a second process does the same "
        f"({together / alone - 1:+.0%}). Micro-batching: half the chain's forward and "
        f"backward over the batch takes {whole * 1e3:.0f} ms in one pass and "
        f"{parts * 1e3:.0f} ms as {M} micro-batches of {BATCH // M} rows (one process, one "
        "thread): small matmuls are less efficient on this CPU, and every pipeline, "
        "torch's included, pays that against one process.\n"
    )


# -- both sides interleaved ---------------------------------------------------------------------

PAIRED = {  # label -> (side, schedule): the chain's schedules on both sides
    "gp 1f1b": ("gp", "1f1b"),
    "gp zb": ("gp", "zb"),
    "gp interleaved": ("gp", "interleaved"),
    "gp zbv": ("gp", "zbv"),
    "torch 1F1B": ("torch", "Schedule1F1B"),
    "torch Interleaved1F1B": ("torch", "ScheduleInterleaved1F1B"),
    "torch ZBV": ("torch", "ScheduleZBVZeroBubble"),
    "torch DualPipeV": ("torch", "ScheduleDualPipeV"),
}


def _paired_worker(label: str, width: int, steps: int) -> dict[str, Any]:
    """One schedule of PAIRED: this rank's median step (each step after a barrier), and for
    graphpipe the busiest rank's compute actions. (Several pipelines stepped in turn in one
    process group were tried: their messages on the same tags met the wrong receives.)"""
    side, schedule = PAIRED[label]
    actions = 0
    if side == "gp":
        pm, x, y = _graphpipe_pipeline("chain", schedule, width)
        step: Callable[[], Any] = functools.partial(pm.step, x, target=y)
        actions = max(sum(isinstance(op, Action) for op in r) for r in pm.program.ranks)
    else:
        step = _torch_step("chain", schedule, width)
    times, cpu = [], []
    for i in range(WARMUP + steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return {"step": statistics.median(times), "cpu": statistics.median(cpu), "actions": actions}


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def paired(runs: int, width: int = 1024, steps: int = STEPS, keep_freed: bool = False) -> str:
    """The chain's schedules on both sides, one launch each, in turn, `runs` times: each
    run's step times (ms, the slower rank's median) and the ratios that matter, then each
    ratio's median and range over the runs."""
    if keep_freed:  # before this process's first launch starts the ranks' server: glibc
        os.environ.update(KEEP_FREED)  # reads it when that server starts
    rows, ratios = [], []
    for r in range(runs):
        log(f"paired run {r + 1}/{runs} (width {width})")
        step, cpu, actions = {}, {}, {}
        for label in PAIRED:  # both sides in turn, so that both see the same load
            results = launch(_paired_worker, 2, args=(label, width, steps), timeout=600)
            step[label] = max(res["step"] for res in results)
            cpu[label] = max(res["cpu"] for res in results)
            actions[label] = results[0]["actions"]
        ours = {k: v for k, v in step.items() if k.startswith("gp")}
        theirs = {k: v for k, v in step.items() if k.startswith("torch")}
        best, peer = min(ours, key=ours.__getitem__), min(theirs, key=theirs.__getitem__)
        ratios.append(
            (
                step["gp 1f1b"] / step["torch 1F1B"],
                ours[best] / theirs[peer],
                step["gp zb"] / step["gp 1f1b"],
                cpu["gp 1f1b"] / cpu["torch 1F1B"],
                cpu["gp zb"] / cpu["torch ZBV"],
            )
        )
        rows.append(
            [
                str(r + 1),
                ", ".join(f"{k.removeprefix('gp ')} {v * 1e3:.1f}" for k, v in ours.items()),
                ", ".join(f"{k.removeprefix('torch ')} {v * 1e3:.1f}" for k, v in theirs.items()),
                *(f"{x:.3f}" for x in ratios[-1]),
                f"{best.removeprefix('gp ')} / {peer.removeprefix('torch ')}",
            ]
        )
        per_action = {k: 1e6 * ours[k] / actions[k] for k in ours}
    headers = [
        "run",
        "graphpipe (ms)",
        "torch (ms)",
        "1f1b / 1F1B",
        "best / best",
        "zb / 1f1b",
        "CPU: 1f1b / 1F1B",
        "CPU: zb / ZBV",
        "bests",
    ]
    spread = [_spread([x[k] for x in ratios]) for k in range(5)]
    return (
        _command("--paired", runs, width, steps, keep_freed)
        + f"The chain 8 x (Linear({width}) + ReLU), batch {BATCH}, "
        f"M = {M}, SGD, 2 ranks of one thread; each schedule in a launch of its own, both "
        "sides in turn, each step after a barrier; each figure the slower rank's median of "
        f"{steps} steps after {WARMUP} warm-up steps. Ratios are step-time ratios (below 1: "
        "the first is faster); CPU: the ratio of the slower rank's median CPU seconds per "
        "step (`time.process_time`, every thread), which other jobs disturb less.\n\n"
        + tabulate(rows, headers=headers, tablefmt="github")
        + f"\n\nOver {runs} runs, median (range): 1f1b / 1F1B {spread[0]}, graphpipe's best / "
        f"torch's best {spread[1]}, zb / 1f1b {spread[2]}; CPU time 1f1b / 1F1B {spread[3]}, "
        f"zb / ZBV {spread[4]}. Per compute action in the last run "
        "(graphpipe's step over its busiest rank's actions): "
        + ", ".join(f"{k.removeprefix('gp ')} {v:.0f} us" for k, v in per_action.items())
        + "\n"
    )


# -- both sides in one launch, steps alternating ---------------------------------------------

GP_SCHEDULES = ("1f1b", "zb", "interleaved", "zbv")
TORCH_SCHEDULES = {  # label -> torch.distributed.pipelining's class
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "ZBV": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


def _alternating_worker(schedule: str, width: int, steps: int) -> dict[str, float]:
    """graphpipe's `schedule` and every torch schedule in this one process pair, their steps
    in turn (the order rotated each round, each step after a barrier): this rank's median
    step of each. torch's schedules each talk on a process group of their own, graphpipe's
    on the default one, so no message of one meets a receive of another."""
    pm, x, y = _graphpipe_pipeline("chain", schedule, width)
    steps_of: dict[str, Callable[[], Any]] = {"gp": functools.partial(pm.step, x, target=y)}
    for label, name in TORCH_SCHEDULES.items():
        steps_of[label] = _torch_step("chain", name, width, group=dist.new_group([0, 1]))
    order = list(steps_of)
    times: dict[str, list[float]] = {label: [] for label in order}
    for i in range(WARMUP + steps):
        for label in order[i % len(order) :] + order[: i % len(order)]:
            dist.barrier()
            start = time.perf_counter()
            steps_of[label]()
            if i >= WARMUP:
                times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def alternating(runs: int, width: int = 1024, steps: int = STEPS, keep_freed: bool = False) -> str:
    """Per run, one launch per graphpipe schedule, its steps alternating with every torch
    schedule's in the same two processes: each graphpipe schedule is read against torch's
    1F1B of its own launch, and torch's schedules against the same 1F1B (their median over
    the launches), so no ratio spans two launches' placement and memory."""
    if keep_freed:
        os.environ.update(KEEP_FREED)
    rows, ratios = [], []
    for r in range(runs):
        log(f"same-launch run {r + 1}/{runs} (width {width})")
        ours: dict[str, float] = {}  # graphpipe's schedule / torch 1F1B of its launch
        theirs: dict[str, list[float]] = {label: [] for label in TORCH_SCHEDULES}
        ms: dict[str, float] = {}
        for schedule in GP_SCHEDULES:
            results = launch(_alternating_worker, 2, args=(schedule, width, steps), timeout=900)
            slower = {k: max(res[k] for res in results) for k in results[0]}
            ours[schedule] = slower["gp"] / slower["1F1B"]
            ms[schedule] = slower["gp"]
            for label in TORCH_SCHEDULES:
                theirs[label].append(slower[label] / slower["1F1B"])
                ms[f"torch {label}"] = slower[label]  # the last launch's
        peers = {k: statistics.median(v) for k, v in theirs.items()}
        best, peer = min(ours, key=ours.__getitem__), min(peers, key=peers.__getitem__)
        ratios.append((ours["1f1b"], ours[best] / peers[peer], ours["zb"] / ours["1f1b"]))
        rows.append(
            [
                str(r + 1),
                ", ".join(f"{k} {ms[k] * 1e3:.1f}" for k in GP_SCHEDULES),
                ", ".join(f"{k} {ms[f'torch {k}'] * 1e3:.1f}" for k in TORCH_SCHEDULES),
                ", ".join(f"{k} {v:.3f}" for k, v in ours.items()),
                ", ".join(f"{k} {v:.3f}" for k, v in peers.items()),
                *(f"{x:.3f}" for x in ratios[-1]),
                f"{best} / {peer}",
            ]
        )
    headers = [
        "run",
        "graphpipe (ms)",
        "torch, last launch (ms)",
        "graphpipe / 1F1B, same launch",
        "torch / 1F1B, median of launches",
        "1f1b / 1F1B",
        "best / best",
        "zb / 1f1b",
        "bests",
    ]
    spread = [_spread([x[k] for x in ratios]) for k in range(3)]
    return (
        _command("--same-launch", runs, width, steps, keep_freed)
        + f"The chain 8 x (Linear({width}) + ReLU), batch {BATCH}, M = {M}, SGD, 2 ranks of "
        "one thread. Per run, one launch per graphpipe schedule; in it that schedule's steps "
        "and every torch schedule's alternate (the order rotated each round, each step after "
        f"a barrier; torch's on process groups of their own), {steps} steps each after "
        f"{WARMUP} warm-up rounds; each figure the slower rank's median. Ratios are "
        "step-time ratios (below 1: the first is faster), each within one launch: graphpipe's "
        "schedules against torch's 1F1B of their launch, torch's against the same 1F1B "
        "(the median over the launches).\n\n"
        + tabulate(rows, headers=headers, tablefmt="github")
        + f"\n\nOver {runs} runs, median (range): 1f1b / 1F1B {spread[0]}, graphpipe's best / "
        f"torch's best {spread[1]}, zb / 1f1b {spread[2]}.\n"
    )


def _command(flag: str, runs: int, width: int, steps: int, keep_freed: bool) -> str:
    """The machine, the command line and what the allocators were told."""
    kept = " --keep-freed" if keep_freed else ""
    return (
        f"{machine()}\n\nCommand: `python -m benchmarks.runtime {flag} {runs} --width {width} "
        f"--steps {steps}{kept}`. " + (_KEPT if keep_freed else _PLAIN)
    )


_KEPT = (
    "Both sides' ranks start with glibc told to keep freed blocks (`MALLOC_MMAP_THRESHOLD_` "
    "32 MiB, `MALLOC_TRIM_THRESHOLD_` 4 GiB, `benchmarks.emulated.KEEP_FREED`), as a device's "
    "caching allocator keeps them. "
)
_PLAIN = (
    "graphpipe's ranks keep freed blocks (its default on CPU, `host_cache`, "
    "`graphpipe.runtime.hostmem`); torch's run on glibc's defaults, which give a freed "
    "weight gradient's 4 MB back to the system and fault it in again (`--keep-freed` gives "
    "both sides the same). "
)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the tables (with --paired: only the chain, both sides interleaved)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paired", type=int, default=0, help="runs of the interleaved chain")
    parser.add_argument("--width", type=int, default=WIDTH["chain"], help="the chain's width")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps of each")
    parser.add_argument(
        "--keep-freed",
        action="store_true",
        help="with --paired or --same-launch: both sides' glibc keeps freed blocks",
    )
    parser.add_argument(
        "--same-launch",
        type=int,
        default=0,
        help="runs of the chain with both sides' steps alternating in one launch",
    )
    args = parser.parse_args(argv)
    if args.same_launch:
        print(alternating(args.same_launch, args.width, args.steps, args.keep_freed))
    elif args.paired:
        print(paired(args.paired, args.width, args.steps, args.keep_freed))
    else:
        print(report())


if __name__ == "__main__":
    main()
