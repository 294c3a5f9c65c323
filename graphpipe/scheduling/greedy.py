"""Greedy runs of a plan's costs: the list scheduling that builds ZB-H2, ZB-V and
graph_interleaved (the orders are described in `graphpipe.scheduling.generators`).

Every device (or replica) is a `_Rank`: it says when its next compute action can start,
given when the messages sent so far arrive. `_greedy` runs, again and again, the action that
can start first, advances that rank's clock by the action's time and records when the
messages it sends arrive (`graphpipe.ir.messages`). The ranks differ only in what they may
run next.

A run reads its times from `Costs`: the plan's own (`plan_costs`), or the zero-bubble
papers' assumption (`PAPER`: F = I = W, messages free). Where several candidate orders are
built, `faster` keeps the one that replays fastest over the plan's costs, and among ties
the one fastest under the papers' F = I = W: so a plan whose op times are unknown (all
zero, as a FLOP profile gives stand-ins that only sleep) gets the paper's order, never a
greedy order over zeros. The papers' replays run only where the plan's costs tie, a run
under `PAPER` reads the plan's shape alone and is made once per shape, and each step's
messages are asked once per plan (`_Wires`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from graphpipe.errors import ScheduleError
from graphpipe.ir import (
    Action,
    ActionKind,
    Message,
    Plan,
    Stage,
    awaits,
    compute_time,
    freed,
    message_time,
    sends,
    weight_share,
)

__all__ = [
    "PAPER",
    "Costs",
    "Order",
    "RankOrder",
    "Step",
    "faster",
    "fastest",
    "graph_interleaved",
    "plan_costs",
    "replay",
    "weight_halves",
    "zb_h2",
    "zbv",
]

F, B, I, W = (ActionKind(k) for k in "FBIW")  # noqa: E741 -- the kinds' own letters
Order = list[tuple[ActionKind, int]]  # a stage's compute actions: (kind, micro-batch)
Step = tuple[int, ActionKind, int]  # (stage, kind, micro-batch)
RankOrder = list[Step]  # a device's compute actions
Arrivals = dict[Message, float]  # when each message sent so far arrives


@dataclass(frozen=True)
class Costs:
    """The times a greedy run reads.

    Attributes:
        compute: Seconds of one compute action of a stage.
        transit: Seconds a message takes, given the plan.
    """

    compute: Callable[[Stage, ActionKind], float]
    transit: Callable[[Plan, Message], float]


def _paper_compute(stage: Stage, kind: ActionKind) -> float:
    """F = I = W = 1 (B = 2); a stage without weights has an empty W and a double I."""
    w = 1.0 if weight_share(stage) > 0 else 0.0
    return {F: 1.0, B: 2.0, I: 2.0 - w, W: w}[kind]


PAPER = Costs(_paper_compute, lambda plan, m: 0.0)  # the papers' F = I = W, free messages


def plan_costs() -> Costs:
    """The plan's own stage times and link model (`compute_time`, `message_time`)."""
    return Costs(compute_time, message_time)


class _Rank(Protocol):
    """A device (or a replica) whose next compute action a greedy run picks. Its next start
    depends on its own state and on the arrivals of messages to the stages it runs
    (`held_stages`), nothing else: a greedy run keeps it until one of them changes."""

    clock: float
    held_stages: frozenset[int]

    def busy(self) -> bool:
        """Whether it has actions left."""
        ...

    def next_start(self, arrivals: Arrivals) -> float:
        """When its next action can start (inf: not before something else runs)."""
        ...

    def pop(self, arrivals: Arrivals) -> Step:
        """Take its next action."""
        ...


def _greedy(plan: Plan, ranks: Sequence[_Rank], what: str, costs: Costs) -> float:
    """Run the ranks' actions over `costs`, always the one that can start first.

    List scheduling: the busy rank with the earliest next start runs its next action, its
    clock advances by the action's compute time and the messages it sends arrive after
    their transfer. A rank's next start is kept until it runs or a message reaches one of
    its stages (`_Rank`), so A actions with messages to at most k ranks each take O(A k)
    `next_start` calls and O(A R) comparisons on R ranks (was O(A R) calls; the orders are
    the same, tests/test_golden.py pins them).

    Returns:
        The run's makespan: the latest clock.

    Raises:
        ScheduleError: no rank can run (not seen for the generators' ranks).
    """
    arrivals: Arrivals = {}
    receivers: dict[int, list[int]] = {}  # stage -> the ranks whose next start its messages move
    for i, r in enumerate(ranks):
        for stage in r.held_stages:
            receivers.setdefault(stage, []).append(i)
    starts: dict[int, float] = {}  # kept until the rank runs or a message reaches its stages
    busy = [i for i, r in enumerate(ranks) if r.busy()]  # in list order: ties go to the first
    while busy:
        for i in busy:
            if i not in starts:
                starts[i] = ranks[i].next_start(arrivals)
        chosen = min(busy, key=starts.__getitem__)  # the first of equal starts, as listed
        rank, start = ranks[chosen], starts.pop(chosen)
        if start == float("inf"):
            raise ScheduleError(f"{what} construction stalled: no rank can run")
        stage, kind, j = rank.pop(arrivals)
        rank.clock = start + costs.compute(plan.stages[stage], kind)
        if not rank.busy():
            busy.remove(chosen)
        for m in _wires(plan).sends(plan, (stage, kind, j)):
            arrivals[m] = rank.clock + costs.transit(plan, m)
            for i in receivers.get(m.dst, ()):
                starts.pop(i, None)
    return max((r.clock for r in ranks), default=0.0)


class _Wires:
    """The messages each step of one plan awaits and sends (`graphpipe.ir.messages`), asked
    once per step and plan: a greedy run asks again and again when its next action can
    start, and the candidate orders of one schedule are run on the same plan."""

    def __init__(self) -> None:  # holds no plan: `_WIRES` keeps it only while the plan lives
        self._awaits: dict[Step, list[Message]] = {}
        self._sends: dict[Step, list[Message]] = {}

    def awaits(self, plan: Plan, step: Step) -> list[Message]:
        """`awaits(plan, Action(*step))`, made once."""
        found = self._awaits.get(step)
        if found is None:
            found = self._awaits[step] = awaits(plan, Action(*step))
        return found

    def sends(self, plan: Plan, step: Step) -> list[Message]:
        """`sends(plan, Action(*step))`, made once."""
        found = self._sends.get(step)
        if found is None:
            found = self._sends[step] = sends(plan, Action(*step))
        return found


_WIRES: dict[int, tuple[weakref.ref[Plan], _Wires]] = {}  # id(plan) -> its wires, while alive


def _wires(plan: Plan) -> _Wires:
    """The plan's `_Wires`, kept while the plan lives (dropped with it)."""
    held = _WIRES.get(id(plan))
    if held is not None and held[0]() is plan:
        return held[1]
    key = id(plan)
    ref = weakref.ref(plan, lambda _: _WIRES.pop(key, None))
    _WIRES[key] = (ref, _Wires())
    return _WIRES[key][1]


class _Needs:
    """When the messages a step awaits arrive (`_Wires.awaits`)."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.wires = plan, _wires(plan)

    def arrived(self, step: Step, arrivals: Arrivals) -> float:
        """When the last message `step` awaits arrives (inf: one is not sent yet)."""
        needed = self.wires.awaits(self.plan, step)
        return max((arrivals.get(m, float("inf")) for m in needed), default=0.0)


def zbv(plan: Plan, mbs: list[int], costs: Costs) -> list[RankOrder]:
    """ZB-V on a "v" placement built by a greedy run over `costs`: each device's compute
    order (see `graphpipe.scheduling.generators`). Under `PAPER` the run reads the plan's
    shape alone (`_shape`), so it is made once per shape and micro-batches."""
    if costs is not PAPER:
        return _zbv_run(plan, mbs, costs)
    key = (_shape(plan), tuple(mbs))
    if key not in _PAPER_ZBV:
        if len(_PAPER_ZBV) >= 256:
            _PAPER_ZBV.clear()
        _PAPER_ZBV[key] = tuple(tuple(order) for order in _zbv_run(plan, mbs, PAPER))
    return [list(order) for order in _PAPER_ZBV[key]]


_PAPER_ZBV: dict[tuple[object, ...], tuple[tuple[Step, ...], ...]] = {}  # `zbv` under PAPER


def _zbv_run(plan: Plan, mbs: list[int], costs: Costs) -> list[RankOrder]:
    ranks = [_VRank(plan, r, mbs, cap=2 * plan.num_devices) for r in range(plan.num_devices)]
    _greedy(plan, ranks, "ZB-V", costs)
    return [r.done for r in ranks]


def _shape(plan: Plan) -> tuple[object, ...]:
    """All a greedy run under `PAPER` reads of a plan: the devices, each stage's devices and
    weight share (`weight_share`: its F = I = W times and freed units), and the edges'
    messages (`graphpipe.ir.messages`); not its times or bytes."""
    stages = tuple((s.devices, weight_share(s)) for s in plan.stages)
    edges = tuple((e.src, e.dst, e.backward_message) for e in plan.edges)
    return plan.num_devices, stages, edges


def faster(plan: Plan, candidates: list[list[RankOrder]]) -> list[RankOrder]:
    """The candidate whose replay over the plan's costs ends first; among those within a
    relative 1e-9 of it, the one whose replay under the papers' F = I = W ends first; then
    the earliest listed. So all-zero (unknown) times choose by the papers' assumption."""
    times = [replay(plan, c) for c in candidates]
    best = min(times)
    near = [i for i, t in enumerate(times) if t <= best * (1 + 1e-9)]
    if len(near) == 1:  # no tie: the papers' replays would not be read
        return candidates[near[0]]
    paper = {i: replay(plan, candidates[i], PAPER) for i in near}
    least = min(paper.values())
    return candidates[next(i for i in near if paper[i] <= least * (1 + 1e-9))]


def replay(plan: Plan, orders: list[RankOrder], costs: Costs | None = None) -> float:
    """The makespan of fixed per-device orders run over `costs` (the plan's by default),
    every device starting each action once it is free and its messages have arrived."""
    ranks = [_FixedRank(plan, order) for order in orders]
    return _greedy(plan, ranks, "replay", costs or plan_costs())


class _FixedRank:
    """A device whose compute order is given."""

    def __init__(self, plan: Plan, order: RankOrder) -> None:
        self.needs, self.todo, self.clock = _Needs(plan), list(order), 0.0
        self.held_stages = frozenset(stage for stage, _, _ in order)

    def busy(self) -> bool:
        return bool(self.todo)

    def next_start(self, arrivals: Arrivals) -> float:
        return max(self.clock, self.needs.arrived(self.todo[0], arrivals))

    def pop(self, arrivals: Arrivals) -> Step:
        return self.todo.pop(0)


class _VRank:
    """One device's state while ZB-V is built: its two stages' forwards and input halves in
    micro-batch order, its pending weight halves, and the activation units it holds."""

    def __init__(self, plan: Plan, rank: int, mbs: list[int], cap: int) -> None:
        self.plan, self.cap, self.needs = plan, cap, _Needs(plan)
        n = plan.num_devices
        self.stages = (2 * n - 1 - rank, rank)  # the deeper one first
        self.held_stages = frozenset(self.stages)
        # how far the shallow stage's forwards may run ahead of the deep stage's: micro-batch
        # j reaches the deep stage 2(N-1-d) stages after the shallow one, so the warm-up has
        # 2(N-d)-1 shallow forwards; more would fill the memory the deep stage needs
        self.shallow_limit = 2 * (n - rank) - 1
        self.ahead = 0  # shallow forwards done less deep forwards done
        self.todo = {(s, k): list(mbs) for s in self.stages for k in (F, I)}
        self.pending_w: list[tuple[int, int]] = []
        self.forwarded: set[tuple[int, int]] = set()
        self.held = 0.0
        self.clock = 0.0
        self.done: RankOrder = []

    def busy(self) -> bool:
        return bool(self.pending_w) or any(self.todo.values())

    def _ready(self, stage: int, kind: ActionKind, arrivals: Arrivals) -> float:
        queue = self.todo[(stage, kind)]
        if not queue:
            return float("inf")
        j = queue[0]
        if kind == I and (stage, j) not in self.forwarded:
            return float("inf")
        if kind == F and self.held + 1 > self.cap + 1e-9:
            return float("inf")
        if kind == F and stage == self.stages[1] and self.ahead >= self.shallow_limit:
            return float("inf")
        return self.needs.arrived((stage, kind, j), arrivals)

    def _choice(self, arrivals: Arrivals) -> tuple[float, Step | None]:
        """When the next action can start, and which: a ready I, then a ready F, then a W."""
        options = [
            (max(self.clock, self._ready(s, k, arrivals)), 0 if k == I else 1, i, s, k)
            for k in (I, F)
            for i, s in enumerate(self.stages)
        ]
        now = [o for o in options if o[0] <= self.clock]
        if now:
            _, _, _, s, k = min(now)
            return self.clock, (s, k, self.todo[(s, k)][0])
        if self.pending_w:
            s, j = self.pending_w[0]
            return self.clock, (s, W, j)
        best = min(options)
        if best[0] == float("inf"):
            return best[0], None
        return best[0], (best[3], best[4], self.todo[(best[3], best[4])][0])

    def next_start(self, arrivals: Arrivals) -> float:
        return self._choice(arrivals)[0]

    def pop(self, arrivals: Arrivals) -> Step:
        _, action = self._choice(arrivals)
        assert action is not None
        stage, kind, j = action
        if kind == W:
            self.pending_w.pop(0)
        else:
            self.todo[(stage, kind)].pop(0)
        if kind == F:
            self.forwarded.add((stage, j))
            self.ahead += 1 if stage == self.stages[1] else -1
        if kind == I:
            self.pending_w.append((stage, j))
        self.held -= freed(self.plan.stages[stage], kind)
        self.done.append(action)
        return action


def graph_interleaved(plan: Plan, mbs: list[int], w: dict[int, int]) -> list[RankOrder]:
    """1F1B on any placement of single-device stages, stage s keeping at most w[s] + 1
    micro-batches in flight: each device's compute order (see
    `graphpipe.scheduling.generators`)."""
    ranks = [_GraphRank(plan, r, mbs, w) for r in range(plan.num_devices)]
    _greedy(plan, ranks, "graph_interleaved", plan_costs())
    return [r.done for r in ranks]


class _GraphRank:
    """One device's state while graph_interleaved is built: per stage, its forwards and
    backwards in micro-batch order and its micro-batches in flight (at most 1F1B's warm-up
    plus one, so each stage keeps 1F1B's activation memory)."""

    def __init__(self, plan: Plan, rank: int, mbs: list[int], warmup: dict[int, int]) -> None:
        self.plan, self.needs = plan, _Needs(plan)
        # deeper stages (nearer a sink) first: their backwards free memory soonest
        self.stages = sorted((s.index for s in plan.stages_on(rank)), key=lambda s: warmup[s])
        self.held_stages = frozenset(self.stages)
        self.cap = {s: warmup[s] + 1 for s in self.stages}
        self.in_flight = dict.fromkeys(self.stages, 0)
        self.todo = {(s, k): list(mbs) for s in self.stages for k in (F, B)}
        self.forwarded: set[tuple[int, int]] = set()
        self.clock = 0.0
        self.done: RankOrder = []

    def busy(self) -> bool:
        return any(self.todo.values())

    def _ready(self, stage: int, kind: ActionKind, arrivals: Arrivals) -> float:
        queue = self.todo[(stage, kind)]
        if not queue:
            return float("inf")
        j = queue[0]
        if kind == B and (stage, j) not in self.forwarded:
            return float("inf")
        if kind == F and self.in_flight[stage] >= self.cap[stage]:
            return float("inf")
        return self.needs.arrived((stage, kind, j), arrivals)

    def _choice(self, arrivals: Arrivals) -> tuple[float, Step | None]:
        """When the next action can start, and which: of those ready now a backward first
        (the oldest micro-batch, then the deeper stage), then a forward (the same order);
        else whichever is ready first."""
        options = []
        for order, s in enumerate(self.stages):
            for k in (B, F):
                ready = max(self.clock, self._ready(s, k, arrivals))
                options.append((ready, k != B, self.todo[(s, k)][:1], order, s, k))
        now = [o for o in options if o[0] <= self.clock]
        ready, _, _, _, s, k = min(now or options)
        if ready == float("inf"):
            return ready, None
        return ready, (s, k, self.todo[(s, k)][0])

    def next_start(self, arrivals: Arrivals) -> float:
        return self._choice(arrivals)[0]

    def pop(self, arrivals: Arrivals) -> Step:
        _, action = self._choice(arrivals)
        assert action is not None
        stage, kind, j = action
        self.todo[(stage, kind)].pop(0)
        if kind == F:
            self.forwarded.add((stage, j))
            self.in_flight[stage] += 1
        else:
            self.in_flight[stage] -= 1
        self.done.append(action)
        return action


def weight_halves(plan: Plan, base: dict[int, Order], w: dict[int, int]) -> dict[int, Order]:
    """Each stage's order `base` (F and I) with its W passes placed by a greedy run of the
    plan's costs: a W whenever the next F or I waits for its input, and before a new F once
    stage s holds w[s] + 1 activation units (1F1B's memory on every stage)."""
    ranks = [
        _ZbRank(plan, s, [a for a in base[s.index] if s.device_for(a[1]) == rank], w[s.index])
        for s in plan.stages
        for rank in s.devices
    ]
    _greedy(plan, ranks, "zero-bubble", plan_costs())
    orders: dict[int, Order] = {s.index: [] for s in plan.stages}
    for r in ranks:  # replicas hold disjoint micro-batches: concatenating keeps each one's order
        orders[r.stage] += r.done
    return orders


class _ZbRank:
    """One rank's state while the zero-bubble order is built."""

    def __init__(self, plan: Plan, stage: Stage, base: Order, warmup: int) -> None:
        self.plan, self.stage, self.base = plan, stage.index, list(base)
        self.held_stages = frozenset({stage.index})
        self.needs = _Needs(plan)
        self.info = stage
        self.cap = warmup + 1  # 1F1B's activation units: ZB-H1 keeps its memory
        self.pending_w: list[int] = []
        self.held = 0.0
        self.clock = 0.0
        self.done: Order = []

    def busy(self) -> bool:
        return bool(self.base or self.pending_w)

    def _ready(self, arrivals: Arrivals) -> float:
        kind, j = self.base[0]
        return self.needs.arrived((self.stage, kind, j), arrivals)

    def _takes_w(self, arrivals: Arrivals) -> bool:
        """Whether the next action is a W: forced by the memory cap, or filling a wait."""
        if not self.pending_w:
            return False
        if not self.base or (self.base[0][0] == F and self.held + 1 > self.cap + 1e-9):
            return True
        return self._ready(arrivals) > self.clock

    def next_start(self, arrivals: Arrivals) -> float:
        if self._takes_w(arrivals):
            return self.clock
        return max(self.clock, self._ready(arrivals))

    def pop(self, arrivals: Arrivals) -> Step:
        if self._takes_w(arrivals):
            action = (W, self.pending_w.pop(0))
        else:
            action = self.base.pop(0)
            if action[0] == I:
                self.pending_w.append(action[1])
        self.held -= freed(self.info, action[0])
        self.done.append(action)
        return (self.stage, *action)


def fastest(plan: Plan, candidates: list[dict[int, Order]]) -> dict[int, Order]:
    """Of per-stage orders (one stage per device), the one that replays fastest over the
    plan's costs; the earliest listed on a tie (see `zbv`)."""

    def per_rank(orders: dict[int, Order]) -> list[RankOrder]:
        ranks: list[RankOrder] = [[] for _ in range(plan.num_devices)]
        for s in plan.stages:
            for kind, j in orders[s.index]:
                ranks[s.device_for(j)].append((s.index, kind, j))
        return ranks

    rank_orders = [per_rank(c) for c in candidates]
    return candidates[rank_orders.index(faster(plan, rank_orders))]


def zb_h2(plan: Plan, mbs: list[int], w: dict[int, int]) -> dict[int, Order]:
    """ZB-H2 (Qi et al., arXiv 2401.10241, section 3.1): each stage's order, built by a
    greedy run under the paper's F = I = W (whatever the plan's times, so unknown times
    cannot bend it). A rank runs a ready I first, then a ready F while fewer than
    2 w[s] + 1 micro-batches have their F done and their W not (2p - 1 on the first stage
    of a chain: the paper's memory), then a pending W, the oldest first. On a chain with
    F = I = W every rank is then busy without a gap from its first F to its last W (the
    paper's parallelogram), and the step is M(F + I + W) + (p - 1)F.

    Replicas of a stage are separate ranks over their own micro-batches. O(A * R).
    """
    memory = 2 * max(w.values(), default=0) + 1
    ranks = [
        _H2Rank(plan, s, [j for j in mbs if s.device_for(j) == rank], 2 * w[s.index] + 1, memory)
        for s in plan.stages
        for rank in s.devices
    ]
    _greedy(plan, ranks, "ZB-H2", PAPER)
    orders: dict[int, Order] = {s.index: [] for s in plan.stages}
    for r in ranks:  # replicas hold disjoint micro-batches: concatenating keeps each one's order
        orders[r.stage] += r.done
    return orders


class _H2Rank:
    """One rank of a stage while ZB-H2 is built: its forwards and input halves in
    micro-batch order, its pending weight halves, its micro-batches with W still to run."""

    def __init__(self, plan: Plan, stage: Stage, mbs: list[int], cap: int, memory: int) -> None:
        self.stage, self.needs, self.cap, self.memory = stage.index, _Needs(plan), cap, memory
        self.held_stages = frozenset({stage.index})
        self.todo = {F: list(mbs), I: list(mbs)}
        self.forwarded: set[int] = set()
        self.pending_w: list[int] = []
        self.weighted = 0  # W passes run
        self.clock = 0.0
        self.done: Order = []

    def busy(self) -> bool:
        return bool(self.pending_w or self.todo[F] or self.todo[I])

    def _ready(self, kind: ActionKind, arrivals: Arrivals) -> float:
        queue = self.todo[kind]
        if not queue or (kind == I and queue[0] not in self.forwarded):
            return float("inf")
        if kind == F and (
            len(self.forwarded) - len(self.pending_w) - self.weighted >= self.cap
            or len(self.forwarded) - self.weighted >= self.memory
        ):
            return float("inf")
        return max(self.clock, self.needs.arrived((self.stage, kind, queue[0]), arrivals))

    def _choice(self, arrivals: Arrivals) -> tuple[float, ActionKind | None]:
        """When the next action can start, and its kind: a ready I, a ready F, a W, else
        whichever of I and F is ready first."""
        ready = {k: self._ready(k, arrivals) for k in (I, F)}
        for k in (I, F):
            if ready[k] <= self.clock:
                return self.clock, k
        if self.pending_w:
            return self.clock, W
        k = min((I, F), key=lambda k: ready[k])
        return (ready[k], k) if ready[k] < float("inf") else (ready[k], None)

    def next_start(self, arrivals: Arrivals) -> float:
        return self._choice(arrivals)[0]

    def pop(self, arrivals: Arrivals) -> Step:
        _, kind = self._choice(arrivals)
        assert kind is not None
        j = self.pending_w.pop(0) if kind == W else self.todo[kind].pop(0)
        if kind == F:
            self.forwarded.add(j)
        if kind == I:
            self.pending_w.append(j)
        self.weighted += kind == W
        self.done.append((kind, j))
        return self.stage, kind, j
