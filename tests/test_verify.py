"""The trace is checked against the model's own forward (graphpipe.tracing.verify).

A graph that computes another function than the eager model (here: code that asks whether
it is being exported, as Hugging Face's masking does) is refused, naming the worst output;
a model with dropout in train mode passes (both runs start from one random state), and a
BatchNorm's statistics are as they were after the check.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphpipe.errors import TraceError
from graphpipe.tracing.tracer import trace


class ExportBranch(nn.Module):
    """Adds 0.19 where torch.export traces it; shape control flow sends fx to export."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.a(x)
        if x.shape[0] > 1:  # fx cannot trace this; export can
            y = y * 1.0
        if torch.compiler.is_exporting():
            y = y + 0.19
        return {"pooled": y.mean(-1), "scores": y}


def test_a_graph_that_computes_another_function_is_refused_naming_the_worst_output() -> None:
    with pytest.raises(
        TraceError,
        match=r"ExportBranch \(train mode\) does not compute .* the worst output is "
        r"out\['pooled'\], float32\[2\], differs by 0\.19 ",
    ):
        trace(ExportBranch(), torch.randn(4, 4), micro_batch_size=2)


class Noisy(nn.Module):
    """Dropout in train mode and a BatchNorm that updates its statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.a(x)))


def test_random_ops_and_buffers_pass_the_check_unchanged() -> None:
    model = Noisy().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    state = torch.get_rng_state()
    trace(model, x, micro_batch_size=4)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state untouched
