"""trace: exact equivalence, the node.meta keys, leaf granularity and the export fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zoo import ZOO

from graphpipe.errors import ConfigError, TraceError
from graphpipe.trace import TensorSpec, trace, trace_info


@pytest.mark.parametrize("name", sorted(ZOO))
def test_traced_module_computes_what_the_model_computes(name: str) -> None:
    model, inputs = ZOO[name]()
    gm = trace(model, inputs)
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)


def test_meta_keys_describe_shapes_bytes_params_and_flops() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    gm = trace(model, torch.randn(3, 4))
    first = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert first.meta["gp_outputs"] == TensorSpec((3, 8), "torch.float32")
    assert first.meta["gp_out_bytes"] == 8 * 4  # per sample: 8 floats
    assert first.meta["gp_params"] == {"0.weight": 4 * 8 * 4, "0.bias": 8 * 4}
    assert first.meta["gp_flops"] == 2 * 4 * 8  # per sample: one 4x8 matmul
    assert first.meta["gp_module"] == "0"
    info = trace_info(gm)
    assert (info.method, info.batch_size, info.input_names) == ("fx", 3, ("input_1",))


def test_tied_weight_is_flagged_shared_under_its_canonical_name() -> None:
    model, inputs = ZOO["tied"]()
    gm = trace(model, inputs)
    holders = [n.name for n in gm.graph.nodes if "embed.weight" in n.meta["gp_params"]]
    assert holders == ["embed", "out"]
    for n in gm.graph.nodes:
        assert n.meta["gp_shared"] == (
            frozenset({"embed.weight"}) if n.name in holders else frozenset()
        )
    assert "out.weight" not in trace_info(gm).param_bytes  # counted once


def test_several_outputs_int_and_bool_tensors() -> None:
    model, inputs = ZOO["masked"]()
    gm = trace(model, inputs)
    specs = {n.name: n.meta["gp_outputs"] for n in gm.graph.nodes if n.op == "placeholder"}
    assert specs == {
        "tokens": TensorSpec((8, 6), "torch.int64"),
        "mask": TensorSpec((8, 6), "torch.bool"),
    }
    out = next(n for n in trace(*ZOO["multi_output"]()).graph.nodes if n.op == "output")
    assert set(out.meta["gp_outputs"]) == {"left", "right"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def test_leaf_modules_by_type_and_by_path() -> None:
    x = torch.randn(2, 4)
    assert len(_ops(trace(Stack(), x))) == 6
    assert _ops(trace(Stack(), x, leaf_modules=[Block])) == ["blocks_0", "blocks_1"]
    assert len(_ops(trace(Stack(), x, leaf_modules=["blocks.1"]))) == 4
    leaf = next(
        n for n in trace(Stack(), x, leaf_modules=[Block]).graph.nodes if n.name == "blocks_0"
    )
    assert set(leaf.meta["gp_params"]) == {
        "blocks.0.a.weight",
        "blocks.0.a.bias",
        "blocks.0.b.weight",
        "blocks.0.b.bias",
    }


def test_unknown_leaf_path_is_named() -> None:
    with pytest.raises(ConfigError, match="'blocks.7'"):
        trace(Stack(), torch.randn(2, 4), leaf_modules=["blocks.7"])


class ShapeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 2:  # Python control flow on a shape: symbolic_trace fails
            return self.a(x) * 2
        return x


class ValueBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a value: nothing can trace this
            return x
        return -x


def test_falls_back_to_torch_export_when_fx_fails() -> None:
    model, x = ShapeBranch(), torch.randn(3, 4)
    gm = trace(model, x)
    info = trace_info(gm)
    assert info.method == "export" and "control flow" in (info.fx_error or "")
    torch.testing.assert_close(gm(x), model(x))
    linear = next(n for n in gm.graph.nodes if n.meta.get("gp_params"))
    assert linear.meta["gp_module"] == "a"


def test_untraceable_model_quotes_both_reasons() -> None:
    with pytest.raises(TraceError) as err:
        trace(ValueBranch(), torch.randn(3, 4))
    message = str(err.value)
    assert "symbolic_trace failed" in message and "torch.export" in message
    assert "leaf_modules" in message  # says what to do


@pytest.mark.parametrize("bad", [(), ("not a tensor",), torch.tensor(1.0)])
def test_bad_example_inputs(bad: object) -> None:
    with pytest.raises(ConfigError):
        trace(nn.Linear(2, 2), bad)  # type: ignore[arg-type]


class Towers(nn.Module):
    """forward(*inputs): one tower per input, as in CANDLE-Uno."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(3, 2) for _ in range(3))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return sum(t(inputs[i]) for i, t in enumerate(self.towers))  # type: ignore[return-value]


def test_varargs_forward_gets_one_placeholder_per_input() -> None:
    model, inputs = Towers(), tuple(torch.randn(4, 3) for _ in range(3))
    gm = trace(model, inputs)
    assert trace_info(gm).input_names == ("inputs_0", "inputs_1", "inputs_2")
    assert all(
        n.meta["gp_outputs"] == TensorSpec((4, 3), "torch.float32")
        for n in gm.graph.nodes
        if n.op == "placeholder"
    )
    torch.testing.assert_close(gm(*inputs), model(*inputs))


def test_tracing_leaves_buffers_and_random_state_alone() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(0.5))
    x = torch.randn(6, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    trace(model, x)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
