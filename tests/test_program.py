"""Programs: schedules lowered to fused communication groups, and dry runs under NCCL's and
gloo's semantics."""

from __future__ import annotations

import pytest
from plans import chain_plan, folded_plans, placed_plans, zoo_plans

from graphpipe.errors import ScheduleError
from graphpipe.ir import Action, Plan, parse_ranks
from graphpipe.ir.program import Comm, Program, parse_ops
from graphpipe.ir.registry import SCHEDULES
from graphpipe.scheduling.dryrun import check_program, check_run
from graphpipe.scheduling.generators import drain_schedule, make_schedule
from graphpipe.scheduling.program import lower, lower_calls

ONE_F_ONE_B_2x4 = [  # the steady-state pairs share a group: SF with RB, SB with RF
    "0F0 [0SF0>1] 0F1 [0SF1>1 0RB0<1] 0B0 0F2 [0SF2>1 0RB1<1] 0B1 0F3 [0SF3>1 0RB2<1] 0B2 "
    "[0RB3<1] 0B3 0U",
    "[1RF0<0] 1F0 1B0 [1RF1<0 1SB0>0] 1F1 1B1 [1RF2<0 1SB1>0] 1F2 1B2 [1RF3<0 1SB2>0] 1F3 "
    "1B3 [1SB3>0] 1U",
]


def test_two_stage_1f1b_fuses_the_steady_state_pairs() -> None:
    plan = chain_plan(2, 4)
    program = lower(plan, make_schedule(plan, "1f1b"))
    assert [" ".join(map(str, ops)) for ops in program.ranks] == ONE_F_ONE_B_2x4


def test_one_message_per_group_deadlocks_under_nccl_semantics() -> None:
    """The old lowering (every message its own batch) is caught: the model is strict enough."""
    plan = chain_plan(2, 4)
    old = lower(plan, make_schedule(plan, "1f1b"), fuse=False)
    assert all(len(g.actions) == 1 for r in range(2) for g in old.groups(r))
    with pytest.raises(ScheduleError, match="rendezvous") as info:
        check_program(plan, old, "rendezvous")
    assert "rank 0 waits forever at operation" in str(info.value)
    assert "rank 1 waits forever" in str(info.value)
    check_program(plan, old, "buffered")  # gloo's buffering hides it


def test_a_receive_order_that_differs_from_the_send_order_deadlocks() -> None:
    plan = chain_plan(2, 2)
    swapped = Program(
        "gpipe",
        2,
        (
            parse_ops("0F0 [0SF0>1] 0F1 [0SF1>1] [0RB0<1] 0B0 [0RB1<1] 0B1 0U"),
            parse_ops("[1RF1<0] [1RF0<0] 1F0 1F1 1B0 [1SB0>0] 1B1 [1SB1>0] 1U"),
        ),
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        check_program(plan, swapped, "rendezvous")


def test_program_text_round_trips() -> None:
    plan = chain_plan(3, 4)
    program = lower(plan, make_schedule(plan, "zb"))
    assert Program.from_json(program.to_json()) == program
    assert all(isinstance(op, Comm) for op in parse_ops("[0SF0>1 0RB0<1]"))
    with pytest.raises(ScheduleError, match="unclosed"):
        parse_ops("0F0 [0SF0>1")


def test_prefetch_posts_every_receive_first() -> None:
    """Every receive of a call is posted in one early group: first on a rank whose first
    action reads a message, right after the first action on the first stage's rank (it
    starts computing at once; nothing can reach it before that action's output left)."""
    plan = chain_plan(3, 4)
    program = lower(plan, make_schedule(plan, "1f1b"), prefetch=True)
    first = program.ranks[1][0]
    assert isinstance(first, Comm) and {a.kind for a in first.actions} == {"RF", "RB"}
    assert len(first.actions) == 8
    head, group = program.ranks[0][:2]
    assert str(head) == "0F0" and isinstance(group, Comm)
    assert [str(a) for a in group.actions] == [*(f"0RB{j}<1" for j in range(4)), "0SF0>1"]
    assert not any(
        a.kind == "RB" for op in program.ranks[0][2:] if isinstance(op, Comm) for a in op.actions
    )
    check_program(plan, program, "buffered")


@pytest.mark.parametrize("name", ["1f1b", "zb"])
def test_prefetch_after_the_first_action_runs_on_dags_with_sources_on_two_ranks(name: str) -> None:
    """On a stage DAG whose sources sit on two ranks, a message may reach a source's rank
    before its receives are posted (gloo buffers it until then): the programs still run."""
    ran = 0
    for _, plan in zoo_plans():
        g = plan.stage_graph
        sources = {plan.stages[s].devices for s in g if g.in_degree(s) == 0}
        if len(sources) < 2:
            continue
        program = lower(plan, make_schedule(plan, name), prefetch=True)
        assert any(isinstance(ops[0], Action) for ops in program.ranks if ops)
        check_program(plan, program, "buffered")
        ran += 1
    assert ran >= 3


def test_an_async_call_receives_what_it_sends_itself() -> None:
    """Messages read by the next call are received at the end of the call that sends them,
    so no send is left pending across calls (on NCCL it would block the stream)."""
    plan = chain_plan(3, 4)
    calls = [make_schedule(plan, "async", first_call=c) for c in range(3)]
    calls.append(drain_schedule(plan, "async", 3))
    for schedule in calls:
        program = lower(plan, schedule)
        sent = {
            (a.stage, a.peer, a.mb, a.kind)
            for ops in program.ranks
            for g in ops
            if isinstance(g, Comm)
            for a in g.actions
            if a.kind[0] == "S"
        }
        received = {
            (a.peer, a.stage, a.mb, "S" + a.kind[1])
            for ops in program.ranks
            for g in ops
            if isinstance(g, Comm)
            for a in g.actions
            if a.kind[0] == "R"
        }
        assert sent == received
    check_program(plan, lower_calls(plan, calls), "rendezvous")


def test_the_zoo_has_the_hard_shapes() -> None:
    plans = [p for _, p in zoo_plans()]
    assert any(s.replicas > 1 for p in plans for s in p.stages)
    assert any(p.stage_graph.out_degree(s) > 1 for p in plans for s in p.stage_graph)
    assert any(p.stage_graph.in_degree(s) > 1 for p in plans for s in p.stage_graph)
    assert any(len(p.stages) > p.depth for p in plans)  # parallel branches


def test_the_folded_zoo_has_devices_holding_branches_and_their_joins() -> None:
    folded = [p for label, p in folded_plans() if " on " in label]
    assert len(folded) >= 20
    assert any(
        p.stage_graph.in_degree(s.index) > 1 and len(p.stages_on(s.devices[0])) > 1
        for p in folded
        for s in p.stages
    )


def _plans_for(name: str) -> list[tuple[str, Plan]]:
    placement = SCHEDULES[name].placement
    if placement in ("loop", "v"):
        return placed_plans(name)
    return folded_plans() if placement == "any" else zoo_plans()


@pytest.mark.parametrize("name", sorted(n for n, s in SCHEDULES.items() if s.training))
def test_every_generator_is_deadlock_free_under_both_semantics(name: str) -> None:
    checked = 0
    for label, plan in _plans_for(name):
        try:
            make_schedule(plan, name)
        except ScheduleError as exc:  # replicated stages, 2bw with M < depth, dualpipev M < 2N
            assert SCHEDULES[name].asynchronous or "micro_batches >= 2 x" in str(exc), exc
            continue
        try:
            check_run(plan, name, calls=2)
        except ScheduleError as exc:
            raise AssertionError(f"{name} on {label}: {exc}") from exc
        checked += 1
    assert checked >= 10


def test_parse_ranks_and_programs_agree_on_actions() -> None:
    (actions,) = parse_ranks(["0F0 0SF0>1"])
    assert [str(op) for op in parse_ops("0F0 [0SF0>1]")] == ["0F0", "[0SF0>1]"]
    assert str(actions[1]) == "0SF0>1"
