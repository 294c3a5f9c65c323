"""Planning at scale: graphs of 1,000+ ops with asserts and constants plan in seconds.

    pytest -q -s tests/test_planner_scale.py   # -s prints the planning times

Two graphs that used to take minutes: an Inception-style CNN whose blocks check their input
channels with `torch._assert` (dead ends: ops nothing uses), traced by torch.fx, and a tiny
Hugging Face Llama (24 layers), traced by torch.export, with `_assert_tensor_metadata` checks
and a mask and rotary tables built from `arange` and read by every layer (constants). Times
are printed, not asserted; the tests check that every plan is valid and where the dead ends
and constants went.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import fx, nn

from graphpipe.ir import Plan
from graphpipe.planning.layouts import LAYOUTS
from graphpipe.planning.opgraph import value_kind
from graphpipe.planning.partition import PlanConfig, partition
from graphpipe.planning.profile import Profile, ProfileConfig, profile
from graphpipe.planning.validate import validate_plan
from graphpipe.tracing.tracer import flat_inputs, trace

DEVICES = (2, 4, 8)
FLOPS = ProfileConfig(mode="flops")  # the same plans on every run


class BasicConv(nn.Module):
    """Conv, BatchNorm, ReLU, after checking the input channels."""

    def __init__(self, cin: int, cout: int, k: int = 1) -> None:
        super().__init__()
        self.cin = cin
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, cin, H, W) -> (B, cout, H, W)
        torch._assert(x.shape[1] == self.cin, "BasicConv: wrong number of channels")
        return torch.relu(self.bn(self.conv(x)))


class InceptionBlock(nn.Module):
    """Four branches (1x1; 1x1, 3x3; 1x1, 3x3, 3x3; pool, 1x1) concatenated."""

    def __init__(self, c: int) -> None:
        super().__init__()
        q = c // 4
        self.c = c
        self.b1 = BasicConv(c, q)
        self.b2 = nn.Sequential(BasicConv(c, q), BasicConv(q, q, 3))
        self.b3 = nn.Sequential(BasicConv(c, q), BasicConv(q, q, 3), BasicConv(q, q, 3))
        self.pool = nn.AvgPool2d(3, 1, 1)
        self.b4 = BasicConv(c, q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c, H, W) -> (B, c, H, W)
        torch._assert(x.shape[1] == self.c, "InceptionBlock: wrong number of channels")
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(self.pool(x))], 1)


class InceptionLike(nn.Module):
    """A stem, `blocks` Inception blocks and a linear head: about 55 ops per block."""

    def __init__(self, blocks: int = 24, c: int = 8) -> None:
        super().__init__()
        self.stem = BasicConv(3, c, 3)
        self.blocks = nn.Sequential(*[InceptionBlock(c) for _ in range(blocks)])
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 10)
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def _plans(name: str, gm: fx.GraphModule, prof: Profile) -> dict[int, Plan]:
    plans = {}
    for devices in DEVICES:
        start = time.perf_counter()
        # the default's layout choice at 4 devices; one stage per device elsewhere (CI's time)
        layouts = LAYOUTS if devices == 4 else ("one",)
        config = PlanConfig(devices=devices, micro_batches=4, layouts=layouts)
        plans[devices] = partition(gm, prof, config)
        seconds = time.perf_counter() - start
        print(f"\n{name}: {len(_ops(gm))} ops, {devices} devices: planned in {seconds:.2f} s")
    return plans


def _checked(check: fx.Node) -> fx.Node | None:
    """The tensor a check reads, through size queries and comparisons (None: a model input,
    or a parameter or buffer, which every stage reading it holds a copy of)."""
    node = check
    while node.all_input_nodes:
        node = node.all_input_nodes[0]
        if node.op in ("placeholder", "get_attr"):
            return None
        if value_kind(node) == "tensor":
            return node
    return None


@pytest.fixture(scope="module")
def inception() -> tuple[fx.GraphModule, Profile]:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    gm = trace(InceptionLike(), x, micro_batch_size=2)
    return gm, profile(gm, flat_inputs(gm, x[:2]), 2, FLOPS)


def test_inception_with_asserts_plans_in_seconds(
    inception: tuple[fx.GraphModule, Profile],
) -> None:
    gm, prof = inception
    asserts = [n for n in _ops(gm) if n.target is torch._assert]
    assert len(_ops(gm)) >= 1000 and len(asserts) == 24 * 8 + 1
    for p in _plans("Inception-style CNN", gm, prof).values():
        validate_plan(p, gm)  # every op, every assert too, in exactly one stage
        for check in asserts:
            checked = _checked(check)
            if checked is not None:  # the assert went with the op it checks
                assert p.stage_of[check.name] == p.stage_of[checked.name], check.name


@pytest.fixture(scope="module")
def llama() -> tuple[fx.GraphModule, Profile]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=24,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    gm = trace(model, {"input_ids": ids, "use_cache": False}, micro_batch_size=1)
    return gm, profile(gm, flat_inputs(gm, input_ids=ids[:1]), 1, FLOPS)


def test_tiny_llama_plans_in_seconds(llama: tuple[fx.GraphModule, Profile]) -> None:
    gm, prof = llama
    checks = [n for n in _ops(gm) if "assert" in str(n.target)]
    # checks of an op's output (a check of a buffer, as transformers 5.24 adds for the rotary
    # table, reads what every stage holding it has a copy of)
    paired = [(c, checked) for c in checks if (checked := _checked(c)) is not None]
    assert len(_ops(gm)) >= 1000 and paired
    for p in _plans("Llama (24 layers)", gm, prof).values():
        validate_plan(p, gm)
        for check, checked in paired:  # each check went with the op it checks
            assert p.stage_of[check.name] == p.stage_of[checked.name]
