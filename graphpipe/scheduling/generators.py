"""Schedule: micro-batch schedules over a Plan's stage graph, as plain per-rank action lists.

    sched = make_schedule(plan, "1f1b")            # one step() call
    print(sched)                                    # rank 0: 0F0 0SF0>1 0F1 ...

Generators:
    gpipe   all forwards, then all backwards, then one update (GPipe). On S equal stages the
            bubble is (S-1)/(M+S-1).
    1f1b    one forward, one backward, with a flush (PipeDream-Flush). The warm-up at stage s
            is the longest path from s to a sink, counted in edges: on a chain, stage i warms
            up with S-1-i forwards, the textbook order; on a stage DAG this is GraphPipe's
            graph 1F1B (parallel branches share a depth and so keep fewer micro-batches in
            flight). Alias: graph1f1b.
    zb      zero bubble ZB-H1 (Qi et al., arXiv 2401.10241): 1F1B with the backward split into
            I (input gradient, on the critical path) and W (weight gradient, deferrable). The
            W passes fill bubbles: a greedy run of the plan's costs does W whenever the next
            F or I waits for its input, and before a new F once a stage holds as much
            activation as 1F1B would (an I frees all but the W share, see
            `graphpipe.scheduling.simulate`). Same memory as 1F1B, a smaller bubble.
    async   1F1B without a flush (PipeDream): micro-batches keep flowing across step() calls,
            call c holding micro-batches cM..cM+M-1, and every backward is followed by an
            update (`sUj`). `drain` ends the run with the backwards still in flight.
    2bw     like async, with one update after the last backward of every mini-batch
            (PipeDream-2BW); needs M >= depth.
    forward every forward, no backward and no update: inference.
    interleaved
            Megatron's interleaved 1F1B on a chain folded "loop" onto the devices (v stages
            per device, `PlanConfig(virtual_stages=v)`): forwards go through the device's
            stages in rounds of N micro-batches, backwards through them in reverse; the
            warm-up on device d is 2(N-1-d) + (v-1)N forwards. Needs M a multiple of N.
            The bubble shrinks by v against 1F1B.
    zbv     ZB-V (Qi et al., arXiv 2401.10241) on a chain of 2N stages folded "v" onto the
            devices (device d holds stages d and 2N-1-d): the backward split into I and W,
            built by a greedy run of the plan's costs in which each device does a ready I
            first, then a ready F (the deeper stage first) while it holds fewer than 2N
            activation units (and its first stage's forwards are fewer than 2(N-d)-1 ahead
            of its second's), and W passes whenever nothing else is ready.
    graph_interleaved
            1F1B on a stage DAG whose devices may hold several stages, in any placement
            (`graphpipe.planning.interleave`: a later stage on a device that holds an
            earlier branch). A greedy run of the plan's costs: each device runs, of the
            actions whose inputs have arrived, a backward first (the oldest micro-batch, then
            the deeper stage), else a forward; a stage keeps at most its 1F1B warm-up plus
            one micro-batches in flight, so every stage has 1F1B's memory. Forwards and
            backwards of a stage go in micro-batch order, so the oldest unfinished
            micro-batch can always move on: the construction cannot stall.

Communication is inserted around compute by the IR's one rule (`graphpipe.ir.messages`):
before F(j) a receive from every in-edge and after it a send on every out-edge; before B/I(j)
a receive of gradients from every out-edge that carries them back, and after it a send on
every such in-edge.

What each schedule is (split backward, placement, asynchronous, replicas) is read from
`graphpipe.ir.registry.SCHEDULES`; this module maps each name there to its builder, and
refuses to import when the two disagree.

Devices holding several stages (interleaved, zbv) get one update `U` for all of them, after
their last backward. A stage replicated on r devices runs micro-batch j on devices[j % r];
each replica's list is the stage order restricted to its own micro-batches, and its update
all-reduces gradients with the other replicas. Asynchronous schedules need unreplicated stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import (
    Action,
    ActionKind,
    Message,
    Plan,
    Schedule,
    ScheduleSpec,
    Stage,
    awaits,
    compute_time,
    device_of,
    edges_to_sink,
    freed,
    message_time,
    registry,
    schedule_spec,
    sends,
    with_messages,
)
from graphpipe.ir.registry import SCHEDULES

__all__ = ["drain_schedule", "make_schedule", "warmups"]

F, B, I, W, U = (ActionKind(k) for k in "FBIWU")  # noqa: E741 -- the kinds' own letters
Order = list[tuple[ActionKind, int]]  # a stage's compute actions: (kind, micro-batch)
Builder = Callable[[Plan, int, int], list[list[Action]]]  # (plan, call, M) -> rank lists


def warmups(plan: Plan) -> dict[int, int]:
    """Forwards each stage runs before its first backward: its longest path to a sink."""
    return edges_to_sink(plan.stage_graph)


def _one_f_one_b(mbs: list[int], warmup: int, backward: ActionKind = B) -> Order:
    w = min(warmup, len(mbs))
    order: Order = [(F, j) for j in mbs[:w]]
    for i, j in enumerate(mbs[w:]):
        order += [(F, j), (backward, mbs[i])]
    return order + [(backward, j) for j in mbs[len(mbs) - w :]]


def _gpipe(plan: Plan, mbs: list[int]) -> dict[int, Order]:
    return {s.index: [(F, j) for j in mbs] + [(B, j) for j in mbs] for s in plan.stages}


def _flush_1f1b(plan: Plan, mbs: list[int]) -> dict[int, Order]:
    w = warmups(plan)
    return {s.index: _one_f_one_b(mbs, w[s.index]) for s in plan.stages}


def _async_slice(plan: Plan, mbs: list[int], update_every: int) -> dict[int, Order]:
    """Steady-state 1F1B over `mbs`: F(f), then B(f - w) and its update, no flush."""
    w = warmups(plan)
    orders: dict[int, Order] = {}
    for s in plan.stages:
        order: Order = []
        for f in mbs:
            order.append((F, f))
            j = f - w[s.index]
            if j >= 0:
                order += _backward_and_update(j, update_every)
        orders[s.index] = order
    return orders


def _backward_and_update(j: int, update_every: int) -> Order:
    return [(B, j), (U, j)] if (j + 1) % update_every == 0 else [(B, j)]


def _update_every(name: str, m: int) -> int:
    """Backwards between an asynchronous schedule's updates: 1 (async), M (2bw)."""
    return 1 if name == "async" else m


# -- the builders, one per schedule of the registry --------------------------------------------


def _flushed(build: Callable[[Plan, list[int]], dict[int, Order]]) -> Builder:
    """Per-stage orders over micro-batches 0..M-1, then one update per stage."""

    def builder(plan: Plan, call: int, m: int) -> list[list[Action]]:
        orders = build(plan, list(range(m)))
        return _rank_lists(plan, {s: [*order, (U, -1)] for s, order in orders.items()})

    return builder


def _asynchronous(name: str) -> Builder:
    """Call `call`'s slice of the unflushed 1F1B: micro-batches call*M..call*M+M-1."""

    def builder(plan: Plan, call: int, m: int) -> list[list[Action]]:
        mbs = list(range(call * m, (call + 1) * m))
        return _rank_lists(plan, _async_slice(plan, mbs, _update_every(name, m)))

    return builder


def _forward_only(plan: Plan, call: int, m: int) -> list[list[Action]]:
    return _rank_lists(plan, {s.index: [(F, j) for j in range(m)] for s in plan.stages})


def _placed(build: Callable[[Plan, list[int]], list[RankOrder]]) -> Builder:
    """Per-device orders over micro-batches 0..M-1, then one update per device."""

    def builder(plan: Plan, call: int, m: int) -> list[list[Action]]:
        return _device_lists(plan, build(plan, list(range(m))))

    return builder


def _builders() -> dict[str, Builder]:
    builders: dict[str, Builder] = {
        "gpipe": _flushed(_gpipe),
        "1f1b": _flushed(_flush_1f1b),
        "zb": _flushed(_zero_bubble),
        "async": _asynchronous("async"),
        "2bw": _asynchronous("2bw"),
        "forward": _forward_only,
        "interleaved": _placed(_interleaved),
        "zbv": _placed(_zbv),
        "graph_interleaved": _placed(_graph_interleaved),
    }
    if set(builders) != set(SCHEDULES):
        raise ConfigError(
            "the generators and graphpipe.ir.registry.SCHEDULES disagree: builders without a "
            f"spec {sorted(set(builders) - set(SCHEDULES))}, specs without a builder "
            f"{sorted(set(SCHEDULES) - set(builders))}"
        )
    return builders


# -- checks, from the registry's spec ----------------------------------------------------------


def _check(plan: Plan, name: str, m: int) -> ScheduleSpec:
    """The spec of `name`, once `plan` and M fit it (see `make_schedule` for the errors)."""
    spec = schedule_spec(name, training=False)
    if m < 1:
        raise ConfigError(f"micro_batches must be >= 1, got {m}")
    if spec.folds_chain:
        _check_placed(plan, spec, m)
    elif spec.placement is None and plan.shared_devices():
        several = sorted(n for n, s in SCHEDULES.items() if s.placement and s.training)
        raise ScheduleError(
            f"schedule {spec.name!r} runs one stage per device, but devices "
            f"{plan.shared_devices()} hold several; use one of {several}"
        )
    replicated = [s.index for s in plan.stages if s.replicas > 1]
    if replicated and not spec.replicas:
        raise ScheduleError(
            f"schedule {spec.name!r} needs unreplicated stages, but stages {replicated} are "
            "data-parallel; plan with replication=False"
        )
    if spec.name == "2bw" and m < plan.depth:
        raise ScheduleError(f"2bw needs micro_batches >= depth, got M={m} < depth {plan.depth}")
    return spec


def _check_placed(plan: Plan, spec: ScheduleSpec, m: int) -> None:
    placement, n = str(spec.placement), plan.num_devices
    wrong = [
        s.index
        for s in plan.stages
        if s.devices != (device_of(s.index, n, placement),)
        or any(e.dst != e.src + 1 for e in plan.edges)
    ]
    if wrong or len(plan.edges) != len(plan.stages) - 1:
        raise ScheduleError(
            f"schedule {spec.name!r} needs a chain of stages placed {placement!r} "
            f"(PlanConfig(virtual_stages=..., placement={placement!r})); stages {wrong} are "
            "not placed so"
        )
    if spec.name == "interleaved" and m % n:
        raise ScheduleError(f"interleaved needs micro_batches a multiple of {n} devices, got {m}")
    if spec.name == "zbv" and len(plan.stages) != 2 * n:
        raise ScheduleError(f"zbv needs 2 stages per device, got {len(plan.stages)} on {n}")


def make_schedule(
    plan: Plan, name: str, micro_batches: int | None = None, *, calls: int = 1, first_call: int = 0
) -> Schedule:
    """The actions of every rank for `calls` consecutive step() calls.

    Args:
        plan: The plan to schedule.
        name: A schedule of `graphpipe.ir.registry.SCHEDULES` (see the module docstring).
        micro_batches: M; the plan's by default.
        calls: Consecutive step() calls to cover. Flushed schedules repeat the same lists with
            micro-batch ids restarting at 0; asynchronous ones number micro-batches on.
        first_call: Index of the first call (asynchronous schedules; the runtime asks for one
            call at a time).

    Returns:
        The schedule. It is not drained: see `drain_schedule` for asynchronous ones.

    Raises:
        ConfigError: an unknown schedule or M < 1.
        ScheduleError: the plan does not fit the schedule's spec (its placement, replicated
            stages for a schedule without replicas), or 2bw with M < depth.

    Example:
        >>> from graphpipe.planning.partition import PlanConfig, partition_op_graph
        >>> # see tests/test_schedule.py for plans built from models
    """
    m = micro_batches or plan.micro_batches
    spec = _check(plan, name, m)
    per_rank: list[list[Action]] = [[] for _ in range(plan.num_devices)]
    for call in range(first_call, first_call + calls):
        for rank, actions in enumerate(_BUILDERS[spec.name](plan, call, m)):
            per_rank[rank] += actions
    return Schedule(spec.name, m, tuple(tuple(a) for a in per_rank), calls)


def drain_schedule(
    plan: Plan, name: str, calls_done: int, micro_batches: int | None = None
) -> Schedule:
    """The backwards (and updates) an asynchronous schedule still owes after `calls_done` calls.

    Raises:
        ConfigError: `name` is not an asynchronous schedule.
    """
    m = micro_batches or plan.micro_batches
    spec = _check(plan, name, m)
    if not spec.asynchronous:
        asynchronous = sorted(n for n, s in SCHEDULES.items() if s.asynchronous)
        raise ConfigError(
            f"only asynchronous schedules ({asynchronous}) need draining, not {spec.name!r}"
        )
    end, w = calls_done * m, warmups(plan)
    every = _update_every(spec.name, m)
    orders = {
        s.index: [
            a for j in range(max(0, end - w[s.index]), end) for a in _backward_and_update(j, every)
        ]
        for s in plan.stages
    }
    lists = _rank_lists(plan, orders)
    return Schedule(spec.name, m, tuple(tuple(a) for a in lists), 0)


# -- from stage orders to rank lists -----------------------------------------------------------


def _rank_lists(plan: Plan, orders: dict[int, Order]) -> list[list[Action]]:
    lists: list[list[Action]] = [[] for _ in range(plan.num_devices)]
    for s in plan.stages:
        for kind, j in orders[s.index]:
            ranks = s.devices if kind == U else (s.device_for(j),)
            for rank in ranks:
                lists[rank] += with_messages(plan, _action(s.index, kind, j))
    return lists


def _action(stage: int, kind: ActionKind, j: int) -> Action:
    """A compute action, or an update (j < 0: the flushed update, `sU`)."""
    return Action(stage, kind, None if kind == U and j < 0 else j)


# -- several stages per device -----------------------------------------------------------------

Step = tuple[int, ActionKind, int]  # (stage, kind, micro-batch)
RankOrder = list[Step]  # a device's compute actions


def _device_lists(plan: Plan, orders: list[RankOrder]) -> list[list[Action]]:
    """Each device's order with its messages, and one update for all its stages."""
    lists: list[list[Action]] = []
    for rank, order in enumerate(orders):
        actions = [
            a for stage, kind, j in order for a in with_messages(plan, Action(stage, kind, j))
        ]
        held = [s.index for s in plan.stages_on(rank)]
        lists.append([*actions, Action(min(held), U)] if held else [])  # idle devices
    return lists


def _interleaved(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """Megatron's interleaved 1F1B on a "loop" placement (see the module docstring)."""
    n = plan.num_devices
    v = len(plan.stages) // n
    total = len(mbs) * v

    def nth(rank: int, k: int, kind: ActionKind) -> Step:
        """The k-th forward (or backward) of `rank`: (stage, kind, micro-batch)."""
        chunk = (k // n) % v
        if kind == B:
            chunk = v - 1 - chunk
        return chunk * n + rank, kind, (k // (n * v)) * n + k % n

    orders = []
    for rank in range(n):
        warmup = min(2 * (n - 1 - rank) + (v - 1) * n, total)
        order = [nth(rank, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            order += [nth(rank, warmup + k, F), nth(rank, k, B)]
        order += [nth(rank, k, B) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


# -- greedy runs of the plan's costs -----------------------------------------------------------

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


def _zbv(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """ZB-V on a "v" placement: a greedy run of the plan's costs (see the module docstring)."""
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


def _graph_interleaved(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """1F1B on any placement of single-device stages: a greedy run of the plan's costs (see
    the module docstring)."""
    w = warmups(plan)
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


# -- zero bubble -------------------------------------------------------------------------------


def _zero_bubble(plan: Plan, mbs: list[int]) -> dict[int, Order]:
    """ZB-H1 per stage: the 1F1B order with I for B, and W placed by a greedy run of the costs."""
    w = warmups(plan)
    base = {s.index: _one_f_one_b(mbs, w[s.index], backward=I) for s in plan.stages}
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


_BUILDERS = _builders()  # after every builder is defined; refuses a registry mismatch

# Derived from the registry for `graphpipe.compile` and `graphpipe.runtime.pipeline` until
# they read it themselves; nothing else should use them.
ASYNC = frozenset(n for n, s in SCHEDULES.items() if s.asynchronous)
PLACED = {n: str(s.placement) for n, s in SCHEDULES.items() if s.folds_chain}
ANY_PLACEMENT = registry.ANY_PLACEMENT
