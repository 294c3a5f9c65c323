"""Programs: schedules lowered to fused communication groups, and dry runs under NCCL's and
gloo's semantics."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from test_partition import synthetic
from test_schedule import chain_plan, random_plan

from graphpipe.errors import ScheduleError
from graphpipe.ir import Action, Plan, parse_ranks
from graphpipe.ir.cost import CostModel, LinkModel
from graphpipe.ir.program import Comm, Program, parse_ops
from graphpipe.ir.registry import SCHEDULES
from graphpipe.planning.interleave import foldings, place_graph
from graphpipe.planning.partition import PlanConfig, partition_op_graph
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
    for _, plan in _zoo_plans():
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


def _zoo_plans() -> list[tuple[str, Plan]]:
    """Chains, random stage DAGs (fan-out, fan-in, skips) and replicated stages."""
    plans = [("chain4", chain_plan(4, 8)), ("chain2", chain_plan(2, 1))]
    return plans + [(f"seed{seed}", random_plan(seed)) for seed in range(24)]


def test_the_zoo_has_the_hard_shapes() -> None:
    plans = [p for _, p in _zoo_plans()]
    assert any(s.replicas > 1 for p in plans for s in p.stages)
    assert any(p.stage_graph.out_degree(s) > 1 for p in plans for s in p.stage_graph)
    assert any(p.stage_graph.in_degree(s) > 1 for p in plans for s in p.stage_graph)
    assert any(len(p.stages) > p.depth for p in plans)  # parallel branches


def placed_plan(devices: int, per_device: int, m: int, placement: str) -> Plan:
    """A chain of devices x per_device equal stages folded onto the devices, every one with
    an input half as in the papers (see `test_schedule.chain_plan`)."""
    names = [f"op{i}" for i in range(devices * per_device)]
    g = synthetic(
        list(itertools.pairwise(names)), dict.fromkeys(names, 3e-3), dict.fromkeys(names, 1000)
    )
    config = PlanConfig(
        devices=devices,
        micro_batches=m,
        pins={name: i for i, name in enumerate(names)},
        partitioner="manual",
        virtual_stages=per_device,
        placement=placement,
    )
    plan = partition_op_graph(g, CostModel(1, m, LinkModel(bandwidth=1e12)), config, "chain")
    return replace(plan, stages=tuple(replace(s, input_half=True) for s in plan.stages))


def _placed_plans(name: str) -> list[tuple[str, Plan]]:
    """Chains folded for `name`'s placement; on a V also M = 12 and 16 (dualpipev needs
    M >= 2N)."""
    v_shaped = SCHEDULES[name].placement == "v"
    plans = []
    for n in (2, 3, 4):
        for m in (1, 2, 4, 6, 8, *((12, 16) if v_shaped else ())):
            if v_shaped:
                plans.append((f"v n={n} m={m}", placed_plan(n, 2, m, "v")))
            elif m % n == 0:
                plans += [(f"loop{v} n={n} m={m}", placed_plan(n, v, m, "loop")) for v in (2, 3)]
    return plans


def _folded_plans() -> list[tuple[str, Plan]]:
    """The zoo's unreplicated stage DAGs, each folded every way onto fewer devices (and once
    unfolded: one stage per device is a placement too)."""
    plans = []
    for label, plan in _zoo_plans():
        if any(s.replicas > 1 for s in plan.stages):
            continue
        plans.append((label, plan))
        count = len(plan.stages)
        for devices in sorted({max(1, count // 2), count - 1} - {0}):
            for how, assignment in foldings(plan, devices).items():
                if len(set(assignment)) == devices:
                    plans.append(
                        (f"{label} {how} on {devices}", place_graph(plan, devices, assignment))
                    )
    return plans


def test_the_folded_zoo_has_devices_holding_branches_and_their_joins() -> None:
    folded = [p for label, p in _folded_plans() if " on " in label]
    assert len(folded) >= 20
    assert any(
        p.stage_graph.in_degree(s.index) > 1 and len(p.stages_on(s.devices[0])) > 1
        for p in folded
        for s in p.stages
    )


def _plans_for(name: str) -> list[tuple[str, Plan]]:
    placement = SCHEDULES[name].placement
    if placement in ("loop", "v"):
        return _placed_plans(name)
    return _folded_plans() if placement == "any" else _zoo_plans()


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
