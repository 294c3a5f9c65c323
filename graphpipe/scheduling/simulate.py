"""Simulate: a discrete-event run of a Schedule over a Plan's costs.

    result = simulate(plan)        # the schedule the plan was made for (`Plan.schedule`)
    result = simulate(plan, "zb")  # or another, by name, or a Schedule from make_schedule
    result.iteration_time, result.bubble, result.peak_memory, result.timeline

A plan the schedule's rule refuses (`graphpipe.scheduling.rules`) is refused here too, by the
same ScheduleError: nothing is simulated that could not run.

Every rank runs its actions in order. Costs (seconds):
    F, B          the stage's forward_time and backward_time for one micro-batch
    I, W          the backward split: W takes `weight_share` of it on a stage with parameters
                  (none without), I the rest (`WEIGHT_SHARE`, one half, by default)
    send          non-blocking; the message arrives link.transfer(bytes) after it starts
                  crossing (at once between two stages of one device). With `contention`,
                  every rank has one link out and one link in; a message holds the sender's
                  out and the receiver's in for its whole transfer, and starts in the earliest
                  window, at or after the send, where both are free (`Links`). So a stage's
                  sends queue behind each other, and so do the messages of a fan-in.
    receive       waits for the matching send's arrival (k-th receive of a channel matches its
                  k-th send)
    U             replicas of a stage meet, then all-reduce (link.allreduce(param_bytes, r))
                  and step the optimizer (the stage's update_time); with a dp dimension
                  (`CostModel.dp`) the update also reduce-scatters (sharded) or all-reduces
                  (replicated) the stage's gradients over it (`CostModel.update_sync`). The
                  dp ranks of a stage run in lockstep, so one rank of each stands for all;
                  the all-gathers that prefetch does not hide are in F and B already
                  (`CostModel.exposed_gather`, applied by the planner)

Memory per rank: the weights of its stages (`CostModel.weights`) + the most activation
bytes held at once (a stage's activation_bytes per unit). A forward adds one unit; a full
backward frees it; an I frees all but the weight share, which its W frees (the weight
gradient still needs the layer inputs).

The same engine, with unit costs, is the validator's dry run (`graphpipe.scheduling.dryrun`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from graphpipe.errors import ScheduleError
from graphpipe.ir import (
    Action,
    ActionKind,
    Message,
    Plan,
    Schedule,
    Span,
    Timeline,
    compute_time,
    freed,
    message_time,
    schedule_spec,
    weight_copies,
)
from graphpipe.ir.registry import SCHEDULES
from graphpipe.scheduling.generators import drain_schedule, make_schedule, warmups
from graphpipe.scheduling.rules import check

__all__ = ["SimResult", "UpdateBarrier", "simulate", "steady_run"]


@dataclass(frozen=True)
class SimResult:
    """What a simulated run predicts.

    Attributes:
        iteration_time: Seconds per step() call.
        throughput: Samples per second.
        bubble: Per rank, the idle share of the run (1.0 for a rank without a stage).
        peak_in_flight: Per rank, the most micro-batches in flight at once (forward done,
            backward not finished).
        peak_memory: Per rank, predicted peak bytes.
        timeline: Every compute and update action's span.
    """

    iteration_time: float
    throughput: float
    bubble: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_memory: tuple[int, ...]
    timeline: Timeline


def simulate(
    plan: Plan,
    schedule: Schedule | str | None = None,
    *,
    contention: bool = True,
    weights: str | None = None,
    durations: Mapping[str, float] | None = None,
) -> SimResult:
    """Run `schedule` over `plan`'s costs.

    Args:
        plan: The plan whose stage times, edge bytes and link model give the costs.
        schedule: The per-rank actions (e.g. from
            `graphpipe.scheduling.generators.make_schedule`), or a schedule name, generated
            for one step() call (asynchronous ones for `ASYNC_CALLS` calls, then drained).
            None: the plan's own (`Plan.schedule`, the one it was made for).
        contention: Every rank has one link out and one link in, which its messages share
            (else every message crosses at once, whatever else is in flight).
        weights: A weight policy ("flush", "stash", "2bw", "pipemare"): each stage then keeps
            `cost.weight_copies` copies of its weights; by default the plan's memory model.
        durations: Seconds of individual actions, by their text (`"1B3"`), in place of their
            stage's times: a measured step replayed action by action
            (`graphpipe.tools.calibrate.replayed`).

    Returns:
        The prediction.

    Raises:
        ConfigError: an unknown schedule name.
        ScheduleError: the schedule's rule refuses the plan (`graphpipe.scheduling.rules`:
            another placement, replicated stages, an M it cannot run), or the schedule
            deadlocks (see `graphpipe.scheduling.dryrun` for a full check).

    Example:
        >>> import graphpipe, torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> plan = graphpipe.plan(model, torch.randn(8, 8), devices=2, micro_batches=4)
        >>> simulate(plan).iteration_time > 0
        True
    """
    if schedule is None:
        schedule = plan.schedule
    if isinstance(schedule, str):
        schedule = steady_run(plan, schedule)
    elif schedule.name in SCHEDULES:  # made elsewhere: it still runs only what its rule takes
        check(plan, schedule.name, schedule.micro_batches)
    engine = Engine(plan, schedule, _durations(plan, durations), _transfers(plan), contention)
    spans = engine.run()
    makespan = max((s.end for s in spans), default=0.0)
    calls = max(schedule.calls, 1)
    busy: dict[int, float] = defaultdict(float)
    for s in spans:
        if Action.parse(s.action).kind != ActionKind.U:
            busy[s.rank] += s.end - s.start
    holders = {r for s in plan.stages for r in s.devices}
    bubble = tuple(
        1 - busy[r] / makespan if r in holders and makespan > 0 else 1.0
        for r in range(plan.num_devices)
    )
    memory = tuple(
        _peak_memory(plan, r, engine.peak_held[r], weights) for r in range(plan.num_devices)
    )
    samples = calls * schedule.micro_batches * plan.micro_batch_size
    return SimResult(
        iteration_time=makespan / calls,
        throughput=samples / makespan if makespan > 0 else float("inf"),
        bubble=bubble,
        peak_in_flight=tuple(engine.peak_in_flight[r] for r in range(plan.num_devices)),
        peak_memory=memory,
        timeline=Timeline(tuple(spans), plan.num_devices, "simulated", schedule.name),
    )


ASYNC_CALLS = 4  # step() calls simulated for an asynchronous schedule named by a string


def steady_run(plan: Plan, name: str, calls: int = ASYNC_CALLS) -> Schedule:
    """`name` over one call, or, when asynchronous, over `calls` calls and its drain."""
    if not schedule_spec(name, training=False).asynchronous:
        return make_schedule(plan, name)
    run, drain = make_schedule(plan, name, calls=calls), drain_schedule(plan, name, calls)
    ranks = tuple(a + b for a, b in zip(run.ranks, drain.ranks, strict=True))
    return Schedule(name, run.micro_batches, ranks, calls)


def _peak_memory(plan: Plan, rank: int, held_bytes: float, policy: str | None) -> int:
    """The rank's weights (every stage it holds) and the most activation bytes it held."""
    stages = plan.stages_on(rank)
    if not stages:
        return 0
    total = held_bytes
    for stage in stages:
        copies = None
        if policy is not None:
            copies = weight_copies(policy, warmups(plan)[stage.index])
        total += plan.cost_model.weights(stage.param_bytes, copies, stage.frozen_bytes)
    return int(total)


def _durations(
    plan: Plan, measured: Mapping[str, float] | None = None
) -> Callable[[Action], float]:
    def duration(a: Action) -> float:
        if measured is not None and str(a) in measured:
            return measured[str(a)]
        stage = plan.stages[a.stage]
        if a.kind == ActionKind.U:
            sync = plan.cost_model.update_sync(stage.param_bytes, stage.replicas)
            return sync + stage.update_time
        return compute_time(stage, a.kind)

    return duration


def _transfers(plan: Plan) -> Callable[[Action], float]:
    def transfer(a: Action) -> float:
        return message_time(plan, a.message)

    return transfer


class Links:
    """Every rank's outbound and inbound link, as the sorted busy windows of each.

    A message holds its sender's out-link and its receiver's in-link for its transfer time;
    `reserve` places it in the earliest window where both are free. Ranks are run one after
    another, not in time order, so a window left free before a later reservation can still
    take an earlier message.
    """

    def __init__(self) -> None:
        self.starts: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.ends: dict[tuple[str, int], list[float]] = defaultdict(list)

    def reserve(self, src: int, dst: int, ready: float, seconds: float) -> float:
        """Book `seconds` on src's out-link and dst's in-link from the earliest common free
        window at or after `ready`; returns the window's start."""
        links = (("out", src), ("in", dst))
        start = ready
        while (later := max(self._free_from(link, start, seconds) for link in links)) > start:
            start = later  # free on one end from here; look again at both
        for link in links:
            i = bisect.bisect_right(self.starts[link], start)
            self.starts[link].insert(i, start)
            self.ends[link].insert(i, start + seconds)
        return start

    def _free_from(self, link: tuple[str, int], t: float, seconds: float) -> float:
        """The earliest time >= t from which `link` is free for `seconds`."""
        starts, ends = self.starts[link], self.ends[link]
        i = bisect.bisect_right(ends, t)  # the first window still busy after t
        while i < len(starts) and starts[i] < t + seconds:
            t = ends[i]  # after t, as every window from i on ends after it
            i += 1
        return t


class Deadlock(ScheduleError):
    """No rank can make progress; `blocked` maps each unfinished rank to its action index."""

    def __init__(self, blocked: dict[int, int]) -> None:
        self.blocked = blocked
        super().__init__(f"the schedule deadlocks: ranks {sorted(blocked)} wait forever")


class Engine:
    """Runs every rank's action list with blocking receives, buffered sends and update barriers.

    Args:
        plan: The plan (stages, replicas, edges).
        schedule: The action lists.
        duration: Seconds a compute or update action takes.
        transfer: Seconds a send's message travels.
        contention: Messages share their sender's out-link and receiver's in-link (`Links`).
    """

    def __init__(
        self,
        plan: Plan,
        schedule: Schedule,
        duration: Callable[[Action], float],
        transfer: Callable[[Action], float],
        contention: bool = True,
    ) -> None:
        self.plan, self.lists = plan, schedule.ranks
        self.duration, self.transfer, self.contention = duration, transfer, contention
        self.pc = [0] * len(self.lists)
        self.clock = [0.0] * len(self.lists)
        self.links = Links()
        self.messages: dict[Message, deque[float]] = defaultdict(deque)  # arrivals, k-th first
        self.barrier = UpdateBarrier(plan)
        self.in_flight = [0] * len(self.lists)
        self.peak_in_flight = [0] * len(self.lists)
        self.held = [0.0] * len(self.lists)
        self.peak_held = [0.0] * len(self.lists)
        self.spans: list[Span] = []
        self.send_times: dict[tuple[int, int], float] = {}  # (rank, list index) -> send start

    def run(self) -> list[Span]:
        """Execute to the end.

        Raises:
            Deadlock: no rank can progress before all are done.
        """
        while True:
            progress = False
            for rank in range(len(self.lists)):
                while self.pc[rank] < len(self.lists[rank]) and self._step(rank):
                    self.pc[rank] += 1
                    progress = True
            unfinished = {
                r: self.pc[r] for r in range(len(self.lists)) if self.pc[r] < len(self.lists[r])
            }
            if not unfinished:
                return sorted(self.spans, key=lambda s: (s.start, s.rank))
            if not progress:
                raise Deadlock(unfinished)

    def _step(self, rank: int) -> bool:
        """Try the rank's next action; False when it must wait."""
        a = self.lists[rank][self.pc[rank]]
        if a.kind.is_send:
            seconds = self.transfer(a)
            start = self.clock[rank]
            if self.contention and seconds > 0:
                assert a.peer is not None and a.mb is not None
                receiver = self.plan.stages[a.peer].device_for(a.mb)
                start = self.links.reserve(rank, receiver, start, seconds)
            self.send_times[(rank, self.pc[rank])] = start
            self.messages[a.message].append(start + seconds)
            return True
        if a.kind.is_receive:  # the k-th receive of a message takes its k-th send's arrival
            queue = self.messages[a.message]
            if not queue:
                return False
            self.clock[rank] = max(self.clock[rank], queue.popleft())
            return True
        if a.kind == ActionKind.U:
            return self._update(rank, a)
        self._compute(rank, a)
        return True

    def _compute(self, rank: int, a: Action) -> None:
        start = self.clock[rank]
        self.clock[rank] = start + self.duration(a)
        self.spans.append(Span(rank, str(a), start, self.clock[rank]))
        stage = self.plan.stages[a.stage]  # held in bytes: stages of one rank differ
        self.held[rank] -= freed(stage, a.kind) * stage.activation_bytes
        self.peak_held[rank] = max(self.peak_held[rank], self.held[rank])
        if a.kind == ActionKind.F:
            self.in_flight[rank] += 1
            self.peak_in_flight[rank] = max(self.peak_in_flight[rank], self.in_flight[rank])
        elif a.kind.ends_backward:
            self.in_flight[rank] -= 1

    def _update(self, rank: int, a: Action) -> bool:
        """Replicas of the stage meet at their n-th update, then all-reduce together."""
        arrived = self.barrier.arrive(rank, a.stage, self.clock[rank])
        if arrived is None:
            return False
        end = max(arrived.values()) + self.duration(a)
        self.spans.append(Span(rank, str(a), max(arrived.values()), end))
        self.clock[rank] = end
        return True


class UpdateBarrier:
    """Replicas of a stage meet at their n-th update: none passes before all have arrived.

    Shared by the simulator (which also needs when each replica arrived) and the dry run of
    programs (`graphpipe.scheduling.dryrun`).
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._arrived: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
        self._passed: dict[tuple[int, int], int] = defaultdict(int)  # (rank, stage) -> updates

    def arrive(self, rank: int, stage: int, when: float = 0.0) -> dict[int, float] | None:
        """Rank `rank` is at its next update of `stage` (since time `when`).

        Returns:
            Once every replica of the stage is there, each one's arrival time, and the rank
            has passed this update; before that None (the rank waits; call again).
        """
        arrived = self._arrived[(stage, self._passed[(rank, stage)])]
        arrived.setdefault(rank, when)
        if len(arrived) < self.plan.stages[stage].replicas:
            return None
        self._passed[(rank, stage)] += 1
        return arrived
