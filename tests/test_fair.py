"""devices + the roofline profile, and the fair planner protocol (benchmarks/protocol.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from benchmarks.protocol import Choice, FairConfig, choose, compare, micro_batch_counts
from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir.cost import LinkModel
from graphpipe.planning.devices import DEVICES, Device, roofline
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

A100 = DEVICES["a100"]  # 312e12 FLOP/s, 2.039e12 B/s, 5 us per kernel


def _linear_times(d_in: int, d_out: int, b: int) -> tuple[float, float]:
    x = torch.randn(b, d_in)
    gm = trace(nn.Linear(d_in, d_out), x)
    t = profile(gm, (x,), b, ProfileConfig(mode="roofline", preset="a100")).times["linear"]
    return t.forward, t.backward


def test_roofline_of_a_memory_bound_linear_is_its_bytes_over_bandwidth() -> None:
    # Linear(256 -> 512), b = 4, float32: 2*4*256*512 FLOPs (3.4 ns of compute) against
    # (256*512 + 512) * 4 weight bytes + 4 * (256 + 512) * 4 activation bytes = 538,624 B
    fwd, bwd = _linear_times(256, 512, 4)
    memory = 538_624 / 2.039e12  # 264.2 ns
    assert fwd == pytest.approx(memory + 5e-6, rel=1e-9)
    assert bwd == pytest.approx(2 * memory + 2 * 5e-6, rel=1e-9)  # two kernels, twice the bytes


def test_roofline_of_a_compute_bound_linear_is_its_flops_over_peak() -> None:
    # Linear(1024 -> 1024), b = 1024: 2 * 1024^3 FLOPs = 6.88 us > 12.6 MB / 2.039e12 = 6.17 us
    fwd, _ = _linear_times(1024, 1024, 1024)
    assert fwd == pytest.approx(2 * 1024**3 / 312e12 + 5e-6, rel=1e-9)
    assert roofline(2 * 1024**3, 0, A100) == pytest.approx(fwd, rel=1e-9)


def test_small_micro_batches_are_less_efficient_per_sample() -> None:
    x = torch.randn(64, 512)
    gm = trace(nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)), x)
    config = ProfileConfig(mode="roofline", preset="h100")
    per_sample = [profile(gm, (x,), b, config).total() / b for b in (1, 8, 64)]
    assert per_sample[0] > 4 * per_sample[1] > 4 * per_sample[2]


def test_embedding_reads_the_rows_it_gathers_not_the_table() -> None:
    idx = torch.randint(0, 100_000, (8, 4))  # 4 int64 indices per sample
    gm = trace(nn.EmbeddingBag(100_000, 16, mode="sum"), idx)
    t = profile(gm, (idx,), 8, ProfileConfig(mode="roofline")).times
    (name,) = [n for n in t if t[n].forward > 0]
    rows = 8 * 4 * 16 * 4  # b * indices * row bytes
    acts = 8 * (4 * 8 + 16 * 4)  # b * (index bytes + output bytes)
    assert t[name].forward == pytest.approx((rows + acts) / 2.039e12 + 5e-6, rel=1e-9)


def test_bad_presets_and_devices_are_named() -> None:
    with pytest.raises(ConfigError, match="'v100'"):
        ProfileConfig(mode="roofline", preset="v100")
    with pytest.raises(ConfigError, match="efficiency"):
        Device("x", 1e12, 1e12, 1e9, efficiency=1.5)
    with pytest.raises(ConfigError, match="'pipedream'"):
        choose(*_tiny("dlrm"), devices=2, strategy="pipedream")
    with pytest.raises(ConfigError, match=r"unknown: \['zigzag'\]"):
        FairConfig(layouts=("one", "zigzag"))
    with pytest.raises(ConfigError, match="dp = 2 only the layout 'one'"):
        FairConfig(layouts=("v",), dp=2)


def test_micro_batch_counts_are_the_powers_of_two_dividing_the_batch() -> None:
    assert micro_batch_counts(48) == [1, 2, 4, 8, 16]
    assert micro_batch_counts(2048) == [1, 2, 4, 8, 16, 32, 64]
    assert micro_batch_counts(2048, (8, 1, 4096, 2)) == [1, 2, 8]


def _tiny(name: str) -> tuple[torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    w = load_workload(f"models.{name}", "tiny")
    return trace(w.model, w.example_inputs, w.leaf_modules), tuple(w.example_inputs)


def _peak(choice: Choice) -> int:
    return max(choice.plan.stages, key=lambda s: s.memory_bytes).memory_bytes


def test_choose_never_returns_a_configuration_over_the_memory_budget() -> None:
    gm, x = _tiny("candle_uno")
    free = choose(gm, x, 3, "sequential", FairConfig(budget=None))
    budget = 0.7 * free.peak_memory  # binds: the unlimited choice does not fit
    for strategy in ("sequential", "graph"):
        tight = choose(gm, x, 3, strategy, FairConfig(budget=budget))
        assert tight.peak_memory <= budget
        assert _peak(tight) <= budget
        assert tight.step_time >= free.step_time * (0.99 if strategy == "graph" else 1)
    with pytest.raises(PlanError, match="memory budget"):
        choose(gm, x, 3, "sequential", FairConfig(budget=1024))


def test_graph_is_never_slower_than_sequential_and_wins_on_a_branchy_model() -> None:
    gm, x = _tiny("dlrm")
    result = compare(gm, x, 3, FairConfig(budget=None))
    assert result.ratio >= 1.0
    assert result.graph.stage_dag and not result.sequential.stage_dag
    assert result.ratio > 1.1  # 1.2x: two stages deep against three
    assert result.sequential.depth > result.graph.depth
    assert result.binding.startswith("depth")


def _equal_chain() -> tuple[torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    """8 equal Linear(2048) + ReLU layers, B = 1024: compute-bound on the A100 roofline."""
    torch.manual_seed(0)
    x = torch.randn(1024, 2048)
    layers = [m for _ in range(8) for m in (nn.Linear(2048, 2048), nn.ReLU())]
    return trace(nn.Sequential(*layers), x), (x,)


# a fast link, so that the chain's 2N stages pay little more in transfers than its N
FOLDING = FairConfig(
    budget=None, micro_batches=(1, 2, 4, 8), link=LinkModel(bandwidth=1e12, latency=1e-6)
)


def test_both_sides_count_folded_layouts_within_the_budget() -> None:
    gm, x = _equal_chain()
    one = choose(gm, x, 4, "sequential", replace(FOLDING, layouts=("one",)))
    result = compare(gm, x, 4, FOLDING, explain_above=0.0)
    folded = result.sequential
    # 4 devices at M <= 8: one stage per device pays a fill/drain that a chain of 8 stages
    # folded loop or v shrinks (zbv at M = 2: 570 us against zb's 607 us)
    assert one.layout == "one" and folded.layout in ("loop", "v")
    assert folded.step_time < 0.97 * one.step_time
    assert result.graph.step_time <= folded.step_time
    # its fill/drain: 3 hops of half a device's work each, against 2M halves
    share = 3 / (2 * folded.micro_batches + 3)
    assert result.binding == f"depth: 8 stages (2 per device) at M=2, fill/drain {share:.0%}"
    tight = choose(gm, x, 4, "sequential", replace(FOLDING, budget=folded.peak_memory - 1))
    assert tight.peak_memory < folded.peak_memory  # not that run: it peaks over the budget
    assert tight.step_time > folded.step_time
