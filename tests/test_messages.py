"""The IR's scheduling vocabulary: action kinds, messages, the communication rule, the
numbering of repeated messages, the replica update barrier, and the schedule registry that
the generators follow."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from plans import chain_plan, random_plan, zoo_plans

from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import (
    Action,
    ActionKind,
    Message,
    Occurrences,
    Plan,
    awaits,
    registry,
    schedule_names,
    sends,
    with_messages,
)
from graphpipe.scheduling import generators
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.simulate import UpdateBarrier

K = ActionKind


def test_kinds_are_their_letters() -> None:
    assert K.F == "F" and K("SB") is K.SB and str(K.RB) == "RB" and f"{K.I}" == "I"
    assert json.dumps([K.SF]) == '["SF"]'
    action = Action(2, "SF", 0, 3)  # letters are converted
    assert action.kind is K.SF and repr(action) == "Action(stage=2, kind='SF', mb=0, peer=3)"
    with pytest.raises(ScheduleError, match="'X'"):
        Action(0, "X", 0)


def test_kind_properties() -> None:
    table = {
        k: (k.is_compute, k.is_send, k.is_receive, k.is_backward, k.communicates, k.direction)
        for k in K
    }
    assert table == {
        K.F: (True, False, False, False, True, "F"),
        K.B: (True, False, False, True, True, "B"),
        K.I: (True, False, False, True, True, "B"),
        K.W: (True, False, False, False, False, "B"),
        K.SF: (False, True, False, False, False, "F"),
        K.RF: (False, False, True, False, False, "F"),
        K.SB: (False, True, False, False, False, "B"),
        K.RB: (False, False, True, False, False, "B"),
        K.U: (False, False, False, False, False, None),
    }
    assert [k for k in K if k.ends_backward] == [K.B, K.W]
    assert (K.SF.counterpart, K.RB.counterpart) == (K.RF, K.SB)
    assert (K.send("B"), K.receive("F")) == (K.SB, K.RF)
    with pytest.raises(ScheduleError, match="counterpart"):
        _ = K.U.counterpart


def test_a_message_is_named_by_its_send_and_its_receive() -> None:
    m = Message("B", 3, 2, 1)
    assert (str(m.send), str(m.receive)) == ("3SB1>2", "2RB1<3")
    assert m.send.message == m.receive.message == m
    assert m.edge == (2, 3) and Message("F", 2, 3, 1).edge == (2, 3)
    assert str(m) == "gradients of micro-batch 1 from stage 3 to stage 2"
    with pytest.raises(ScheduleError, match="no message"):
        _ = Action(2, "F", 0).message


def test_the_rule_on_a_chain() -> None:
    plan = chain_plan(3, 2)
    assert awaits(plan, Action(1, "F", 0)) == [Message("F", 0, 1, 0)]
    assert sends(plan, Action(1, "F", 0)) == [Message("F", 1, 2, 0)]
    assert awaits(plan, Action(1, "I", 0)) == [Message("B", 2, 1, 0)]
    assert sends(plan, Action(1, "B", 0)) == [Message("B", 1, 0, 0)]
    assert awaits(plan, Action(1, "W", 0)) == sends(plan, Action(1, "W", 0)) == []
    assert awaits(plan, Action(0, "F", 0)) == sends(plan, Action(0, "B", 0)) == []
    assert [str(a) for a in with_messages(plan, Action(1, "B", 1))] == ["1RB1<2", "1B1", "1SB1>0"]


@pytest.mark.parametrize(("label", "plan"), zoo_plans())
def test_every_message_sent_is_awaited_by_its_receiver(label: str, plan: Plan) -> None:
    """Over stage DAGs: what a stage's F sends, the receiver's F awaits; what a backward
    sends, the receiver's backward awaits; edges without gradients carry no backward."""
    stages = [s.index for s in plan.stages]
    for kind in (K.F, K.B):
        sent = {m for s in stages for m in sends(plan, Action(s, kind, 0))}
        awaited = {m for s in stages for m in awaits(plan, Action(s, kind, 0))}
        assert sent == awaited
        assert all(m.direction == kind.direction for m in sent)
    backward = {m.edge for s in stages for m in sends(plan, Action(s, K.B, 0))}
    edges = plan.edges
    assert backward == {(e.src, e.dst) for e in edges if e.backward_message}


def test_repeats_of_a_message_are_numbered_per_side() -> None:
    seen = Occurrences()
    texts = ["0SF0>1", "1RF0<0", "0SF0>1", "0SF1>1", "1RF0<0"]
    assert [seen.number(Action.parse(t)) for t in texts] == [0, 0, 1, 0, 1]


def test_replicas_pass_an_update_together() -> None:
    plan = next(p for p in map(random_plan, range(30)) if any(s.replicas > 1 for s in p.stages))
    stage = next(s for s in plan.stages if s.replicas > 1)
    first, *others = stage.devices
    barrier = UpdateBarrier(plan)
    assert barrier.arrive(first, stage.index, 1.0) is None
    assert barrier.arrive(first, stage.index, 5.0) is None  # still waiting, still at 1.0
    for r in others[:-1]:
        assert barrier.arrive(r, stage.index, 2.0) is None
    met = barrier.arrive(others[-1], stage.index, 3.0)
    assert met is not None and met[first] == 1.0 and set(met) == set(stage.devices)
    assert barrier.arrive(first, stage.index, 4.0) is not None  # passes its first update
    assert barrier.arrive(first, stage.index, 6.0) is None  # waits at its second


def test_the_generators_follow_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert schedule_names(training=True, asynchronous=False, placement=None) == [
        "gpipe",
        "1f1b",
        "zb",
        "zb2",
    ]
    plan = next(p for p in map(random_plan, range(30)) if any(s.replicas > 1 for s in p.stages))
    make_schedule(plan, "1f1b")
    no_replicas = replace(registry.SCHEDULES["1f1b"], replicas=False)
    monkeypatch.setitem(registry.SCHEDULES, "1f1b", no_replicas)
    with pytest.raises(ScheduleError, match="'1f1b' needs unreplicated stages"):
        make_schedule(plan, "1f1b")


def test_the_generators_refuse_a_registry_they_do_not_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(registry.SCHEDULES, "zigzag", registry.ScheduleSpec("zigzag", "new"))
    with pytest.raises(ConfigError, match=r"specs without a builder \['zigzag'\]"):
        generators._builders()
