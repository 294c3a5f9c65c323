"""Dry run: validate a Schedule against its Plan before anything runs.

Checks, every problem reported at once:
- each rank runs only the stages it holds, and a micro-batch only on the replica that owns it
  (devices[j % r]);
- every (stage, micro-batch) has exactly one forward and one backward (a full B, or an I and a
  later W), forward first, per step() call for flushed schedules;
- every send follows the compute that makes its value, every receive comes before the compute
  that needs it, and sends and receives pair up one to one (the lowering to a program then
  issues every rank pair's messages in the same order on both ends);
- a dry run with blocking receives and buffered sends finishes: the schedule cannot deadlock;
- the peak memory of every rank fits the plan's budget;
- a step at other shapes than the step before (`check_shapes`): every message is sized on its
  two ends from the shapes of the step that brought its micro-batch, which both ranks know
  when they issue it (before its receive is posted).

`check_program` runs a lowered program (`graphpipe.scheduling.program`) under a transport's
semantics:
NCCL's rendezvous (one FIFO stream per peer pair, a send completes only when its receive
runs) or gloo's buffering. `check_run` checks all of it for what the runtime will run.

A failure raises `ScheduleError` with the rank-by-time grid, the offending actions marked
with `>>...<<`.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from graphpipe.errors import ScheduleError
from graphpipe.ir import (
    SCHEDULES,
    Action,
    ActionKind,
    Message,
    Occurrences,
    Plan,
    Schedule,
    awaits,
    schedule_spec,
    sends,
)
from graphpipe.ir.program import Comm, Op, Program
from graphpipe.scheduling.generators import drain_schedule, make_schedule
from graphpipe.scheduling.program import lower_calls
from graphpipe.scheduling.simulate import Deadlock, Engine, UpdateBarrier, simulate

__all__ = ["SEMANTICS", "check_program", "check_run", "check_schedule", "check_shapes", "grid"]

Mark = tuple[int, int]  # (rank, index in its list)


def check_schedule(plan: Plan, schedule: Schedule) -> None:
    """Validate `schedule` for `plan` (see the module docstring).

    Raises:
        ScheduleError: listing every problem, followed by the marked grid.
    """
    problems: list[str] = []
    marks: list[Mark] = []
    _placement(plan, schedule, problems, marks)
    _completeness(plan, schedule, problems, marks)
    _data_order(plan, schedule, problems, marks)
    _pairing(schedule, problems, marks)
    if not problems:
        _deadlock_and_memory(plan, schedule, problems, marks)
    if problems:
        raise ScheduleError(
            f"invalid {schedule.name} schedule ({len(problems)} problems):",
            [*problems, "grid (offending actions marked >>...<<):\n" + grid(schedule, marks)],
        )


def grid(schedule: Schedule, marks: list[Mark] = (), context: int = 10) -> str:  # type: ignore[assignment]
    """The rank-by-time grid: one row per rank, one column per step of its list.

    With marks, only the columns around the first marked step are shown.
    """
    lo, hi = 0, max((len(a) for a in schedule.ranks), default=0)
    if marks:
        first = min(i for _, i in marks)
        lo, hi = max(0, first - context), first + context + 1
    marked = set(marks)
    cells = [
        [(f">>{a}<<" if (r, i) in marked else str(a)) for i, a in enumerate(actions)][lo:hi]
        for r, actions in enumerate(schedule.ranks)
    ]
    width = max((len(c) for row in cells for c in row), default=2)
    head = f"{'':>8} " + " ".join(
        f"{f't{i}':<{width}}" for i in range(lo, lo + max(map(len, cells), default=0))
    )
    rows = [f"rank {r:<3} " + " ".join(f"{c:<{width}}" for c in row) for r, row in enumerate(cells)]
    return "\n".join([head, *rows])


def _placement(plan: Plan, schedule: Schedule, problems: list[str], marks: list[Mark]) -> None:
    if len(schedule.ranks) != plan.num_devices:
        problems.append(
            f"the schedule has {len(schedule.ranks)} ranks, the plan {plan.num_devices}"
        )
    for rank, actions in enumerate(schedule.ranks):
        held = {s.index: s for s in plan.stages_on(rank)}
        for i, a in enumerate(actions):
            stage = held.get(a.stage)
            if stage is None:
                where = f"stages {sorted(held)}" if held else "no stage"
                problems.append(f"rank {rank} runs {a} but holds {where}")
                marks.append((rank, i))
            elif a.mb is not None and a.kind != ActionKind.U and stage.device_for(a.mb) != rank:
                problems.append(
                    f"rank {rank} runs {a}, but micro-batch {a.mb} of stage "
                    f"{stage.index} belongs to rank {stage.device_for(a.mb)}"
                )
                marks.append((rank, i))


def _completeness(plan: Plan, schedule: Schedule, problems: list[str], marks: list[Mark]) -> None:
    """Per (stage, micro-batch): F then B, or F then I then W; once per call when flushed."""
    seen: dict[tuple[int, int], str] = defaultdict(str)
    where: dict[tuple[int, int], Mark] = {}
    for rank, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            if a.is_compute and a.mb is not None:
                seen[(a.stage, a.mb)] += a.kind
                where.setdefault((a.stage, a.mb), (rank, i))
    spec = SCHEDULES.get(schedule.name)
    repeats = 1 if spec is not None and spec.asynchronous else schedule.calls
    mbs = sorted({mb for _, mb in seen})
    for s in plan.stages:
        wanted = ("FB" * repeats, "FIW" * repeats) if s.backward else ("F" * repeats,)
        for j in mbs:
            kinds = seen.get((s.index, j), "")
            if kinds not in wanted:
                expected = "F then B (or F, I, W)" if s.backward else "F alone (forward only)"
                problems.append(
                    f"stage {s.index} micro-batch {j} runs {' '.join(kinds) or 'nothing'}; "
                    f"expected {expected}{' per call' if repeats > 1 else ''}"
                )
                if (s.index, j) in where:
                    marks.append(where[(s.index, j)])


def _data_order(plan: Plan, schedule: Schedule, problems: list[str], marks: list[Mark]) -> None:
    """Sends after the compute that makes their value, receives before the one that needs it."""
    for rank, actions in enumerate(schedule.ranks):
        made: set[Message] = set()  # by the computes so far
        received: set[Message] = set()
        for i, a in enumerate(actions):
            if a.is_compute:
                missing = sorted(m.receive for m in awaits(plan, a) if m not in received)
                if missing:
                    problems.append(
                        f"rank {rank} runs {a} before receiving "
                        + ", ".join(f"{r.kind}<{r.peer}" for r in missing)
                    )
                    marks.append((rank, i))
                made.update(sends(plan, a))
            elif a.kind.is_receive:
                received.add(a.message)
            elif a.kind.is_send and a.message not in made:
                problems.append(f"rank {rank} sends {a} before computing it")
                marks.append((rank, i))


def _pairing(schedule: Schedule, problems: list[str], marks: list[Mark]) -> None:
    """Every send has its receive and vice versa. (The order in which a rank pair's messages
    are issued is the program's: `graphpipe.scheduling.program` issues them in one global order.)"""
    sent: dict[Message, list[Mark]] = defaultdict(list)
    received: dict[Message, list[Mark]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            if a.kind.is_send:
                sent[a.message].append((rank, i))
            elif a.kind.is_receive:
                received[a.message].append((rank, i))
    for key in sorted(set(sent) | set(received)):
        n_sent, n_got = len(sent.get(key, [])), len(received.get(key, []))
        if n_sent != n_got:
            problems.append(f"{key} is sent {n_sent} time(s) and received {n_got}")
            marks.extend((sent.get(key) or received.get(key) or [])[:1])


def _deadlock_and_memory(
    plan: Plan, schedule: Schedule, problems: list[str], marks: list[Mark]
) -> None:
    try:
        Engine(plan, schedule, lambda a: 1.0, lambda a: 0.0).run()
    except Deadlock as dead:
        for rank, i in sorted(dead.blocked.items()):
            problems.append(f"deadlock: rank {rank} waits forever at {schedule.ranks[rank][i]}")
            marks.append((rank, i))
        return
    budget = plan.cost_model.memory.budget
    if budget is None:
        return
    for rank, peak in enumerate(simulate(plan, schedule).peak_memory):
        if peak > budget:
            problems.append(f"rank {rank} peaks at {peak} bytes, over the budget of {budget:.0f}")


# -- programs under a transport's semantics ----------------------------------------------------


def check_run(
    plan: Plan,
    name: str,
    micro_batches: int | None = None,
    calls: int = 2,
    made: Schedule | None = None,
) -> None:
    """Check everything the runtime will run for schedule `name`: the schedule (over `calls`
    calls and the drain when asynchronous), and the programs lowered from it call by call,
    in NCCL's form under rendezvous semantics and in gloo's (receives first) under buffered.

    Args:
        plan: The plan.
        name: The schedule's name.
        micro_batches: M; the plan's by default.
        calls: step() calls to check.
        made: The first call's schedule, already made (`make_schedule(plan, name, M)`):
            checked as it is, not made again.

    Raises:
        ScheduleError: the first check that fails, naming every problem it found.
    """
    m = micro_batches or plan.micro_batches
    if schedule_spec(name, training=False).asynchronous:
        parts = [made] if made else []
        parts += [make_schedule(plan, name, m, first_call=c) for c in range(len(parts), calls)]
        parts.append(drain_schedule(plan, name, calls, m))
        ranks = tuple(tuple(a for p in parts for a in p.ranks[r]) for r in range(plan.num_devices))
        check_schedule(plan, Schedule(parts[0].name, m, ranks, calls))
        brought = [range(c * m, (c + 1) * m) for c in range(calls)] + [range(0)]
        check_shapes(parts, brought)
    else:
        parts = [made or make_schedule(plan, name, m)]
        check_schedule(plan, parts[0])
        check_shapes(parts * 2, [range(m)] * 2)  # two calls, the second at other shapes
    check_program(plan, lower_calls(plan, parts), "rendezvous")
    check_program(plan, lower_calls(plan, parts, prefetch=True), "buffered")


def check_shapes(parts: Sequence[Schedule], brought: Sequence[Sequence[int]]) -> None:
    """Run consecutive step() calls, each at shapes of its own (other than the call before's),
    and check that every message is sized alike on its two ends, from the shapes of the call
    that brought its micro-batch, known to each rank when it issues the message.

    Every rank receives each call's whole mini-batch, so from the call's start it knows the
    shapes of the micro-batches the call brings (`brought[c]`: c*M.. for an asynchronous
    schedule, 0..M-1 again for a flushed one, none for a drain). It keeps a micro-batch's
    shapes across calls while it has acted on it and still has actions on it (the runtime's
    executor keeps them for its micro-batches in flight); otherwise it would size a message
    of an older micro-batch from the new call's shapes, which its peer does not.

    Args:
        parts: Each call's schedule, in order.
        brought: The micro-batch ids each call brings.

    Raises:
        ScheduleError: naming every action on a micro-batch whose shapes its rank does not
            know, and every message whose two ends size it from different calls' shapes.
    """
    actions = [
        [(c, a) for c, p in enumerate(parts) for a in p.ranks[r]]
        for r in range(len(parts[0].ranks))
    ]
    problems: list[str] = []
    sized: dict[tuple[Message, int, bool], int] = {}  # (message, occurrence, send) -> call
    for rank, acts in enumerate(actions):
        last = {a.mb: c for c, a in acts if a.mb is not None}  # the last call acting on j
        known: dict[int, int] = {}  # micro-batch -> the call whose shapes it has
        acted: set[int] = set()  # micro-batches this rank has acted on
        seen = Occurrences()
        call = -1
        for c, a in acts:
            if c != call:  # a call starts: keep the shapes of micro-batches in flight here
                known = {j: k for j, k in known.items() if j in acted and last[j] >= c}
                known.update({j: c for j in brought[c]})
                call = c
            if a.mb is None or a.kind == ActionKind.U:
                continue
            acted.add(a.mb)
            if a.mb not in known:
                problems.append(
                    f"rank {rank} runs {a} in call {c} without the shapes of micro-batch "
                    f"{a.mb}, which an earlier call brought and this rank had not yet acted on"
                )
            elif a.kind.is_send or a.kind.is_receive:
                sized[(a.message, seen.number(a), a.kind.is_send)] = known[a.mb]
    for (message, n, sending), c in sized.items():
        other = sized.get((message, n, not sending))
        if sending and other is not None and other != c:
            problems.append(
                f"{message} is sized from call {c}'s shapes by its sender and call "
                f"{other}'s by its receiver"
            )
    if problems:
        raise ScheduleError(
            f"the {parts[0].name} schedule cannot change shapes between calls:", problems
        )


SEMANTICS = ("rendezvous", "buffered")


def check_program(plan: Plan, program: Program, semantics: str = "rendezvous") -> None:
    """Run `program` under a transport's semantics and fail if it cannot finish.

    Semantics:
        rendezvous  NCCL's: on each rank, every peer pair has one FIFO stream for both
                    directions; a group starts once it heads every stream it uses (a group
                    with several peers heads all of theirs), and a send completes only when
                    its receive has started too (no buffering). A compute action waits for
                    the whole group of every receive it reads (NCCL's work is the group's).
        buffered    gloo's: a send completes when it is issued; a receive when it and its send
                    are issued.
    In both, a rank issues its operations in order, an update waits for the stage's other
    replicas, and a rank ends once all its groups completed. A message between two stages of
    one rank is a local copy: its send completes at once, its receive once the send is issued.

    Raises:
        ScheduleError: the program deadlocks, naming where every stuck rank waits, followed
            by the marked program.
    """
    if semantics not in SEMANTICS:
        raise ScheduleError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    stuck = _ProgramRun(plan, program, semantics == "rendezvous").run()
    if stuck:
        lines = [
            f"deadlock under {semantics} semantics: rank {r} waits forever at {what}"
            for r, what in sorted(stuck.items())
        ]
        raise ScheduleError(
            f"the {program.name} program deadlocks ({len(stuck)} ranks stuck):",
            [*lines, "programs:\n" + str(program)],
        )


@dataclass
class _Group:
    rank: int
    comm: Comm
    keys: list[tuple[Message, int, bool]]  # (message, occurrence, is a send) per action
    peers: frozenset[int]  # remote peers (a message to the rank itself is a local copy)
    local: list[bool]
    issued: bool = False
    started: bool = False
    done: list[bool] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(self.done)


class _ProgramRun:
    """The dry run of `check_program`: a fixed point over issue, start and completion."""

    def __init__(self, plan: Plan, program: Program, rendezvous: bool) -> None:
        self.plan, self.program, self.rendezvous = plan, program, rendezvous
        self.pc = [0] * len(program.ranks)
        self.groups: dict[tuple[int, int], _Group] = {}  # (rank, op index) -> group
        self.where: dict[tuple[Message, int, bool], _Group] = {}
        self.streams: dict[tuple[int, int], deque[_Group]] = defaultdict(deque)
        self.unread: list[list[tuple[Action, _Group]]] = [[] for _ in program.ranks]
        self.barrier = UpdateBarrier(plan)
        self._index()

    def _index(self) -> None:
        for rank, ops in enumerate(self.program.ranks):
            seen = Occurrences()
            for i, op in enumerate(ops):
                if not isinstance(op, Comm):
                    continue
                keys = [(a.message, seen.number(a), a.kind.is_send) for a in op.actions]
                local = [self._peer(a) == rank for a in op.actions]
                peers = frozenset(self._peer(a) for a in op.actions) - {rank}
                group = _Group(rank, op, keys, peers, local, done=[False] * len(keys))
                self.groups[(rank, i)] = group
                for key in keys:
                    self.where[key] = group

    def _peer(self, a: Action) -> int:
        assert a.peer is not None and a.mb is not None
        return self.plan.stages[a.peer].device_for(a.mb)

    def run(self) -> dict[int, str]:
        """Ranks that cannot finish, with what each waits at (empty when all finish)."""
        progress = True
        while progress:
            progress = self._issue_and_compute()
            progress = self._complete() or progress
        stuck: dict[int, str] = {}
        for rank, ops in enumerate(self.program.ranks):
            if self.pc[rank] < len(ops):
                stuck[rank] = f"operation {self.pc[rank]}: {ops[self.pc[rank]]}"
            else:
                open_groups = [
                    g for (r, _), g in self.groups.items() if r == rank and not g.complete
                ]
                if open_groups:
                    stuck[rank] = f"the end, group {open_groups[0].comm} incomplete"
        return stuck

    def _issue_and_compute(self) -> bool:
        progress = False
        for rank, ops in enumerate(self.program.ranks):
            while self.pc[rank] < len(ops) and self._advance(rank, ops[self.pc[rank]]):
                self.pc[rank] += 1
                progress = True
        return progress

    def _advance(self, rank: int, op: Op) -> bool:
        if isinstance(op, Comm):
            group = self.groups[(rank, self.pc[rank])]
            group.issued = True
            if self.rendezvous:
                for peer in group.peers:
                    self.streams[(rank, peer)].append(group)
            self.unread[rank] += [(a, group) for a in op.actions if a.kind.is_receive]
            return True
        if op.kind == ActionKind.U:
            return self.barrier.arrive(rank, op.stage) is not None
        needed = awaits(self.plan, op)  # what the compute reads
        wanted = [(a, g) for a, g in self.unread[rank] if a.message in needed]
        if not all(self._arrived(a, g) for a, g in wanted):
            return False
        self.unread[rank] = [x for x in self.unread[rank] if x not in wanted]
        return True

    def _arrived(self, receive: Action, group: _Group) -> bool:
        if self.rendezvous:  # NCCL: the work of a group completes as a whole
            return group.complete
        return group.done[group.comm.actions.index(receive)]

    def _started(self, group: _Group) -> bool:
        """Whether the group runs (or ran): issued and, under rendezvous, heading its streams."""
        if not group.started and group.issued:
            group.started = not self.rendezvous or all(
                self.streams[(group.rank, p)][0] is group for p in group.peers
            )
        return group.started

    def _complete(self) -> bool:
        progress = False
        for group in self.groups.values():
            if group.complete or not self._started(group):
                continue
            for k, (key, n, sending) in enumerate(group.keys):
                if group.done[k]:
                    continue
                partner = self.where.get((key, n, not sending))
                buffered = not self.rendezvous or group.local[k]  # local copies never wait
                if sending and buffered:
                    ready = True
                elif group.local[k]:
                    ready = partner is not None and partner.issued
                else:
                    ready = partner is not None and self._started(partner)
                if ready:
                    group.done[k] = True
                    progress = True
            if group.complete and self.rendezvous:
                for p in group.peers:
                    self.streams[(group.rank, p)].popleft()
        return progress
