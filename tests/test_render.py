"""render: one SVG cluster per stage, readable large graphs, stage-graph labels."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from zoo import TwoBranch

from graphpipe.errors import ConfigError
from graphpipe.planning.partition import PlanConfig, partition
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.tools.render import render, side_by_side
from graphpipe.tracing.tracer import trace


def _planned(model: nn.Module, x: torch.Tensor, devices: int):  # type: ignore[no-untyped-def]
    gm = trace(model, x)
    flops = ProfileConfig(mode="flops")  # the same plan every run: one stage per device
    config = PlanConfig(devices=devices, replication=False, layouts=("one",))
    return gm, partition(gm, profile(gm, (x,), 2, flops), config)


def _clusters(svg: str) -> int:
    return len(re.findall(r'class="cluster"', svg))


def test_op_graph_has_one_cluster_per_stage() -> None:
    gm, plan = _planned(TwoBranch(width=32, depth=2), torch.randn(8, 32), devices=3)
    svg = render(gm, plan).pipe(format="svg").decode()
    assert _clusters(svg) == len(plan.stages) == 3
    for s in plan.stages:
        assert f"S{s.index} on devices {list(s.devices)}" in svg
    assert "float32[8,32]" in svg  # shapes on edges
    assert "a.0.0" in svg  # module-path labels


def test_large_op_graph_is_drawn_by_module() -> None:
    blocks = nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(40)]
    )
    gm, plan = _planned(blocks, torch.randn(4, 8), devices=4)
    assert sum(1 for n in gm.graph.nodes) > 100
    dot = render(gm, plan, max_nodes=60)
    boxes = [line for line in dot.body if "fillcolor" in line]
    assert len(boxes) <= 60 + 2  # placeholders and output are drawn as they are
    assert "(3 ops)" in dot.source
    assert _clusters(dot.pipe(format="svg").decode()) == len(plan.stages)


def test_stage_graph_shows_devices_times_and_bytes() -> None:
    _, plan = _planned(TwoBranch(width=32, depth=2), torch.randn(8, 32), devices=3)
    source = render(plan).source
    assert "devices [0]" in source and "in flight" in source
    assert source.count("->") == len(plan.edges)
    assert "KiB" in source or " B (" in source
    both = side_by_side([plan, plan]).pipe(format="svg").decode()
    assert _clusters(both) == 2


def test_render_rejects_other_objects() -> None:
    with pytest.raises(ConfigError, match="Plan or an fx.GraphModule"):
        render("not a graph")  # type: ignore[arg-type]
