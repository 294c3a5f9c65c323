"""The lowering: a Schedule -> a Program (`graphpipe.ir.program`), messages fused into groups.

    program = lower(make_schedule(plan, "1f1b"))
    print(program)          # rank 0: 0F0 [0SF0>1] 0F1 [0SF1>1 0RB0<1] 0B0 ...

A rank's program is an ordered list of compute actions (F, B, I, W, U) and communication
groups. A group holds every send and receive that falls between the same two compute
actions, and the runtime issues it as one `batch_isend_irecv`: on NCCL the group's
operations run together, so a send whose receiver is itself sending in the same group cannot
block it. This is what keeps the steady state of 1F1B from deadlocking on NCCL: rank s sends
F(j+1) and receives B(j) in one group while rank s+1 sends B(j) and receives F(j+1) in one.
Issued one message at a time, the two ranks' first operations are both sends, and each waits
for a receive the other has not reached (`graphpipe.scheduling.dryrun.check_program` shows it).

A compute action waits only for the receives it reads: the forward of micro-batch j for the
activations of j, a backward for the gradients of j.

Lowerings:
    lower(schedule)                  fused groups, the order the schedule gives (NCCL)
    lower(schedule, prefetch=True)   every receive of the call in one early group, posted before
                                     any compute (after the first one on a rank whose first
                                     action reads no message); for transports that match
                                     messages by tag and buffer them (gloo), so data flows as
                                     soon as it is sent
    lower(schedule, fuse=False)      one group per message: how graphpipe issued messages before,
                                     kept to show that it deadlocks under NCCL's semantics

The text form brackets each group; `graphpipe.ir.program.parse_ops` reads it back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from graphpipe.errors import ScheduleError
from graphpipe.ir import Action, Message, Occurrences, Plan, Schedule
from graphpipe.ir.program import Comm, Op, Program
from graphpipe.scheduling.simulate import Engine

__all__ = ["lower", "lower_calls", "self_contained"]


def lower(plan: Plan, schedule: Schedule, *, fuse: bool = True, prefetch: bool = False) -> Program:
    """Each rank's operations: its compute actions, with its messages grouped.

    Args:
        plan: The plan the schedule is for.
        schedule: The per-rank actions of one or more step() calls.
        fuse: Place the messages by one global order and group those that land between the
            same two compute actions (else one group per message, where the schedule has it).
        prefetch: Move every receive into one group before the first operation (transports
            that buffer, such as gloo).

    Returns:
        The program.

    Raises:
        ScheduleError: the messages cannot be ordered consistently with the ranks' compute
            orders (not seen for the generators' schedules; the message names the rank).
    """
    lists = self_contained(plan, schedule.ranks)
    if fuse:
        keys = _message_keys(plan, Schedule(schedule.name, schedule.micro_batches, lists))
        ranks = tuple(_place(r, actions, keys) for r, actions in enumerate(lists))
    else:
        ranks = tuple(_one_per_message(actions) for actions in lists)
    if prefetch:
        ranks = tuple(_hoist_receives(plan, r, ops) for r, ops in enumerate(ranks))
    return Program(schedule.name, schedule.micro_batches, ranks, schedule.calls, prefetch)


def lower_calls(plan: Plan, schedules: Sequence[Schedule], **options: bool) -> Program:
    """The programs of consecutive step() calls (and a drain), lowered one by one as the
    runtime lowers them, end to end: what the dry run of an asynchronous pipeline checks."""
    programs = [lower(plan, s, **options) for s in schedules]
    ranks = tuple(tuple(op for p in programs for op in p.ranks[r]) for r in range(plan.num_devices))
    first = programs[0]
    return Program(first.name, first.micro_batches, ranks, len(schedules), first.prefetch)


def self_contained(plan: Plan, ranks: Sequence[Sequence[Action]]) -> tuple[tuple[Action, ...], ...]:
    """The lists with every message sent in them also received in them.

    An asynchronous call sends some messages that the next call (or the drain) reads. Their
    receives are posted at the end of the sending call instead, and the next call does not
    post them again, so every call's messages complete within the call: on NCCL a send left
    pending would block the sender's stream until the next call. The received values wait in
    the executor's state for the action that reads them.
    """
    sends: dict[Message, list[Action]] = defaultdict(list)
    receives: dict[Message, int] = defaultdict(int)
    for actions in ranks:
        for a in actions:
            if a.kind.is_send:
                sends[a.message].append(a)
            elif a.kind.is_receive:
                receives[a.message] += 1
    out = [list(actions) for actions in ranks]
    for r, actions in enumerate(ranks):  # receives of messages sent before these lists
        drop = {k: receives[k] - len(sends.get(k, [])) for k in receives}
        kept = []
        for a in actions:
            key = a.message if a.kind.is_receive else None
            if key is not None and drop.get(key, 0) > 0:
                drop[key] -= 1
                continue
            kept.append(a)
        out[r] = kept
    for key, sent in sends.items():  # messages whose receive comes after these lists
        for _ in sent[receives.get(key, 0) :]:
            out[plan.stages[key.dst].device_for(key.mb)].append(key.receive)
    return tuple(tuple(actions) for actions in out)


Key = tuple[float, int, int]  # (send time in a unit-cost run, sender rank, its list index)


def _message_keys(plan: Plan, schedule: Schedule) -> dict[tuple[int, int], Key]:
    """The global order of messages, for each (rank, list index) of a send or receive.

    Messages are ordered by when a run with unit compute costs sends them. Every rank issues
    its messages in this one order, so the earliest unfinished message always heads the
    streams of both its ranks, whatever NCCL's stream order: the program cannot deadlock.
    """
    engine = Engine(plan, schedule, lambda a: 1.0, lambda a: 0.0, contention=False)
    engine.run()
    by_message: dict[tuple[Message, int], Key] = {}
    sent = Occurrences()
    for (rank, i), t in sorted(engine.send_times.items()):
        a = schedule.ranks[rank][i]
        by_message[(a.message, sent.number(a))] = (t, rank, i)
    keys: dict[tuple[int, int], Key] = {}
    for rank, actions in enumerate(schedule.ranks):
        seen = Occurrences()
        for i, a in enumerate(actions):
            if a.kind.is_message:
                keys[(rank, i)] = by_message[(a.message, seen.number(a))]
    return keys


def _place(
    rank: int, actions: Sequence[Action], keys: dict[tuple[int, int], Key]
) -> tuple[Op, ...]:
    """Put each message in a slot between compute actions, in the global order (the slots
    never go back): a send right after the compute that makes it, or later where the order
    needs it; a receive right before the compute that reads it, or earlier where the order
    needs it."""
    computes: list[Action] = []
    bounds: list[tuple[Key, int, Action]] = []
    for i, a in enumerate(actions):
        if a.kind.is_message:
            bounds.append((keys[(rank, i)], len(computes), a))
        else:
            computes.append(a)
    order = sorted(bounds, key=lambda b: b[0])
    earliest, at = [], 0
    for _, bound, a in order:  # forward: the earliest slots that keep the order
        if a.kind.is_send:
            at = max(at, bound)
        elif at > bound:
            raise ScheduleError(
                f"rank {rank}: cannot order {a} before the compute that reads it; "
                "its messages do not follow one global order"
            )
        earliest.append(at)
    slots: dict[int, list[Action]] = defaultdict(list)
    after = len(computes)
    for (_, bound, a), lo in zip(reversed(order), reversed(earliest), strict=True):
        # backward: a send as early as it can go, a receive as late (its group is waited
        # for as a whole on NCCL, so an early receive would hold up the compute after it)
        after = lo if a.kind.is_send else min(bound, after)
        slots[after].insert(0, a)
    ops: list[Op] = []
    for k in range(len(computes) + 1):
        if slots.get(k):
            ops.append(Comm(tuple(slots[k])))
        if k < len(computes):
            ops.append(computes[k])
    return tuple(ops)


def _one_per_message(actions: Sequence[Action]) -> tuple[Op, ...]:
    return tuple(Comm((a,)) if a.kind.is_message else a for a in actions)


def _hoist_receives(plan: Plan, rank: int, ops: Sequence[Op]) -> tuple[Op, ...]:
    """Every receive from another rank moved into one early group (a receive from a stage of
    the same rank stays after the local send it copies). The group comes first, or, on a
    rank whose first compute action reads no message (the first stage's), right after that
    action: posting a call's receives takes the host a millisecond or more while every rank
    starts its step at once, and no message can reach such a rank before its first action's
    output has left it, except from another source stage of a stage DAG (received then at
    the cost of gloo's rendezvous)."""

    def early(a: Action) -> bool:
        assert a.peer is not None and a.mb is not None
        return a.kind.is_receive and plan.stages[a.peer].device_for(a.mb) != rank

    first = tuple(a for op in ops if isinstance(op, Comm) for a in op.actions if early(a))
    rest: list[Op] = []
    for op in ops:
        if isinstance(op, Comm):
            kept = tuple(a for a in op.actions if not early(a))
            if kept:
                rest.append(Comm(kept))
        else:
            rest.append(op)
    if not first:
        return tuple(rest)
    if ops and isinstance(ops[0], Action) and ops[0].kind.is_compute:  # it reads no message
        then = rest[1] if len(rest) > 1 and isinstance(rest[1], Comm) else None
        joined = Comm(first + (then.actions if then is not None else ()))
        return (rest[0], joined, *rest[2 if then is not None else 1 :])
    return (Comm(first), *rest)
