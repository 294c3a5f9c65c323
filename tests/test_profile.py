"""profile: the FLOP estimate, measured times and the cache."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import graphpipe
from graphpipe.compile.steps import _profile_config
from graphpipe.errors import ConfigError
from graphpipe.planning.profile import Profile, ProfileConfig, profile
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
        assert _profile_config(gm, None).mode == "auto"  # resolved to flops, as documented
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
