"""graphpipe's schedules beside torch.distributed.pipelining's, on emulated ranks.

    python -m benchmarks.peers                         # 4 ranks, about 5 minutes on 2 cores
    python -m benchmarks.peers --ranks 4 8             # and 8 ranks, about 10 minutes

A chain of 2N layers on N ranks, M = 8 micro-batches of a 32-row batch. Compute is replaced by
sleeps on both sides, so N processes act as N devices on a 2-core machine:
- graphpipe: the real runtime with `Emulate` (`graphpipe.runtime.emulate`): each stage sleeps
  its plan's forward time, and the input and weight halves of its backward;
- torch: each stage is one stand-in module (`Sleeper`) whose forward sleeps the stage's F,
  whose input gradient sleeps its I and whose weight gradient its W, in torch's own schedule
  runtime (its split backward runs them apart, as it runs real stages). The first stage's
  input needs no gradient, so no input half runs there: its weight gradient sleeps I + W,
  as graphpipe's emulated first stage does (before 2026-11-26 09:20 it slept W alone, so
  torch's first stage did I less work than the plan and graphpipe's).
Two layer costs: equal (F = I = W = 10 ms a layer) and unequal (F = 6, I = W = 12 ms: the
cost model fixes I = W, `graphpipe.ir.plan.WEIGHT_SHARE`). Every torch schedule runs beside
every graphpipe schedule: one stage per rank (GPipe, 1F1B, ZB-H1 as torch's interleaved zero
bubble with one stage per rank; gpipe, 1f1b, zb, zb2), two per rank in a loop
(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble; interleaved, interleaved_zb) and in a V
(ZBVZeroBubble, DualPipeV; zbv, dualpipev). A schedule that refuses the setting is listed
with its error (DualPipeV needs M >= 2N on both sides).
The machine is shared and rows move by about 2% between runs: read differences of a few
percent as noise.

Host work, `--host` (both by default, each a run of its own per side): "serial" waits inside
the stand-ins, so each framework's host work for an action (its Python, autograd's
bookkeeping, making the outputs) runs before and after the action's compute, as on a CPU
device. "overlapped" stands for a GPU, whose host runs ahead of the device: an action takes
max(its host work, its compute) from its start. graphpipe: `Emulate(host="overlapped")`
(`graphpipe.runtime.emulate`); torch: the stand-ins add their time to the rank's device time
and each stage's `forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk`
(torch's actions) waits it out from its start before returning. On both sides what lies
between actions stays on the host's path: posting and waiting for messages, the optimizer.
Both sides wait with graphpipe's `wait_until` (a sleep, then a yielding spin for its last
0.3 ms), so a 10 ms compute takes 10 ms, not the 10.1-10.2 ms a plain sleep takes here.

Columns: each order's ideal, its simulated step over the stages' true times (graphpipe's
simulator for both sides: torch's `pipeline_order` is read back into a graphpipe Schedule),
per host mode the measured step (each rank's median over `--steps` steps after a warm-up,
each step started by a barrier; the slowest rank) and measured over ideal. The last line of
each setting gives the ratio of the sides' bests per host mode (torch's best over
graphpipe's: above 1 graphpipe is faster).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from benchmarks._common import log, machine, ratio
from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import GraphPipeError, ScheduleError
from graphpipe.ir import Action, ActionKind, Plan, Schedule, with_messages
from graphpipe.planning.partition import plan as make_plan
from graphpipe.runtime.emulate import HOST_MODES, DeviceTime, Emulate, wait_until
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.simulate import simulate

M, BATCH, WIDTH = 8, 32, 16
COSTS = {"equal": (0.010, 0.010, 0.010), "unequal": (0.006, 0.012, 0.012)}  # F, I, W a layer
GRAPHPIPE = {  # schedule -> placement (None: one stage per rank)
    "gpipe": None,
    "1f1b": None,
    "zb": None,
    "zb2": None,
    "interleaved": "loop",
    "interleaved_zb": "loop",
    "zbv": "v",
    "dualpipev": "v",
}
TORCH = {  # label -> (torch schedule class, placement)
    "GPipe": ("ScheduleGPipe", None),
    "1F1B": ("Schedule1F1B", None),
    "ZB1P (ZB-H1)": ("ScheduleInterleavedZeroBubble", None),  # one stage per rank
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": ("ScheduleDualPipeV", "v"),
}
# torch's Schedule1F1B.pipeline_order is for display only (it names micro-batch M of M and
# deadlocks when run); its runtime runs the textbook 1F1B, graphpipe's 1f1b on one chain
TEXTBOOK = {"1F1B": "1f1b"}
HOSTS = HOST_MODES  # each a run of its own per side


@dataclass(frozen=True)
class Case:
    """One run's setting."""

    ranks: int  # N
    costs: str  # a key of COSTS
    steps: int  # timed steps after one warm-up
    host: str = "serial"  # the emulated host work: beside compute, or overlapped with it

    @property
    def layers(self) -> int:
        """2N layers: 2 per stage on one stage per rank, 1 on two per rank."""
        return 2 * self.ranks


def _stage_ids(rank: int, n: int, placement: str | None) -> list[int]:
    if placement is None:
        return [rank]
    return [rank, rank + n] if placement == "loop" else [rank, 2 * n - 1 - rank]


def _timed_steps(step: Any, steps: int) -> float:
    """This rank's median step over `steps` steps after one warm-up, each after a barrier."""
    step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- graphpipe ------------------------------------------------------------------------------------


def chain_model(layers: int) -> nn.Sequential:
    """The benchmarked model: `layers` equal linear layers (seeded: the same on every rank)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def chain_plan(ranks: int, costs: tuple[float, float, float], placement: str | None) -> Plan:
    """The chain of 2N layers cut into N (or 2N, folded `placement`) stages, each layer
    taking `costs` (F, I, W seconds); `benchmarks.overhead` plans with it too."""
    f, i, w = costs
    layers = 2 * ranks
    stages = ranks if placement is None else 2 * ranks
    per = layers // stages
    options: dict[str, Any] = {"virtual_stages": 2, "placement": placement} if placement else {}
    pins = {str(k): k // per for k in range(layers)}
    x = torch.randn(BATCH, WIDTH)
    p = make_plan(chain_model(layers), x, devices=ranks, micro_batches=M, pins=pins, **options)
    timed = tuple(
        replace(s, forward_time=per * f, backward_time=per * (i + w), time=per * (f + i + w))
        for s in p.stages
    )
    return replace(p, stages=timed)


def timed_plan(case: Case, placement: str | None) -> Plan:
    """The chain cut into N (or 2N, folded `placement`) stages with the case's true times."""
    return chain_plan(case.ranks, COSTS[case.costs], placement)


def _graphpipe_worker(
    cases: list[Case], plans: dict[str, dict[str | None, Plan]]
) -> dict[str, dict[str, float]]:
    """Each case's schedules: this rank's median step."""
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    out: dict[str, dict[str, float]] = {}
    for case in cases:
        out[case.costs] = {}
        for name, placement in GRAPHPIPE.items():
            if refusal(plans[case.costs][placement], name):
                continue
            pm = gp_compile(
                chain_model(case.layers),
                x,
                loss_fn=F.mse_loss,
                optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
                schedule=name,
                plan=plans[case.costs][placement],
                runtime=RuntimeConfig(timeout=120, emulate=Emulate(host=case.host)),
            )
            out[case.costs][name] = _timed_steps(lambda pm=pm: pm.step(x, target=y), case.steps)
    return out


def refusal(plan: Plan, name: str) -> str | None:
    """Why graphpipe's schedule `name` refuses `plan` (the error's first line), or None."""
    try:
        make_schedule(plan, name)
    except ScheduleError as exc:
        return f"ScheduleError: {exc}".splitlines()[0]
    return None


# -- torch.distributed.pipelining ---------------------------------------------------------------


class _Device:
    """This process's emulated device under host "overlapped" (`Case.host`): the stand-ins
    owe their time to `clock` (emulate's `DeviceTime`), and each torch action waits it out
    from its start."""

    overlapped = False
    clock = DeviceTime()


def _sleep(seconds: float) -> None:
    """A stand-in's compute: waited out now (graphpipe's waits, `wait_until`), or owed."""
    if _Device.overlapped:
        _Device.clock.owe(seconds)
    else:
        wait_until(time.perf_counter() + seconds)


def _settled(method: Any) -> Any:
    """torch's stage action `method`, ending no earlier than its device time after its start."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = method(*args, **kwargs)
        _Device.clock.settle(start)
        return out

    return run


class _Input(torch.autograd.Function):
    """The values pass through after F; their gradient after I."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, i: float) -> torch.Tensor:
        ctx.i = i
        _sleep(f)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _sleep(ctx.i)
        return grad * 1.0, None, None


class _Weight(torch.autograd.Function):
    """A zero that depends on the weight: its gradient sleeps W."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, w: float) -> torch.Tensor:
        ctx.w = w
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _sleep(ctx.w)
        return grad.new_zeros(1), None


class Sleeper(nn.Module):
    """A stage stand-in for torch's pipelining: F, I and W seconds, one one-element weight."""

    def __init__(self, f: float, i: float, w: float) -> None:
        super().__init__()
        self.f, self.i, self.w = f, i, w
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Input.apply(x, self.f, self.i) + _Weight.apply(self.weight, self.w)


def _torch_schedule(case: Case, label: str) -> tuple[Any, list[Sleeper], list[int]]:
    from torch.distributed import pipelining

    n, rank, (name, placement) = case.ranks, dist.get_rank(), TORCH[label]
    stages = n if placement is None else 2 * n
    per = case.layers // stages
    f, i, w = (per * t for t in COSTS[case.costs])
    ids = _stage_ids(rank, n, placement)
    # the first stage's input needs no gradient, so torch runs no input half there: its
    # weight gradient sleeps the whole backward, as graphpipe's emulated stage 0 does
    parts = [Sleeper(f, i, w + i * (s == 0)) for s in ids]
    cpu = torch.device("cpu")
    pipe = [pipelining.PipelineStage(p, s, stages, cpu) for p, s in zip(parts, ids, strict=True)]
    _Device.overlapped, _Device.clock = case.host == "overlapped", DeviceTime()
    if _Device.overlapped:
        for stage in pipe:
            for action in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, action, _settled(getattr(stage, action)))
    cls = getattr(pipelining, name)
    single = name in ("ScheduleGPipe", "Schedule1F1B")
    schedule = cls(pipe[0] if single else pipe, n_microbatches=M, loss_fn=F.mse_loss)
    return schedule, parts, ids


def _torch_worker(cases: list[Case]) -> dict[str, dict[str, Any]]:
    """Each case's schedules: this rank's median step and the schedule's compute order."""
    return {case.costs: {name: _torch_run(case, name) for name in TORCH} for case in cases}


def _torch_run(case: Case, name: str) -> dict[str, Any]:
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    try:
        schedule, parts, ids = _torch_schedule(case, name)
    except Exception as exc:  # a schedule refusing this setting is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    stages = case.ranks if TORCH[name][1] is None else 2 * case.ranks
    opt = torch.optim.SGD([p for m in parts for p in m.parameters()], lr=1e-3)
    args = (x,) if 0 in ids else ()
    kwargs = {"target": y} if stages - 1 in ids else {}

    def step() -> None:
        schedule.step(*args, **kwargs)
        _Device.clock.settle(time.perf_counter())  # nothing owed is left behind
        opt.step()
        opt.zero_grad()

    order = schedule.pipeline_order or {}
    return {
        "step": _timed_steps(step, case.steps),
        "order": {r: [str(a) for a in acts if a is not None] for r, acts in order.items()},
    }


def torch_order_schedule(plan: Plan, order: dict[int, list[str]]) -> Schedule:
    """torch's compute order (its `pipeline_order`, as text: `2F0`, `(0F1;3B0)OVERLAP_F_B`)
    as a graphpipe Schedule on `plan`: messages by graphpipe's rule, one update per rank."""
    ranks = []
    for rank in range(plan.num_devices):
        actions: list[Action] = []
        for text in order.get(rank, []):
            parts = text[1:].split(")")[0].split(";") if text.startswith("(") else [text]
            for part in parts:
                try:
                    a = Action.parse(part)
                except GraphPipeError:  # not a compute action (REDUCE_GRAD, UNSHARD, ...)
                    continue
                if a.kind.is_compute:
                    actions += with_messages(plan, a)
        held = [s.index for s in plan.stages_on(rank)]
        ranks.append((*actions, Action(min(held), ActionKind.U)))
    return Schedule("torch", M, tuple(ranks), 1)


# -- report ----------------------------------------------------------------------------------------


def headers(hosts: Sequence[str]) -> list[str]:
    """The table's columns: per host mode the measured step and its ratio to the ideal."""
    per = [c for h in hosts for c in (f"{h} ms", f"{h} / ideal")]
    return ["N", "costs", "side", "schedule", "stages", "ideal ms", *per]


def rows(n: int, steps: int, hosts: Sequence[str] = HOSTS) -> list[list[str]]:
    """Both sides' rows on N ranks, every cost setting, each followed by the bests' ratio."""
    plans = {c: {p: timed_plan(Case(n, c, steps), p) for p in (None, "loop", "v")} for c in COSTS}
    ours, theirs = {}, {}
    for host in hosts:
        cases = [Case(n, costs, steps, host) for costs in COSTS]
        log(f"N={n}, host {host}: graphpipe")
        ours[host] = launch(_graphpipe_worker, n, args=(cases, plans), timeout=900)
        log(f"N={n}, host {host}: torch.distributed.pipelining")
        theirs[host] = launch(_torch_worker, n, args=(cases,), timeout=900)
    table = []
    for costs in COSTS:
        table += _case_rows(Case(n, costs, steps), plans[costs], ours, theirs)
    return table


def _case_rows(
    case: Case,
    plans: dict[str | None, Plan],
    ours: dict[str, list[Any]],
    theirs: dict[str, list[Any]],
) -> list[list[str]]:
    """One setting's rows: graphpipe's schedules, torch's, then the bests' ratio per host."""
    hosts = list(ours)
    table: list[list[str]] = []
    best: dict[tuple[str, str], float] = {}
    for name, placement in GRAPHPIPE.items():
        why = refusal(plans[placement], name)
        if why:
            table.append(_refused(case, "graphpipe", name, why, len(hosts)))
            continue
        steps = [max(r[case.costs][name] for r in ours[h]) for h in hosts]
        ideal = simulate(plans[placement], name).iteration_time
        table.append(_row(case, "graphpipe", name, placement, ideal, steps))
        for h, step in zip(hosts, steps, strict=True):
            best[("graphpipe", h)] = min(best.get(("graphpipe", h), step), step)
    for name, (_, placement) in TORCH.items():
        got = theirs[hosts[0]][0][case.costs][name]
        if "error" in got:
            table.append(_refused(case, "torch", name, got["error"], len(hosts)))
            continue
        steps = [max(r[case.costs][name]["step"] for r in theirs[h]) for h in hosts]
        order = TEXTBOOK.get(name) or torch_order_schedule(plans[placement], got["order"])
        ideal = simulate(plans[placement], order).iteration_time
        table.append(_row(case, "torch", name, placement, ideal, steps))
        for h, step in zip(hosts, steps, strict=True):
            best[("torch", h)] = min(best.get(("torch", h), step), step)
    marks = [c for h in hosts for c in ("", ratio(best[("torch", h)], best[("graphpipe", h)]))]
    return [*table, [str(case.ranks), case.costs, "best", "torch / graphpipe", "", "", *marks]]


def _refused(case: Case, side: str, name: str, why: str, hosts: int) -> list[str]:
    return [str(case.ranks), case.costs, side, name, "-", "-", why, *["-"] * (2 * hosts - 1)]


def _row(
    case: Case,
    side: str,
    name: str,
    placement: str | None,
    ideal: float,
    steps: Sequence[float],
) -> list[str]:
    stages = f"{case.ranks}" if placement is None else f"{2 * case.ranks} ({placement})"
    measured = [c for step in steps for c in (f"{step * 1e3:.0f}", f"{step / ideal:.2f}")]
    return [str(case.ranks), case.costs, side, name, stages, f"{ideal * 1e3:.0f}", *measured]


def report(ranks: Sequence[int], steps: int, hosts: Sequence[str] = HOSTS) -> str:
    """The table as a markdown section."""
    table = [r for n in ranks for r in rows(n, steps, hosts)]
    return (
        "## Against torch.distributed.pipelining, emulated ranks\n\n"
        f"{machine()}\n\nCommand: `python -m benchmarks.peers --ranks "
        f"{' '.join(map(str, ranks))} --steps {steps} --host {' '.join(hosts)}`. A chain of "
        f"2N layers, M = {M}, batch {BATCH}; costs per layer (F, I, W) in ms: "
        + ", ".join(f"{k} {tuple(round(t * 1e3) for t in v)}" for k, v in COSTS.items())
        + f"; measured: each rank's median of {steps} steps, the slowest rank; host: the "
        "emulated host work beside each action's compute (serial) or overlapped with it, as "
        "a GPU's host runs ahead (the module docstring).\n\n"
        + tabulate(table, headers=headers(hosts), tablefmt="github")
        + "\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--host", nargs="+", choices=HOSTS, default=list(HOSTS))
    args = parser.parse_args(argv)
    print(report(args.ranks, args.steps, args.host))


if __name__ == "__main__":
    main()
