"""A real model on a ("pp", "dp") mesh (a tiny Hugging Face Llama), recompute and bf16.

Four gloo processes on a (2, 2) mesh, as in tests/test_mesh.py. A tiny Llama (hidden 32, two
decoder layers, random weights) trained under 1f1b with Adam for 3 steps must equal one
process training on the whole mini-batch with gradient accumulation over the same M
micro-batches, and so must the same under zero bubble (zb: the backward split into input and
weight halves, FSDP2's reduction run after the last weight half): the losses of every step,
every parameter (`pm.state_dict()`), Adam's state (the optimizer's sharded moments gathered
over dp) and an `eval_step` afterwards.

Llama traces through torch.export: the stage is a flat aten graph whose parameters are
read by get_attr, with no submodule calls for FSDP2's hooks to wrap, so each decoder layer
is outlined into a submodule at its own path first (`graphpipe.runtime.outline`) and is one
FSDP2 unit, the stage root another (embedding, final norm, head); the Llama runs check that
layout on every rank (tests/test_mesh_blocks.py checks the outlining alone). bf16 runs it
under autocast, as one process does (`graphpipe.runtime.precision`: export fixed the model's
own float32 casts into the graph), and equals one process under `torch.autocast` at a bf16
tolerance.

On the chain of tests/test_mesh.py: `recompute=True` equals one process at rtol 1e-5, and
`precision="bf16"` (FSDP2's MixedPrecisionPolicy) equals one process's bf16 recipe at a bf16
tolerance (`BF16_RTOL`).
"""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from real_models import rounded_to
from test_mesh import PINS as CHAIN_PINS
from test_mesh import STEPS as CHAIN_STEPS
from test_mesh import _optimizer as chain_optimizer
from test_mesh import batch as chain_batch
from test_mesh import chain
from test_mesh import reference as chain_reference
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from zoo import dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch
from graphpipe.runtime.mesh import RESHARDING, stage_blocks
from graphpipe.tracing.tracer import trace

B = 8  # mini-batch: 2 micro-batches of 4 rows, 2 rows per dp rank
M = 2  # micro-batches
L = 6  # sequence length
V = 64  # vocabulary
STEPS = 3
TIMEOUT = 300  # seconds for a whole launch
PINS = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}


def llama(tied: bool = False) -> nn.Module:
    """A seeded tiny Llama: hidden 32, 2 decoder layers, 2 heads, vocabulary 64; with
    `tied`, lm_head.weight is model.embed_tokens.weight (tie_word_embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)


LR = 1e-2
# Adam's eps bounds how far a rounding difference in a gradient element moves its update:
# d(step)/d(grad) peaks at lr / eps for a gradient near zero (the sum over two dp halves
# rounds differently from the whole micro-batch's). torch's default eps=1e-8 makes that
# 1e6, so a near-zero gradient of layer 0's k_proj at initialisation (attention almost
# uniform) moved a parameter by 2e-6; eps=1e-4 keeps it at 100 while every gradient above
# 1e-4 is still normalised by its own magnitude.
EPS = 1e-4


def _optimizer() -> functools.partial[torch.optim.Optimizer]:
    return functools.partial(torch.optim.Adam, lr=LR, eps=EPS)


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s token ids (B, L) and next-token targets (B, L)."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(3, V, (B, L), generator=gen), torch.randint(3, V, (B, L), generator=gen)


def reference(tied: bool = False) -> dict[str, Any]:
    """One process, the whole mini-batch, gradient accumulation over the M micro-batches
    (of `llama(tied)`)."""
    model = llama(tied)
    opt = _optimizer()(model.parameters())
    losses = []
    for step in range(STEPS):
        ids, target = batch(step)
        total = 0.0
        for j in range(M):
            loss = lm_loss(model(input_ids=ids.chunk(M)[j], use_cache=False), target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    ids, target = batch(0)
    with torch.no_grad():
        parts = zip(ids.chunk(M), target.chunk(M), strict=True)
        evaluated = sum(float(lm_loss(model(input_ids=x, use_cache=False), t)) for x, t in parts)
    names = {id(p): n for n, p in model.named_parameters()}
    adam = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return {
        "losses": losses,
        "state": model.state_dict(),
        "eval": evaluated / M,
        "adam": adam,
    }


def _adam_state(pm: Any) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's Adam state by parameter name, each moment gathered whole over dp (a
    collective over dp: both dp ranks of the stage walk the same names in the same order)."""
    out = {}
    for name, p in pm.module.named_parameters():
        state = pm.optimizer.state[p]
        out[name] = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()
        }
    return out


SCHEDULES = ("1f1b", "zb")


def _compile_llama(
    schedule: str = "1f1b", optimizer: Any = None, mesh: Any = None, **kwargs: Any
) -> Any:
    """The Llama over a 2 x 2 mesh (by default ("pp", "dp")), pinned to two stages."""
    ids, _ = batch(0)
    return gp_compile(
        llama(),
        {"input_ids": ids, "use_cache": False},
        loss_fn=lm_loss,
        optimizer=optimizer or _optimizer(),
        micro_batches=M,
        schedule=schedule,
        pins=PINS,
        mesh=mesh or init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")),
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120),
        **kwargs,
    )


def _bf16_llama() -> dict[str, Any]:
    """The exported Llama in bf16 on the mesh (1f1b): its losses and parameters."""
    pm = _compile_llama(precision="bf16", optimizer=_bf16_optimizer())
    losses = [pm.step(input_ids=batch(s)[0], target=batch(s)[1]) for s in range(STEPS)]
    dtypes = {p.dtype for p in pm.module.parameters()}  # the sharded master weights
    return {"losses": losses, "state": pm.state_dict(), "dtypes": dtypes}


def _train_worker() -> dict[str, dict[str, Any]]:
    return {schedule: _train(schedule) for schedule in SCHEDULES}


def _train(schedule: str) -> dict[str, Any]:
    pm = _compile_llama(schedule)
    losses = [pm.step(input_ids=batch(s)[0], target=batch(s)[1]) for s in range(STEPS)]
    evaluated = pm.eval_step(input_ids=batch(0)[0], target=batch(0)[1])
    return {
        "losses": losses,
        "eval": evaluated,
        "state": pm.state_dict(),
        "adam": _adam_state(pm),
        "stages": len(pm.plan.stages),
        "sharded": all(isinstance(p, DTensor) for p in pm.module.parameters()),
        "units": [n for n, m in pm.module.named_modules() if isinstance(m, FSDPModule)],
        "resharding": (schedule, pm.module.meta.get(RESHARDING, ())),
        "bf16": _bf16_llama() if schedule == "1f1b" else {},
    }


def _named(what: str) -> Any:
    return lambda message: f"{what}: {message}"


@pytest.fixture(scope="module")
def launched() -> list[dict[str, dict[str, Any]]]:
    return launch(_train_worker, 4, timeout=TIMEOUT)


@pytest.fixture(scope="module", params=SCHEDULES)
def runs(launched: list[dict[str, dict[str, Any]]], request: pytest.FixtureRequest) -> Any:
    """Each rank's results under one schedule."""
    return [by_schedule[request.param] for by_schedule in launched]


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return reference()


def test_llama_on_the_mesh_trains_as_one_process(
    runs: list[dict[str, Any]], expected: dict[str, Any]
) -> None:
    for rank, result in enumerate(runs):
        assert result["stages"] == 2 and result["sharded"], f"rank {rank}"
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), f"rank {rank}"
        assert list(result["state"]) == list(expected["state"]), f"rank {rank}"
        for key, value in expected["state"].items():
            torch.testing.assert_close(
                result["state"][key], value, rtol=1e-5, atol=1e-6, msg=_named(key)
            )
    start = llama().state_dict()
    assert not torch.equal(expected["state"]["lm_head.weight"], start["lm_head.weight"])


def test_llama_s_adam_state_on_the_mesh_equals_one_process_s(
    runs: list[dict[str, Any]], expected: dict[str, Any]
) -> None:
    seen: set[str] = set()
    for rank, result in enumerate(runs):
        for name, moments in result["adam"].items():
            assert sorted(moments) == sorted(expected["adam"][name]), f"rank {rank} {name}"
            for k, v in moments.items():
                want = expected["adam"][name][k]
                torch.testing.assert_close(v, want, rtol=1e-5, atol=1e-7, msg=_named(f"{name} {k}"))
            seen.add(name)
    assert seen == set(expected["adam"])  # every parameter's state, on some stage
    assert all(int(s["step"]) == STEPS for s in expected["adam"].values())


def test_llama_s_eval_step_on_the_mesh_equals_one_process_s(
    runs: list[dict[str, Any]], expected: dict[str, Any]
) -> None:
    for rank, result in enumerate(runs):
        assert result["eval"] == pytest.approx(expected["eval"], rel=1e-5), f"rank {rank}"


def _bf16_optimizer() -> functools.partial[torch.optim.Optimizer]:
    """SGD for the bf16 comparisons: Adam's update is near lr * sign(g) for a gradient
    element near its eps, so bf16's rounding of a near-zero element (a dp slice's bf16
    matmul rounds otherwise than the whole micro-batch's) can move a weight by lr either
    way; SGD's update is proportional to the gradient, so a rounding stays a rounding."""
    return functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)


def _sgd_run(bf16: bool) -> dict[str, Any]:
    """One process with `_bf16_optimizer`, in float32 or by the documented bf16 recipe for
    an exported model: the float32 model's forward and loss under
    `torch.autocast(bfloat16)`, the values crossing the pinned cut (layer 0's hidden states,
    the rotary embedding's cos and sin) and their gradients rounded to bf16 as the messages
    are, gradients accumulated in float32 on the float32 weights, which SGD steps."""
    model = llama()
    if bf16:
        model.model.layers[0].register_forward_hook(rounded_to(torch.bfloat16))
        model.model.rotary_emb.register_forward_hook(rounded_to(torch.bfloat16))
    return _accumulated(model, [batch(step) for step in range(STEPS)], bf16)


def _accumulated(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], bf16: bool = False
) -> dict[str, Any]:
    """One process stepping `_bf16_optimizer` once per batch, each batch's gradient
    accumulated over its M micro-batches (forward and loss under `torch.autocast(bfloat16)`
    with `bf16`, as the last stage computes its loss): the losses and the state after."""
    opt = _bf16_optimizer()(model.parameters())
    losses = []
    for ids, target in batches:
        total = 0.0
        for j in range(M):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the loss too,
                out = model(input_ids=ids.chunk(M)[j], use_cache=False)  # as the last stage's
                loss = lm_loss(out, target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return {"losses": losses, "state": model.state_dict()}


def llama_bf16_reference() -> dict[str, Any]:
    """The bf16 recipe's run, with the float32 run's losses under "fp32"."""
    return {**_sgd_run(bf16=True), "fp32": _sgd_run(bf16=False)["losses"]}


def test_bf16_on_the_mesh_runs_an_exported_graph_as_one_process_under_autocast(
    launched: list[dict[str, dict[str, Any]]],
) -> None:
    """torch.export fixed the model's own float32 casts in the Llama graph: the stages run
    it under autocast over FSDP2's float32 masters, and equal one process's autocast run
    within bf16's tolerance; the losses stay within 2% of float32's."""
    want = llama_bf16_reference()
    for rank, result in enumerate(r["1f1b"]["bf16"] for r in launched):
        assert result["dtypes"] == {torch.float32}, f"rank {rank}"  # the master weights
        assert result["losses"] == pytest.approx(want["losses"], rel=BF16_RTOL), f"rank {rank}"
        assert result["losses"] == pytest.approx(want["fp32"], rel=0.02), f"rank {rank}"
        assert result["losses"] != pytest.approx(want["fp32"], rel=1e-6)  # bf16 ran
        for key, value in want["state"].items():
            torch.testing.assert_close(
                result["state"][key], value, rtol=BF16_RTOL, atol=BF16_ATOL, msg=_named(key)
            )


def test_an_exported_stage_is_one_fsdp_unit_per_decoder_layer(
    runs: list[dict[str, Any]],
) -> None:
    """torch.export lifts Llama's parameters into get_attr reads of a flat aten graph: each
    decoder layer is outlined into a called block at its own path, one FSDP2 unit, beside
    the stage root; under zb too (its split backward reduces every unit). Under 1f1b
    (reshard_after_forward) a layer reshards after every backward, so a stage holds at
    most two layers gathered (benchmarks/fsdp_units.py measures it); under zb it stays
    gathered until the last weight half."""
    model = llama()
    gm = trace(model, {"input_ids": batch(0)[0], "use_cache": False})
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    assert stage_blocks(gm, model) == []  # before `shard_stage` outlines the layers
    for rank, result in enumerate(runs):
        layer = f"model.layers.{rank // 2}"
        assert result["units"] == ["", layer], f"rank {rank}"
        schedule, resharding = result["resharding"]  # after every backward, not only the last
        assert resharding == ((layer,) if schedule == "1f1b" else ()), f"rank {rank}"


# -- recompute ----------------------------------------------------------------------------------

RECOMPUTE_CASES = [("1f1b", True), ("gpipe", False)]  # (schedule, reshard_after_forward)


def _recompute_worker() -> dict[tuple[str, bool], Any]:
    out = {}
    for schedule, reshard in RECOMPUTE_CASES:
        model, inputs = chain()
        pm = gp_compile(
            model,
            inputs,
            loss_fn=dict_loss,
            optimizer=chain_optimizer(),
            micro_batches=M,
            schedule=schedule,
            pins=CHAIN_PINS["chain"],
            recompute=True,
            dp=2,
            reshard_after_forward=reshard,
            profile=ProfileConfig(mode="flops"),
            runtime=RuntimeConfig(timeout=60),
        )
        out[(schedule, reshard)] = {
            "recompute": [s.recompute for s in pm.plan.stages],
            "losses": [
                pm.step(*chain_batch("chain", s)[0], target=chain_batch("chain", s)[1])
                for s in range(CHAIN_STEPS)
            ],
            "state": pm.state_dict(),
        }
    return out


def test_recompute_on_the_mesh_trains_as_one_process() -> None:
    """Each stage's forward runs under torch.utils.checkpoint around its FSDP2 root, and
    its backward recomputes it (FSDP2 gathers the parameters again): equal to one process."""
    ref_losses, ref_params, _, _ = chain_reference("chain")
    runs = launch(_recompute_worker, 4, timeout=TIMEOUT)
    for case in RECOMPUTE_CASES:
        for rank, result in enumerate(runs):
            assert result[case]["recompute"] == [True, True], f"rank {rank} {case}"
            assert result[case]["losses"] == pytest.approx(ref_losses, rel=1e-5), f"{case}"
            for n, value in ref_params.items():
                torch.testing.assert_close(
                    result[case]["state"][n], value, rtol=1e-5, atol=1e-6, msg=_named(n)
                )


# -- bf16 ---------------------------------------------------------------------------------------

# bf16 has an 8-bit mantissa (relative rounding 2**-8 = 0.4%): the mesh computes each
# micro-batch's gradient in two dp halves (each rounded to bf16, summed in float32) where one
# process computes it whole, so the two agree to a few bf16 roundings, not to float32's.
BF16_RTOL = 1e-2
BF16_ATOL = 1e-3


def _bf16_worker() -> dict[bool, dict[str, Any]]:
    """bf16 sharded over dp and replicated (HSDP with one shard), keyed by dp_shard."""
    return {shard: _bf16_run(shard) for shard in (True, False)}


def _chain_on_the_mesh(precision: str, dp_shard: bool = True) -> Any:
    """test_mesh's chain under 1f1b on pp 2 x dp 2, in `precision`."""
    model, inputs = chain()
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=chain_optimizer(),
        micro_batches=M,
        schedule="1f1b",
        pins=CHAIN_PINS["chain"],
        precision=precision,
        dp=2,
        dp_shard=dp_shard,
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=60, quiet=True),
    )


def _bf16_run(shard: bool) -> dict[str, Any]:
    pm = _chain_on_the_mesh("bf16", dp_shard=shard)
    seen: set[torch.dtype] = set()  # a layer's parameters' dtype in its forward: FSDP2's cast
    for layer in pm.module.modules():
        if any(True for _ in layer.parameters(recurse=False)):
            layer.register_forward_pre_hook(
                lambda m, _: seen.update(p.dtype for p in m.parameters(recurse=False))
            )
    steps = range(CHAIN_STEPS)
    losses = [
        pm.step(*chain_batch("chain", s)[0], target=chain_batch("chain", s)[1]) for s in steps
    ]
    return {
        "losses": losses,
        "state": pm.state_dict(),
        "computed_in": seen,
        "dtypes": {p.dtype for p in pm.module.parameters()},  # the sharded master weights
        "momenta": {s["momentum_buffer"].dtype for s in pm.optimizer.state.values()},
    }


def bf16_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same recipe: each whole micro-batch through a bf16 copy of the
    float32 weights, its loss in float32, its gradients accumulated in float32 on the
    float32 weights, which the optimizer steps."""
    model, _ = chain()
    opt = chain_optimizer()(model.parameters())
    losses = []
    for step in range(CHAIN_STEPS):
        inputs, target = chain_batch("chain", step)
        total = 0.0
        for j in range(M):
            low = copy.deepcopy(model).to(torch.bfloat16)
            out = low(*[x.chunk(M)[j].to(torch.bfloat16) for x in inputs]).float()
            loss = dict_loss(out, target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
            for p, q in zip(model.parameters(), low.parameters(), strict=True):
                grad = q.grad.float()
                p.grad = grad if p.grad is None else p.grad + grad
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def test_bf16_on_the_mesh_is_fsdp2_mixed_precision_and_equals_one_process_s_recipe() -> None:
    ref_losses, ref_params = bf16_reference()
    fp32_losses = chain_reference("chain")[0]
    runs = launch(_bf16_worker, 4, timeout=TIMEOUT)
    for rank, shard in itertools.product(range(4), (True, False)):
        result, where = runs[rank][shard], f"rank {rank} dp_shard={shard}"
        assert result["computed_in"] == {torch.bfloat16}, where  # not autocast
        assert result["dtypes"] == {torch.float32}, where  # the master weights
        assert result["momenta"] == {torch.float32}, where  # gradients in float32
        assert result["losses"] == pytest.approx(ref_losses, rel=BF16_RTOL), where
        assert result["losses"] != pytest.approx(fp32_losses, rel=1e-5), where  # bf16 ran
        for n, value in ref_params.items():
            torch.testing.assert_close(
                result["state"][n], value, rtol=BF16_RTOL, atol=BF16_ATOL, msg=_named(n)
            )


def _bf16_without_a_mesh() -> list[float]:
    ids, _ = batch(0)
    pm = gp_compile(
        llama(),
        {"input_ids": ids, "use_cache": False},
        loss_fn=lm_loss,
        optimizer=_bf16_optimizer(),
        micro_batches=M,
        pins=PINS,
        precision="bf16",
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120, quiet=True),
    )
    return [pm.step(input_ids=batch(s)[0], target=batch(s)[1]) for s in range(STEPS)]


def test_bf16_runs_an_exported_graph_across_two_ranks_without_a_mesh() -> None:
    """The bf16 message from stage 0 arrives at stage 1's exported graph, which asserts
    float32 there: it is cast back as it arrives, and the run is the autocast recipe's."""
    want = llama_bf16_reference()
    for rank, losses in enumerate(launch(_bf16_without_a_mesh, 2, timeout=TIMEOUT)):
        assert losses == pytest.approx(want["losses"], rel=BF16_RTOL), f"rank {rank}"
        assert losses != pytest.approx(want["fp32"], rel=1e-6), f"rank {rank}"


def _bf16_on_tp() -> list[float]:
    """The exported Llama in bf16 on pp 2 x tp 2 (its own tp plan): no FSDP2 to cast its
    parameters, so autocast over the DTensors."""
    pm = _compile_llama(
        precision="bf16",
        optimizer=_bf16_optimizer(),
        mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")),
    )
    return [pm.step(input_ids=batch(s)[0], target=batch(s)[1]) for s in range(STEPS)]


def test_bf16_with_tensor_parallel_stages_is_the_autocast_recipe() -> None:
    want = llama_bf16_reference()
    for rank, losses in enumerate(launch(_bf16_on_tp, 4, timeout=TIMEOUT)):
        assert losses == pytest.approx(want["losses"], rel=BF16_RTOL), f"rank {rank}"
        assert losses != pytest.approx(want["fp32"], rel=1e-6), f"rank {rank}"


PINS_FOLDED = {"model.embed_tokens": 0, "model.layers.0": 1, "model.layers.1": 2, "lm_head": 3}


def _full_recipe() -> dict[str, Any]:
    """torchtitan's recipe on the exported Llama: pp 2 x dp 2 x tp 2 (its own tp plan), four
    stages folded two per pp rank under the interleaved schedule, bf16, every stage
    recomputed."""
    ids, _ = batch(0)
    pm = gp_compile(
        llama(),
        {"input_ids": ids, "use_cache": False},
        loss_fn=lm_loss,
        optimizer=_bf16_optimizer(),
        micro_batches=M,
        schedule="interleaved",
        pins=PINS_FOLDED,
        precision="bf16",
        recompute=True,
        mesh=init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp")),
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120, quiet=True),
    )
    losses = [pm.step(input_ids=batch(s)[0], target=batch(s)[1]) for s in range(STEPS)]
    return {"losses": losses, "state": pm.state_dict()}


def test_the_full_recipe_on_eight_ranks_is_the_autocast_recipe_of_one_process() -> None:
    want = llama_bf16_reference()
    for rank, result in enumerate(launch(_full_recipe, 8, timeout=TIMEOUT)):
        assert result["losses"] == pytest.approx(want["losses"], rel=BF16_RTOL), f"rank {rank}"
        for key, value in want["state"].items():
            torch.testing.assert_close(
                result["state"][key], value, rtol=BF16_RTOL, atol=BF16_ATOL, msg=_named(key)
            )


def _fp16_on_the_mesh() -> dict[str, Any]:
    """The chain in fp16 on pp 2 x dp 2 (FSDP2 gathers fp16 parameters, reduces in float32).
    At step 1 one rank's gradient shard alone holds an inf (planted after FSDP2's
    reduce-scatter, as the scaler is about to unscale it): every rank must skip that step."""
    pm = _chain_on_the_mesh("fp16")
    scaler = pm._update.scaler
    unscale = scaler.unscale

    def planted(params: list[torch.Tensor], device: torch.device) -> bool:
        held = [p for p in params if p.grad is not None]
        held[0].grad.to_local().view(-1)[0] = float("inf")  # this dp rank's shard only
        return unscale(params, device)

    out: dict[str, Any] = {"losses": [], "scales": [], "skipped": [], "changed": []}
    for step in range(CHAIN_STEPS):
        before = {n: p.to_local().detach().clone() for n, p in pm.module.named_parameters()}
        scaler.unscale = planted if step == 1 and dist.get_rank() == 1 else unscale
        out["losses"].append(
            pm.step(*chain_batch("chain", step)[0], target=chain_batch("chain", step)[1])
        )
        after = dict(pm.module.named_parameters())
        out["changed"].append(
            any(not torch.equal(after[n].to_local(), v) for n, v in before.items())
        )
        out["scales"].append(pm.loss_scale)
        out["skipped"].append(pm.skipped_steps)
    return out


def test_fp16_on_the_mesh_agrees_on_one_loss_scale_over_every_dp_rank() -> None:
    fp32_losses = chain_reference("chain")[0]
    for rank, r in enumerate(launch(_fp16_on_the_mesh, 4, timeout=TIMEOUT)):
        assert r["changed"] == [True, False, True], f"rank {rank}"  # step 1 skipped everywhere
        assert r["skipped"] == [0, 1, 1], f"rank {rank}"
        assert r["scales"] == [2.0**16, 2.0**15, 2.0**15], f"rank {rank}"
        assert r["losses"][0] == pytest.approx(fp32_losses[0], rel=BF16_RTOL), f"rank {rank}"


def _shaped_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The compiled shape, two shorter sequences, then the compiled shape again (fewer rows
    would leave one row per dp slice here, a size torch.export traces to another graph)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(B, L), (B, L - 2), (B, L - 1), (B, L)]
    return [
        (torch.randint(3, V, s, generator=gen), torch.randint(3, V, s, generator=gen))
        for s in shapes
    ]


def _shapes_reference() -> dict[str, Any]:
    return _accumulated(llama(), _shaped_batches())


def _shapes_worker() -> dict[str, Any]:
    """The exported Llama stepping at other shapes on pp 2 x dp 2 and on pp 2 x tp 2."""
    out = {}
    for dims in ("dp", "tp"):
        pm = _compile_llama(
            optimizer=_bf16_optimizer(),
            mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", dims)),
        )
        losses = [pm.step(input_ids=ids, target=t) for ids, t in _shaped_batches()]
        out[dims] = {"losses": losses, "state": pm.state_dict()}
    return out


def test_an_exported_graph_steps_at_other_shapes_on_a_mesh_as_one_process() -> None:
    """A new shape's stage graph runs through the live stage module, so FSDP2 gathers its
    shards and tp makes its outputs whole around it as around the compiled graph."""
    want = _shapes_reference()
    for rank, result in enumerate(launch(_shapes_worker, 4, timeout=TIMEOUT)):
        for dims, got in result.items():
            where = f"rank {rank} {dims}"
            assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), where
            for key, value in want["state"].items():
                torch.testing.assert_close(
                    got["state"][key], value, rtol=1e-5, atol=ATOL_SHAPES, msg=_named(key)
                )


ATOL_SHAPES = 2e-6  # tp's all-reduces sum in another order than one process
