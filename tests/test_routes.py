"""Routes: a rank's program resolved once agrees with the plan, send for receive."""

from __future__ import annotations

import pytest
from plans import placed_plan, random_plan

from graphpipe.ir import Plan
from graphpipe.ir.program import Comm
from graphpipe.runtime.comm import tag_for
from graphpipe.runtime.routes import compiled
from graphpipe.runtime.sync import final_backwards
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.program import lower

PLANS = {
    "zbv": placed_plan(3, 2, 4, "v"),  # the V's turn is a message between stages of one rank
    "zb": next(p for p in map(random_plan, range(24)) if any(s.replicas > 1 for s in p.stages)),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_route_matches_its_message_and_every_send_its_receive(name: str) -> None:
    plan: Plan = PLANS[name]
    program = lower(plan, make_schedule(plan, name, plan.micro_batches))
    sent, received, local = set(), set(), 0
    for device, ops in enumerate(program.ranks):
        steps = compiled(plan, device, ops)
        assert [s.op for s in steps] == list(ops)
        assert {i for i, s in enumerate(steps) if s.final} == final_backwards(ops)
        for step in steps:
            if not isinstance(step.op, Comm):
                assert step.label == f"graphpipe::{step.op}" and not step.routes
                continue
            for r in step.routes:
                a, (src, dst) = r.action, r.message.edge
                edge = plan.edges[r.edge]
                assert (edge.src, edge.dst) == (src, dst)
                assert r.names == tuple(edge.tensors if r.message.direction == "F" else edge.grads)
                assert r.peer == plan.stages[a.peer].device_for(a.mb)  # type: ignore[index,arg-type]
                assert r.local == (r.peer == device)
                assert r.tag == tag_for(r.edge, r.message.direction == "B", r.message.mb)
                local += r.local
                # (sender, receiver, tag): what gloo matches a send and a receive by
                key = (device, r.peer, r.tag) if a.kind.is_send else (r.peer, device, r.tag)
                (sent if a.kind.is_send else received).add(key)
    assert sent == received
    assert (local > 0) == (name == "zbv")
