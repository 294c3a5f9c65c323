"""Greedy runs of a plan's costs: the list scheduling that builds ZB-H1's weight passes, ZB-V
and graph_interleaved (the orders are described in `graphpipe.scheduling.generators`).

Every device (or replica) is a `_Rank`: it says when its next compute action can start,
given when the messages sent so far arrive. `_greedy` runs, again and again, the action that
can start first, advances that rank's clock by the action's time and records when the
messages it sends arrive (`graphpipe.ir.messages`). The ranks differ only in what they may
run next.
"""

from __future__ import annotations

from collections.abc import Sequence
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
)

__all__ = ["Order", "RankOrder", "Step", "graph_interleaved", "weight_halves", "zbv"]

F, B, I, W = (ActionKind(k) for k in "FBIW")  # noqa: E741 -- the kinds' own letters
Order = list[tuple[ActionKind, int]]  # a stage's compute actions: (kind, micro-batch)
Step = tuple[int, ActionKind, int]  # (stage, kind, micro-batch)
RankOrder = list[Step]  # a device's compute actions
Arrivals = dict[Message, float]  # when each message sent so far arrives


class _Rank(Protocol):
    """A device (or a replica) whose next compute action a greedy run picks."""

    clock: float

    def busy(self) -> bool:
        """Whether it has actions left."""
        ...

    def next_start(self, arrivals: Arrivals) -> float:
        """When its next action can start (inf: not before something else runs)."""
        ...

    def pop(self, arrivals: Arrivals) -> Step:
        """Take its next action."""
        ...


def _greedy(plan: Plan, ranks: Sequence[_Rank], what: str) -> None:
    """Run the ranks' actions over the plan's costs, always the one that can start first.

    List scheduling: the busy rank with the earliest next start runs its next action, its
    clock advances by the action's compute time and the messages it sends arrive after
    their transfer. O(A * R) `next_start` calls for A actions on R ranks.

    Raises:
        ScheduleError: no rank can run (not seen for the generators' ranks).
    """
    arrivals: Arrivals = {}
    while busy := [r for r in ranks if r.busy()]:
        rank = min(busy, key=lambda r: r.next_start(arrivals))
        start = rank.next_start(arrivals)
        if start == float("inf"):
            raise ScheduleError(f"{what} construction stalled: no rank can run")
        stage, kind, j = rank.pop(arrivals)
        rank.clock = start + compute_time(plan.stages[stage], kind)
        for m in sends(plan, Action(stage, kind, j)):
            arrivals[m] = rank.clock + message_time(plan, m)


class _Needs:
    """The messages each step awaits, asked once per step (a greedy run asks again and again
    when its next action can start)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._needs: dict[Step, list[Message]] = {}

    def arrived(self, step: Step, arrivals: Arrivals) -> float:
        """When the last message `step` awaits arrives (inf: one is not sent yet)."""
        needed = self._needs.get(step)
        if needed is None:
            needed = self._needs[step] = awaits(self.plan, Action(*step))
        return max((arrivals.get(m, float("inf")) for m in needed), default=0.0)


def zbv(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """ZB-V on a "v" placement: each device's compute order (see
    `graphpipe.scheduling.generators`)."""
    ranks = [_VRank(plan, r, mbs, cap=2 * plan.num_devices) for r in range(plan.num_devices)]
    _greedy(plan, ranks, "ZB-V")
    return [r.done for r in ranks]


class _VRank:
    """One device's state while ZB-V is built: its two stages' forwards and input halves in
    micro-batch order, its pending weight halves, and the activation units it holds."""

    def __init__(self, plan: Plan, rank: int, mbs: list[int], cap: int) -> None:
        self.plan, self.cap, self.needs = plan, cap, _Needs(plan)
        n = plan.num_devices
        self.stages = (2 * n - 1 - rank, rank)  # the deeper one first
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
    _greedy(plan, ranks, "graph_interleaved")
    return [r.done for r in ranks]


class _GraphRank:
    """One device's state while graph_interleaved is built: per stage, its forwards and
    backwards in micro-batch order and its micro-batches in flight (at most 1F1B's warm-up
    plus one, so each stage keeps 1F1B's activation memory)."""

    def __init__(self, plan: Plan, rank: int, mbs: list[int], warmup: dict[int, int]) -> None:
        self.plan, self.needs = plan, _Needs(plan)
        # deeper stages (nearer a sink) first: their backwards free memory soonest
        self.stages = sorted((s.index for s in plan.stages_on(rank)), key=lambda s: warmup[s])
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
    """ZB-H1: each stage's order `base` (F and I) with its W passes placed by a greedy run,
    stage s holding at most w[s] + 1 activation units (1F1B's memory)."""
    ranks = [
        _ZbRank(plan, s, [a for a in base[s.index] if s.device_for(a[1]) == rank], w[s.index])
        for s in plan.stages
        for rank in s.devices
    ]
    _greedy(plan, ranks, "zero-bubble")
    orders: dict[int, Order] = {s.index: [] for s in plan.stages}
    for r in ranks:  # replicas hold disjoint micro-batches: concatenating keeps each one's order
        orders[r.stage] += r.done
    return orders


class _ZbRank:
    """One rank's state while the zero-bubble order is built."""

    def __init__(self, plan: Plan, stage: Stage, base: Order, warmup: int) -> None:
        self.plan, self.stage, self.base = plan, stage.index, list(base)
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
