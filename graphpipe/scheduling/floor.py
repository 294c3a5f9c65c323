"""Floor: a lower bound on the simulated step of a plan under any flushed schedule, from the
plan alone (no schedule built, nothing simulated).

    step_floor(plan) <= simulate(plan, name).iteration_time   # name: 1f1b, zb, zbv, ...

Index letters: s a stage, r a rank (device), j a micro-batch, M the micro-batches, c_r(s)
the micro-batches of s that rank r runs (M without replicas), F_s, B_s its forward and
backward times (`compute_time`), I_s = B_s (1 - weight share) its input half, t(e) an
edge's transfer (`message_time` without contention: contention only delays a message).

What the simulator (`graphpipe.scheduling.simulate`) guarantees under a flushed schedule
(1f1b, zb, interleaved, zbv, dualpipev, ...: every micro-batch's F and B, or I and W, once,
then the updates), whatever the order:

    head      F(s, j) starts after the forward of j has crossed every path into s:
              head(s) = max over edges e = (u, s) of head(u) + F_u + t(e)
    return    a backward of (s, j) starts after its gradients came back: at least
              back(s) = max over edges e = (s, v) carrying one of t(e) + F_v + back(v) + I_v
              + t_B(e) after F(s, j) ends (v's I, or its whole B, sends them)
    rank      a rank runs its actions one at a time, and its last is an update (U: its
              gradients' sync and optimizer step) after all its compute

so, for each rank r, with U_r the least update time of its stages:

    busy      min over its stages of head(s) + sum over its stages of c_r(s) (F_s + B_s) + U_r
    last      for each stage s on r: head(s) + c_r(s) F_s + back(s) + B_s + U_r (the last
              of its forwards ends after c_r(s) of them from head(s) on; that micro-batch's
              backward then waits back(s), and its I and W, then the update, follow)
    drain     min over its stages of head(s) + F_s + back(s), plus the sum over its stages
              of c_r(s) B_s, plus U_r (no backward of a stage, I or W, starts before its
              first micro-batch's gradients came back: every backward on r runs after the
              earliest such return: the pipeline's drain)
    through   for each stage s of one device: arrive(s) + B_s + U_r, arrive(s) when the
              last micro-batch's gradients reach s at the earliest: a stage v's last I ends
              after head(v) and the F and I of every micro-batch its busiest rank runs, and
              after its own last gradients arrived, and then crosses its edge back to s
              (`_latest_returns`; with replicas the last arrival's rank is not known)

and the floor is the largest. O(S x E) for S stages and E edges (each stage scans the edge
list).
"""

from __future__ import annotations

from graphpipe.ir import Plan, compute_time, message_time
from graphpipe.ir.actions import Message

__all__ = ["step_floor"]


def step_floor(plan: Plan) -> float:
    """A lower bound on `simulate(plan, name).iteration_time` for every flushed schedule
    `name` (module docstring); asynchronous schedules are not covered.

    Args:
        plan: The plan.

    Returns:
        Seconds.

    Example:
        >>> import graphpipe, torch
        >>> from graphpipe.scheduling.simulate import simulate
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> plan = graphpipe.plan(model, torch.randn(8, 8), devices=2, micro_batches=4)
        >>> step_floor(plan) <= simulate(plan).iteration_time
        True
    """
    head = _heads(plan)
    back = _returns(plan)
    latest = _latest_returns(plan, head)
    best = 0.0
    for rank in range(plan.num_devices):
        stages = plan.stages_on(rank)
        if not stages:
            continue
        update = min(_update_time(plan, s.index) for s in stages)
        counts = {s.index: _runs(plan, s.index, rank) for s in stages}
        work = sum(counts[s.index] * (s.forward_time + s.backward_time) for s in stages)
        best = max(best, min(head[s.index] for s in stages) + work + update)
        returned = min(head[s.index] + s.forward_time + back[s.index] for s in stages)
        drain = sum(counts[s.index] * s.backward_time for s in stages)
        best = max(best, returned + drain + update)
        for s in stages:
            end = head[s.index] + counts[s.index] * s.forward_time + back[s.index]
            best = max(best, end + s.backward_time + update)
            if len(s.devices) == 1:
                best = max(best, latest[s.index] + s.backward_time + update)
    return best


def _latest_returns(plan: Plan, head: list[float]) -> list[float]:
    """arrive(s) per stage, from the sinks back: when the last micro-batch's gradients reach
    s at the earliest. A stage v's last I ends after its first forward's head and every
    F and I of the micro-batches its busiest rank runs, and after its own last gradients
    arrived: done(v) = max(head(v) + c(v) (F_v + I_v), arrive(v) + I_v), c(v) the most any
    of its ranks runs; arrive(s) = max over edges e = (s, v) carrying one of done(v) +
    t_B(e)."""
    arrive = [0.0] * len(plan.stages)
    done = [0.0] * len(plan.stages)
    for s in reversed(_topological(plan)):
        st = plan.stages[s]
        for e in plan.edges:
            if e.src == s and e.backward_message:
                arrive[s] = max(arrive[s], done[e.dst] + _transfer(plan, e.dst, s, "B"))
        runs = max(_runs(plan, s, r) for r in st.devices)
        own = compute_time(st, "I")
        done[s] = max(head[s] + runs * (st.forward_time + own), arrive[s] + own)
    return arrive


def _heads(plan: Plan) -> list[float]:
    """head(s) per stage, in a topological order of the stage graph."""
    head = [0.0] * len(plan.stages)
    for s in _topological(plan):
        for e in plan.edges:
            if e.dst == s:
                arrive = head[e.src] + plan.stages[e.src].forward_time
                head[s] = max(head[s], arrive + _transfer(plan, e.src, e.dst, "F"))
    return head


def _returns(plan: Plan) -> list[float]:
    """back(s) per stage, from the sinks back."""
    back = [0.0] * len(plan.stages)
    for s in reversed(_topological(plan)):
        for e in plan.edges:
            if e.src == s and e.backward_message:
                v = plan.stages[e.dst]
                trip = _transfer(plan, s, e.dst, "F") + _transfer(plan, e.dst, s, "B")
                back[s] = max(back[s], trip + v.forward_time + back[v.index] + compute_time(v, "I"))
    return back


def _transfer(plan: Plan, sender: int, receiver: int, direction: str) -> float:
    """Seconds one message of `direction` ("F" activations, "B" gradients) takes from stage
    `sender` to stage `receiver`, without contention."""
    return message_time(plan, Message(direction, sender, receiver, 0))


def _topological(plan: Plan) -> list[int]:
    """The stages in an order where every edge goes forward (Kahn's algorithm)."""
    indegree = [0] * len(plan.stages)
    for e in plan.edges:
        indegree[e.dst] += 1
    ready = [s for s, d in enumerate(indegree) if d == 0]
    order: list[int] = []
    while ready:
        s = ready.pop()
        order.append(s)
        for e in plan.edges:
            if e.src == s:
                indegree[e.dst] -= 1
                if indegree[e.dst] == 0:
                    ready.append(e.dst)
    return order


def _runs(plan: Plan, stage: int, rank: int) -> int:
    """c_r(s): the micro-batches of `stage` that `rank` runs (`Stage.device_for`)."""
    s = plan.stages[stage]
    return sum(1 for j in range(plan.micro_batches) if s.device_for(j) == rank)


def _update_time(plan: Plan, stage: int) -> float:
    """A stage's update: its gradients' sync and its optimizer step (as simulated)."""
    s = plan.stages[stage]
    return plan.cost_model.update_sync(s.param_bytes, s.replicas) + s.update_time
