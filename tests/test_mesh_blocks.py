"""Outlining a flat stage graph's blocks into submodules, FSDP2's units (no processes).

`graphpipe.runtime.outline.outline_blocks` turns each decoder layer of a graph torch.export
traced (the tiny Hugging Face Llama of tests/test_mesh_models.py) into one `call_module` of a
small GraphModule at the layer's own path. The stage must compute the same outputs and
gradients as the flat one, keep every parameter name (and tensor) in order, and
`stage_blocks` must then find one unit per layer. A block whose weight is read elsewhere
(tied) stays in the root. The multi-process check (pp2 x dp2, one FSDP2 unit per layer,
trained equal to one process) is in tests/test_mesh_models.py.
"""

from __future__ import annotations

import pytest
import torch
from test_mesh_models import batch, llama, lm_loss
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from graphpipe.planning.partition import plan
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.mesh import stage_blocks
from graphpipe.runtime.outline import outline_blocks, outline_like, outlined
from graphpipe.runtime.stage import build_stage
from graphpipe.runtime.tp import attention, for_dtensor
from graphpipe.tracing.tracer import trace

# layer 0's attention on stage 0, its MLP on stage 1: a cut through the middle of a block
MID_BLOCK = {
    "model.embed_tokens": 0,
    "model.layers.0.self_attn": 0,
    "model.layers.0.mlp": 1,
    "model.layers.1": 1,
    "lm_head": 1,
}


def _named(module: nn.Module) -> list[tuple[str, int]]:
    return [(n, id(p)) for n, p in module.named_parameters()]


def _step(gm: fx.GraphModule) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole graph's logits and every parameter's gradient of the loss."""
    ids, target = batch(0)
    gm.zero_grad(set_to_none=True)
    out = gm(input_ids=ids)
    lm_loss(out, target).backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in gm.named_parameters()}


def test_each_decoder_layer_of_an_exported_graph_becomes_one_called_block() -> None:
    model = llama()
    gm = trace(model, {"input_ids": batch(0)[0], "use_cache": False})
    names = _named(gm)
    flat_out, flat_grads = _step(gm)
    assert stage_blocks(gm, model) == []  # flat: get_attr reads, no module called
    paths = outline_blocks(gm, model)
    assert paths == ["model.layers.0", "model.layers.1"] == list(outlined(gm))
    assert _named(gm) == names  # the same names, tensors and order
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert calls == paths
    units = stage_blocks(gm, model)
    assert [[gm.get_submodule(p)] for p in paths] == units
    out, grads = _step(gm)
    torch.testing.assert_close(out, flat_out, rtol=0, atol=0)
    for name, grad in flat_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def _stage_run(stage: fx.GraphModule, args: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stage's values and its parameters' gradients of the sum of its float outputs."""
    stage.zero_grad(set_to_none=True)
    out = stage(*args)
    leaves = {f"{k} {i}": v for k, value in out.items() for i, v in enumerate(tree_leaves(value))}
    values = {k: v for k, v in leaves.items() if isinstance(v, torch.Tensor)}
    sum(v.float().sum() for v in values.values() if v.requires_grad).backward()
    grads = {f"grad {n}": p.grad.clone() for n, p in stage.named_parameters()}
    return {**{k: v.detach() for k, v in values.items()}, **grads}


def test_a_stage_cut_through_a_block_outlines_each_part_and_computes_the_same() -> None:
    model = llama()
    ids, _ = batch(0)
    inputs = {"input_ids": ids, "use_cache": False}
    made = plan(model, inputs, devices=2, micro_batches=2, pins=MID_BLOCK,
                profile=ProfileConfig(mode="flops"))  # fmt: skip
    gm = trace(model, inputs, micro_batch_size=4)
    first, io0 = build_stage(gm, made, 0)
    second, io1 = build_stage(gm, made, 1)
    sent = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in first(ids[:4]).items()}
    runs = [(first, [ids[:4]]), (second, [sent[n] for n in io1.received])]
    flat = [_stage_run(stage, args) for stage, args in runs]
    names = [_named(stage) for stage, _ in runs]
    assert outline_blocks(first, model) == ["model.layers.0"]  # its attention half
    assert outline_blocks(second, model) == ["model.layers.0", "model.layers.1"]
    assert [_named(stage) for stage, _ in runs] == names
    assert {n for n, _ in second.get_submodule("model.layers.0").named_parameters()} == {
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    for (stage, args), want in zip(runs, flat, strict=True):
        got = _stage_run(stage, args)
        assert set(got) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    assert len(io0.sent) > 1  # the attention half hands several values on


def test_a_stage_graph_made_again_is_outlined_as_the_live_one() -> None:
    model = llama()
    gm = trace(model, {"input_ids": batch(0)[0], "use_cache": False})
    again = trace(model, {"input_ids": batch(1)[0], "use_cache": False})
    outline_blocks(gm, model)
    outline_like(again, outlined(gm))
    assert outlined(again) == outlined(gm)
    torch.testing.assert_close(_step(again)[0], _step(gm)[0], rtol=0, atol=0)


class _Block(nn.Module):
    """A block that reads its weight directly (fx traces it as a get_attr)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


class _Net(nn.Module):
    """Three blocks; with `tied`, the head reads the last block's weight too."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(4) for _ in range(3)])
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x @ self.blocks[2].weight.t() if self.tied else x


@pytest.mark.parametrize("tied", [False, True])
def test_a_block_whose_weight_is_read_elsewhere_stays_in_the_root(tied: bool) -> None:
    torch.manual_seed(0)
    model = _Net(tied)
    x = torch.randn(2, 4)
    gm = trace(model, x)
    names, want = _named(gm), gm(x)
    paths = outline_blocks(gm, model)
    assert paths == (["blocks.0", "blocks.1"] if tied else ["blocks.0", "blocks.1", "blocks.2"])
    assert _named(gm) == names
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)
    assert len(stage_blocks(gm, model)) == len(paths)


def test_a_graph_of_called_modules_is_left_as_it_is() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    gm = trace(model, torch.randn(2, 4))
    code = gm.code
    assert outline_blocks(gm, model) == []
    assert gm.code == code


def test_tensor_parallel_s_rewrites_keep_the_layers_outlinable() -> None:
    """tp rewrites an exported stage before FSDP2 wraps it (attention in plain ops): the
    new nodes keep their layer's module path, so each layer is still one block."""
    model = llama()
    gm = trace(model, {"input_ids": batch(0)[0], "use_cache": False})
    want = _step(gm)[0]
    for_dtensor(gm)
    assert any(n.target is attention for n in gm.graph.nodes)
    assert outline_blocks(gm, model) == ["model.layers.0", "model.layers.1"]
    torch.testing.assert_close(_step(gm)[0], want, rtol=1e-6, atol=1e-6)
