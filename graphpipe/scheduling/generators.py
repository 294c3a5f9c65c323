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
    zb      zero bubble ZB-H1 (Qi et al., arXiv 2401.10241, section 3.1): 1F1B with the
            backward split into I (input gradient, on the critical path) and W (weight
            gradient, deferrable). The F and I passes keep 1F1B's order; a stage d stages
            from a source (stage i of a chain) defers its first d W passes, then runs the
            oldest pending W right after each I, and its deferred ones at the end, where
            they fill the cool-down bubble (as torch's ScheduleInterleavedZeroBubble does
            with one stage per rank). On a chain of p equal stages the step is
            M(F + I + W) + (p - 1)(F + I - W), the paper's bubble; the peak memory is
            1F1B's (the first stage's p micro-batches): stage i holds p - i full
            micro-batches and i weight halves at most. A second candidate places the W
            passes by a greedy run of the plan's costs (a W whenever the next F or I waits,
            and before an F once the stage holds 1F1B's activation); the one that replays
            faster over the plan's costs is kept, the paper's on a tie, so unknown
            (all-zero) times give the paper's order.
    zb2     zero bubble ZB-H2 (same paper): stage s warms up with up to 2 w(s) + 1 forwards
            (w: its 1F1B warm-up, so 2p - 1 on a chain's first stage), runs a ready I
            first, then F, and W passes in between, built by a greedy run under the paper's
            F = I = W (`graphpipe.scheduling.greedy.zb_h2`). Each rank is busy from its
            first F to its last W with no gap on equal stages: the step is
            M(F + I + W) + (p - 1)F, the rest of the paper's zero bubble being the ramp of a
            flushed step.
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
    interleaved_zb
            interleaved zero bubble (torch's ScheduleInterleavedZeroBubble, the ZB paper's
            ZB-1P over a "loop" placement): interleaved 1F1B's rounds with the backward
            split, a warm-up of (N-1-d) + (v-1)N forwards on device d, each I followed by the
            W of the oldest pending I once the device has deferred d of them, the rest at the
            end. A fixed order. Needs M a multiple of N.
    zbv     ZB-V (Qi et al., arXiv 2405.15362) on a chain of 2N stages folded "v" onto the
            devices (device d holds stages d and 2N-1-d), the backward split into I and W.
            Three candidates: the paper's order (`paper_zbv`, its figure 4, as torch's
            ScheduleZBVZeroBubble), and two greedy runs, under the paper's F = I = W and
            under the plan's times, in which each device does a ready I first, then a ready
            F (the deeper stage first) while it holds fewer than 2N activation units (and
            its first stage's forwards are fewer than 2(N-d)-1 ahead of its second's), and
            W passes whenever nothing else is ready. The one that replays fastest over the
            plan's times is kept; ties go to the fastest under F = I = W, then to the
            paper's, so unknown (all-zero) times never give a greedy order over zeros (the
            greedy runs win where M < 2N - 1). On equal stages the step is
            2M(F + I + W) + (N - 1)F.
    dualpipev
            DualPipeV (DeepSeek-V3's DualPipe, arXiv 2412.19437, cut in half onto a "v"
            placement, as torch's ScheduleDualPipeV): on the chain of 2N stages folded "v"
            (device d holds d and 2N-1-d), a warm-up of forwards and split backwards, then a
            steady state in which each device runs a forward of one of its stages paired with
            the full backward (B) of the other, then a cool-down of full and split
            backwards (`graphpipe.scheduling.orders.dualpipev` has the phases). A fixed
            order. DualPipe overlaps each pair's compute and communication; here the pair
            runs one after the other, each half sending as it ends. DualPipe's published
            bubble, (N-1)(F&B + B - 3W), is what the order steps when a pair sends as one
            unit; with F = I = W = T this runtime steps 6MT + (N - 1)T, ZB-V's, holding 2N + 1
            micro-batches' activations per device (ZB-V: 2N). Needs M >= 2N, as DualPipe
            (its order of 2N restricted to fewer is valid but slower than zbv, 690 against
            550 ms on benchmarks.peers' N = 8, M = 8 chain).
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
refuses to import when the two disagree. Which plans and M each one runs is its rule
(`graphpipe.scheduling.rules`), checked before anything is built.

Devices holding several stages (interleaved, zbv, dualpipev) get one update `U` for all of
them, after their last backward. A stage replicated on r devices runs micro-batch j on
devices[j % r]; each replica's list is the stage order restricted to its own micro-batches,
and its update all-reduces gradients with the other replicas. Asynchronous schedules need
unreplicated stages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from graphpipe.errors import ConfigError
from graphpipe.ir import Action, ActionKind, Plan, Schedule, edges_to_sink, with_messages
from graphpipe.ir.registry import SCHEDULES
from graphpipe.scheduling.greedy import (
    PAPER,
    Order,
    RankOrder,
    faster,
    fastest,
    graph_interleaved,
    plan_costs,
    weight_halves,
    zb_h2,
    zbv,
)
from graphpipe.scheduling.orders import (
    dualpipev,
    interleaved,
    interleaved_zb,
    one_f_one_b,
    paper_zb_h1,
    paper_zbv,
)
from graphpipe.scheduling.rules import check

__all__ = ["drain_schedule", "in_flight", "make_schedule", "warmups"]

F, B, I, W, U = (ActionKind(k) for k in "FBIWU")  # noqa: E741 -- the kinds' own letters
Builder = Callable[[Plan, int, int], list[list[Action]]]  # (plan, call, M) -> rank lists


def warmups(plan: Plan) -> dict[int, int]:
    """Forwards each stage runs before its first backward: its longest path to a sink."""
    return edges_to_sink(plan.stage_graph)


def _gpipe(plan: Plan, mbs: list[int]) -> dict[int, Order]:
    return {s.index: [(F, j) for j in mbs] + [(B, j) for j in mbs] for s in plan.stages}


def _flush_1f1b(plan: Plan, mbs: list[int]) -> dict[int, Order]:
    w = warmups(plan)
    return {s.index: one_f_one_b(mbs, w[s.index]) for s in plan.stages}


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
        "zb": _flushed(_zb_h1),
        "zb2": _flushed(lambda p, mbs: zb_h2(p, mbs, warmups(p))),
        "async": _asynchronous("async"),
        "2bw": _asynchronous("2bw"),
        "forward": _forward_only,
        "interleaved": _placed(interleaved),
        "interleaved_zb": _placed(interleaved_zb),
        "zbv": _placed(_zbv),
        "dualpipev": _placed(dualpipev),
        "graph_interleaved": _placed(lambda p, mbs: graph_interleaved(p, mbs, warmups(p))),
    }
    if set(builders) != set(SCHEDULES):
        raise ConfigError(
            "the generators and graphpipe.ir.registry.SCHEDULES disagree: builders without a "
            f"spec {sorted(set(builders) - set(SCHEDULES))}, specs without a builder "
            f"{sorted(set(SCHEDULES) - set(builders))}"
        )
    return builders


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
        ScheduleError: the schedule's rule (`graphpipe.scheduling.rules`) does not hold: the
            plan's placement is not the schedule's, replicated stages for a schedule without
            replicas, a loop's M not a multiple of N, 2bw with M < depth, dualpipev with
            M < 2N; every problem named.

    Example:
        >>> from graphpipe.planning.partition import PlanConfig, partition_op_graph
        >>> # see tests/test_schedule.py for plans built from models
    """
    m = micro_batches or plan.micro_batches
    spec = check(plan, name, m)
    per_rank: list[list[Action]] = [[] for _ in range(plan.num_devices)]
    for call in range(first_call, first_call + calls):
        for rank, actions in enumerate(_BUILDERS[spec.name](plan, call, m)):
            per_rank[rank] += actions
    return Schedule(spec.name, m, _without_backward(plan, per_rank), calls)


BACKWARD_KINDS = frozenset({ActionKind.B, ActionKind.I, ActionKind.W})


def _without_backward(plan: Plan, per_rank: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    """The lists without the B, I and W of stages that run forward only (`Stage.backward`:
    a frozen encoder). Their edges carry no gradient (`StageEdge.backward_message`), so no
    message goes with those actions; each builder's order is kept otherwise."""
    skip = {s.index for s in plan.stages if not s.backward}
    return tuple(
        tuple(a for a in actions if not (a.stage in skip and a.kind in BACKWARD_KINDS))
        for actions in per_rank
    )


def drain_schedule(
    plan: Plan, name: str, calls_done: int, micro_batches: int | None = None
) -> Schedule:
    """The backwards (and updates) an asynchronous schedule still owes after `calls_done` calls.

    Raises:
        ConfigError: `name` is not an asynchronous schedule.
    """
    m = micro_batches or plan.micro_batches
    spec = check(plan, name, m)
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
    return Schedule(spec.name, m, _without_backward(plan, lists), 0)


def in_flight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most micro-batches one of its devices holds at once in `schedule`'s
    order: from a forward to the end of its backward (its B, or its W after the I; a weight
    half waiting for its W is counted whole). Read from the order alone, per call.

    On a chain under 1f1b this is each stage's warm-up + 1 (1F1B's count, which the planner
    assumes); zb holds up to p on every stage, zb2 up to 2p - 1, zbv 2N per device and
    dualpipev 2N + 1, shared by its two stages.

    Example (a W deferred past the next F: 3 held, where B in its place would hold 2):
        >>> from graphpipe.ir import parse_ranks
        >>> lists = parse_ranks(["0F0 0F1 0I0 0F2 0W0 0I1 0W1 0I2 0W2 0U"])
        >>> in_flight(Schedule("zb", 3, lists, 1))
        {0: 3}
    """
    most: dict[int, int] = {}
    for actions in schedule.ranks:
        held: dict[int, int] = defaultdict(int)
        for a in actions:
            if a.kind == F:
                held[a.stage] += 1
                most[a.stage] = max(most.get(a.stage, 0), held[a.stage])
            elif a.kind in (B, W):
                held[a.stage] -= 1
    return most


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


def _zbv(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """ZB-V (see the module docstring): the faster of the paper's order and two greedy runs."""
    candidates = [paper_zbv(plan, mbs), zbv(plan, mbs, PAPER), zbv(plan, mbs, plan_costs())]
    return faster(plan, candidates)


def _zb_h1(plan: Plan, mbs: list[int]) -> dict[int, Order]:
    """ZB-H1 per stage (see the module docstring): the paper's order, or the plan's costs'
    placement of the W passes where that replays faster."""
    w = warmups(plan)
    base = {s.index: one_f_one_b(mbs, w[s.index], backward=I) for s in plan.stages}
    return fastest(plan, [paper_zb_h1(plan, base), weight_halves(plan, base, w)])


_BUILDERS = _builders()  # after every builder is defined; refuses a registry mismatch
