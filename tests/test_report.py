"""The plain-text plan tables (graphpipe.tools.report): which layers each stage holds."""

from __future__ import annotations

import torch
from torch import nn

import graphpipe
from graphpipe.planning.profile import ProfileConfig
from graphpipe.tools.report import modules_of, plan_table
from graphpipe.tracing.tracer import trace


class Stack(nn.Module):
    """An embedding, eight numbered layers and a head: a Hugging Face model's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_each_stage_names_the_layers_it_holds_by_their_indices() -> None:
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(8, 8)
    plan = graphpipe.plan(model, x, 2, profile=ProfileConfig(mode="flops"), micro_batches=2)
    table = plan_table(plan, modules_of(trace(model, x).graph.nodes))
    rows = [line for line in table.splitlines() if line.startswith("S")]
    assert len(rows) == len(plan.stages) >= 2, table
    held = [r.split()[2] for r in rows]  # the ops column's first group: most ops
    assert all(h.startswith("layers.") for h in held), table
    first, last = held[0].split("(")[0], held[-1].split("(")[0]
    assert first.startswith("layers.0-") and last.endswith("-7"), table  # in order, all 8
