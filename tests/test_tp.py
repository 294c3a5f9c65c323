"""Tensor parallelism inside stages: a "tp" mesh dimension by DTensor (graphpipe.runtime.tp).

A tiny Hugging Face Llama (tests/test_mesh_models.py) with its own `base_model_tp_plan`
(q, k, v, gate and up projections colwise; o and down projections rowwise), pinned to two
stages, on pp 2 x tp 2 (4 gloo processes) and pp 2 x dp 2 x tp 2 (8), trained 3 steps under
1f1b with Adam: the losses, every parameter (`pm.state_dict()`, gathered whole over tp and
dp) and Adam's moments must equal one process training on the whole mini-batch with
gradient accumulation over the same micro-batches, at rtol 1e-5. Checkpoints reshard between
tp degrees both ways (pp 2 x tp 2 -> pp 4 without a mesh -> pp 2 x tp 2). A chain built on the
meta device materialises only each rank's tp (x dp) shards on both meshes and trains as the
same chain made whole on one process.

Tied weights under tp, in the same launches: the tiny Llama with tie_word_embeddings (the
embedding on stage 0, lm_head on stage 1: a tie across pp ranks; and at pp 2 x tp 2 under
zbv, stages 0 and 3 on pp rank 0: a tie across two stages of one rank) and an fx-traced net with
two ties (an embedding read again as a column-wise output layer: the weight replicated over
tp; a square layer applied twice, column-wise at both uses: the weight Shard(0)), pinned with
both ties inside one stage and across the pp ranks; each equal to one process.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from real_models import MOE_CASES
from test_mesh import PINS as CHAIN_PINS
from test_mesh import STEPS as CHAIN_STEPS
from test_mesh import _optimizer as chain_optimizer
from test_mesh import batch as chain_batch
from test_mesh import chain
from test_mesh_meta import PINS as META_PINS
from test_mesh_meta import STEPS as META_STEPS
from test_mesh_meta import M as META_M
from test_mesh_meta import _meta_chain as meta_chain
from test_mesh_meta import _optimizer as meta_optimizer
from test_mesh_meta import data as meta_data
from test_mesh_meta import one_process
from test_mesh_meta import reference as meta_reference
from test_mesh_models import (
    PINS,
    STEPS,
    M,
    _adam_state,
    _named,
    _optimizer,
    batch,
    llama,
    lm_loss,
    reference,
)
from test_mesh_state import MAX_NORM, clipped_reference
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from zoo import dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch
from graphpipe.runtime.tp import (
    attention,
    model_tp_plan,
    placements,
    resolve_tp_plan,
    shared_placements,
)

TIMEOUT = 400  # seconds for a whole launch (8 processes on 2 cores)
# Adam moves a parameter by up to lr / eps = 100 times a rounding difference in a gradient
# element near zero (test_mesh_models's EPS); tp's all-reduces sum in another order than one
# process, and one element of 2048 of the embedding (a sum over every token) moved 1.2e-6
ATOL = 2e-6
SHAPES = {4: ((2, 2), ("pp", "tp")), 8: ((2, 2, 2), ("pp", "dp", "tp"))}


def _llama(pins: dict[str, int], mesh: Any, tied: bool = False, schedule: str = "1f1b") -> Any:
    """The tiny Llama (`llama(tied)`) pipelined under `schedule` by `pins`, over `mesh`
    (None: one rank a stage)."""
    ids, _ = batch(0)
    return gp_compile(
        llama(tied),
        {"input_ids": ids, "use_cache": False},
        loss_fn=lm_loss,
        optimizer=_optimizer(),
        micro_batches=M,
        schedule=schedule,
        pins=pins,
        mesh=mesh,
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120),
    )


def _train_worker(world: int, where: str) -> dict[str, Any]:
    shape, names = SHAPES[world]
    pm = _llama(PINS, init_device_mesh("cpu", shape, mesh_dim_names=names))
    losses = [pm.step(input_ids=batch(s)[0], target=batch(s)[1]) for s in range(STEPS)]
    local = {n: p.to_local().numel() for n, p in pm.module.named_parameters()}
    out = {
        "losses": losses,
        "state": pm.state_dict(),
        "adam": _adam_state(pm),
        "local": local,
        "placements": {n: str(p.placements) for n, p in pm.module.named_parameters()},
    }
    if world == 4:
        out["resumed"] = _resume_at_tp1(pm, where)
        out["chain"] = _chain_on_tp()
    out["meta"] = _meta_chain_on_tp(shape, names)
    out["tied"] = _tied_llama_on_tp(shape, names, PINS)
    if world == 4:  # zbv's v: stages 0 and 3, the embedding and lm_head, on pp rank 0
        out["tied_v"] = _tied_llama_on_tp(shape, names, PINS4, "zbv")
        out["meta_tie_refused"] = _meta_tie_on_one_rank(shape, names)
    out["tied_net"] = {k: _tied_net_on_tp(shape, names, pins) for k, pins in TIED_PINS.items()}
    return out


def _tied_llama_on_tp(
    shape: tuple[int, ...], names: tuple[str, ...], pins: dict[str, int], schedule: str = "1f1b"
) -> dict[str, Any]:
    """The Llama with lm_head.weight tied to the embedding, on this launch's mesh, pinned by
    `pins`: its losses, state, this rank's stages and the tied weight's placements here (one
    parameter however many of the rank's stages read it)."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = _llama(pins, mesh, tied=True, schedule=schedule)
    losses = [pm.step(input_ids=batch(s)[0], target=batch(s)[1]) for s in range(STEPS)]
    held = {n: p.placements for n, p in pm.module.named_parameters()}
    tied = [p for n, p in held.items() if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    stages = [s.index for s in pm.plan.stages_on(pm.rank)]
    return {"losses": losses, "state": pm.state_dict(), "placements": tied, "stages": stages}


class _TiedNet(nn.Module):
    """Two ties: `out` reads the embedding's table as its weight (a column-wise output layer,
    the vocabulary split, against an embedding kept whole), and `b` is `a` applied again
    (both column-wise: one layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(self.embed(ids)))))  # (B, 3, 8)
        return self.head(torch.tanh(self.out(h))).mean(1)  # (B, 4)


TIED_TP = {"a": "colwise", "b": "colwise", "out": "colwise", "head": "rowwise"}
TIED_PINS = {  # both ties inside stage 0, or each across the two pp ranks
    "one stage": {"embed": 0, "a": 0, "b": 0, "out": 0, "head": 1},
    "across pp": {"embed": 0, "a": 0, "b": 1, "out": 1, "head": 1},
}


def _tied_net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _TiedNet()


def _tied_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s token ids (8, 3) and target (8, 4)."""
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, 16, (8, 3), generator=gen), torch.randn(8, 4, generator=gen)


def _tied_optimizer() -> Any:
    return functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _tied_net_on_tp(
    shape: tuple[int, ...], names: tuple[str, ...], pins: dict[str, int]
) -> dict[str, Any]:
    """`_TiedNet` pinned by `pins` on this launch's mesh: losses, state, placements held."""
    pm = gp_compile(
        _tied_net(),
        _tied_data(0)[0],
        loss_fn=nn.functional.mse_loss,
        optimizer=_tied_optimizer(),
        micro_batches=M,
        pins=pins,
        mesh=init_device_mesh("cpu", shape, mesh_dim_names=names),
        tp_plan=TIED_TP,
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120, quiet=True),
    )
    losses = [pm.step(_tied_data(s)[0], target=_tied_data(s)[1]) for s in range(STEPS)]
    module = cast(nn.Module, pm.module)  # every rank holds a stage
    held = {n: cast(DTensor, p).placements[-1] for n, p in module.named_parameters()}  # over tp
    return {"losses": losses, "state": pm.state_dict(), "placements": held}


def _meta_tie_on_one_rank(shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    """`_TiedNet` built on meta, its ties each on one pp rank (zbv's v): the error."""
    with torch.device("meta"):
        model = _TiedNet()
    try:
        gp_compile(
            model,
            _tied_data(0)[0],
            loss_fn=nn.functional.mse_loss,
            optimizer=_tied_optimizer(),
            micro_batches=M,
            pins={"embed": 0, "a": 1, "b": 2, "out": 3, "head": 3},
            schedule="zbv",
            mesh=init_device_mesh("cpu", shape, mesh_dim_names=names),
            tp_plan=TIED_TP,
            profile=ProfileConfig(mode="flops"),
            runtime=RuntimeConfig(timeout=120, quiet=True),
        )
    except ConfigError as exc:
        return str(exc)
    return "compiled"


def _tied_net_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, gradient accumulation over the same M micro-batches."""
    model = _tied_net()
    opt = _tied_optimizer()(model.parameters())
    losses = []
    for step in range(STEPS):
        ids, target = _tied_data(step)
        total = 0.0
        for j in range(M):
            loss = nn.functional.mse_loss(model(ids.chunk(M)[j]), target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return losses, model.state_dict()


PINS4 = {"model.embed_tokens": 0, "model.layers.0": 1, "model.layers.1": 2, "lm_head": 3}


def _resume_at_tp1(tp2: Any, where: str) -> dict[str, Any]:
    """The pp 2 x tp 2 run's checkpoint loaded by a pp 4 pipeline without a mesh (tp 1):
    its state right after the load, and both runs' next step; then the reverse: the pp 4
    run's checkpoint loaded by a new pp 2 x tp 2 pipeline, and both runs' next step."""
    tp2.save(where)
    pp4 = _llama(PINS4, None)
    pp4.load(where)
    loaded = pp4.state_dict()
    ids, target = batch(STEPS)
    out = {
        "loaded": loaded,
        "losses": [pm.step(input_ids=ids, target=target) for pm in (tp2, pp4)],
        "after": [tp2.state_dict(), pp4.state_dict()],
    }
    pp4.save(f"{where}-tp1")
    back = _llama(PINS, init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")))
    back.load(f"{where}-tp1")
    out["back"] = {"loaded": back.state_dict(), "saved": out["after"][1]}
    ids, target = batch(STEPS + 1)
    out["back"]["losses"] = [pm.step(input_ids=ids, target=target) for pm in (pp4, back)]
    out["back"]["after"] = [pp4.state_dict(), back.state_dict()]
    return out


CHAIN_TP = {"blocks.0.0": "colwise", "blocks.1.0": "rowwise", "blocks.2.0": "colwise",
            "blocks.3.0": "rowwise", "head": "colwise"}  # fmt: skip


def _chain_on_tp() -> dict[str, Any]:
    """An fx-traced chain (Linear + Tanh blocks, called as modules) on pp 2 x tp 2 with a
    tp_plan of its own, clipped; SGD with momentum, as tests/test_mesh_state.py's reference."""
    model, inputs = chain()
    pm = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=chain_optimizer(),
        micro_batches=M,
        pins=CHAIN_PINS["chain"],
        mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")),
        tp_plan=CHAIN_TP,
        max_grad_norm=MAX_NORM,  # active every step: the norm over pp and tp's DTensors
        schedule="zb",  # split backward: the weight halves add into DTensor gradients
        recompute=True,  # every stage's forward again in the backward, on the DTensors
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120),
    )
    losses, norms = [], []
    for step in range(CHAIN_STEPS):
        losses.append(pm.step(*chain_batch("chain", step)[0], target=chain_batch("chain", step)[1]))
        norms.append(pm.last_grad_norm)
    recomputed = [s.recompute for s in pm.plan.stages]
    outputs = pm(*chain_batch("chain", 0)[0])  # forward only, the tp ranks' outputs made one
    return {
        "losses": losses,
        "norms": norms,
        "state": pm.state_dict(),
        "recompute": recomputed,
        "outputs": outputs,
    }


META_TP = {"0.0": "colwise", "1.0": "rowwise", "2.0": "colwise", "3.0": "rowwise"}


def _meta_chain_on_tp(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    """tests/test_mesh_meta.py's chain built on meta, on this launch's mesh (pp 2 x tp 2, or
    pp 2 x dp 2 x tp 2): each rank materialises only its tp (x dp) shards, by
    reset_parameters seeded by path (`graphpipe.runtime.materialize.materialize_sharded`)."""
    pm = gp_compile(
        meta_chain(),
        meta_data(0)[0],
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=meta_optimizer(),
        micro_batches=META_M,
        pins=META_PINS,
        mesh=init_device_mesh("cpu", shape, mesh_dim_names=names),
        tp_plan=META_TP,
        schedule="zb" if "dp" in names else "1f1b",  # zero bubble under FSDP2 x TP too
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120),
    )
    losses = [pm.step(meta_data(s)[0], target=meta_data(s)[1]) for s in range(META_STEPS)]
    local = sum(p.to_local().numel() * p.element_size() for p in pm.module.parameters())
    return {"losses": losses, "state": pm.state_dict(), "local": local}


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return reference()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, Any]]]:
    """Each world size's launch, run once and kept."""
    done: dict[int, list[dict[str, Any]]] = {}

    def run(world: int) -> list[dict[str, Any]]:
        if world not in done:
            where = str(tmp_path_factory.mktemp("tp") / "ckpt")
            done[world] = launch(_train_worker, world, args=(world, where), timeout=TIMEOUT)
        return done[world]

    return run


@pytest.fixture(scope="module", params=sorted(SHAPES))
def runs(
    request: pytest.FixtureRequest, launched: Callable[[int], list[dict[str, Any]]]
) -> tuple[int, list[dict[str, Any]]]:
    return request.param, launched(request.param)


def test_llama_with_tensor_parallel_stages_trains_as_one_process(
    runs: tuple[int, list[dict[str, Any]]], expected: dict[str, Any]
) -> None:
    _, results = runs
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), f"rank {rank}"
        assert list(result["state"]) == list(expected["state"]), f"rank {rank}"
        for key, value in expected["state"].items():
            torch.testing.assert_close(
                result["state"][key], value, rtol=1e-5, atol=ATOL, msg=_named(key)
            )
    seen: set[str] = set()
    for result in results:
        for name, moments in result["adam"].items():
            for k, v in moments.items():
                want = expected["adam"][name][k]
                torch.testing.assert_close(v, want, rtol=1e-5, atol=1e-7, msg=_named(f"{name} {k}"))
            seen.add(name)
    assert seen == set(expected["adam"])


def test_each_rank_holds_its_tp_shard_of_the_planned_layers(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    """q_proj (32 x 32, colwise) holds 1/tp of its rows per tp rank, and 1/dp of that with
    FSDP2 over dp; a norm's weight (replicated over tp) 1/dp."""
    world, results = runs
    dp = 2 if world == 8 else 1
    rank0 = results[0]
    assert rank0["local"]["model.layers.0.self_attn.q_proj.weight"] == 32 * 32 // 2 // dp
    assert rank0["local"]["model.layers.0.input_layernorm.weight"] == 32 // dp
    assert "Shard(dim=0)" in rank0["placements"]["model.layers.0.self_attn.q_proj.weight"]
    assert "Shard(dim=1)" in rank0["placements"]["model.layers.0.self_attn.o_proj.weight"]


def test_an_fx_traced_chain_with_its_own_tp_plan_and_clipping_trains_as_one_process(
    launched: Callable[[int], list[dict[str, Any]]],
) -> None:
    """Modules called by an fx graph, their Linear weights sharded by the plan (pp 2 x tp 2),
    clipped by the whole model's norm: torch's norm of the DTensor gradients made whole over
    tp, summed over pp; equal to clip_grad_norm_ on one process."""
    results = launched(4)
    ref_losses, ref_norms, ref_params = clipped_reference("chain", 2.0)
    for rank, result in enumerate(results):
        got = result["chain"]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), f"rank {rank}"
        assert all(n > MAX_NORM for n in ref_norms)  # clipped at every step
        assert got["recompute"] == [True, True]  # every stage's forward run again
        for n, value in ref_params.items():
            torch.testing.assert_close(got["state"][n], value, rtol=1e-5, atol=1e-6, msg=n)
    model, _ = chain()  # pm(...) on every rank: the trained model's output, as one process's
    model.load_state_dict(ref_params, strict=False)
    with torch.no_grad():
        expected = model(*chain_batch("chain", 0)[0])
    for rank, result in enumerate(results):
        got = result["chain"]["outputs"]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


def test_a_tp2_checkpoint_loads_at_tp1_and_steps_the_same(
    launched: Callable[[int], list[dict[str, Any]]],
) -> None:
    """DCP reshards the tp shards (and Adam's) by name into a pp 4 pipeline without a mesh."""
    for rank, result in enumerate(launched(4)):  # saved: the tp run's weights after 3 steps
        _assert_resumed(rank, result["state"], result["resumed"])


def test_a_tp1_checkpoint_loads_at_tp2_and_steps_the_same(
    launched: Callable[[int], list[dict[str, Any]]],
) -> None:
    """The reverse: the pp 4 run's checkpoint (no mesh) loaded into a new pp 2 x tp 2
    pipeline, each tensor split into its tp shards (and Adam's moments), steps as the pp 4
    run goes on."""
    for rank, result in enumerate(launched(4)):
        got = result["resumed"]["back"]
        _assert_resumed(rank, got["saved"], got)
        for n, value in got["after"][0].items():
            assert not torch.equal(value, got["saved"][n]), f"{n} never moved"


def _assert_resumed(rank: int, saved: dict[str, torch.Tensor], got: dict[str, Any]) -> None:
    """The loaded tensors are the saved ones exactly; the next step's loss and tensors equal
    the saving run's own next step (`got["losses"]`, `got["after"]`: saver's, then loader's)."""
    for n, value in saved.items():
        torch.testing.assert_close(got["loaded"][n], value, rtol=0, atol=0, msg=n)
    saver_loss, loader_loss = got["losses"]
    assert loader_loss == pytest.approx(saver_loss, rel=1e-5), f"rank {rank}"
    saver_after, loader_after = got["after"]
    for n, value in saver_after.items():
        torch.testing.assert_close(loader_after[n], value, rtol=1e-5, atol=ATOL, msg=n)


def test_a_meta_model_materialises_only_its_tp_shards_and_trains_as_one_process(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    """The chain on meta, 4 Linear blocks split colwise / rowwise over tp (and sharded by
    FSDP2 over dp): values by the single-process rules, and each rank's local parameters
    1/pp of the model's, split in two by tp (a rowwise layer's bias whole) and by dp."""
    world, results = runs
    dp = 2 if world == 8 else 1
    losses, params = meta_reference(one_process("reset_parameters"))
    weights = sum(v.numel() * 4 for k, v in params.items() if k.endswith("weight"))
    biases = {k: v.numel() * 4 for k, v in params.items() if k.endswith("bias")}
    whole = sum(b for k, b in biases.items() if k.startswith(("1.", "3.")))  # rowwise biases
    for rank, result in enumerate(results):
        got = result["meta"]
        assert got["losses"] == pytest.approx(losses, rel=1e-5), f"rank {rank}"
        for name, value in params.items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        split = (weights + sum(biases.values()) - whole) / 2 + whole  # tp's share, all stages
        assert got["local"] == split / 2 / dp, f"rank {rank}: 1/pp of tp's share, / dp"


def test_an_embedding_tied_to_a_tp_split_output_layer_trains_as_one_process(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    """The Llama's lm_head (column-wise by its plan) reads the embedding's table (kept whole):
    the tied weight is replicated over tp on both pp ranks, their gradients summed over
    each (dp, tp) coordinate's pp pair."""
    _, results = runs
    expected = reference(tied=True)
    for rank, result in enumerate(results):
        got = result["tied"]
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), f"rank {rank}"
        assert list(got["state"]) == list(expected["state"]), f"rank {rank}"
        for key, value in expected["state"].items():
            torch.testing.assert_close(
                got["state"][key], value, rtol=1e-5, atol=ATOL, msg=_named(key)
            )
        assert [p[-1] for p in got["placements"]] == [Replicate()], f"rank {rank}"
    start = llama(tied=True).state_dict()
    assert not torch.equal(expected["state"]["lm_head.weight"], start["lm_head.weight"])


def test_an_embedding_tied_to_a_tp_split_output_layer_on_one_pp_rank_trains_as_one_process(
    launched: Callable[[int], list[dict[str, Any]]],
) -> None:
    """zbv's v puts stages 0 (the embedding) and 3 (lm_head) on pp rank 0: the two stages
    share one replicated DTensor of the tied weight there (pp 2 x tp 2)."""
    expected = reference(tied=True)
    for rank, result in enumerate(launched(4)):
        got = result["tied_v"]
        assert got["stages"] == ([0, 3] if rank < 2 else [1, 2]), f"rank {rank}"
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), f"rank {rank}"
        for key, value in expected["state"].items():
            torch.testing.assert_close(
                got["state"][key], value, rtol=1e-5, atol=ATOL, msg=_named(key)
            )
        assert [p[-1] for p in got["placements"]] == [Replicate()] * (rank < 2), f"rank {rank}"


@pytest.mark.parametrize("where", sorted(TIED_PINS))
def test_tied_weights_take_one_layout_inside_a_stage_and_across_pp_ranks(
    runs: tuple[int, list[dict[str, Any]]], where: str
) -> None:
    """`_TiedNet`'s ties, both in one stage or both across the pp ranks: the embedding and
    its column-wise reader share a replicated table, the layer applied twice keeps Shard(0);
    every step equal to one process."""
    _, results = runs
    losses, params = _tied_net_reference()
    layouts = {"embed.weight": Replicate(), "out.weight": Replicate(), "a.weight": Shard(0)}
    layouts |= {"b.weight": Shard(0), "head.weight": Shard(1)}
    for rank, result in enumerate(results):
        got = result["tied_net"][where]
        assert got["losses"] == pytest.approx(losses, rel=1e-5), f"rank {rank}"
        for name, value in params.items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        for name, placement in got["placements"].items():
            assert layouts.get(name, placement) == placement, f"rank {rank} {name}"
    stage0 = set(results[0]["tied_net"][where]["placements"])  # what pp rank 0 holds
    assert ("embed.weight" in stage0, "b.bias" in stage0) == (True, where == "one stage")


def test_a_meta_model_s_weight_tied_across_two_stages_of_one_rank_is_refused_by_name(
    launched: Callable[[int], list[dict[str, Any]]],
) -> None:
    """Materialised stage by stage, the copy two stages of one rank share got the wrong
    module's initial values (measured): refused on every rank alike."""
    from graphpipe.runtime.refusals import refusal

    row = refusal("meta-tie-one-rank", "x").split(": ", 1)[1]
    said = {result["meta_tie_refused"] for result in launched(4)}
    assert said == {f"a.weight is held by stages [1, 2] on one pp rank, on meta: {row}"}


# -- the plan -------------------------------------------------------------------------------------


def test_the_hugging_face_plan_is_read_under_the_base_model_s_path() -> None:
    plan = model_tp_plan(llama())
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"


def test_placements_follow_the_style_and_star_is_one_component() -> None:
    plan = {"layers.*.fc": "rowwise"}
    assert placements("layers.3.fc.weight", plan) == [Shard(1)]
    assert placements("layers.3.fc.bias", plan) == [Replicate()]
    assert placements("layers.3.x.fc.weight", plan) == [Replicate()]  # * is one component


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.out = nn.Linear(4, 8, bias=False)
        self.out.weight = self.embed.weight


@pytest.mark.parametrize(
    ("plan", "named"),
    [
        ({"model.layers.*.self_attn.qproj": "colwise"}, "model.layers.*.self_attn.qproj"),
        ({"model.layers.*.mlp.up_proj": "sequence_parallel"}, "sequence_parallel"),
    ],
)
def test_a_bad_plan_entry_is_refused_naming_it(plan: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("*", r"\*").replace(".", r"\.")):
        resolve_tp_plan(llama(), plan)


def test_a_tied_weight_takes_the_layout_its_uses_agree_on_else_replicated() -> None:
    """An embedding (kept whole) tied to a column-wise output layer: replicated; the plan is
    not refused for the tie."""
    assert resolve_tp_plan(_Tied(), {"out": "colwise"}) == {"out": "colwise"}
    assert shared_placements(["embed.weight", "out.weight"], {"out": "colwise"}) == [Replicate()]
    both = {"a": "colwise", "b": "colwise"}
    assert shared_placements(["a.weight", "b.weight"], both) == [Shard(0)]
    assert shared_placements(["a.weight"], {"a": "rowwise"}) == [Shard(1)]


@pytest.mark.parametrize("build", ["mixtral", "qwen2_moe"])
def test_a_moe_model_s_own_plan_is_applied_where_graphpipe_can_the_experts_kept_whole(
    build: str,
) -> None:
    """Hugging Face's plan for packed experts ("packed_colwise", "moe_tp_experts", entries
    naming parameters) and for dense MLPs this configuration has not: dropped, named in a
    warning; attention stays split. Given as a tp_plan, those entries are refused."""
    model = MOE_CASES[build].build()
    with pytest.warns(UserWarning, match=r"moe_tp_experts.*replicated over tp"):
        plan = resolve_tp_plan(model, None)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert not any("experts" in k for k in plan)
    with pytest.raises(ConfigError, match="packed_colwise"):
        resolve_tp_plan(model, model_tp_plan(model))


def test_a_model_without_a_plan_needs_one() -> None:
    with pytest.raises(ConfigError, match="has no base_model_tp_plan"):
        resolve_tp_plan(nn.Linear(2, 2), None)


@pytest.mark.parametrize("causal", [False, True])
def test_plain_attention_equals_torch_s(causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=gen) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(attention(q, k, v, is_causal=causal), want)
    mask = torch.randn(2, 1, 5, 5, generator=gen)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(attention(q, k, v, attn_mask=mask), want)
    kv = k[:, :1], v[:, :1]  # one key-value head for three query heads
    want = torch.nn.functional.scaled_dot_product_attention(q, *kv, enable_gqa=True)
    torch.testing.assert_close(attention(q, *kv, enable_gqa=True), want)


def test_what_tensor_parallelism_cannot_run_yet_is_refused_by_name() -> None:
    from graphpipe.ir import ParallelDims
    from graphpipe.runtime.refusals import refusal
    from graphpipe.runtime.spec import tp_refusals

    said = tp_refusals(ParallelDims(pp=None, dp=2, tp=2, dp_shard=False), tp_plan=None)
    assert said == [refusal("tp-hsdp", "dp_shard=False")]
    assert "no 'tp' dimension" in tp_refusals(ParallelDims(pp=None), tp_plan={})[0]


class _CutAtAView(nn.Module):
    """Two Linears with a view between them, pinned to two stages: stage 0 returns the view."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).view(-1, 8))


def _fsdp_warnings() -> dict[str, Any]:
    """One step on pp 1 x dp 1 x tp 2 (the chain's outputs made whole by `full_tensor()`, a
    view) and one on pp 2 x dp 1 (stage 0 cut after a view), both under FSDP2; each run's
    losses and the warnings it raised on this rank."""
    out: dict[str, Any] = {}
    model, inputs = chain()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    runs = {
        "tp": (
            model,
            inputs,
            (1, 1, 2),
            ("pp", "dp", "tp"),
            dict.fromkeys(CHAIN_PINS["chain"], 0),
            CHAIN_TP,
        ),
        "cut": (_CutAtAView(), (x,), (2, 1), ("pp", "dp"), {"a": 0, "b": 1}, None),
    }
    for name, (net, example, shape, dims, pins, tp_plan) in runs.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = gp_compile(
                net,
                example,
                loss_fn=dict_loss,
                optimizer=chain_optimizer(),
                micro_batches=M,
                pins=pins,
                mesh=init_device_mesh("cpu", shape, mesh_dim_names=dims),
                tp_plan=tp_plan,
                profile=ProfileConfig(mode="flops"),
                runtime=RuntimeConfig(timeout=60, quiet=True),
            )
            target = torch.zeros(8, 4 if name == "tp" else 2)
            loss = pm.step(*example, target=target)
        out[name] = {"loss": loss, "warnings": [str(w.message) for w in caught]}
    return out


def test_fsdp2_sees_no_view_among_a_stage_s_outputs() -> None:
    """FSDP2 hangs its pre-backward hook on a stage's outputs and warns of each that is a
    view (an in-place op on it would drop the hook): graphpipe's own views (tp's whole
    outputs, a cut after a reshape) reach it as tensors of their own."""
    for rank, run in enumerate(launch(_fsdp_warnings, 2, timeout=TIMEOUT)):
        for name, got in run.items():
            assert math.isfinite(got["loss"]), f"rank {rank} {name}"
            views = [w for w in got["warnings"] if "returned a view tensor" in w]
            assert views == [], f"rank {rank} {name}: {views}"
