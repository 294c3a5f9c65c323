"""Pipelines over a ("pp", "dp") DeviceMesh: FSDP2 per stage (graphpipe.runtime.mesh).

Four gloo processes on a (2, 2) mesh: two pipeline devices, each stage on two data-parallel
ranks that run half of every micro-batch. Every run must equal one process training on the
whole mini-batch with gradient accumulation over the same M micro-batches.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zoo
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.compile.steps import checked_plan
from graphpipe.errors import ConfigError
from graphpipe.ir import ParallelDims
from graphpipe.ir.cost import LinkModel
from graphpipe.planning.api import plan
from graphpipe.planning.interleave import place_graph
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.batching import Inputs
from graphpipe.runtime.launch import launch
from graphpipe.runtime.mesh import ParallelLayout, stage_blocks
from graphpipe.runtime.spec import RunSpec
from graphpipe.tracing.tracer import trace

M = 2  # micro-batches; the zoo's batch of 8 gives 2 rows per dp slice
STEPS = 3
LR = 0.05
TIMEOUT = 300  # seconds for a whole launch
D = 16


class Chain(nn.Module):
    """Four transformer-like blocks in a ModuleList and a head: the FSDP units are blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, 4)


def chain() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Chain()
    return model, (torch.randn(8, D, generator=torch.Generator().manual_seed(1)),)


MODELS = {"chain": chain, "two_branch": ZOO["two_branch"]}
PINS = {  # two stages each
    "chain": {"blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1, "head": 1},
    "two_branch": {"a": 0, "b": 1, "cat": 1, "head": 1},  # branches run concurrently
}


def _optimizer() -> functools.partial[torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)


def batch(name: str, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Step `step`'s mini-batch and a target shaped like the output."""
    model, inputs = MODELS[name]()
    gen = torch.Generator().manual_seed(1000 + step)
    fresh = tuple(torch.randn(x.shape, generator=gen) for x in inputs)
    with torch.no_grad():
        out = model(*fresh)
    return fresh, torch.randn(out.shape, generator=gen)


def accumulate(model: nn.Module, name: str, step: int) -> float:
    """Step `step`'s gradient accumulation over M micro-batches on one process (no
    optimizer step): the mini-batch's mean loss."""
    inputs, target = batch(name, step)
    total = 0.0
    for j in range(M):
        loss = dict_loss(model(*[x.chunk(M)[j] for x in inputs]), target.chunk(M)[j])
        (loss / M).backward()
        total += loss.item()
    return total / M


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor], float, Any]:
    """One process, the whole mini-batch, gradient accumulation over the M micro-batches:
    the losses, the parameters after them, and then the mean loss of step 0's batch and its
    outputs (the micro-batches' in order)."""
    model, _ = MODELS[name]()
    opt = _optimizer()(model.parameters())
    losses = []
    for step in range(STEPS):
        losses.append(accumulate(model, name, step))
        opt.step()
        opt.zero_grad()
    inputs, target = batch(name, 0)
    with torch.no_grad():
        parts = [model(*[x.chunk(M)[j] for x in inputs]) for j in range(M)]
    evaluated = sum(float(dict_loss(p, t)) for p, t in zip(parts, target.chunk(M), strict=True)) / M
    outputs = tree_map(lambda *xs: torch.cat(xs), *parts)
    return losses, {k: v.detach() for k, v in model.named_parameters()}, evaluated, outputs


def _compile(name: str, schedule: str, variant: str, m: int = M) -> Any:
    """`name` over the 2 x 2 mesh, pinned to two stages; `variant` picks the mesh options."""
    model, inputs = MODELS[name]()
    mesh_args: dict[str, Any] = {
        "mesh": None if variant == "shorthand" else _mesh(),
        "dp": 2 if variant == "shorthand" else None,
        "dp_shard": variant != "replicate",
        "reshard_after_forward": None if schedule == "zb" else variant != "keep",
    }
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=_optimizer(),
        micro_batches=m,
        schedule=schedule,
        pins=PINS[name],
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=60),
        **mesh_args,
    )


def _mesh() -> Any:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))


def _full_parameters(pm: Any) -> dict[str, torch.Tensor]:
    """This rank's stage's parameters, gathered whole over dp (a collective over dp)."""
    return {n: p.full_tensor().detach().clone() for n, p in pm.module.named_parameters()}


def _train(pm: Any, name: str) -> dict[str, Any]:
    losses = [pm.step(*batch(name, s)[0], target=batch(name, s)[1]) for s in range(STEPS)]
    inputs, target = batch(name, 0)
    evaluated = pm.eval_step(*inputs, target=target)
    return {
        "outputs": pm(*inputs),  # gathered over the dp slices, on every rank
        "losses": losses,
        "params": _full_parameters(pm),
        "eval": evaluated,
        "state": pm.state_dict(),
        "plan": (pm.plan.num_devices, pm.plan.micro_batch_size, pm.plan.cost_model),
    }


def _equality_worker(cases: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], Any]:
    return {case: _train(_compile(*case), case[0]) for case in cases}


CASES = [
    *[(name, s, "mesh") for name in MODELS for s in ("1f1b", "gpipe", "zb")],
    ("chain", "zb", "replicate"),
    ("chain", "1f1b", "shorthand"),
    ("chain", "1f1b", "replicate"),
    ("two_branch", "gpipe", "replicate"),
    ("chain", "gpipe", "keep"),
    ("two_branch", "1f1b", "keep"),
]


@pytest.fixture(scope="module")
def runs() -> list[dict[tuple[str, str, str], Any]]:
    return launch(_equality_worker, 4, args=(CASES,), timeout=TIMEOUT)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_a_mesh_step_equals_one_process_on_the_whole_mini_batch(
    runs: list[dict[tuple[str, str, str], Any]], case: tuple[str, str, str]
) -> None:
    ref_losses, ref_params, ref_eval, ref_outputs = reference(case[0])
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(runs):
        assert result[case]["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert result[case]["eval"] == pytest.approx(ref_eval, rel=1e-5), f"rank {rank}"
        torch.testing.assert_close(result[case]["outputs"], ref_outputs, rtol=1e-5, atol=1e-6)
        for n, value in result[case]["params"].items():
            if n in merged:  # the other dp rank of the same stage holds the same whole
                torch.testing.assert_close(value, merged[n], rtol=0, atol=0)
            merged[n] = value
    assert sorted(merged) == sorted(ref_params)
    for rank, result in enumerate(runs):  # pm.state_dict(): every parameter whole, everywhere
        assert list(result[case]["state"]) == list(ref_params), f"rank {rank}"
        for n, value in result[case]["state"].items():
            torch.testing.assert_close(value, merged[n], rtol=0, atol=0, msg=n)
    for n, value in ref_params.items():
        torch.testing.assert_close(merged[n], value, rtol=1e-5, atol=1e-6, msg=n)
        assert not torch.equal(value, MODELS[case[0]]()[0].get_parameter(n)), f"{n} never moved"
    # rank 0 planned for the mesh: 2 pp devices, whole micro-batches of 8 / M rows, the dp
    # dimension with the run's FSDP options in its cost model
    pp, rows, cost = runs[0][case]["plan"]
    assert (pp, rows, cost.dims.dp) == (2, 8 // M, 2)
    kept = case[2] == "keep" or case[1] == "zb"  # zero bubble keeps them gathered to its W
    assert (cost.dims.dp_shard, cost.dp.reshard_after_forward) == (case[2] != "replicate", not kept)


# -- several stages per pp rank ---------------------------------------------------------------

CHAIN4 = {"blocks.0": 0, "blocks.1": 1, "blocks.2": 2, "blocks.3": 3, "head": 3}
FOLDED = ({"a": 0, "b": 1, "cat": 2, "head": 2}, [0, 1, 0])  # join on pp rank 0 with a
SEVERAL = [("chain", "interleaved"), ("chain", "zbv"), ("two_branch", "graph_interleaved")]


def _several_plan(name: str, schedule: str) -> Any:
    """A plan for the 2 x 2 mesh with two stages on a pp rank: the chain cut in four and
    folded "loop" (interleaved) or "v" (zbv), or the two-branch DAG's three stages folded
    onto two pp ranks (branch a and the join on rank 0)."""
    model, inputs = MODELS[name]()
    if schedule == "graph_interleaved":
        pins, assignment = FOLDED
        unfolded = plan(model, inputs, devices=6, dp=2, micro_batches=M, pins=pins)
        return place_graph(unfolded, 2, assignment)
    placement = {"interleaved": "loop", "zbv": "v"}[schedule]
    return plan(
        model,
        inputs,
        devices=4,
        dp=2,
        micro_batches=M,
        pins=CHAIN4,
        virtual_stages=2,
        placement=placement,
    )


def _several_worker() -> dict[tuple[str, str], Any]:
    out = {}
    for name, schedule in SEVERAL:
        model, inputs = MODELS[name]()
        pm = gp_compile(
            model,
            inputs,
            loss_fn=dict_loss,
            optimizer=_optimizer(),
            schedule=schedule,
            plan=_several_plan(name, schedule),
            mesh=_mesh(),
            runtime=RuntimeConfig(timeout=60),
        )
        out[(name, schedule)] = {**_train(pm, name), "held": len(pm.plan.stages_on(0))}
    return out


@pytest.fixture(scope="module")
def several() -> list[dict[tuple[str, str], Any]]:
    return launch(_several_worker, 4, timeout=TIMEOUT)


@pytest.mark.parametrize("case", SEVERAL, ids=["-".join(c) for c in SEVERAL])
def test_several_stages_per_pp_rank_on_a_mesh_equal_one_process(
    several: list[dict[tuple[str, str], Any]], case: tuple[str, str]
) -> None:
    """Each stage of a pp rank is its own FSDP2 root over the rank's dp sub-mesh."""
    ref_losses, ref_params, ref_eval, _ = reference(case[0])
    for rank, result in enumerate(several):
        got = result[case]
        assert got["held"] == 2, f"rank {rank}"
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert got["eval"] == pytest.approx(ref_eval, rel=1e-5), f"rank {rank}"
        assert list(got["state"]) == list(ref_params), f"rank {rank}"
        for n, value in ref_params.items():
            torch.testing.assert_close(got["state"][n], value, rtol=1e-5, atol=1e-6, msg=n)


# -- once per step ------------------------------------------------------------------------------


def _count_worker() -> dict[tuple[str, int], int]:
    """Reduce-scatters in one warm step, for M = 2 and M = 4, under 1f1b and zero bubble."""
    calls = []
    original = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counted  # type: ignore[assignment]
    try:
        out = {}
        for schedule in ("1f1b", "zb"):
            for m in (2, 4):
                pm = _compile("chain", schedule, "mesh", m=m)
                inputs, target = batch("chain", 0)
                pm.step(*inputs, target=target)  # warm
                calls.clear()
                pm.step(*inputs, target=target)
                out[(schedule, m)] = len(calls)
        return out
    finally:
        dist.reduce_scatter_single = original  # type: ignore[assignment]


def test_gradients_are_reduce_scattered_once_per_step_not_per_micro_batch() -> None:
    units = {0: 2, 1: 3}  # stage 0: blocks 0 and 1; stage 1: blocks 2 and 3, and the head
    for rank, counts in enumerate(launch(_count_worker, 4, timeout=TIMEOUT)):
        # one reduce-scatter per FSDP unit per step, whatever M (mesh ranks [[0, 1], [2, 3]])
        want = {(s, m): units[rank // 2] for s in ("1f1b", "zb") for m in (2, 4)}
        assert counts == want, f"rank {rank}"


def test_stage_blocks_are_the_model_s_list_elements() -> None:
    from graphpipe.tracing.tracer import trace

    model, inputs = chain()
    gm = trace(model, inputs)
    units = stage_blocks(gm, model)
    assert [[type(m).__name__ for m in u] for u in units] == [["Linear"]] * 5
    assert units[0][0] is model.blocks[0][0] and units[-1][0] is model.head


# -- state dicts --------------------------------------------------------------------------------


def _round_trip_worker() -> dict[str, Any]:
    """A full state dict loaded (each rank keeps its shard) and gathered back; then a step."""
    pm = _compile("chain", "1f1b", "mesh")
    state = {k: v + 1 for k, v in chain()[0].state_dict().items()}
    pm.load_state_dict(state)
    back = pm.state_dict()
    shards = {n: p.to_local().clone() for n, p in pm.module.named_parameters()}
    inputs, target = batch("chain", 0)
    return {"back": back, "shards": shards, "loss": pm.step(*inputs, target=target)}


def test_a_full_state_dict_loads_into_the_shards_and_gathers_back() -> None:
    state = {k: v + 1 for k, v in chain()[0].state_dict().items()}
    model = chain()[0]
    model.load_state_dict(state)
    inputs, target = batch("chain", 0)
    with torch.no_grad():
        pairs = zip(inputs[0].chunk(M), target.chunk(M), strict=True)
        ref = sum(float(dict_loss(model(x), t)) for x, t in pairs) / M
    for rank, result in enumerate(launch(_round_trip_worker, 4, timeout=TIMEOUT)):
        assert list(result["back"]) == list(state)
        for k, v in state.items():
            torch.testing.assert_close(result["back"][k], v, rtol=0, atol=0)
        for n, shard in result["shards"].items():  # dim 0 split over the 2 dp ranks
            half = state[n].chunk(2)[rank % 2]
            torch.testing.assert_close(shard, half, rtol=0, atol=0, msg=f"rank {rank} {n}")
        assert result["loss"] == pytest.approx(ref, rel=1e-5)


# -- refusals -----------------------------------------------------------------------------------


def _spec(**kwargs: Any) -> RunSpec:
    return RunSpec.build(
        torch.randn(8, D), loss_fn=dict_loss, optimizer=_optimizer(), micro_batches=2, **kwargs
    )


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"weights": "pipemare"}, "weights='pipemare'"),
        ({"schedule": "zb", "reshard_after_forward": True}, "reshard_after_forward=True"),
        ({"schedule": "zbv", "reshard_after_forward": True}, "reshard_after_forward=True"),
        ({"reshard_after_forward": 1}, "reshard_after_forward=1"),
        ({"nan_check": True}, "nan_check=True"),
        ({"compile_stages": True}, "compile_stages=True"),
        ({"replication": True}, "replication=True"),
        ({"dp": 0}, "dp=0"),
        ({"dp": 3, "micro_batches": None}, "M * dp = 12"),
    ],
)
def test_what_a_mesh_cannot_run_yet_is_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    kwargs = {"dp": 2, **kwargs}
    if kwargs.get("micro_batches", 2) is None:
        kwargs.pop("micro_batches")
        with pytest.raises(ConfigError, match=named.replace("*", r"\*")):
            RunSpec.build(torch.randn(8, D), loss_fn=dict_loss, optimizer=_optimizer(), **kwargs)
        return
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        _spec(**kwargs)


def test_a_mesh_traces_each_rank_s_slice_of_a_micro_batch() -> None:
    assert _spec().micro_batch_size == 4
    assert _spec(dp=2).micro_batch_size == 2


def test_a_mesh_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="mesh_dim_names"):
        _spec(mesh="pp x dp")


def test_the_identity_layout_translates_nothing() -> None:
    layout = ParallelLayout.identity(2, 4)
    assert (layout.pp, layout.dp, layout.pp_index, layout.rank) == (4, 1, 2, 2)
    assert [layout.rank_of(d) for d in range(4)] == [0, 1, 2, 3]
    assert not layout.meshed and layout.dims == ParallelDims(pp=4)


def _refusal_worker() -> list[str]:
    """Each runtime refusal's message (every rank alike)."""
    said = []

    def refused(call: Any) -> None:
        try:
            call()
        except ConfigError as exc:
            said.append(str(exc))
        else:
            said.append("not refused")

    refused(
        lambda: _compile_with(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")))
    )
    refused(lambda: _compile_with(mesh=_mesh(), dp=2))
    refused(lambda: _compile_with(dp=3, micro_batches=1, example=torch.randn(6, D)))
    return said


# -- a weight tied across pp ranks ----------------------------------------------------------

TIED_PINS = {"embed": 0, "body": 1, "out": 1}  # out.weight is embed.weight, read on pp rank 1


def _tied_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, 12, (8, 5), generator=gen), torch.randn(8, 12, generator=gen)


def _tied_reference() -> tuple[list[float], torch.Tensor]:
    """One process, gradient accumulation over M micro-batches: losses, the tied weight."""
    model, _ = ZOO["tied"]()
    opt = _optimizer()(model.parameters())
    losses = []
    for step in range(STEPS):
        tokens, target = _tied_batch(step)
        total = 0.0
        for j in range(M):
            loss = dict_loss(model(tokens.chunk(M)[j]), target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        losses.append(total / M)
        opt.step()
        opt.zero_grad()
    return losses, model.embed.weight.detach().clone()


TIED_TP = {"body.0.0": "colwise", "body.1.0": "rowwise"}  # the tie itself is not split


def _tied_worker(cases: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """The tied model on pp 2 x dp 2, or on pp 2 x tp 2 with its body split: per (schedule,
    mesh) its losses and, after every step, the tied weight as each holder has it."""
    out: dict[tuple[str, str], Any] = {}
    for schedule, dims in cases:
        model, inputs = ZOO["tied"]()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", dims))
        pm = gp_compile(
            model,
            inputs,
            loss_fn=dict_loss,
            optimizer=_optimizer(),
            micro_batches=M,
            schedule=schedule,
            pins=TIED_PINS,
            mesh=mesh,
            tp_plan=TIED_TP if dims == "tp" else None,
            profile=ProfileConfig(mode="flops"),
            runtime=RuntimeConfig(timeout=60, quiet=True),
        )
        losses, held = [], []
        for step in range(STEPS):
            tokens, target = _tied_batch(step)
            losses.append(pm.step(tokens, target=target))
            params = dict(pm.module.named_parameters(remove_duplicate=False))
            name = "embed.weight" if "embed.weight" in params else "out.weight"
            held.append(tree_map(_whole, params[name]).detach().clone())  # this holder's
        out[(schedule, dims)] = {"losses": losses, "held": held, "state": pm.state_dict()}
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def test_a_weight_tied_across_pp_ranks_is_summed_over_its_holders_on_a_mesh() -> None:
    """embed.weight on pp rank 0 and, as out.weight, on pp rank 1, each FSDP2-sharded over
    dp (or whole on each tp rank): the holders' gradients summed per dp and tp coordinate
    (Megatron's embedding group), so both copies stay one tensor after every step, equal to
    one process's."""
    cases = [("1f1b", "dp"), ("zb", "dp"), ("1f1b", "tp")]
    results = launch(_tied_worker, 4, args=(cases,), timeout=TIMEOUT)
    ref_losses, ref_weight = _tied_reference()
    for schedule in cases:
        for rank, result in enumerate(results):
            got = result[schedule]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (schedule, rank)
            torch.testing.assert_close(
                got["state"]["embed.weight"], ref_weight, rtol=1e-5, atol=1e-6
            )
        for step in range(STEPS):  # every holder, every dp rank: the same tensor
            first = results[0][schedule]["held"][step]
            for result in results[1:]:
                torch.testing.assert_close(result[schedule]["held"][step], first, rtol=0, atol=0)


def _tied_on_meta_worker() -> list[torch.Tensor]:
    """The tied model built on the meta device on pp 2 x dp 2: each holder materialises its
    own shards, by the tensor's owning module's path (`graphpipe.runtime.materialize`), so
    every holder draws the same values. The tied copies as they start, and after one step."""
    with torch.device("meta"):
        model = zoo.Tied()
    tokens, target = _tied_batch(0)
    pm = gp_compile(
        model,
        (tokens,),
        loss_fn=dict_loss,
        optimizer=_optimizer(),
        micro_batches=M,
        pins=TIED_PINS,
        dp=2,
        runtime=RuntimeConfig(timeout=60, quiet=True),
    )
    params = dict(pm.module.named_parameters(remove_duplicate=False))
    name = "embed.weight" if "embed.weight" in params else "out.weight"
    start = _whole(params[name]).detach().clone()
    pm.step(tokens, target=target)
    return [start, _whole(params[name]).detach().clone()]


def test_a_tied_weight_materialised_on_each_holder_starts_as_one_tensor() -> None:
    results = launch(_tied_on_meta_worker, 4, timeout=TIMEOUT)
    for when in range(2):
        for result in results[1:]:
            torch.testing.assert_close(result[when], results[0][when], rtol=0, atol=0)


def _compile_with(
    example: torch.Tensor | None = None,
    micro_batches: int = M,
    **kwargs: Any,
) -> Any:
    return gp_compile(
        chain()[0],
        example if example is not None else chain()[1],
        loss_fn=dict_loss,
        optimizer=_optimizer(),
        micro_batches=micro_batches,
        pins=PINS["chain"],
        profile=ProfileConfig(mode="flops"),
        **kwargs,
    )


def test_what_needs_the_process_group_is_refused_by_name() -> None:
    said = launch(_refusal_worker, 4, timeout=TIMEOUT)
    assert all(s == said[0] for s in said)
    expected = [
        "mesh_dim_names=('pp', 'dp')",
        "mesh= and dp=2, tp=None given",
        "dp=3 x tp=1 does not divide the world size 4",
    ]
    assert len(said[0]) == len(expected)
    for message, part in zip(said[0], expected, strict=True):
        assert part in message, message


def test_compile_takes_the_planners_mesh_options_under_their_names() -> None:
    """dp=, dp_shard= and dp_link= mean in compile what they mean in plan() (one option each,
    `graphpipe.planning.options`): the degree, the sharding and the dp link's cost."""
    link = LinkModel(bandwidth=1e9)
    spec = _spec(dp=2, dp_shard=False, dp_link=link)
    assert spec.dims == ParallelDims(pp=None, dp=2, dp_shard=False)
    assert spec.plan_options["dp_link"] is link  # the planner costs the dp link given


def test_a_given_plan_is_checked_against_the_runs_dp_and_tp() -> None:
    model, inputs = chain()
    gm = trace(model, inputs, micro_batch_size=2)  # one dp rank's slice: 8 rows, M=2, dp=2
    for_dp1 = plan(model, inputs, devices=2, micro_batches=2, pins=PINS["chain"])
    with pytest.raises(ConfigError, match="made for dp=1, this run has dp=2"):
        checked_plan(for_dp1, gm, ParallelDims(pp=2, dp=2))
    for_dp2 = plan(model, inputs, devices=4, dp=2, micro_batches=2, pins=PINS["chain"])
    assert checked_plan(for_dp2, gm, ParallelDims(pp=2, dp=2)) is for_dp2
    with pytest.raises(ConfigError, match="made for tp=1, this run has tp=2"):
        checked_plan(for_dp2, gm, ParallelDims(pp=1, dp=2, tp=2))


def test_the_one_time_loss_check_sees_this_ranks_slice_of_the_target() -> None:
    model, inputs = chain()  # 8 rows, M = 2, dp = 2: each rank runs 2 rows per micro-batch
    gm = trace(model, inputs, micro_batch_size=2)
    seen: list[tuple[torch.Size, torch.Size]] = []

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append((out.shape, target.shape))
        return (out - target).pow(2).mean()

    checks = Inputs(gm, inputs, ["x"], loss, 2, torch.device("cpu"), True, dp=2, dp_index=1)
    checks.check_loss(torch.randn(8, 4))
    assert seen == [(torch.Size([2, 4]), torch.Size([2, 4]))]


# -- the mesh chosen by the planner ------------------------------------------------------------

AUTO = {"mesh": "auto", "micro_batches": "auto", "profile": ProfileConfig(mode="flops")}


def _auto_worker() -> dict[str, Any]:
    """compile(mesh="auto") on the chain: rank 0 chooses pp x dp x tp and M for the world."""
    model, inputs = chain()
    pm = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=_optimizer(),
        runtime=RuntimeConfig(timeout=60, quiet=True),
        **AUTO,
    )
    losses = []
    for step in range(STEPS):
        x, y = batch("chain", step)
        losses.append(pm.step(*x, target=y))
    mesh = pm.plan.info["mesh"]
    return {
        "chosen": (mesh["pp"], mesh["dp"], mesh["tp"], pm.plan.micro_batches),
        "dims": tuple(pm.spec.mesh.mesh_dim_names) if pm.spec.mesh is not None else (),
        "losses": losses,
        "state": pm.state_dict(),
    }


def test_compile_chooses_the_mesh_and_trains_as_one_process() -> None:
    """mesh="auto": the world's 4 ranks become the mesh rank 0's search chose (the one
    graphpipe.plan(mesh="auto") chooses on the same costs, compile's one stage per pp rank
    included), built and run as a named one would be: the same losses and parameters as one
    process accumulating over the mini-batch (the chain has no batch statistics, so any M)."""
    runs = launch(_auto_worker, 4, timeout=TIMEOUT)
    model, inputs = chain()
    alone = plan(model, inputs, devices=4, layouts=("one",), **AUTO)
    pp, dp, tp = alone.dims.pp, alone.dims.dp, alone.dims.tp  # type: ignore[union-attr]
    assert all(r["chosen"] == (pp, dp, tp, alone.micro_batches) for r in runs), runs[0]["chosen"]
    assert all(r["dims"] == runs[0]["dims"] for r in runs)
    losses, params, _, _ = reference("chain")
    for r in runs:
        torch.testing.assert_close(r["losses"], losses, rtol=1e-5, atol=1e-6)
        for name, value in params.items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6)
