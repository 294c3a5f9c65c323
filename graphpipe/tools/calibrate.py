"""Calibrate: replace a plan's predicted costs with ones measured on the running pipeline.

    timeline = pm.timeline()                       # after a few recorded steps
    link = measure_link()                          # a collective: every rank calls it
    plan = calibrated(pm.plan, timeline, link)
    simulate(plan, pm.schedule).iteration_time     # compare with the measured step time

Per-action costs come from the measured timeline (by default the median span of each kind on
each stage, robust to a slow first step; `statistic=statistics.mean` when every recorded step
is a steady one: the simulated actions then add up to the compute the steps really did, where
a skewed spread of backward times makes the median fall short; the executor does not count
waiting for peers as part of an action), the link's latency
and bandwidth from a ping-pong between ranks 0 and 1. What the simulator then adds, bubbles,
transfers and the order of actions, is what the comparison tests.

    for step, times in zip(walls, replayed(timeline)):
        simulate(plan, pm.schedule, durations=times).iteration_time   # vs this step's wall

`replayed` gives every action of each recorded step its own measured time instead: the
simulated step then has the measured steps' spread too (a backward slowed by the other
process delays its successors as it did), and what the measured step adds to it is the
runtime's own cost: posting and waiting for messages, and Python between actions.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from graphpipe.ir import Action, ActionKind, Plan, Timeline
from graphpipe.ir.cost import LinkModel
from graphpipe.runtime.failures import guarded

__all__ = ["calibrated", "measure_link", "replayed"]


def calibrated(
    plan: Plan,
    timeline: Timeline,
    link: LinkModel | None = None,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> Plan:
    """`plan` with every stage's forward, backward and update times measured in `timeline`.

    Args:
        plan: The plan that ran.
        timeline: Its measured timeline.
        link: The measured link (None: the plan's).
        statistic: Of each stage's spans of one kind (see the module docstring).

    A full backward's time is the B spans' statistic; with zero bubble it is I's plus W's.
    """
    spans: dict[tuple[int, ActionKind], list[float]] = defaultdict(list)
    for span in timeline.spans:
        a = Action.parse(span.action)
        spans[(a.stage, a.kind)].append(span.end - span.start)

    def measured(stage: int, kind: ActionKind, default: float) -> float:
        values = spans.get((stage, kind))
        return statistic(values) if values else default

    stages = []
    for s in plan.stages:
        backward = measured(s.index, ActionKind.B, 0.0) or (
            measured(s.index, ActionKind.I, 0.0) + measured(s.index, ActionKind.W, 0.0)
        )
        stages.append(
            replace(
                s,
                forward_time=measured(s.index, ActionKind.F, s.forward_time),
                backward_time=backward or s.backward_time,
                update_time=measured(s.index, ActionKind.U, s.update_time),
            )
        )
    cost = plan.cost_model if link is None else replace(plan.cost_model, link=link)
    return replace(plan, stages=tuple(stages), cost_model=cost)


def replayed(timeline: Timeline) -> list[dict[str, float]]:
    """Each recorded step's actions with their measured seconds, by action text.

    Every step runs the same actions, once each, so the k-th span of an action belongs to
    the k-th recorded step.

    Raises:
        ValueError: the actions were not recorded the same number of times (a partly
            recorded step), naming two that differ.
    """
    seen: dict[str, list[float]] = defaultdict(list)
    for span in sorted(timeline.spans, key=lambda s: s.start):
        seen[span.action].append(span.end - span.start)
    counts = {action: len(times) for action, times in seen.items()}
    if len(set(counts.values())) > 1:
        low, high = min(counts, key=counts.get), max(counts, key=counts.get)  # type: ignore[arg-type]
        raise ValueError(
            f"actions recorded unequal times: {low} {counts[low]}, {high} {counts[high]}"
        )
    steps = next(iter(counts.values()), 0)
    return [{action: times[k] for action, times in seen.items()} for k in range(steps)]


def measure_link(sizes: tuple[int, int] = (8, 1 << 22), repeats: int = 20) -> LinkModel:
    """Latency and bandwidth between ranks 0 and 1, by ping-pong (a collective on all ranks).

    Latency is half a small message's round trip; bandwidth is a large message's size over
    half its round trip less the latency.
    """
    rank = dist.get_rank()
    times = [_round_trip(rank, n, repeats) for n in sizes]
    result = torch.tensor(times, dtype=torch.float64)
    guarded("the broadcast of the measured link", lambda: dist.broadcast(result, src=0))
    small, large = (float(t) for t in result)
    latency = small / 2
    bandwidth = sizes[1] / max(large / 2 - latency, 1e-9)
    return LinkModel(bandwidth=bandwidth, latency=latency)


def _round_trip(rank: int, nbytes: int, repeats: int) -> float:
    """Rank 0 -> 1 -> 0 with receives posted in advance, as the executor posts them."""
    out, back = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    samples = []
    for i in range(repeats + 2):
        pending = dist.irecv(back if rank == 0 else out, 1 - rank, tag=i) if rank < 2 else None
        guarded("the barrier before a ping-pong", dist.barrier)
        start = time.perf_counter()
        if rank == 0 and pending is not None:
            dist.send(out, 1, tag=i)
            pending.wait()
        elif rank == 1 and pending is not None:
            pending.wait()
            dist.send(out, 0, tag=i)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])
