"""The planner knows the (pp, dp) mesh: dp costs, plans over pp = N / dp, choosing dp itself."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn
from zoo import multi_output, skip_across, tied, two_branch

from benchmarks.protocol import FairConfig, choose
from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir import Plan
from graphpipe.ir.actions import Action, ActionKind
from graphpipe.ir.cost import CostModel, DataParallel, LinkModel, MemoryModel
from graphpipe.ir.dims import ParallelDims
from graphpipe.planning.mesh import per_rank_graph
from graphpipe.planning.opgraph import op_graph
from graphpipe.planning.partition import PlanConfig, partition
from graphpipe.planning.partition import plan as planned
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.cli import main
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

P = 8e6  # parameter bytes of the hand-computed cases
LINK = LinkModel(bandwidth=1e9, latency=1e-5)
FLOPS = ProfileConfig(mode="flops")  # the same plans on every run


def plan(*args: Any, **options: Any) -> Plan:
    """`graphpipe.plan` on FLOP costs with one stage per device: these tests are about dp."""
    return planned(*args, **{"profile": FLOPS, "layouts": ("one",), **options})


def _cost(k: int, shard: bool = True, **dp: Any) -> CostModel:
    memory = MemoryModel(weight_versions=1, optimizer_slots=2)
    dims = ParallelDims(dp=k, dp_shard=shard)
    return CostModel(4, 4, LINK, memory, dims=dims, dp=DataParallel(**dp))


# -- memory -------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4, 8])
def test_sharded_state_divides_by_dp_and_the_gathered_copy_and_gradient_do_not(k: int) -> None:
    # versions 1 + Adam's 2 slots sharded over k; one gathered copy and the unsharded gradient
    assert _cost(k).weights(P) == pytest.approx(P * 3 / k + P + P)
    assert _cost(k, gather_share=0.25).weights(P) == pytest.approx(P * 3 / k + P / 4 + P)
    # without reshard_after_forward the whole stage stays gathered, whatever the share
    kept = _cost(k, gather_share=0.25, reshard_after_forward=False)
    assert kept.weights(P) == pytest.approx(P * 3 / k + P + P)
    halved = _cost(k).weights(P) - _cost(2 * k).weights(P)
    assert halved == pytest.approx(P * 3 / (2 * k))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_replicated_dp_keeps_every_byte_on_every_rank(k: int) -> None:
    assert _cost(k, shard=False).weights(P) == P * (1 + 1 + 2)


def test_a_stage_on_k_dp_ranks_holds_its_state_sharded_and_1_over_k_of_the_activations() -> None:
    model, x = _wide()
    alone = plan(model, x, devices=1, micro_batches=2)
    sharded = plan(model, x, devices=4, micro_batches=2, dp=4)
    replicas = plan(model, x, devices=4, micro_batches=2, dp=4, dp_shard=False)
    (s1,), (s4,), (r4,) = alone.stages, sharded.stages, replicas.stages
    p, a = s1.param_bytes, s1.activation_bytes
    assert s4.param_bytes == r4.param_bytes == p
    assert s4.activation_bytes == a // 4 and r4.activation_bytes == a // 4
    assert s1.memory_bytes == p * 4 + a
    assert s4.memory_bytes == pytest.approx(p * 3 / 4 + 2 * p + a / 4, abs=1)
    assert r4.memory_bytes == pytest.approx(p * 4 + a / 4, abs=1)


def test_the_per_rank_graph_divides_times_and_bytes() -> None:
    model, x = two_branch()
    gm = trace(model, x, micro_batch_size=4)
    g = op_graph(gm, profile(gm, x, 4, FLOPS))
    half = per_rank_graph(g, 2)
    assert per_rank_graph(g, 1) is g
    for n, data in g.nodes(data=True):
        for key in ("forward", "backward", "act"):
            assert half.nodes[n][key] == data[key] / 2
    assert all(half.edges[e]["bytes"] == g.edges[e]["bytes"] / 2 for e in g.edges)


def test_a_roofline_profile_is_re_costed_at_the_dp_slice() -> None:
    model, x = _wide()
    gm = trace(model, x, micro_batch_size=16)
    roofline = ProfileConfig(mode="roofline")
    free = LinkModel(bandwidth=1e18, latency=0.0)  # no gathers to expose
    config = PlanConfig(devices=4, micro_batches=1, dp=4, dp_link=free)
    (stage,) = partition(gm, profile(gm, x, 16, roofline), config).stages
    whole, quarter = (profile(gm, x, b, roofline).times for b in (16, 4))
    assert stage.forward_time == pytest.approx(sum(t.forward for t in quarter.values()))
    assert stage.forward_time > 2 * sum(t.forward for t in whole.values()) / 4  # weight reads


# -- time ---------------------------------------------------------------------------------------


def test_all_gather_and_reduce_scatter_follow_the_ring_formula() -> None:
    ring = 3 / 4 * P / 1e9 + 3 * 1e-5  # (k-1)/k bytes / bandwidth + (k-1) latency at k = 4
    assert LINK.all_gather(P, 4) == pytest.approx(ring) == pytest.approx(0.00603)
    assert LINK.reduce_scatter(P, 4) == LINK.all_gather(P, 4)
    assert LINK.all_gather(P, 1) == 0.0 and LINK.all_gather(0, 4) == 0.0
    cost = _cost(4)  # M = 4
    assert cost.gather_time(P) == pytest.approx(2 * ring)  # forward and backward gather
    assert _cost(4, reshard_after_forward=False).gather_time(P) == pytest.approx(ring / 4)
    assert cost.dp_sync_time(P) == pytest.approx(ring)
    assert _cost(4, shard=False).dp_sync_time(P) == pytest.approx(2 * ring)  # all-reduce
    assert _cost(4, shard=False).gather_time(P) == 0.0
    # prefetch hides the gathers behind a longer compute; a shorter one waits for them
    assert cost.stage_time(0.02, P, 1) == pytest.approx(0.02 + ring / 4)
    assert cost.stage_time(0.005, P, 1) == pytest.approx(2 * ring + ring / 4)
    f, b = cost.exposed_gather(0.002, 0.003, P)
    assert (f, b) == pytest.approx(
        (0.002 + 0.4 * (2 * ring - 0.005), 0.003 + 0.6 * (2 * ring - 0.005))
    )
    assert cost.exposed_gather(0.01, 0.01, P) == (0.01, 0.01)
    assert cost.stage_times(0.02, P, 3)[0] == cost.stage_time(0.02, P, 1)
    assert math.isinf(cost.stage_times(0.02, P, 3)[1])


def test_the_dp_link_is_its_own_when_given() -> None:
    fast = LinkModel(bandwidth=4e9, latency=0.0)
    cost = replace(_cost(4), dp=DataParallel(link=fast))
    assert cost.dp_sync_time(P) == pytest.approx(3 / 4 * P / 4e9)
    assert _cost(4).dp_link == LINK


def test_replicas_and_dp_are_exclusive_in_the_cost_model() -> None:
    with pytest.raises(ConfigError, match="replicas and dp degree 2"):
        _cost(2).stage_time(1.0, P, 2)


def test_the_simulated_update_reduce_scatters_and_the_peak_counts_sharded_weights() -> None:
    model, x = _wide()
    p = plan(model, x, devices=2, micro_batches=2, dp=2)
    (stage,) = p.stages
    run = simulate(p, "1f1b")
    updates = [s for s in run.timeline.spans if Action.parse(s.action).kind == ActionKind.U]
    expected = p.cost_model.dp_sync_time(stage.param_bytes) + stage.update_time
    assert [s.end - s.start for s in updates] == pytest.approx([expected])
    assert expected == pytest.approx(LinkModel().reduce_scatter(stage.param_bytes, 2))
    weights = p.cost_model.weights(stage.param_bytes)
    assert run.peak_memory[0] == int(weights + stage.activation_bytes)


# -- plans --------------------------------------------------------------------------------------


def test_a_plan_with_dp_round_trips_through_json() -> None:
    model, x = two_branch()
    slow = LinkModel(bandwidth=1e9, latency=1e-4)
    p = plan(model, x, devices=4, micro_batches=2, dp=2, dp_link=slow, reshard_after_forward=False)
    back = Plan.from_json(p.to_json())
    assert back == p and back.info == p.info
    assert back.cost_model.dp == DataParallel(False, 1.0, slow)
    assert back.dims == ParallelDims(pp=2, dp=2) == p.dims
    assert p.num_devices == 2 and "mesh pp 2 x dp 2 (sharded" in str(p)


def test_a_plan_written_before_dp_reads_as_dp_1() -> None:
    model, x = two_branch()
    text = plan(model, x, devices=2, micro_batches=2).to_json()
    assert '"dp"' not in text and '"dims"' not in text  # the format main writes
    assert Plan.from_json(text).cost_model.dp == DataParallel()
    assert Plan.from_json(text).dims == ParallelDims(pp=2)


def test_a_plan_written_with_degrees_in_dp_and_tp_reads_them_as_its_dims() -> None:
    model, x = two_branch()
    data = json.loads(plan(model, x, devices=4, micro_batches=2, dp=2).to_json())
    del data["cost_model"]["dims"]  # as plans were written before the one layout value
    data["cost_model"]["dp"] = {"degree": 2, "shard": False, "reshard_after_forward": True}
    data["cost_model"]["tp"] = {"degree": 1, "link": None}
    back = Plan.from_json(json.dumps(data))
    assert back.dims == ParallelDims(pp=2, dp=2, dp_shard=False)
    assert back.cost_model.dp == DataParallel(True)


@pytest.mark.parametrize("make", [two_branch, skip_across, tied, multi_output])
@pytest.mark.parametrize("options", [{"devices": 3}, {"devices": 4, "memory_budget": 3e4}])
def test_dp_1_plans_are_the_plans_without_the_argument(
    make: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]], options: dict[str, Any]
) -> None:
    model, x = make()
    try:
        before = plan(model, x, micro_batches=4, **options)
    except PlanError:
        with pytest.raises(PlanError):
            plan(model, x, micro_batches=4, dp=1, **options)
        return
    after = plan(model, x, micro_batches=4, dp=1, **options)
    assert replace(after, search_time=0.0).to_json() == replace(before, search_time=0.0).to_json()
    assert str(after) == str(before) and "mesh" not in str(after)


def test_dp_must_divide_the_devices_and_the_micro_batch() -> None:
    model, x = two_branch()  # a batch of 8
    with pytest.raises(ConfigError, match="dp=4 x tp=1 does not divide devices=6"):
        plan(model, x, devices=6, dp=4)
    with pytest.raises(ConfigError, match="dp=4 does not divide a micro-batch of 2 rows"):
        plan(model, x, devices=4, micro_batches=4, dp=4)
    with pytest.raises(ConfigError, match="'two'"):
        PlanConfig(devices=4, dp="two")
    with pytest.raises(ConfigError, match="dp must be an int >= 1"):
        PlanConfig(devices=4, dp=0)


def test_dp_turns_replication_off_and_says_dp_is_uniform() -> None:
    model, x = two_branch()
    p = plan(model, x, devices=8, micro_batches=2, dp=2, replication=True)
    assert all(s.replicas == 1 for s in p.stages) and p.num_devices == 4
    mesh = p.info["mesh"]
    assert mesh["dp"] == 2 and mesh["pp"] == 4 and "same dp degree" in mesh["uniform"]
    assert mesh["replication"].startswith("off")
    kept = plan(model, x, devices=8, micro_batches=2, dp=2, replication=False).info["mesh"]
    assert "replication" not in kept


# -- choosing the split -------------------------------------------------------------------------


def _wide() -> tuple[nn.Module, torch.Tensor]:
    """One large layer (0.5 MiB of weights) among small ops: pp cannot split its state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 512), nn.Tanh())
    return model, torch.randn(16, 8)


def test_auto_shards_over_dp_when_the_large_layer_state_fits_no_device() -> None:
    model, x = _wide()
    big = 256 * 512 * 4 + 512 * 4  # the large Linear's weight and bias
    budget = 3.3 * big  # below its 4 copies (weights, gradient, Adam's 2); above 3/4 + 2
    with pytest.raises(PlanError):
        plan(model, x, devices=4, micro_batches=2, memory_budget=budget)
    p = plan(model, x, devices=4, micro_batches=2, memory_budget=budget, dp="auto")
    mesh = p.info["mesh"]
    assert p.cost_model.dims.dp == 4 and mesh["dp"] == 4 and mesh["chosen_by"] == "auto"
    assert mesh["bound"]["1"].startswith("memory") and mesh["bound"]["2"].startswith("memory")
    assert "memory binds dp=1" in mesh["summary"] and "memory binds dp=2" in mesh["summary"]
    assert max(simulate(p, "1f1b").peak_memory) <= budget


def test_auto_keeps_dp_1_when_the_dp_link_is_slow_and_names_it() -> None:
    model, x = _wide()
    slow = LinkModel(bandwidth=1e7)
    p = plan(model, x, devices=4, micro_batches=4, dp="auto", dp_link=slow)
    mesh = p.info["mesh"]
    assert p.cost_model.dims.dp == 1 and mesh["dp"] == 1
    assert mesh["bound"]["2"].startswith("dp link") and mesh["bound"]["4"].startswith("dp link")
    assert mesh["steps"]["1"] < min(mesh["steps"]["2"], mesh["steps"]["4"])
    assert mesh["summary"].startswith("dp=1 x pp=4")


def test_auto_picks_the_fastest_simulated_step_of_every_degree() -> None:
    model, x = two_branch()
    p = plan(model, x, devices=4, micro_batches=2, dp="auto")
    steps = p.info["mesh"]["steps"]
    assert set(steps) == {"1", "2", "4"}
    assert steps[str(p.cost_model.dims.dp)] == min(steps.values())
    assert simulate(p, "1f1b").iteration_time == pytest.approx(min(steps.values()))


# -- the command line and the fair protocol ---------------------------------------------------


def test_the_cli_shows_the_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "models.mmt", "--preset", "tiny", "--devices", "4", "-m", "2"]
    assert main([*argv, "--dp", "2", "--partitioner", "graph"]) == 0
    out = capsys.readouterr().out
    assert "mesh pp 2 x dp 2 (sharded)" in out and "dp link/mb" in out
    assert main([*argv, "--dp", "auto", "--partitioner", "graph"]) == 0
    assert "chosen: dp=" in capsys.readouterr().out
    assert main([*argv, "--dp", "3"]) == 2
    assert "dp=3 x tp=1 does not divide devices=4" in capsys.readouterr().err


def test_the_fair_protocol_plans_both_strategies_on_the_mesh() -> None:
    w = load_workload("models.mmt", "tiny")
    gm = trace(w.model, w.example_inputs, w.leaf_modules)
    rules = FairConfig(budget=None, micro_batches=(1, 2), schedules=("1f1b",), dp=2)
    for strategy in ("graph", "sequential"):
        c = choose(gm, tuple(w.example_inputs), 4, strategy, rules)
        assert c.plan.cost_model.dims.dp == 2 and c.plan.num_devices == 2
        assert not c.replication
    with pytest.raises(ConfigError, match="dp=2 x tp=1 does not divide devices=3"):
        choose(gm, tuple(w.example_inputs), 3, "graph", rules)


# -- the tp dimension -----------------------------------------------------------------------------

D, B, BLOCKS = 32, 4, 4  # the MLP's width, micro-batch rows, blocks
MLP_PLAN = {"*.0": "colwise", "*.2": "rowwise"}  # every block's fc1 and fc2, as Megatron's MLP
MLP_PINS = {"0": 0, "1": 0, "2": 1, "3": 1}


def _mlp(blocks: int = BLOCKS) -> tuple[nn.Module, torch.Tensor]:
    """Blocks of fc1 (D -> 4D), ReLU, fc2 (4D -> D): every op a planned layer or between
    two (ReLU), so one tp rank computes exactly half."""
    mlp = [
        nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU(), nn.Linear(4 * D, D)) for _ in range(blocks)
    ]
    return nn.Sequential(*mlp), torch.randn(2 * B, D)


def _ring_allreduce(nbytes: float, t: int) -> float:
    return 2 * (t - 1) / t * nbytes / LINK.bandwidth + 2 * (t - 1) * LINK.latency


def _mlp_plans(**options: Any) -> tuple[Plan, Plan]:
    model, x = _mlp()
    kw = {
        "micro_batches": 2,
        "pins": MLP_PINS,
        "link": LINK,
        "profile": ProfileConfig(mode="flops"),
    }
    kw.update(options)
    tp1 = plan(model, x, devices=2, **kw)
    tp2 = plan(model, x, devices=4, tp=2, tp_plan=MLP_PLAN, **kw)
    return tp1, tp2


def test_tp_halves_the_planned_layers_bytes_and_time_and_adds_megatron_s_all_reduces() -> None:
    """Per stage (two blocks): fc1's weight and bias and fc2's weight split in two, fc2's
    bias whole; the compute halved; one all-reduce of the block's output (B x D floats) per
    fc2 in the forward, and per fc1 whose input is an activation (not the model's input) in
    the backward: 2 + 1 on stage 0, 2 + 2 on stage 1."""
    tp1, tp2 = _mlp_plans()
    fc1, fc2 = (D * 4 * D + 4 * D) * 4, (4 * D * D + D) * 4
    assert [s.param_bytes for s in tp1.stages] == [2 * (fc1 + fc2)] * 2
    split = 2 * (fc1 / 2 + (fc2 - D * 4) / 2 + D * 4)
    assert [s.param_bytes for s in tp2.stages] == [split] * 2
    assert split / (2 * (fc1 + fc2)) == pytest.approx(0.5, abs=0.01)
    reduce = _ring_allreduce(B * D * 4, 2)
    for s1, s2, backward_reduces in zip(tp1.stages, tp2.stages, (1, 2), strict=True):
        assert s2.time == pytest.approx(s1.time / 2 + (2 + backward_reduces) * reduce, rel=1e-9)
        assert s2.forward_time == pytest.approx(s1.forward_time / 2 + 2 * reduce, rel=1e-9)
        # fc1's and ReLU's outputs (4D wide) are split, fc2's (D) whole
        assert s2.activation_bytes == s1.activation_bytes - 2 * 2 * (4 * D * B * 4) / 2
    assert [e.bytes for e in tp2.edges] == [e.bytes for e in tp1.edges] == [B * D * 4]
    assert tp2.cost_model.dims.tp == 2 and tp2.info["mesh"]["tp"] == 2
    assert "tp 2" in str(tp2).splitlines()[0]


def test_the_tp_link_is_its_own_when_given() -> None:
    slow = LinkModel(bandwidth=LINK.bandwidth / 10, latency=LINK.latency)
    (_, fast), (_, slowed) = _mlp_plans(), _mlp_plans(tp_link=slow)
    extra = 3 * (B * D * 4 / slow.bandwidth - B * D * 4 / LINK.bandwidth)  # the ring's 2(t-1)/t = 1
    assert slowed.stages[0].time - fast.stages[0].time == pytest.approx(extra, rel=1e-9)


def test_a_column_wise_layer_read_by_no_row_wise_one_gathers_its_output_whole() -> None:
    """An LM head: its output all-gathered in the forward, whole, no all-reduce after it."""
    model, x = nn.Sequential(nn.Linear(D, 4 * D)), torch.randn(2 * B, D)
    kw: dict[str, Any] = {"micro_batches": 2, "link": LINK, "profile": ProfileConfig(mode="flops")}
    (s1,) = plan(model, x, devices=1, **kw).stages
    (s2,) = plan(model, x, devices=2, tp=2, tp_plan={"0": "colwise"}, **kw).stages
    gather = (B * 4 * D * 4) / 2 / LINK.bandwidth + LINK.latency  # (t-1)/t bytes, t-1 steps
    assert s2.forward_time == pytest.approx(s1.forward_time / 2 + gather, rel=1e-9)
    assert s2.backward_time == pytest.approx(s1.backward_time / 2, rel=1e-9)
    assert s2.activation_bytes == s1.activation_bytes


def test_a_plan_with_tp_round_trips_through_json_and_a_tp_1_plan_is_unchanged() -> None:
    tp1, tp2 = _mlp_plans()
    assert Plan.from_json(tp2.to_json()) == tp2
    assert '"tp"' not in tp1.to_json()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"tp": 3}, "dp=1 x tp=3 does not divide devices=4"),
        ({"tp": 2}, "tp=2 needs tp_plan"),
        ({"tp": 2, "tp_plan": {"0": "sideways"}}, "sideways"),
        ({"tp": 2, "tp_plan": MLP_PLAN, "dp": 4}, "dp=4 x tp=2 does not divide devices=4"),
    ],
)
def test_tp_must_divide_the_devices_and_needs_a_plan(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        PlanConfig(devices=4, **options)


@pytest.mark.parametrize(("blocks", "devices"), [(3, 4), (4, 8)])
def test_the_search_never_cuts_between_a_column_wise_layer_and_its_row_wise_one(
    blocks: int, devices: int
) -> None:
    """3 blocks on pp 2 (balanced at 1.5 blocks), 4 on pp 4: every value crossing stages is
    a block's output (fc2's, whole)."""
    model, x = _mlp(blocks)
    kw: dict[str, Any] = {"micro_batches": 2, "link": LINK, "profile": ProfileConfig(mode="flops")}
    made = plan(model, x, devices=devices, tp=2, tp_plan=MLP_PLAN, **kw)
    assert len(made.stages) == devices // 2
    crossing = [t for e in made.edges for t in e.tensors]
    assert crossing and all(t.endswith("_2") for t in crossing), crossing
