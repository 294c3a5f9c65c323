"""benchmarks.peers: torch's compute orders read back into graphpipe Schedules, so both
sides' ideals come from one simulator."""

from __future__ import annotations

import pytest

from benchmarks.peers import Case, timed_plan, torch_order_schedule
from graphpipe.scheduling.dryrun import check_schedule
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.simulate import simulate


def test_a_torch_order_with_overlaps_and_reductions_reads_back_as_graphpipes_own() -> None:
    """zbv's own order written as torch prints it (one F/I pair fused into an OVERLAP_F_B,
    a REDUCE_GRAD per stage) is the same schedule, and simulates to the same step."""
    case = Case(ranks=2, costs="unequal", steps=1)
    plan = timed_plan(case, "v")
    own = make_schedule(plan, "zbv")
    order = {r: [str(a) for a in actions] for r, actions in enumerate(own.compute_only())}
    order = {r: [t for t in texts if not t.endswith("U")] for r, texts in order.items()}
    first, second = order[0][3], order[0][4]
    order[0][3:5] = [f"({first};{second})OVERLAP_F_B"]
    for r in order:
        order[r] += [f"{s.index}REDUCE_GRAD" for s in plan.stages_on(r)]
    read = torch_order_schedule(plan, order)
    check_schedule(plan, read)
    assert read.ranks == own.ranks
    assert simulate(plan, read).iteration_time == pytest.approx(simulate(plan, own).iteration_time)
