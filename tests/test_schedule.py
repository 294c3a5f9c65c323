"""Schedules: golden orders, validity on random stage DAGs, the dry run and its grid."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from plans import chain_plan, random_plan

from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import Action, Plan, Schedule, parse_ranks
from graphpipe.ir.cost import MemoryModel
from graphpipe.ir.program import Comm
from graphpipe.ir.registry import SCHEDULES
from graphpipe.scheduling.dryrun import check_program, check_schedule
from graphpipe.scheduling.generators import drain_schedule, make_schedule
from graphpipe.scheduling.program import lower
from graphpipe.scheduling.simulate import steady_run

# -- the text form -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["2F0", "0B13", "1I4", "1W4", "2SF0>3", "3RF0<2", "3SB1>2", "2RB1<3", "2U", "2U5"]
)
def test_actions_print_compactly_and_parse_back(text: str) -> None:
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text", ["F0", "2X0", "2SF0<3", "2RF0>1", "2SF0"])
def test_malformed_actions_are_named(text: str) -> None:
    with pytest.raises(ScheduleError, match="action|peer|micro-batch"):
        Action.parse(text)


def test_schedule_json_round_trip() -> None:
    plan = chain_plan(3, 4)
    sched = make_schedule(plan, "1f1b")
    assert Schedule.from_json(sched.to_json()) == sched


# -- golden orders on chains -----------------------------------------------------------------------

ONE_F_ONE_B_4x8 = [
    "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7 0U",
    "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7 1U",
    "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7 2U",
    "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 3U",
]


def test_1f1b_on_four_stages_and_eight_micro_batches_is_the_textbook_order() -> None:
    sched = make_schedule(chain_plan(4, 8), "1f1b")
    assert [" ".join(r) for r in sched.compute_only()] == ONE_F_ONE_B_4x8


def test_gpipe_runs_every_forward_then_every_backward() -> None:
    sched = make_schedule(chain_plan(3, 4), "gpipe")
    assert [" ".join(r) for r in sched.compute_only()] == [
        f"{s}F0 {s}F1 {s}F2 {s}F3 {s}B0 {s}B1 {s}B2 {s}B3 {s}U" for s in range(3)
    ]


def test_communication_is_placed_around_compute() -> None:
    sched = make_schedule(chain_plan(2, 2), "1f1b")
    assert [" ".join(map(str, r)) for r in sched.ranks] == [
        "0F0 0SF0>1 0F1 0SF1>1 0RB0<1 0B0 0RB1<1 0B1 0U",
        "1RF0<0 1F0 1B0 1SB0>0 1RF1<0 1F1 1B1 1SB1>0 1U",
    ]


def test_async_numbers_micro_batches_on_across_calls_and_drains() -> None:
    plan = chain_plan(2, 2)
    second = make_schedule(plan, "async", first_call=1)
    assert [" ".join(r) for r in second.compute_only()] == [
        "0F2 0B1 0U1 0F3 0B2 0U2",
        "1F2 1B2 1U2 1F3 1B3 1U3",
    ]
    drain = drain_schedule(plan, "async", calls_done=2)
    assert [" ".join(r) for r in drain.compute_only()] == ["0B3 0U3", ""]


def test_2bw_updates_once_per_mini_batch() -> None:
    sched = make_schedule(chain_plan(2, 2), "2bw", calls=2)
    assert [" ".join(r) for r in sched.compute_only()] == [
        "0F0 0F1 0B0 0F2 0B1 0U1 0F3 0B2",
        "1F0 1B0 1F1 1B1 1U1 1F2 1B2 1F3 1B3 1U3",
    ]


# -- validity on random stage DAGs -----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_every_generator_passes_the_validator_on_random_stage_dags(seed: int) -> None:
    plan = random_plan(seed)
    m = plan.micro_batches
    replicated = any(s.replicas > 1 for s in plan.stages)
    for name in sorted(n for n, s in SCHEDULES.items() if s.training):
        spec = SCHEDULES[name]
        if spec.placement in ("loop", "v"):  # they need a folded chain (test_program.py)
            try:
                check_schedule(plan, make_schedule(plan, name))
            except ScheduleError as exc:
                assert re.search("placed|multiple of|2 stages per device", str(exc)), exc
            continue
        if not spec.replicas and replicated:
            with pytest.raises(ScheduleError, match="unreplicated"):
                make_schedule(plan, name)
            continue
        if name == "2bw" and m < plan.depth:
            with pytest.raises(ScheduleError, match="micro_batches >= depth"):
                make_schedule(plan, name)
            continue
        check_schedule(plan, steady_run(plan, name, calls=1 + seed % 3))


def test_unknown_schedule_is_named() -> None:
    with pytest.raises(ConfigError, match="'zigzag'"):
        make_schedule(chain_plan(2, 2), "zigzag")


# -- broken schedules are caught, with the grid ---------------------------------------------------


def _broken(plan: Plan, rank: int, move: str, to: int) -> Schedule:
    sched = make_schedule(plan, "1f1b")
    ranks = [list(r) for r in sched.ranks]
    action = next(a for a in ranks[rank] if str(a) == move)
    ranks[rank].remove(action)
    ranks[rank].insert(to, action)
    return Schedule("1f1b", sched.micro_batches, tuple(map(tuple, ranks)))


def test_backward_before_its_forward_is_caught_with_the_grid() -> None:
    plan = chain_plan(3, 4)
    with pytest.raises(ScheduleError) as err:
        check_schedule(plan, _broken(plan, 1, "1B0", 0))
    text = str(err.value)
    assert "stage 1 micro-batch 0 runs B F" in text
    assert "rank 1" in text and ">>1B0<<" in text  # the grid, offending action marked


def test_receives_listed_out_of_order_are_issued_in_the_send_order() -> None:
    """The lowering issues messages in one global order, so a schedule that lists two
    receives the other way round from their sends still runs under NCCL's semantics."""
    plan = chain_plan(2, 2)
    ranks = parse_ranks(
        [
            "0F0 0SF0>1 0F1 0SF1>1 0RB0<1 0B0 0RB1<1 0B1 0U",
            "1RF1<0 1RF0<0 1F0 1B0 1SB0>0 1F1 1B1 1SB1>0 1U",
        ]
    )
    schedule = Schedule("1f1b", 2, ranks)
    check_schedule(plan, schedule)
    program = lower(plan, schedule)
    first = program.ranks[1][0]
    assert isinstance(first, Comm) and [str(a) for a in first.actions] == ["1RF0<0", "1RF1<0"]
    check_program(plan, program, "rendezvous")


def test_a_deadlock_is_proved_by_the_dry_run() -> None:
    plan = chain_plan(2, 1)
    ranks = parse_ranks(
        [
            "0RB0<1 0F0 0SF0>1 0B0 0U",  # waits for a gradient before sending the activation
            "1RF0<0 1F0 1B0 1SB0>0 1U",
        ]
    )
    with pytest.raises(ScheduleError) as err:
        check_schedule(plan, Schedule("1f1b", 1, ranks))
    assert "deadlock: rank 0 waits forever at 0RB0<1" in str(err.value)
    assert "deadlock: rank 1 waits forever at 1RF0<0" in str(err.value)
    assert ">>0RB0<1<<" in str(err.value)


def test_a_missing_receive_is_named() -> None:
    plan = chain_plan(2, 1)
    ranks = parse_ranks(["0F0 0SF0>1 0RB0<1 0B0 0U", "1F0 1B0 1SB0>0 1U"])
    with pytest.raises(ScheduleError, match="rank 1 runs 1F0 before receiving RF<0"):
        check_schedule(plan, Schedule("1f1b", 1, ranks))


def test_memory_over_budget_is_caught() -> None:
    plan = chain_plan(2, 8)
    tight = MemoryModel(budget=plan.stages[0].memory_bytes * 1.01)
    plan = replace(plan, cost_model=replace(plan.cost_model, memory=tight))
    check_schedule(plan, make_schedule(plan, "1f1b"))  # 1F1B keeps 2 in flight: fits
    with pytest.raises(ScheduleError, match="rank 0 peaks at .* over the budget"):
        check_schedule(plan, make_schedule(plan, "gpipe"))  # GPipe keeps all 8
