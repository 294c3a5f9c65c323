"""Dry run: validate a Schedule against its Plan before anything runs.

Checks, every problem reported at once:
- each rank runs only the stage it holds, and a micro-batch only on the replica that owns it
  (devices[j % r]);
- every (stage, micro-batch) has exactly one forward and one backward (a full B, or an I and a
  later W), forward first, per step() call for flushed schedules;
- every send follows the compute that makes its value, every receive comes before the compute
  that needs it, and sends and receives pair up one to one, in the same order per channel
  (so the pairing is the same whatever the transport);
- a dry run with blocking receives and buffered sends finishes: the schedule cannot deadlock;
- the peak memory of every rank fits the plan's budget.

A failure raises `ScheduleError` with the rank-by-time grid, the offending actions marked
with `>>...<<`.
"""

from __future__ import annotations

from collections import defaultdict

from graphpipe.errors import ScheduleError
from graphpipe.ir import Action, Plan, Schedule
from graphpipe.schedule import ASYNC
from graphpipe.simulate import Deadlock, Engine, channel, simulate

__all__ = ["check_schedule", "grid"]

Mark = tuple[int, int]  # (rank, index in its list)
Message = tuple[str, int, int, int]  # (direction, from stage, to stage, micro-batch)


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
        held = plan.stage_on(rank)
        for i, a in enumerate(actions):
            if held is None or a.stage != held.index:
                where = "no stage" if held is None else f"stage {held.index}"
                problems.append(f"rank {rank} runs {a} but holds {where}")
                marks.append((rank, i))
            elif a.mb is not None and a.kind != "U" and held.device_for(a.mb) != rank:
                problems.append(
                    f"rank {rank} runs {a}, but micro-batch {a.mb} of stage "
                    f"{held.index} belongs to rank {held.device_for(a.mb)}"
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
    repeats = 1 if schedule.name in ASYNC else schedule.calls
    mbs = sorted({mb for _, mb in seen})
    for s in plan.stages:
        for j in mbs:
            kinds = seen.get((s.index, j), "")
            if kinds not in ("FB" * repeats, "FIW" * repeats):
                problems.append(
                    f"stage {s.index} micro-batch {j} runs {' '.join(kinds) or 'nothing'}; "
                    f"expected F then B (or F, I, W){' per call' if repeats > 1 else ''}"
                )
                if (s.index, j) in where:
                    marks.append(where[(s.index, j)])


def _data_order(plan: Plan, schedule: Schedule, problems: list[str], marks: list[Mark]) -> None:
    """Sends after the compute that makes their value, receives before the one that needs it."""
    for rank, actions in enumerate(schedule.ranks):
        done: set[tuple[str, int]] = set()
        for i, a in enumerate(actions):
            if a.is_compute and a.mb is not None:
                done.add((a.kind, a.mb))
                needed = _receives_needed(plan, a)
                got = {
                    (x.kind, x.peer) for x in actions[:i] if x.mb == a.mb and x.kind in ("RF", "RB")
                }
                missing = needed - got
                if missing:
                    problems.append(
                        f"rank {rank} runs {a} before receiving "
                        + ", ".join(f"{k}<{p}" for k, p in sorted(missing))
                    )
                    marks.append((rank, i))
            elif a.kind in ("SF", "SB") and a.mb is not None:
                makers = {"F"} if a.kind == "SF" else {"B", "I"}
                if not any((m, a.mb) in done for m in makers):
                    problems.append(f"rank {rank} sends {a} before computing it")
                    marks.append((rank, i))


def _receives_needed(plan: Plan, a: Action) -> set[tuple[str, int]]:
    if a.kind == "F":
        return {("RF", e.src) for e in plan.edges if e.dst == a.stage}
    if a.kind in ("B", "I"):
        return {("RB", e.dst) for e in plan.edges if e.src == a.stage and e.backward_message}
    return set()


def _pairing(schedule: Schedule, problems: list[str], marks: list[Mark]) -> None:
    """Every send has its receive and vice versa, in the same order on every rank pair."""
    sent: dict[Message, list[Mark]] = defaultdict(list)
    received: dict[Message, list[Mark]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            if a.kind in ("SF", "SB"):
                sent[channel(a)].append((rank, i))
            elif a.kind in ("RF", "RB"):
                received[channel(a)].append((rank, i))
    for key in sorted(set(sent) | set(received)):
        n_sent, n_got = len(sent.get(key, [])), len(received.get(key, []))
        if n_sent != n_got:
            problems.append(f"{_name(key)} is sent {n_sent} time(s) and received {n_got}")
            marks.extend((sent.get(key) or received.get(key) or [])[:1])
    if problems:
        return
    _channel_order(schedule, sent, received, problems, marks)


def _channel_order(
    schedule: Schedule,
    sent: dict[Message, list[Mark]],
    received: dict[Message, list[Mark]],
    problems: list[str],
    marks: list[Mark],
) -> None:
    by_pair_sent: dict[tuple[int, int], list[tuple[Mark, Message]]] = defaultdict(list)
    by_pair_got: dict[tuple[int, int], list[tuple[Mark, Message]]] = defaultdict(list)
    for key, senders in sent.items():
        for (src, i), (dst, k) in zip(senders, received[key], strict=True):
            by_pair_sent[(src, dst)].append(((src, i), key))
            by_pair_got[(src, dst)].append(((dst, k), key))
    for pair, items in by_pair_got.items():
        order = [key for _, key in sorted(items)]
        expected = [key for _, key in sorted(by_pair_sent[pair])]
        for (mark, _), got, want in zip(sorted(items), order, expected, strict=True):
            if got != want:
                problems.append(
                    f"rank {pair[1]} receives {_name(got)} before {_name(want)}, but rank "
                    f"{pair[0]} sends them the other way round"
                )
                marks.append(mark)
                break


def _name(key: Message) -> str:
    direction, a, b, mb = key
    what = "activations" if direction == "F" else "gradients"
    return f"{what} of micro-batch {mb} from stage {a} to stage {b}"


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
