"""Placements with several stages per device: interleaved ("loop") and V-shaped ("v").

A plan for N devices with v virtual stages each is planned as a chain of N*v single-device
stages, then folded onto the N devices:

    loop  stage i on device i mod N (Megatron's interleaved 1F1B: each device holds stages
          d, d+N, d+2N, ...)
    v     two stages per device, stage i on device i for i < N and 2N-1-i after (ZB-V: the
          first and the last stage share device 0, so the loss's gradient starts where the
          first forward ran)

The plan's bottleneck becomes the busiest device's summed stage time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir import Plan, chain_in_order, device_of
from graphpipe.ir.plan import default_schedule

__all__ = ["PLACEMENTS", "device_of", "on_devices", "place_stages"]

PLACEMENTS = ("loop", "v")


def place_stages(plan: Plan, devices: int, placement: str) -> Plan:
    """`plan` (a chain of single-device stages, skips allowed: `chain_in_order`) with its
    stages folded onto `devices` devices.

    Raises:
        ConfigError: an unknown placement.
        PlanError: the plan is not a chain of single-device stages, or "v" without exactly two
            stages per device.
    """
    if placement not in PLACEMENTS:
        raise ConfigError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    count = len(plan.stages)
    if not chain_in_order(plan) or any(s.replicas != 1 for s in plan.stages):
        raise PlanError(
            f"a {placement!r} placement needs a chain of single-device stages (stage i feeding "
            f"i + 1, other edges forward); this plan has "
            f"edges {[(e.src, e.dst) for e in plan.edges]} and replicas "
            f"{[s.replicas for s in plan.stages]}"
        )
    if count % devices or (placement == "v" and count != 2 * devices):
        want = f"2 x {devices}" if placement == "v" else f"a multiple of {devices}"
        raise PlanError(
            f"a {placement!r} placement needs {want} stages, the partitioner made {count}; "
            "pin the stages (pins={module: stage}) to choose them"
        )
    assignment = [device_of(s.index, devices, placement) for s in plan.stages]
    return on_devices(plan, assignment, devices, placement, count // devices)


def on_devices(
    plan: Plan, assignment: Sequence[int], devices: int, placement: str, virtual: float
) -> Plan:
    """`plan` with stage i on the one device `assignment[i]` of `devices`: its bottleneck is
    the busiest device's summed stage time, its layout the placement's ("graph" for a
    folded stage DAG) with that layout's default schedule, and its info records `placement`
    and `virtual` (stages per device)."""
    stages = tuple(replace(s, devices=(d,)) for s, d in zip(plan.stages, assignment, strict=True))
    load = [0.0] * devices
    for s in stages:
        load[s.devices[0]] += s.time
    layout = placement if placement in PLACEMENTS else "graph"  # a folded stage DAG
    return replace(
        plan,
        stages=stages,
        num_devices=devices,
        bottleneck=max(load),
        layout=layout,
        schedule=default_schedule(layout),
        info={**plan.info, "placement": placement, "virtual_stages": virtual},
    )
