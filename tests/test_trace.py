"""trace: exact equivalence, the node.meta keys, leaf granularity and the export fallback."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from zoo import ZOO

from graphpipe.errors import ConfigError, TraceError
from graphpipe.planning.partition import plan
from graphpipe.planning.profile import ProfileConfig
from graphpipe.tracing.tracer import TensorSpec, flat_inputs, model_output, trace, trace_info


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


class TwoLayerShapeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 2:  # symbolic_trace fails: torch.export traces it
            x = self.a(x)
        return self.b(x)


def test_an_exported_model_is_planned_with_measured_costs_without_a_future_warning() -> None:
    """torch 2.13 deprecates pytree's LeafSpec with a FutureWarning from its constructor;
    graphpipe's copies of an exported graph (the profiler's, to time ops on a device) share
    torch's one leaf spec instead of building one (`graphpipe._torch.copy_graph`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        p = plan(
            TwoLayerShapeBranch(),
            torch.randn(8, 4),
            devices=2,
            micro_batches=2,
            profile=ProfileConfig(mode="measure", warmup=0, repeats=1),
        )
    assert p.stages


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


class KeywordModel(nn.Module):
    """A Hugging-Face-like forward: keyword inputs, optional arguments, a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        scale: float = 1.0,
        return_dict: bool = True,
    ) -> dict[str, torch.Tensor] | tuple[torch.Tensor]:
        h = self.proj(input_ids) * scale
        if attention_mask is not None:
            h = h * attention_mask
        return {"logits": h} if return_dict else (h,)


def test_keyword_inputs_and_optional_arguments_become_constants() -> None:
    model, x = KeywordModel(), torch.randn(6, 4)
    gm = trace(model, {"input_ids": x, "scale": 2.0}, micro_batch_size=3)
    info = trace_info(gm)
    assert info.input_names == ("input_ids",) and info.sources == ("input_ids",)
    assert info.constants == {"scale": "2.0"} and info.micro_batch_size == 3
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert placeholder.meta["gp_outputs"] == TensorSpec((3, 4), "torch.float32")
    torch.testing.assert_close(gm(x), model(x, scale=2.0))
    assert flat_inputs(gm, input_ids=x)[0] is x
    with pytest.raises(ConfigError, match="scale"):
        flat_inputs(gm, input_ids=x, scale=3.0)  # a constant of the trace
    with pytest.raises(ConfigError, match="attention_mask"):
        flat_inputs(gm, input_ids=x, attention_mask=x)  # not traced as an input


def test_keyword_tensor_inputs_feed_their_placeholders() -> None:
    model, x, mask = KeywordModel(), torch.randn(4, 4), torch.rand(4, 4)
    gm = trace(model, {"attention_mask": mask, "input_ids": x, "return_dict": False})
    info = trace_info(gm)
    assert info.sources == ("input_ids", "attention_mask")  # signature order
    flat = flat_inputs(gm, attention_mask=mask, input_ids=x)
    assert flat[0] is x and flat[1] is mask
    assert "return_dict" in info.constants
    torch.testing.assert_close(gm(*flat), model(x, mask, return_dict=False))


def test_unknown_keyword_input_is_named() -> None:
    with pytest.raises(ConfigError, match="pixel_values"):
        trace(KeywordModel(), {"input_ids": torch.randn(2, 4), "pixel_values": torch.ones(2)})


class ExportedKeywords(ShapeBranch):
    """Falls back to torch.export, with keyword inputs, a constant and a nested output."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, mask: torch.Tensor | None = None, flag: bool = False
    ) -> dict[str, Any]:
        y = super().forward(x)
        y = y * mask if mask is not None else y
        return {"y": y + 1 if flag else y, "pair": (y, y * 3)}


def test_exported_keyword_inputs_constants_and_nested_outputs() -> None:
    model, x, mask = ExportedKeywords(), torch.randn(4, 4), torch.rand(4, 4)
    gm = trace(model, {"x": x, "mask": mask, "flag": True}, micro_batch_size=2)
    info = trace_info(gm)
    assert info.method == "export"
    assert info.sources == ("x", "mask") and set(info.constants) == {"flag"}
    flat = flat_inputs(gm, x=x[:2], mask=mask[:2])
    out = model_output(gm, _run(gm, flat))
    expected = model(x[:2], mask=mask[:2], flag=True)
    torch.testing.assert_close(out, expected)


def _run(gm: torch.fx.GraphModule, flat: list[torch.Tensor]) -> Any:
    return torch.fx.Interpreter(gm).run(*flat)


class FixedBatch(nn.Module):
    """Its code holds the batch size as a literal: it cannot run on micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).view(8, 2, 2).sum(-1)


class FixedBatchExported(FixedBatch):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 2:  # forces the torch.export fallback
            return self.a(x).reshape(8, 2, 2).sum(-1)
        return x


@pytest.mark.parametrize("model", [FixedBatch(), FixedBatchExported()], ids=["fx", "export"])
def test_a_batch_size_fixed_by_the_code_is_named(model: nn.Module) -> None:
    x = torch.randn(8, 4)
    trace(model, x)  # the whole batch traces
    with pytest.raises(TraceError, match="batch size") as err:
        trace(model, x, micro_batch_size=2)
    assert "8" in str(err.value) and "2" in str(err.value)


class CountsCalls(nn.Module):
    """Updates a buffer behind fx's back (as timm's BatchNormAct2d did): the graph would not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._buffers["calls"].add_(1)  # type: ignore[union-attr]
        return self.a(x)


def test_tracing_that_changes_a_buffer_is_refused_naming_it() -> None:
    model = CountsCalls()
    with pytest.raises(TraceError, match="calls"):
        trace(model, torch.randn(2, 4))
    assert int(model.calls) == 0  # and the model is left as it was


class ForeignBatchNorm(nn.BatchNorm1d):
    """A BatchNorm subclass from another library, updating its statistics in Python."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        return nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps
        )


def test_batchnorm_subclasses_are_leaves_so_their_updates_run() -> None:
    model = nn.Sequential(nn.Linear(4, 4), ForeignBatchNorm(4))
    gm = trace(model, torch.randn(6, 4))
    assert [n.op for n in gm.graph.nodes].count("call_module") == 2
    gm(torch.randn(6, 4))
    gm(torch.randn(6, 4))
    assert int(model[1].num_batches_tracked) == 2  # every run counts, as in the model


def test_nodes_that_update_buffers_are_flagged() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    gm = trace(model, torch.randn(6, 4))
    flagged = {n.name: n.meta["gp_mutates"] for n in gm.graph.nodes if n.meta["gp_mutates"]}
    assert flagged == {"_1": {"1.running_mean", "1.running_var", "1.num_batches_tracked"}}
    exported = trace(ExportedNorm(), torch.randn(8, 4))
    assert trace_info(exported).method == "export"
    mutated = set().union(*(n.meta["gp_mutates"] for n in exported.graph.nodes))
    assert mutated == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}


class ExportedNorm(ShapeBranch):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))
