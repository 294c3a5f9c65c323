"""The composition matrix: every pair of values of (schedule family, mesh dims, precision,
tracing path) meets in at least one tiny case trained against one process.

The factors:
- schedule family: 1f1b (one stage per pp rank), zb (zero bubble, its backward split),
  interleaved (four stages folded loop-wise on pp 2), zbv (four stages folded as a V);
- mesh dims: ("pp", "dp"), ("pp", "tp"), ("pp", "dp", "tp");
- precision: fp32, bf16;
- tracing path: fx (test_mesh's chain of Linear + Tanh blocks with a tp plan of its own),
  export (the tiny Hugging Face Llama of test_mesh_models, with its own tp plan).

`CASES` is a covering array of 12 rows (the 4 x 3 family-mesh pairs, each once, the other
two factors spread over them); `test_the_cases_cover_every_pair` checks that it still does.
Four rows are trained by another test already (`ELSEWHERE`, checked to exist) and run here
no second time.
fp32 runs equal one process at rtol 1e-5. bf16 runs equal one process running the documented
bf16 recipe (`torch.autocast(bfloat16)` over the float32 weights, gradients accumulated in
float32 on them; for the exported Llama the values crossing its cut rounded to bf16 as the
messages are) at rtol 1e-2 / atol 1e-3, losses and parameters, and their losses are within
2% of one process's float32 ones and not equal to them. FSDP2's bf16 policy (the fx chain
on a dp mesh) computes with bf16 copies of the weights: the same products and roundings as
autocast's. Two fp16 rows (`FP16`: on ("pp", "tp") and ("pp", "dp", "tp"); ("pp", "dp") is
tests/test_mesh_models.py's) equal the same recipe in float16 with torch's GradScaler, whose
defaults graphpipe's loss scale keeps, at the same tolerances. Three steps each; the 4-rank
rows in one launch, the 8-rank rows in another.
"""

from __future__ import annotations

import importlib
import itertools
from typing import Any

import pytest
import torch
from real_models import rounded_to
from test_mesh import Chain
from test_mesh import _optimizer as chain_optimizer
from test_mesh_models import BF16_ATOL, BF16_RTOL, PINS_FOLDED, V, lm_loss
from test_mesh_models import PINS as LLAMA_PINS
from test_mesh_models import llama as build_llama
from torch.distributed.device_mesh import init_device_mesh
from zoo import dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch

FAMILIES = ("1f1b", "zb", "interleaved", "zbv")
MESHES = ("dp", "tp", "dp_tp")
PRECISIONS = ("fp32", "bf16")
TRACING = ("fx", "export")
CASES = [  # (family, mesh, precision, tracing)
    ("1f1b", "dp", "fp32", "fx"),
    ("1f1b", "tp", "bf16", "export"),
    ("1f1b", "dp_tp", "bf16", "fx"),
    ("zb", "dp", "bf16", "export"),
    ("zb", "tp", "fp32", "fx"),
    ("zb", "dp_tp", "fp32", "export"),
    ("interleaved", "dp", "bf16", "fx"),
    ("interleaved", "tp", "fp32", "export"),
    ("interleaved", "dp_tp", "bf16", "export"),
    ("zbv", "dp", "fp32", "export"),
    ("zbv", "tp", "bf16", "fx"),
    ("zbv", "dp_tp", "fp32", "fx"),
]
# rows another test already trains against one process, with the same model, mesh,
# schedule and precision (and more): they are not run twice
ELSEWHERE = {
    ("1f1b", "dp", "fp32", "fx"): (
        "test_mesh",
        "test_a_mesh_step_equals_one_process_on_the_whole_mini_batch",
    ),
    ("1f1b", "tp", "bf16", "export"): (
        "test_mesh_models",
        "test_bf16_with_tensor_parallel_stages_is_the_autocast_recipe",
    ),
    ("zb", "tp", "fp32", "fx"): (  # with clipping and recompute too
        "test_tp",
        "test_an_fx_traced_chain_with_its_own_tp_plan_and_clipping_trains_as_one_process",
    ),
    ("interleaved", "dp_tp", "bf16", "export"): (  # with recompute too
        "test_mesh_models",
        "test_the_full_recipe_on_eight_ranks_is_the_autocast_recipe_of_one_process",
    ),
}
# fp16 (its loss scale agreed over every rank) on the meshes tests/test_mesh_models.py's
# fp16 test, on ("pp", "dp"), does not cover: outside the covering array
FP16 = [("zb", "tp", "fp16", "export"), ("1f1b", "dp_tp", "fp16", "fx")]
RUN = [case for case in CASES if case not in ELSEWHERE] + FP16
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = {"dp": ((2, 2), ("pp", "dp")), "tp": ((2, 2), ("pp", "tp")),
          "dp_tp": ((2, 2, 2), ("pp", "dp", "tp"))}  # fmt: skip
M, STEPS, B, L, TIMEOUT = 2, 3, 8, 6, 400
CHAIN_TP = {"blocks.0.0": "colwise", "blocks.1.0": "rowwise", "blocks.2.0": "colwise",
            "blocks.3.0": "rowwise"}  # fmt: skip
CHAIN_PINS = {
    2: {"blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1, "head": 1},
    4: {"blocks.0": 0, "blocks.1": 1, "blocks.2": 2, "blocks.3": 3, "head": 3},
}


def test_the_rows_run_elsewhere_are_tests_there() -> None:
    for module, name in ELSEWHERE.values():
        assert callable(getattr(importlib.import_module(module), name, None)), (module, name)


def test_the_cases_cover_every_pair() -> None:
    factors = (FAMILIES, MESHES, PRECISIONS, TRACING)
    for (i, a), (j, b) in itertools.combinations(enumerate(factors), 2):
        met = {(case[i], case[j]) for case in CASES}
        assert met == set(itertools.product(a, b)), (i, j, set(itertools.product(a, b)) - met)


def _chain() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Chain()


def _data(tracing: str, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    if tracing == "fx":
        return {"x": torch.randn(B, 16, generator=gen)}, torch.randn(B, 4, generator=gen)
    ids, target = (torch.randint(3, V, (B, L), generator=gen) for _ in range(2))
    return {"input_ids": ids}, target


def _setup(tracing: str) -> tuple[torch.nn.Module, Any, Any, dict[str, Any]]:
    """The model, its loss, its optimizer and compile's example keywords."""
    if tracing == "fx":
        return _chain(), dict_loss, chain_optimizer(), {}
    return build_llama(), lm_loss, chain_optimizer(), {"use_cache": False}


def _run(case: tuple[str, str, str, str]) -> dict[str, Any]:
    family, mesh, precision, tracing = case
    model, loss, optimizer, constants = _setup(tracing)
    folded = family in ("interleaved", "zbv")
    if tracing == "fx":
        pins: dict[str, int] = CHAIN_PINS[4 if folded else 2]
    else:
        pins = PINS_FOLDED if folded else LLAMA_PINS
    shape, names = SHAPES[mesh]
    inputs, _ = _data(tracing, 0)
    pm = gp_compile(
        model,
        {**inputs, **constants} if tracing == "export" else (inputs["x"],),
        loss_fn=loss,
        optimizer=optimizer,
        micro_batches=M,
        schedule=family,
        pins=pins,
        mesh=init_device_mesh("cpu", shape, mesh_dim_names=names),
        tp_plan=CHAIN_TP if tracing == "fx" and "tp" in mesh else None,
        precision=None if precision == "fp32" else precision,
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120, quiet=True),
    )
    losses = []
    for step in range(STEPS):
        inputs, target = _data(tracing, step)
        if tracing == "fx":
            losses.append(pm.step(inputs["x"], target=target))
        else:
            losses.append(pm.step(**inputs, target=target))
    return {"losses": losses, "state": pm.state_dict(), "stages": len(pm.plan.stages)}


def _worker(cases: list[tuple[str, str, str, str]]) -> dict[tuple[str, str, str, str], Any]:
    return {case: _run(case) for case in cases}


def _reference(tracing: str, precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, gradient accumulation over the same M micro-batches: in float32, or by
    the half-precision recipe (module docstring) with `precision` "bf16" or "fp16" (fp16's
    loss scaled by torch's GradScaler, whose defaults graphpipe's LossScaler keeps)."""
    model, loss_fn, optimizer, constants = _setup(tracing)
    half = HALF.get(precision)
    if half is not None and tracing == "export":  # the cut: layer 0's output, the rotary's
        model.model.layers[0].register_forward_hook(rounded_to(half))
        model.model.rotary_emb.register_forward_hook(rounded_to(half))
    opt = optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    losses = []
    for step in range(STEPS):
        inputs, target = _data(tracing, step)
        total = 0.0
        for j in range(M):
            part = {k: v.chunk(M)[j] for k, v in inputs.items()}
            with torch.autocast("cpu", dtype=half or torch.float32, enabled=half is not None):
                if tracing == "export":  # its loss under autocast too, as the last stage's
                    loss = loss_fn(model(**part, **constants), target.chunk(M)[j])
                else:  # FSDP2's half-precision chain: its output read as float32
                    loss = loss_fn(model(part["x"]).float(), target.chunk(M)[j])
            scaler.scale(loss / M).backward()
            total += loss.item()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(total / M)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str, str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for world, meshes in ((4, ("dp", "tp")), (8, ("dp_tp",))):
        cases = [case for case in RUN if case[1] in meshes]
        for rank, by_case in enumerate(launch(_worker, world, args=(cases,), timeout=TIMEOUT)):
            for case, result in by_case.items():
                out.setdefault(case, []).append(result)
                assert len(out[case]) == rank + 1
    return out


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], tuple[list[float], dict[str, torch.Tensor]]]:
    """(tracing, precision) -> one process's losses and state."""
    return {key: _reference(*key) for key in itertools.product(TRACING, (*PRECISIONS, "fp16"))}


@pytest.mark.parametrize("case", RUN, ids=["-".join(c) for c in RUN])
def test_each_composition_trains_as_one_process(
    runs: dict[tuple[str, str, str, str], list[dict[str, Any]]],
    references: dict[tuple[str, str], tuple[list[float], dict[str, torch.Tensor]]],
    case: tuple[str, str, str, str],
) -> None:
    family, _, precision, tracing = case
    ref_losses, ref_state = references[tracing, precision]
    rtol, atol = (1e-5, 2e-6) if precision == "fp32" else (BF16_RTOL, BF16_ATOL)
    fp32_losses = references[tracing, "fp32"][0]
    for rank, result in enumerate(runs[case]):
        where = f"rank {rank}"
        assert result["stages"] == (4 if family in ("interleaved", "zbv") else 2), where
        assert result["losses"] == pytest.approx(ref_losses, rel=rtol), where
        if precision != "fp32":
            assert result["losses"] == pytest.approx(fp32_losses, rel=0.02), where
            assert result["losses"] != pytest.approx(fp32_losses, rel=1e-6), where  # it ran
        for key, value in ref_state.items():
            torch.testing.assert_close(
                result["state"][key], value, rtol=rtol, atol=atol, msg=f"{where} {key}"
            )
