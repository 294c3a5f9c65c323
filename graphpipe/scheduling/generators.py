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

Communication is inserted around compute: before F(j) a receive from every in-edge and after
it a send on every out-edge; before B/I(j) a receive of gradients from every out-edge that
carries them back, and after it a send on every such in-edge.

Devices holding several stages (interleaved, zbv) get one update `U` for all of them, after
their last backward. A stage replicated on r devices runs micro-batch j on devices[j % r];
each replica's list is the stage order restricted to its own micro-batches, and its update
all-reduces gradients with the other replicas. Asynchronous schedules need unreplicated stages.
"""

from __future__ import annotations

from collections.abc import Callable

from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import (
    Action,
    Plan,
    Schedule,
    Stage,
    compute_time,
    device_of,
    edges_to_sink,
    freed,
    transfer_time,
)

__all__ = ["ASYNC", "PLACED", "SCHEDULES", "drain_schedule", "make_schedule", "warmups"]

Order = list[tuple[str, int]]  # a stage's compute actions: (kind, micro-batch)
ASYNC = frozenset({"async", "2bw"})
PLACED = {"interleaved": "loop", "zbv": "v"}  # schedules for several stages per device
ANY_PLACEMENT = "graph_interleaved"  # runs any placement of single-device stages
ALIASES = {"graph1f1b": "1f1b"}


def warmups(plan: Plan) -> dict[int, int]:
    """Forwards each stage runs before its first backward: its longest path to a sink."""
    return edges_to_sink(plan.stage_graph)


def _one_f_one_b(mbs: list[int], warmup: int, backward: str = "B") -> Order:
    w = min(warmup, len(mbs))
    order: Order = [("F", j) for j in mbs[:w]]
    for i, j in enumerate(mbs[w:]):
        order += [("F", j), (backward, mbs[i])]
    return order + [(backward, j) for j in mbs[len(mbs) - w :]]


def _gpipe(plan: Plan, mbs: list[int]) -> dict[int, Order]:
    return {s.index: [("F", j) for j in mbs] + [("B", j) for j in mbs] for s in plan.stages}


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
            order.append(("F", f))
            j = f - w[s.index]
            if j >= 0:
                order += _backward_and_update(j, update_every)
        orders[s.index] = order
    return orders


def _backward_and_update(j: int, update_every: int) -> Order:
    return [("B", j), ("U", j)] if (j + 1) % update_every == 0 else [("B", j)]


def _per_stage_orders(plan: Plan, name: str, call: int, m: int) -> dict[int, Order]:
    if name in ASYNC:
        every = 1 if name == "async" else m
        return _async_slice(plan, list(range(call * m, (call + 1) * m)), every)
    if name == "forward":
        return {s.index: [("F", j) for j in range(m)] for s in plan.stages}
    builders: dict[str, Callable[[Plan, list[int]], dict[int, Order]]] = {
        "gpipe": _gpipe,
        "1f1b": _flush_1f1b,
        "zb": _zero_bubble,
    }
    orders = builders[name](plan, list(range(m)))
    return {s: [*order, ("U", -1)] for s, order in orders.items()}


def _check(plan: Plan, name: str, m: int) -> str:
    name = ALIASES.get(name, name)
    if name not in (*SCHEDULES, "forward"):
        raise ConfigError(f"unknown schedule {name!r}; known: {sorted(SCHEDULES)}")
    if m < 1:
        raise ConfigError(f"micro_batches must be >= 1, got {m}")
    if name in PLACED:
        _check_placed(plan, name, m)
    elif name == ANY_PLACEMENT:
        replicated = [s.index for s in plan.stages if s.replicas > 1]
        if replicated:
            raise ScheduleError(
                f"graph_interleaved needs unreplicated stages; stages {replicated} are "
                "replicated (plan with replication=False)"
            )
    else:
        shared = plan.shared_devices()
        if shared and name != "forward":
            raise ScheduleError(
                f"schedule {name!r} runs one stage per device, but devices {shared} hold "
                f"several; use one of {sorted([*PLACED, ANY_PLACEMENT])}"
            )
    if name in ASYNC:
        replicated = [s.index for s in plan.stages if s.replicas > 1]
        if replicated:
            raise ScheduleError(
                f"schedule {name!r} needs unreplicated stages, but stages {replicated} are "
                "data-parallel; plan with replication=False"
            )
    if name == "2bw" and m < plan.depth:
        raise ScheduleError(f"2bw needs micro_batches >= depth, got M={m} < depth {plan.depth}")
    return name


def _check_placed(plan: Plan, name: str, m: int) -> None:
    placement = PLACED[name]
    n = plan.num_devices
    wrong = [
        s.index
        for s in plan.stages
        if s.devices != (device_of(s.index, n, placement),)
        or any(e.dst != e.src + 1 for e in plan.edges)
    ]
    if wrong or len(plan.edges) != len(plan.stages) - 1:
        raise ScheduleError(
            f"schedule {name!r} needs a chain of stages placed {placement!r} "
            f"(PlanConfig(virtual_stages=..., placement={placement!r})); stages {wrong} are "
            "not placed so"
        )
    if name == "interleaved" and m % n:
        raise ScheduleError(f"interleaved needs micro_batches a multiple of {n} devices, got {m}")
    if name == "zbv" and len(plan.stages) != 2 * n:
        raise ScheduleError(f"zbv needs 2 stages per device, got {len(plan.stages)} on {n}")


def make_schedule(
    plan: Plan, name: str, micro_batches: int | None = None, *, calls: int = 1, first_call: int = 0
) -> Schedule:
    """The actions of every rank for `calls` consecutive step() calls.

    Args:
        plan: The plan to schedule.
        name: A generator from `SCHEDULES` (see the module docstring).
        micro_batches: M; the plan's by default.
        calls: Consecutive step() calls to cover. Flushed schedules repeat the same lists with
            micro-batch ids restarting at 0; asynchronous ones number micro-batches on.
        first_call: Index of the first call (asynchronous schedules; the runtime asks for one
            call at a time).

    Returns:
        The schedule. It is not drained: see `drain_schedule` for asynchronous ones.

    Raises:
        ConfigError: an unknown schedule or M < 1.
        ScheduleError: an asynchronous schedule on replicated stages, or 2bw with M < depth.

    Example:
        >>> from graphpipe.planning.partition import PlanConfig, partition_op_graph
        >>> # see tests/test_schedule.py for plans built from models
    """
    m = micro_batches or plan.micro_batches
    name = _check(plan, name, m)
    per_rank: list[list[Action]] = [[] for _ in range(plan.num_devices)]
    for call in range(first_call, first_call + calls):
        if name in PLACED or name == ANY_PLACEMENT:
            lists = _placed_lists(plan, name, m)
        else:
            lists = _rank_lists(plan, _per_stage_orders(plan, name, call, m))
        for rank, actions in enumerate(lists):
            per_rank[rank] += actions
    return Schedule(name, m, tuple(tuple(a) for a in per_rank), calls)


def drain_schedule(
    plan: Plan, name: str, calls_done: int, micro_batches: int | None = None
) -> Schedule:
    """The backwards (and updates) an asynchronous schedule still owes after `calls_done` calls.

    Raises:
        ConfigError: `name` is not an asynchronous schedule.
    """
    m = micro_batches or plan.micro_batches
    name = _check(plan, name, m)
    if name not in ASYNC:
        raise ConfigError(
            f"only asynchronous schedules ({sorted(ASYNC)}) need draining, not {name!r}"
        )
    end, w = calls_done * m, warmups(plan)
    every = 1 if name == "async" else m
    orders = {
        s.index: [
            a for j in range(max(0, end - w[s.index]), end) for a in _backward_and_update(j, every)
        ]
        for s in plan.stages
    }
    lists = _rank_lists(plan, orders)
    return Schedule(name, m, tuple(tuple(a) for a in lists), 0)


# -- from stage orders to rank lists -----------------------------------------------------------


def _rank_lists(plan: Plan, orders: dict[int, Order]) -> list[list[Action]]:
    lists: list[list[Action]] = [[] for _ in range(plan.num_devices)]
    for s in plan.stages:
        for kind, j in orders[s.index]:
            ranks = s.devices if kind == "U" else (s.device_for(j),)
            for rank in ranks:
                lists[rank] += _with_comm(plan, s.index, kind, j)
    return lists


def _with_comm(plan: Plan, s: int, kind: str, j: int) -> list[Action]:
    ins = [e for e in plan.edges if e.dst == s]
    outs = [e for e in plan.edges if e.src == s]
    if kind == "U":
        return [Action(s, "U", j if j >= 0 else None)]
    if kind == "F":
        return (
            [Action(s, "RF", j, e.src) for e in ins]
            + [Action(s, "F", j)]
            + [Action(s, "SF", j, e.dst) for e in outs]
        )
    if kind in ("B", "I"):
        return (
            [Action(s, "RB", j, e.dst) for e in outs if e.backward_message]
            + [Action(s, kind, j)]
            + [Action(s, "SB", j, e.src) for e in ins if e.backward_message]
        )
    return [Action(s, kind, j)]


# -- several stages per device -----------------------------------------------------------------

RankOrder = list[tuple[int, str, int]]  # a device's compute actions: (stage, kind, mb)


def _placed_lists(plan: Plan, name: str, m: int) -> list[list[Action]]:
    builders: dict[str, Callable[[Plan, int], list[RankOrder]]] = {
        "interleaved": _interleaved,
        "zbv": lambda p, m: _zbv(p, list(range(m))),
        ANY_PLACEMENT: lambda p, m: _graph_interleaved(p, list(range(m))),
    }
    orders = builders[name](plan, m)
    lists: list[list[Action]] = []
    for rank, order in enumerate(orders):
        actions = [a for stage, kind, j in order for a in _with_comm(plan, stage, kind, j)]
        held = [s.index for s in plan.stages_on(rank)]
        lists.append([*actions, Action(min(held), "U")] if held else [])  # idle devices
    return lists


def _interleaved(plan: Plan, m: int) -> list[RankOrder]:
    """Megatron's interleaved 1F1B on a "loop" placement (see the module docstring)."""
    n = plan.num_devices
    v = len(plan.stages) // n
    total = m * v

    def nth(rank: int, k: int, kind: str) -> tuple[int, str, int]:
        """The k-th forward (or backward) of `rank`: (stage, kind, micro-batch)."""
        chunk = (k // n) % v
        if kind == "B":
            chunk = v - 1 - chunk
        return chunk * n + rank, kind, (k // (n * v)) * n + k % n

    orders = []
    for rank in range(n):
        warmup = min(2 * (n - 1 - rank) + (v - 1) * n, total)
        order = [nth(rank, k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            order += [nth(rank, warmup + k, "F"), nth(rank, k, "B")]
        order += [nth(rank, k, "B") for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def _zbv(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """ZB-V on a "v" placement: a greedy run of the plan's costs (see the module docstring)."""
    n = plan.num_devices
    ranks = [_VRank(plan, r, mbs, cap=2 * n) for r in range(n)]
    arrivals: Arrivals = {}
    while any(r.busy() for r in ranks):
        rank = min((r for r in ranks if r.busy()), key=lambda r: r.next_start(arrivals))
        start = rank.next_start(arrivals)
        if start == float("inf"):
            raise ScheduleError("ZB-V construction stalled: no device can run")
        stage, kind, j = rank.pop(arrivals)
        rank.clock = start + compute_time(plan.stages[stage], kind)
        _post(plan, stage, kind, j, rank.clock, arrivals)
    return [r.done for r in ranks]


class _VRank:
    """One device's state while ZB-V is built: its two stages' forwards and input halves in
    micro-batch order, its pending weight halves, and the activation units it holds."""

    def __init__(self, plan: Plan, rank: int, mbs: list[int], cap: int) -> None:
        self.plan, self.cap = plan, cap
        n = plan.num_devices
        self.stages = (2 * n - 1 - rank, rank)  # the deeper one first
        # how far the shallow stage's forwards may run ahead of the deep stage's: micro-batch
        # j reaches the deep stage 2(N-1-d) stages after the shallow one, so the warm-up has
        # 2(N-d)-1 shallow forwards; more would fill the memory the deep stage needs
        self.shallow_limit = 2 * (n - rank) - 1
        self.ahead = 0  # shallow forwards done less deep forwards done
        self.todo = {(s, k): list(mbs) for s in self.stages for k in ("F", "I")}
        self.pending_w: list[tuple[int, int]] = []
        self.forwarded: set[tuple[int, int]] = set()
        self.held = 0.0
        self.clock = 0.0
        self.done: RankOrder = []

    def busy(self) -> bool:
        return bool(self.pending_w) or any(self.todo.values())

    def _ready(self, stage: int, kind: str, arrivals: Arrivals) -> float:
        queue = self.todo[(stage, kind)]
        if not queue:
            return float("inf")
        j = queue[0]
        if kind == "I" and (stage, j) not in self.forwarded:
            return float("inf")
        if kind == "F" and self.held + 1 > self.cap + 1e-9:
            return float("inf")
        if kind == "F" and stage == self.stages[1] and self.ahead >= self.shallow_limit:
            return float("inf")
        keys = [(d, a, b, j) for d, a, b in _inputs(self.plan, stage, kind)]
        return max((arrivals.get(k, float("inf")) for k in keys), default=0.0)

    def _choice(self, arrivals: Arrivals) -> tuple[float, tuple[int, str, int] | None]:
        """When the next action can start, and which: a ready I, then a ready F, then a W."""
        options = [
            (max(self.clock, self._ready(s, k, arrivals)), 0 if k == "I" else 1, i, s, k)
            for k in ("I", "F")
            for i, s in enumerate(self.stages)
        ]
        now = [o for o in options if o[0] <= self.clock]
        if now:
            _, _, _, s, k = min(now)
            return self.clock, (s, k, self.todo[(s, k)][0])
        if self.pending_w:
            s, j = self.pending_w[0]
            return self.clock, (s, "W", j)
        best = min(options)
        if best[0] == float("inf"):
            return best[0], None
        return best[0], (best[3], best[4], self.todo[(best[3], best[4])][0])

    def next_start(self, arrivals: Arrivals) -> float:
        return self._choice(arrivals)[0]

    def pop(self, arrivals: Arrivals) -> tuple[int, str, int]:
        _, action = self._choice(arrivals)
        assert action is not None
        stage, kind, j = action
        if kind == "W":
            self.pending_w.pop(0)
        else:
            self.todo[(stage, kind)].pop(0)
        if kind == "F":
            self.forwarded.add((stage, j))
            self.ahead += 1 if stage == self.stages[1] else -1
        if kind == "I":
            self.pending_w.append((stage, j))
        self.held -= freed(self.plan.stages[stage], kind)
        self.done.append(action)
        return action


def _graph_interleaved(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """1F1B on any placement of single-device stages: a greedy run of the plan's costs (see
    the module docstring)."""
    w = warmups(plan)
    ranks = [_GraphRank(plan, r, mbs, w) for r in range(plan.num_devices)]
    arrivals: Arrivals = {}
    while any(r.busy() for r in ranks):
        rank = min((r for r in ranks if r.busy()), key=lambda r: r.next_start(arrivals))
        start = rank.next_start(arrivals)
        if start == float("inf"):
            raise ScheduleError("graph_interleaved construction stalled: no device can run")
        stage, kind, j = rank.pop(arrivals)
        rank.clock = start + compute_time(plan.stages[stage], kind)
        _post(plan, stage, kind, j, rank.clock, arrivals)
    return [r.done for r in ranks]


class _GraphRank:
    """One device's state while graph_interleaved is built: per stage, its forwards and
    backwards in micro-batch order and its micro-batches in flight (at most 1F1B's warm-up
    plus one, so each stage keeps 1F1B's activation memory)."""

    def __init__(self, plan: Plan, rank: int, mbs: list[int], warmup: dict[int, int]) -> None:
        self.plan = plan
        # deeper stages (nearer a sink) first: their backwards free memory soonest
        self.stages = sorted((s.index for s in plan.stages_on(rank)), key=lambda s: warmup[s])
        self.cap = {s: warmup[s] + 1 for s in self.stages}
        self.in_flight = dict.fromkeys(self.stages, 0)
        self.todo = {(s, k): list(mbs) for s in self.stages for k in ("F", "B")}
        self.forwarded: set[tuple[int, int]] = set()
        self.clock = 0.0
        self.done: RankOrder = []

    def busy(self) -> bool:
        return any(self.todo.values())

    def _ready(self, stage: int, kind: str, arrivals: Arrivals) -> float:
        queue = self.todo[(stage, kind)]
        if not queue:
            return float("inf")
        j = queue[0]
        if kind == "B" and (stage, j) not in self.forwarded:
            return float("inf")
        if kind == "F" and self.in_flight[stage] >= self.cap[stage]:
            return float("inf")
        keys = [(d, a, b, j) for d, a, b in _inputs(self.plan, stage, kind)]
        return max((arrivals.get(k, float("inf")) for k in keys), default=0.0)

    def _choice(self, arrivals: Arrivals) -> tuple[float, tuple[int, str, int] | None]:
        """When the next action can start, and which: of those ready now a backward first
        (the oldest micro-batch, then the deeper stage), then a forward (the same order);
        else whichever is ready first."""
        options = []
        for order, s in enumerate(self.stages):
            for k in ("B", "F"):
                ready = max(self.clock, self._ready(s, k, arrivals))
                options.append((ready, k != "B", self.todo[(s, k)][:1], order, s, k))
        now = [o for o in options if o[0] <= self.clock]
        ready, _, _, _, s, k = min(now or options)
        if ready == float("inf"):
            return ready, None
        return ready, (s, k, self.todo[(s, k)][0])

    def next_start(self, arrivals: Arrivals) -> float:
        return self._choice(arrivals)[0]

    def pop(self, arrivals: Arrivals) -> tuple[int, str, int]:
        _, action = self._choice(arrivals)
        assert action is not None
        stage, kind, j = action
        self.todo[(stage, kind)].pop(0)
        if kind == "F":
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
    base = {s.index: _one_f_one_b(mbs, w[s.index], backward="I") for s in plan.stages}
    ranks = [
        _ZbRank(s, [a for a in base[s.index] if s.device_for(a[1]) == rank], w[s.index])
        for s in plan.stages
        for rank in s.devices
    ]
    arrivals: Arrivals = {}
    while any(r.busy() for r in ranks):
        rank = min((r for r in ranks if r.busy()), key=lambda r: r.next_start(plan, arrivals))
        start = rank.next_start(plan, arrivals)
        if start == float("inf"):
            raise ScheduleError("zero-bubble construction stalled: no rank can run")
        kind, j = rank.pop(plan, arrivals)
        rank.clock = start + compute_time(plan.stages[rank.stage], kind)
        _post(plan, rank.stage, kind, j, rank.clock, arrivals)
    orders: dict[int, Order] = {s.index: [] for s in plan.stages}
    for r in ranks:  # replicas hold disjoint micro-batches: concatenating keeps each one's order
        orders[r.stage] += r.done
    return orders


Arrivals = dict[tuple[str, int, int, int], float]  # (direction, from, to, mb) -> arrival time


class _ZbRank:
    """One rank's state while the zero-bubble order is built."""

    def __init__(self, stage: Stage, base: Order, warmup: int) -> None:
        self.stage, self.base = stage.index, list(base)
        self.info = stage
        self.cap = warmup + 1  # 1F1B's activation units: ZB-H1 keeps its memory
        self.pending_w: list[int] = []
        self.held = 0.0
        self.clock = 0.0
        self.done: Order = []

    def busy(self) -> bool:
        return bool(self.base or self.pending_w)

    def _ready(self, plan: Plan, arrivals: Arrivals) -> float:
        kind, j = self.base[0]
        keys = [(d, a, b, j) for d, a, b in _inputs(plan, self.stage, kind)]
        return max((arrivals.get(k, float("inf")) for k in keys), default=0.0)

    def _takes_w(self, plan: Plan, arrivals: Arrivals) -> bool:
        """Whether the next action is a W: forced by the memory cap, or filling a wait."""
        if not self.pending_w:
            return False
        if not self.base or (self.base[0][0] == "F" and self.held + 1 > self.cap + 1e-9):
            return True
        return self._ready(plan, arrivals) > self.clock

    def next_start(self, plan: Plan, arrivals: Arrivals) -> float:
        if self._takes_w(plan, arrivals):
            return self.clock
        return max(self.clock, self._ready(plan, arrivals))

    def pop(self, plan: Plan, arrivals: Arrivals) -> tuple[str, int]:
        if self._takes_w(plan, arrivals):
            action = ("W", self.pending_w.pop(0))
        else:
            action = self.base.pop(0)
            if action[0] == "I":
                self.pending_w.append(action[1])
        self.held -= freed(self.info, action[0])
        self.done.append(action)
        return action


def _inputs(plan: Plan, s: int, kind: str) -> list[tuple[str, int, int]]:
    """Messages (direction, from stage, to stage) an action of stage `s` waits for."""
    if kind == "F":
        return [("F", e.src, s) for e in plan.edges if e.dst == s]
    if kind in ("B", "I"):
        return [("B", e.dst, s) for e in plan.edges if e.src == s and e.backward_message]
    return []


def _post(plan: Plan, s: int, kind: str, j: int, end: float, arrivals: Arrivals) -> None:
    """Record when the messages an action sends arrive."""
    if kind == "F":
        for e in plan.edges:
            if e.src == s:
                arrivals[("F", s, e.dst, j)] = end + transfer_time(plan, e, "F")
    elif kind in ("B", "I"):
        for e in plan.edges:
            if e.dst == s and e.backward_message:
                arrivals[("B", s, e.src, j)] = end + transfer_time(plan, e, "B")


SCHEDULES = frozenset(
    {"gpipe", "1f1b", "zb", "async", "2bw", "interleaved", "zbv", "graph_interleaved"}
)
