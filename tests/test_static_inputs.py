"""Static inputs: small integer tensors the model reads back to size its blocks become
constants of the trace (graphpipe.tracing.static).

Pure logic, one process: a model that cuts its sequence into blocks by `sizes.tolist()`
(as Qwen2-VL's vision attention does by its image grid) cannot be exported with `sizes` an
input; made static, it traces to a graph with no read-back, whose output equals the
model's. A value decided from another input's values is refused by name, never baked in;
so are a static positional input and a model on the meta device. The runtime refuses a
micro-batch whose static values differ from the traced ones, naming both. Training the
real model pipelined (Qwen2-VL with images) is in tests/test_multimodal.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphpipe.errors import ConfigError, TraceError
from graphpipe.runtime.batching import Inputs
from graphpipe.tracing.checks import READS
from graphpipe.tracing.tracer import trace

B, L, H = 4, 6, 8


class Blocks(nn.Module):
    """Attention within blocks of the sequence, the blocks' sizes read from `sizes` (as
    Qwen2-VL's vision attention; a block of two or fewer rows passes as it is, a decision
    on its size that torch.export cannot take from an input's values)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        blocks = torch.split(h, sizes[0].tolist(), dim=1)
        out = [self._attend(b) if b.shape[1] > 2 else b for b in blocks]
        return torch.cat(out, dim=1)

    def _attend(self, b: torch.Tensor) -> torch.Tensor:
        return torch.softmax(b @ b.transpose(1, 2), -1) @ b


class Branches(Blocks):
    """As Blocks, with a branch on the values of `x`: no trace may bake it in."""

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        out = super().forward(x, sizes)
        return out * 2 if bool(x.sum() > 0) else out


def _inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(B, L, H), "sizes": torch.tensor([[2, 4]]).repeat(B, 1)}


def test_a_static_input_is_folded_into_a_graph_that_equals_the_model() -> None:
    torch.manual_seed(0)
    model, inputs = Blocks(), _inputs()
    with pytest.raises(TraceError, match="torch.export"):  # sizes as an input: no trace
        trace(model, inputs, micro_batch_size=2)
    gm = trace(model, inputs, micro_batch_size=2, input_split={"sizes": "static"})
    assert gm.meta["graphpipe"].sources == ("x",)
    torch.testing.assert_close(gm.meta["gp_static"]["sizes"], torch.tensor([[2, 4]] * 2))
    reads = [n.name for n in gm.graph.nodes if n.target in READS]
    assert reads == []  # what sizes computed is literals now
    x = torch.randn(2, L, H)
    torch.testing.assert_close(gm(x=x), model(x, torch.tensor([[2, 4]] * 2)))


def test_a_decision_on_another_inputs_values_is_never_baked_in_silently() -> None:
    """torch.export, tracing with static inputs, takes the branch the example takes and
    asserts its condition: the assert is kept, and fails on a micro-batch that would take
    the other branch (a read-back making a shape, or an assert graphpipe cannot keep, is
    refused by name: tests below and in test_value_checks)."""
    torch.manual_seed(0)
    model, inputs = Branches(), _inputs()
    inputs["x"] = inputs["x"].abs()  # the example takes the `* 2` branch
    gm = trace(model, inputs, micro_batch_size=2, input_split={"sizes": "static"})
    sizes = torch.tensor([[2, 4]] * 2)
    x = torch.rand(2, L, H)
    torch.testing.assert_close(gm(x=x), model(x, sizes))
    with pytest.raises(RuntimeError, match="a check of the model's forward failed"):
        gm(x=-x)  # the model would not double this one


def test_a_read_back_of_another_input_that_makes_a_shape_is_refused() -> None:
    class Sized(Blocks):
        def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
            return super().forward(x, sizes)[:, : int(x.abs().sum().clamp(max=3))]

    with pytest.raises(TraceError, match=r"reads clamp back .* a decision torch.export took"):
        trace(Sized(), _inputs(), micro_batch_size=2, input_split={"sizes": "static"})


def test_static_needs_a_keyword_tensor_and_real_weights() -> None:
    inputs = _inputs()
    with pytest.raises(ConfigError, match=r"must be a tensor given as a keyword input"):
        trace(Blocks(), (inputs["x"], inputs["sizes"]), input_split={1: "static"})
    with torch.device("meta"):
        meta = Blocks()
    with pytest.raises(ConfigError, match="need a model with real weights"):
        trace(meta, inputs, input_split={"sizes": "static"})


def test_a_micro_batch_with_other_static_values_is_refused_naming_both() -> None:
    gm = trace(Blocks(), _inputs(), micro_batch_size=2, input_split={"sizes": "static"})
    inputs = Inputs(
        gm,
        [_inputs()["x"]],
        ["x"],
        lambda out, target: out.sum(),
        2,
        torch.device("cpu"),
        True,
        split=gm.meta["gp_split"],
    )
    same = _inputs()
    assert len(inputs.batch((), same, None, 0).inputs["x"]) == 2
    other = {**same, "sizes": torch.tensor([[2, 4], [2, 4], [3, 3], [3, 3]])}
    with pytest.raises(ConfigError, match=r"'sizes' of micro-batch 1 is \[\[3, 3\], \[3, 3\]\]"):
        inputs.batch((), other, None, 0)
    with pytest.raises(ConfigError, match=r"missing \['sizes'\]"):
        inputs.batch((), {"x": same["x"]}, None, 0)
