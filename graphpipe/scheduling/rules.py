"""Rules: which plans, at which M, each schedule runs. One rule per schedule, asked by all.

A schedule's rule is made of plain checks, each `(plan, spec, M) -> problems` naming the
values: those of its placement (`ScheduleSpec.placement` in
`graphpipe.ir.registry.SCHEDULES`), no replicated stage where its spec allows none, and
the check of its bound on M (`ScheduleSpec.min_micro_batches`, `BOUNDS`):

    placement None    one stage per device (a stage may be replicated)
              "loop"  a chain (`chain_in_order`), stage s on device s mod N, as many stages
                      on every device, M a multiple of N (Megatron's rounds of N)
              "v"     a chain of 2N stages, device d holding stages d and 2N-1-d
              "any"   any placement of single-device stages
    bound     2bw: M >= depth; dualpipev: M >= 2N

`make_schedule` and `drain_schedule` check it before building anything, so `simulate`, the
dry run (`check_run`), the planner's layout choice (which simulates each candidate) and
`compile` (`schedule_plan`) refuse what cannot run with the same message. On a chain of 3
stages on 4 devices (one idle) at M = 8:

    problems(plan, "interleaved_zb", 8)   # [] where it runs; here
        ['interleaved_zb needs a multiple of 4 stages (as many on every device), got 3']
    check(plan, "interleaved_zb", 8)      # the spec, or a ScheduleError naming every problem
"""

from __future__ import annotations

from collections.abc import Callable

from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir import SCHEDULES, Plan, ScheduleSpec, chain_in_order, device_of, schedule_spec

__all__ = ["BOUNDS", "PLACEMENT_RULES", "Rule", "check", "problems", "rule"]

Rule = Callable[[Plan, ScheduleSpec, int], list[str]]  # (plan, spec, M) -> problems


def _one_per_device(plan: Plan, spec: ScheduleSpec, m: int) -> list[str]:
    shared = plan.shared_devices()
    if not shared:
        return []
    several = sorted(n for n, s in SCHEDULES.items() if s.placement and s.training)
    return [
        f"schedule {spec.name!r} runs one stage per device, but devices {shared} hold "
        f"several; use one of {several}"
    ]


def _chain_placed(plan: Plan, spec: ScheduleSpec, m: int) -> list[str]:
    """A chain whose stage s is on device `device_of(s, N, placement)` alone."""
    placement, n = str(spec.placement), plan.num_devices
    wrong = [s.index for s in plan.stages if s.devices != (device_of(s.index, n, placement),)]
    why = []
    if not chain_in_order(plan):
        why.append(f"its stage edges {[(e.src, e.dst) for e in plan.edges]} are no chain")
    if wrong:
        why.append(f"stages {wrong} are not placed so")
    if not why:
        return []
    return [
        f"schedule {spec.name!r} needs a chain of stages placed {placement!r} "
        f"(PlanConfig(virtual_stages=..., placement={placement!r})); {' and '.join(why)}"
    ]


def _loop_counts(plan: Plan, spec: ScheduleSpec, m: int) -> list[str]:
    n, count = plan.num_devices, len(plan.stages)
    found = []
    if count == 0 or count % n:
        found.append(
            f"{spec.name} needs a multiple of {n} stages (as many on every device), got {count}"
        )
    if m % n:
        found.append(f"{spec.name} needs micro_batches a multiple of {n} devices, got {m}")
    return found


def _v_counts(plan: Plan, spec: ScheduleSpec, m: int) -> list[str]:
    n, count = plan.num_devices, len(plan.stages)
    return [] if count == 2 * n else [f"{spec.name} needs 2 stages per device, got {count} on {n}"]


def _unreplicated(plan: Plan, spec: ScheduleSpec, m: int) -> list[str]:
    replicated = [s.index for s in plan.stages if s.replicas > 1]
    if not replicated:
        return []
    return [
        f"schedule {spec.name!r} needs unreplicated stages, but stages {replicated} are "
        "data-parallel; plan with replication=False"
    ]


def _m_at_least_depth(plan: Plan, spec: ScheduleSpec, m: int) -> list[str]:
    if m >= plan.depth:
        return []
    return [f"{spec.name} needs micro_batches >= depth, got M={m} < depth {plan.depth}"]


def _m_at_least_two_n(plan: Plan, spec: ScheduleSpec, m: int) -> list[str]:
    n = plan.num_devices
    if m >= 2 * n:
        return []
    return [
        f"{spec.name} needs micro_batches >= 2 x {n} devices = {2 * n} (its steady state "
        f"pairs a forward with a backward on every device), got {m}; zbv runs any M"
    ]


PLACEMENT_RULES: dict[str | None, tuple[Rule, ...]] = {
    None: (_one_per_device,),
    "loop": (_chain_placed, _loop_counts),
    "v": (_chain_placed, _v_counts),
    "any": (),
}
# the check of each bound on M a schedule's spec names (`ScheduleSpec.min_micro_batches`)
BOUNDS: dict[str, Rule] = {"depth": _m_at_least_depth, "2n": _m_at_least_two_n}


def rule(name: str) -> tuple[Rule, ...]:
    """The checks of schedule `name` (or its alias), read from its spec as it is now.

    Raises:
        ConfigError: an unknown schedule.
    """
    spec = schedule_spec(name, training=False)
    replicas = () if spec.replicas else (_unreplicated,)
    bound = (BOUNDS[spec.min_micro_batches],) if spec.min_micro_batches else ()
    return PLACEMENT_RULES[spec.placement] + replicas + bound


def problems(plan: Plan, name: str, m: int | None = None) -> list[str]:
    """Every reason schedule `name` cannot run `plan` at M = `m` (the plan's by default);
    empty when it can.

    Raises:
        ConfigError: an unknown schedule.
    """
    spec = schedule_spec(name, training=False)
    m = plan.micro_batches if m is None else m
    return [p for check in rule(spec.name) for p in check(plan, spec, m)]


def check(plan: Plan, name: str, m: int | None = None) -> ScheduleSpec:
    """The spec of schedule `name`, once its rule holds for `plan` at M = `m` (the plan's
    by default).

    Raises:
        ConfigError: an unknown schedule or M < 1.
        ScheduleError: every problem the rule finds, each naming its values (one problem:
            the message is that problem).
    """
    spec = schedule_spec(name, training=False)
    m = plan.micro_batches if m is None else m
    if m < 1:
        raise ConfigError(f"micro_batches must be >= 1, got {m}")
    found = problems(plan, spec.name, m)
    if len(found) == 1:
        raise ScheduleError(found[0])
    if found:
        raise ScheduleError(f"schedule {spec.name!r} cannot run the plan at M={m}:", found)
    return spec


def _check_tables() -> None:
    """Refuse a bound on M or a placement of a spec without its rule."""
    named = {s.min_micro_batches for s in SCHEDULES.values() if s.min_micro_batches}
    stray = sorted(named - set(BOUNDS))
    unruled = sorted({s.placement for s in SCHEDULES.values()} - set(PLACEMENT_RULES), key=str)
    if stray or unruled:
        raise ConfigError(
            f"scheduling.rules: bounds on M without a check {stray}, placements without "
            f"rules {unruled}"
        )


_check_tables()
