"""profile: the FLOP estimate, measured times (shared by equal ops, in-place ops on copies, a
fallback to FLOPs, the spread), and the cache."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import graphpipe
from graphpipe.compile.steps import _profile_config
from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.planning.profile import NodeTime, Profile, ProfileConfig, noted, profile
from graphpipe.tools.cli import main
from graphpipe.tracing.tracer import trace


def _model() -> tuple[torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    x = torch.randn(8, 64)
    return trace(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)), x), (x,)


def test_flop_estimate_scales_with_micro_batch_size() -> None:
    gm, x = _model()
    config = ProfileConfig(mode="flops", device_flops=1e9, node_overhead=0.0)
    small, large = profile(gm, x, 2, config), profile(gm, x, 4, config)
    assert small.times["_0"].forward == pytest.approx(2 * 2 * 64 * 256 / 1e9)
    assert large.times["_0"].forward == pytest.approx(2 * small.times["_0"].forward)
    assert small.times["_0"].backward == pytest.approx(2 * small.times["_0"].forward)
    assert small.times["input_1"].forward == 0.0


def test_measured_profile_times_every_op_and_is_cached(tmp_path: Path) -> None:
    gm, x = _model()
    config = ProfileConfig(mode="measure", warmup=1, repeats=3, cache_dir=str(tmp_path))
    lines: list[str] = []
    first = profile(gm, x, 4, config, log=lines.append)
    assert all(first.times[n].forward > 0 for n in ("_0", "_1", "_2"))
    assert first.times["_0"].backward > 0 and lines
    cached = list(tmp_path.glob("profile-*.json"))
    assert len(cached) == 1
    assert Profile.from_json(cached[0].read_text()) == first
    lines.clear()
    assert profile(gm, x, 4, config, log=lines.append) == first and not lines  # no re-run
    assert profile(gm, x, 2, config) != first  # another micro-batch size, another entry
    assert len(list(tmp_path.glob("profile-*.json"))) == 2


def test_bad_profile_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="'fast'"):
        ProfileConfig(mode="fast")
    gm, x = _model()
    with pytest.raises(ConfigError, match="micro_batch_size must be >= 1, got 0"):
        profile(gm, x, 0)


def test_measuring_a_meta_device_model_says_to_use_the_estimate() -> None:
    with torch.device("meta"):
        model, x = nn.Linear(4, 4), torch.randn(2, 4)
    gm = trace(model, x)
    with pytest.raises(ConfigError, match="meta device.*mode='flops'"):
        profile(gm, (x,), 1, ProfileConfig(mode="measure"))


def test_the_default_measures_a_real_model_and_estimates_a_meta_one() -> None:
    """ProfileConfig() ("auto"): a model with real tensors is timed on its own device; one on
    the meta device, which cannot run, is estimated from FLOPs, without an error."""
    gm, x = _model()
    measured = profile(gm, x, 2)
    assert (measured.mode, measured.device) == ("measure", "cpu")
    with torch.device("meta"):
        model, y = nn.Linear(4, 4), torch.randn(2, 4)
    estimated = profile(trace(model, y), (y,), 1)
    assert (estimated.mode, estimated.device) == ("flops", "meta")


def test_a_plan_says_which_costs_it_was_made_with() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    measured = graphpipe.plan(model, x, devices=2, micro_batches=2, layouts=("one",))
    assert "costs: measured on cpu" in str(measured)
    flops = ProfileConfig(mode="flops")
    estimated = graphpipe.plan(model, x, devices=2, micro_batches=2, profile=flops)
    assert "costs: FLOPs estimate" in str(estimated)
    roofline = ProfileConfig(mode="roofline", preset="a100")
    assert "costs: roofline of the a100 preset" in str(
        graphpipe.plan(model, x, devices=2, micro_batches=2, profile=roofline)
    )


def test_compile_warns_only_when_a_meta_model_was_asked_to_be_measured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with torch.device("meta"):
        model, x = nn.Linear(4, 4), torch.randn(2, 4)
    gm = trace(model, x)
    with caplog.at_level(logging.WARNING, logger="graphpipe"):
        assert (
            _profile_config(gm, ProfileConfig()).mode == "auto"
        )  # resolved to flops, as documented
        assert not caplog.records
        assert _profile_config(gm, ProfileConfig(mode="measure")).mode == "flops"
    assert "meta device" in caplog.text and "not measured" in caplog.text


def test_graphpipe_plan_prints_the_costs_and_the_layouts(capsys: pytest.CaptureFixture) -> None:
    argv = ["plan", "models.nbranch", "--preset", "tiny", "--devices", "2"]
    assert main([*argv, "--partitioner", "graph"]) == 0
    out = capsys.readouterr().out
    assert "op costs: measured on cpu" in out
    assert "layout: " in out and "\n  one " in out and "\n  graph " in out
    assert main([*argv, "--partitioner", "graph", "--schedule", "1f1b"]) == 0
    assert "layout: " not in capsys.readouterr().out  # 1f1b runs one stage per device only
    assert main(["plan", "models.nbranch", "--preset", "paper", "--devices", "2"]) == 0
    assert "op costs: FLOPs estimate" in capsys.readouterr().out  # a meta model


class _Buckets(nn.Module):
    """An index made by an in-place add before an embedding, as T5's relative-position
    buckets are: timing the add again and again must not move the index the lookup reads."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = (x[:, 0] > 100).long()  # zeros
        index.add_(2)  # the last row of the table
        return self.table(index) * x[:, :1]


def test_measuring_an_in_place_op_leaves_later_ops_their_values() -> None:
    x = torch.randn(4, 3)
    gm = trace(_Buckets(), x)
    config = ProfileConfig(mode="measure", warmup=2, repeats=3)
    prof = profile(gm, (x,), 4, config)  # without restoring: index 2 + 5 runs, out of range
    assert {"add_", "table"} <= set(prof.times)


class _Router(nn.Module):
    """A mixture-of-experts router as Mixtral's: softmax, top-k, and the k weights divided
    in place by their sum (`div_` on a value derived from the input and a parameter)."""

    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.expert = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, _ = torch.topk(torch.softmax(self.gate(x), dim=-1), 2, dim=-1)
        weights.div_(weights.sum(-1, keepdim=True))
        return weights.sum(-1, keepdim=True) * self.expert(x)


def _in_place_models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )
    moe = nn.Sequential(nn.Linear(16, 16), _Router(), nn.Linear(16, 4))
    return {
        "relu_inplace": (cnn, torch.randn(4, 3, 8, 8)),
        "router_div_": (moe, torch.randn(8, 16)),
    }


def _in_place(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(node.target)), "inplace", False)
    return node.name.startswith("div_")


@pytest.mark.parametrize("name", ["relu_inplace", "router_div_"])
def test_in_place_ops_are_timed_on_copies(name: str) -> None:
    """Autograd refuses an in-place op on a leaf that requires grad: the default profile
    crashed on both models (torchvision's CNNs, Mixtral's router). Timed on copies, every
    op is measured, none estimated."""
    model, x = _in_place_models()[name]
    gm = trace(model, x)
    prof = profile(gm, (x,), 2)
    in_place = [n.name for n in gm.graph.nodes if _in_place(gm, n)]
    assert len(in_place) == {"relu_inplace": 2, "router_div_": 1}[name]
    assert not prof.fallbacks
    assert all(n in prof.spread for n in in_place)  # timed (a copy-sized op may time 0)
    plan = graphpipe.plan(model, x, devices=2, micro_batches=2)
    assert "costs: measured on cpu" in str(plan) and "estimated" not in str(plan)


class _Refuses(nn.Module):
    """Runs when traced (no grad) and refuses to run recording for autograd, as the timed
    forward runs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            raise RuntimeError("cannot run under autograd")
        return x * 2


def test_an_op_that_cannot_be_timed_is_estimated_from_its_flops_and_named() -> None:
    model = nn.Sequential(nn.Linear(8, 8), _Refuses(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    gm = trace(model, x, leaf_modules=[_Refuses])
    prof = profile(gm, (x,), 2)
    assert prof.fallbacks == {"_1": "RuntimeError: cannot run under autograd"}
    assert prof.times["_1"].forward > 0 and prof.times["_0"].forward > 0
    plan = graphpipe.plan(model, x, devices=2, micro_batches=2, leaf_modules=[_Refuses])
    text = str(plan)
    assert "_1: estimated from its FLOPs, not measured (RuntimeError: cannot run" in text
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.info["profile"] == plan.info["profile"]


def test_a_noisy_host_is_named_by_the_plan() -> None:
    """The spread of the repeats, weighted by the ops' times, is printed above `NOISY`."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(4, 8)
    plan = graphpipe.plan(model, x, devices=2, micro_batches=2, profile=ProfileConfig("flops"))
    times = {"_0": NodeTime(3e-3, 6e-3), "_1": NodeTime(1e-3, 0.0)}
    calm = Profile(2, "measure", "cpu", times, spread={"_0": 0.1, "_1": 3.0})
    assert calm.summary() == {} and noted(plan, calm) is plan  # 0.1 * 9 + 3 * 1 < 0.5 * 10
    noisy = replace(calm, spread={"_0": 1.0, "_1": 0.0})
    assert noisy.summary()["spread"] == {
        "weighted": pytest.approx(0.9),
        "op": "_0",
        "op_spread": 1.0,
    }
    assert "noisy host: op runs took 90% more than the least kept" in str(noted(plan, noisy))
    assert Profile.from_json(noisy.to_json()) == noisy


def test_ops_with_one_signature_share_one_time() -> None:
    """Equal blocks are timed once; a setting the shapes do not show (a stride) tells two
    convolutions apart."""
    blocks = [m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())]
    convs = [nn.Conv2d(4, 4, 3, stride=s, padding=1) for s in (1, 1, 2)]
    model = nn.Sequential(*blocks, nn.Unflatten(1, (4, 2, 4)), *convs)
    x = torch.randn(4, 32)
    gm = trace(model, x)
    prof = profile(gm, (x,), 4)
    linears = {prof.times[f"_{i}"] for i in range(0, 8, 2)}
    relus = {prof.times[f"_{i}"] for i in range(1, 8, 2)}
    assert len(linears) == 1 and len(relus) == 1
    assert prof.times["_9"] == prof.times["_10"]  # conv at stride 1 twice (unflatten is _8)
    unshared = profile(gm, (x,), 4, ProfileConfig(shared=False, repeats=2))
    assert len({unshared.times[f"_{i}"] for i in range(0, 8, 2)}) > 1  # separate timings


@pytest.fixture
def busy_core() -> Iterator[None]:
    """Another process keeping a core busy (it stops itself after a minute if left)."""
    loop = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", loop])
    try:
        yield
    finally:
        busy.kill()
        busy.wait(timeout=10)


@pytest.mark.parametrize("devices", [2, 4])
def test_equal_blocks_are_cut_equally_on_a_busy_host(devices: int, busy_core: None) -> None:
    """8 equal blocks planned five times with the default (measured) profile while another
    process keeps a core busy: one unlucky op's time cut them 3/5 and [1, 2, 2, 6] before
    equal ops shared one time."""
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())])
    x = torch.randn(64, 256)
    for layouts in ({"layouts": ("one",)}, {}):  # one stage per device; every layout
        cuts = set()
        for _ in range(5):
            plan = graphpipe.plan(
                model, x, devices=devices, micro_batches=4, replication=False, **layouts
            )
            cuts.add(tuple(s.nodes for s in plan.stages))
            blocks = {sum(n.startswith("_") and int(n[1:]) % 2 == 0 for n in s.nodes) for s in plan}
            assert len(blocks) == 1, [s.nodes for s in plan]
        assert len(cuts) == 1, cuts


def test_mixtral_plans_with_the_measured_default() -> None:
    """Mixtral's router divides its top-k weights in place (`aten.div_`): the default
    profile crashed at compile on it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
    )
    model = transformers.MixtralForCausalLM(config)
    inputs = {"input_ids": torch.randint(0, 32, (2, 4)), "use_cache": False}
    plan = graphpipe.plan(model, inputs, devices=2, micro_batches=2, layouts=("one",))
    assert "costs: measured on cpu" in str(plan)
    assert "fallbacks" not in plan.info.get("profile", {})
