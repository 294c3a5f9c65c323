"""Clipping and checkpoints of pipelines over a ("pp", "dp") mesh (FSDP2 per stage).

Four gloo processes on a (2, 2) mesh, as in tests/test_mesh.py, whose models, pins and
batches these tests reuse. Every run must equal one process training on the whole
mini-batch with gradient accumulation over the same M micro-batches.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from test_mesh import (
    MODELS,
    PINS,
    STEPS,
    TIMEOUT,
    M,
    _full_parameters,
    _mesh,
    _optimizer,
    accumulate,
    batch,
)
from torch.distributed.device_mesh import init_device_mesh
from zoo import dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch

MAX_NORM = 0.01  # below every step's gradient norm: clipping is active each step


def _compile(name: str, **kwargs: Any) -> Any:
    """`name` over the 2 x 2 mesh, pinned to two stages, 1F1B."""
    model, inputs = MODELS[name]()
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=_optimizer(),
        micro_batches=M,
        schedule="1f1b",
        pins=PINS[name],
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=60),
        mesh=_mesh(),
        **kwargs,
    )


# -- clipping -----------------------------------------------------------------------------------


CLIP_CASES = [  # (model, dp_shard, norm_type)
    ("chain", True, 2.0),
    ("two_branch", True, 2.0),
    ("chain", False, 2.0),  # replicated over dp: whole gradients, a DTensor all the same
    ("chain", True, math.inf),  # the largest |g|: MAX over dp, then over pp
]


def clipped_reference(
    name: str, norm_type: float
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, gradient accumulation over M micro-batches, then torch's
    clip_grad_norm_: the losses, the norms before clipping, and the parameters after."""
    model, _ = MODELS[name]()
    opt = _optimizer()(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(accumulate(model, name, step))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach() for k, v in model.named_parameters()}


def _clip_worker() -> dict[tuple[str, bool, float], Any]:
    out = {}
    for name, shard, norm_type in CLIP_CASES:
        pm = _compile(name, max_grad_norm=MAX_NORM, grad_norm_type=norm_type, dp_shard=shard)
        losses, norms = [], []
        for s in range(STEPS):
            inputs, target = batch(name, s)
            losses.append(pm.step(*inputs, target=target))
            norms.append(pm.last_grad_norm)
        run = {"losses": losses, "norms": norms, "params": _full_parameters(pm)}
        out[name, shard, norm_type] = run
    return out


@pytest.fixture(scope="module")
def clipped() -> list[dict[tuple[str, bool, float], Any]]:
    return launch(_clip_worker, 4, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "case", CLIP_CASES, ids=[f"{n}-{'shard' if s else 'replicate'}-p{p}" for n, s, p in CLIP_CASES]
)
def test_clipping_under_a_mesh_equals_torch_s_on_one_process(
    clipped: list[dict[tuple[str, bool, float], Any]], case: tuple[str, bool, float]
) -> None:
    name, _, norm_type = case
    ref_losses, ref_norms, ref_params = clipped_reference(name, norm_type)
    assert min(ref_norms) > 2 * MAX_NORM  # every step is clipped
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(clipped):
        run = result[case]
        assert run["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        # the norm over every stage's shards, the same on all four ranks
        assert run["norms"] == pytest.approx(ref_norms, rel=1e-5), f"rank {rank}"
        merged.update(run["params"])
    assert sorted(merged) == sorted(ref_params)
    for n, value in ref_params.items():
        torch.testing.assert_close(merged[n], value, rtol=1e-5, atol=1e-6, msg=n)


# -- checkpoints --------------------------------------------------------------------------------

SAVED_AT = 1  # steps before the save; the rest of STEPS run after it
PINS4 = {"blocks.0": 0, "blocks.1": 1, "blocks.2": 2, "blocks.3": 3, "head": 3}
LAYOUTS = {  # (pp, dp) -> compile's mesh arguments and pins for the chain
    (2, 2): ({"mesh_shape": (2, 2)}, PINS["chain"]),
    (4, 1): ({}, PINS4),
    (1, 4): ({"mesh_shape": (1, 4)}, dict.fromkeys(PINS4, 0)),
}


def _adam() -> Any:
    return functools.partial(torch.optim.Adam, lr=0.01)


def _chain_under(layout: tuple[int, int]) -> Any:
    """The chain with Adam (sharded state under a mesh) under `layout`, 1F1B."""
    mesh_args, pins = LAYOUTS[layout]
    shape = mesh_args.get("mesh_shape")
    model, inputs = MODELS["chain"]()
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=_adam(),
        micro_batches=M,
        schedule="1f1b",
        pins=pins,
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=60),
        mesh=None if shape is None else init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp")),
    )


def _steps(pm: Any, first: int, last: int) -> list[float]:
    return [pm.step(*batch("chain", s)[0], target=batch("chain", s)[1]) for s in range(first, last)]


def _resume_worker(path: str) -> dict[Any, Any]:
    """The pp2 x dp2 run saved after SAVED_AT steps and run on; then loaded under each
    layout and run on: the losses after the save and the whole parameters at the end.
    "back": the pp4 x dp1 load saved again at once, without a mesh, and loaded by pp2 x dp2."""
    pm = _chain_under((2, 2))
    _steps(pm, 0, SAVED_AT)
    pm.save(path)
    out: dict[Any, Any] = {"through": _steps(pm, SAVED_AT, STEPS), "meta": None}
    out["through_state"] = pm.state_dict()
    for layout in LAYOUTS:
        resumed = _chain_under(layout)
        meta = resumed.load(path)
        out["meta"] = (meta["mesh"], meta["step"], resumed.steps_done)
        if layout == (4, 1):
            resumed.save(path + "-plain")
        out[layout] = (_steps(resumed, SAVED_AT, STEPS), resumed.state_dict())
    back = _chain_under((2, 2))
    out["plain_mesh"] = back.load(path + "-plain")["mesh"]
    out["back"] = (_steps(back, SAVED_AT, STEPS), back.state_dict())
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    path = str(tmp_path_factory.mktemp("mesh") / "ckpt")
    return launch(_resume_worker, 4, args=(path,), timeout=TIMEOUT)


def test_a_mesh_checkpoint_records_its_mesh_and_step(resumed: list[dict[Any, Any]]) -> None:
    for result in resumed:
        assert result["meta"] == ([2, 2], SAVED_AT, SAVED_AT)
        assert result["plain_mesh"] is None


@pytest.mark.parametrize(
    "layout", [*LAYOUTS, "back"], ids=[*(f"pp{p}xdp{d}" for p, d in LAYOUTS), "pp4-to-pp2xdp2"]
)
def test_a_pp2_dp2_checkpoint_resumes_the_uninterrupted_run(
    resumed: list[dict[Any, Any]], layout: tuple[int, int] | str
) -> None:
    # the same layout resumes to the last bit; another one sums in another order
    exact = layout == (2, 2)
    rtol, atol = (0.0, 0.0) if exact else (1e-5, 1e-6)
    through = resumed[0]["through"]
    assert len(through) == STEPS - SAVED_AT
    for rank, result in enumerate(resumed):
        losses, state = result[layout]
        assert losses == (through if exact else pytest.approx(through, rel=rtol)), f"rank {rank}"
        for n, value in result["through_state"].items():
            msg = f"rank {rank} {n}"
            torch.testing.assert_close(state[n], value, rtol=rtol, atol=atol, msg=msg)
