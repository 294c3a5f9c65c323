"""The one parallel-layout value (graphpipe.ir.dims.ParallelDims): its check, its mesh
names, "meshed", its words and its JSON, and every phase reading the same value."""

from __future__ import annotations

import pytest
from zoo import two_branch

from graphpipe.errors import ConfigError
from graphpipe.ir import ParallelDims, Plan
from graphpipe.planning.partition import PlanConfig
from graphpipe.planning.partition import plan as planned
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.spec import RunSpec


def test_every_bad_size_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        ParallelDims(pp=0, dp=-1, tp=2.5, dp_shard="yes")  # type: ignore[arg-type]
    message = str(err.value)
    for part in ("pp must be an int >= 1, got 0", "dp must be an int >= 1, got -1",
                 "tp must be an int >= 1, got 2.5", "dp_shard must be True or False"):  # fmt: skip
        assert part in message, message


@pytest.mark.parametrize("dim", ["ep", "cp"])
def test_expert_and_context_parallelism_have_room_but_are_refused_by_name(dim: str) -> None:
    assert ParallelDims(**{dim: 1}).names == ("pp",)
    with pytest.raises(ConfigError, match=f"{dim}=2: .* is not built yet"):
        ParallelDims(**{dim: 2})


def test_the_mesh_names_meshed_and_words_come_from_the_sizes() -> None:
    flat = ParallelDims(pp=4)
    assert (flat.names, flat.meshed, str(flat), flat.devices) == (("pp",), False, "pp 4", 4)
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert (dims.names, dims.sizes, dims.meshed, dims.fsdp) == (
        ("pp", "dp", "tp"), (2, 2, 2), True, True
    )  # fmt: skip
    assert str(dims) == "pp 2 x dp 2 (sharded) x tp 2" and dims.devices == 8
    replicas = ParallelDims(pp=2, dp=4, dp_shard=False)
    assert str(replicas) == "pp 2 x dp 4 (replicated)" and not replicas.sharded
    assert ParallelDims(pp=2, tp=2).names == ("pp", "tp")


def test_a_given_mesh_naming_a_dimension_of_size_one_is_meshed() -> None:
    dims = ParallelDims.of_names(("pp", "dp"), (4, 1))
    assert dims == ParallelDims(pp=4, dp=1, size_one=("dp",))
    assert dims.meshed and dims.fsdp and dims.names == ("pp", "dp") and dims.sizes == (4, 1)
    with pytest.raises(ConfigError, match=r"mesh_dim_names must be one of"):
        ParallelDims.of_names(("dp", "pp"), (2, 2))


def test_pp_is_resolved_on_the_world_or_the_sizes_are_refused() -> None:
    open_pp = ParallelDims(pp=None, dp=2, tp=2)
    assert open_pp.on(8) == ParallelDims(pp=2, dp=2, tp=2)
    with pytest.raises(ConfigError, match="dp=2 x tp=2 does not divide the world size 6"):
        open_pp.on(6)
    with pytest.raises(ConfigError, match="dp=2 x tp=2 does not divide devices=6"):
        open_pp.on(6, "devices=6")
    with pytest.raises(ConfigError, match="is 8 ranks, the process group 4"):
        ParallelDims(pp=2, dp=2, tp=2).on(4)
    with pytest.raises(ConfigError, match="pp is not known"):
        _ = open_pp.devices


def test_the_value_round_trips_through_json_data() -> None:
    for dims in (ParallelDims(pp=3), ParallelDims(pp=2, dp=4, dp_shard=False),
                 ParallelDims.of_names(("pp", "dp", "tp"), (2, 1, 2))):  # fmt: skip
        assert ParallelDims.from_dict(dims.to_dict()) == dims


def test_the_options_the_planner_and_the_plan_carry_one_value() -> None:
    """What compile resolves (RunSpec.dims), what the planner plans for (PlanConfig.dims)
    and what the plan says (Plan.dims, in its cost model and its JSON) are the same value."""
    model, x = two_branch()
    spec = RunSpec.build(
        x, loss_fn=lambda out, y: out.mean(), optimizer=lambda ps: None, dp=2, dp_shard=False
    )
    assert spec.dims == ParallelDims(pp=None, dp=2, dp_shard=False) and spec.meshed
    config = PlanConfig(devices=4, dp=2, dp_shard=False)
    assert config.dims == spec.dims
    plan = planned(
        model, x, devices=4, dp=2, dp_shard=False, micro_batches=2, layouts=("one",),
        profile=ProfileConfig("flops"),
    )  # fmt: skip
    assert plan.dims == spec.dims.on(4) == ParallelDims(pp=2, dp=2, dp_shard=False)
    assert plan.cost_model.dims is plan.dims and Plan.from_json(plan.to_json()).dims == plan.dims
    assert "mesh pp 2 x dp 2 (replicated)" in str(plan)
