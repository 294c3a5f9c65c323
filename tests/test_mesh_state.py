"""Clipping and checkpoints of pipelines over a ("pp", "dp") mesh (FSDP2 per stage).

Four gloo processes on a (2, 2) mesh, as in tests/test_mesh.py, whose models, pins and
batches these tests reuse. Every run must equal one process training on the whole
mini-batch with gradient accumulation over the same M micro-batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_mesh import MODELS, PINS, STEPS, TIMEOUT, M, _full_parameters, _mesh, _optimizer, batch
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
        profile_config=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=60),
        mesh=_mesh(),
        **kwargs,
    )


# -- clipping -----------------------------------------------------------------------------------


def clipped_reference(name: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, gradient accumulation over M micro-batches, then torch's
    clip_grad_norm_: the losses, the norms before clipping, and the parameters after."""
    model, _ = MODELS[name]()
    opt = _optimizer()(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        inputs, target = batch(name, step)
        total = 0.0
        for j in range(M):
            loss = dict_loss(model(*[x.chunk(M)[j] for x in inputs]), target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return losses, norms, {k: v.detach() for k, v in model.named_parameters()}


def _clip_worker(names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        pm = _compile(name, max_grad_norm=MAX_NORM)
        losses, norms = [], []
        for s in range(STEPS):
            inputs, target = batch(name, s)
            losses.append(pm.step(*inputs, target=target))
            norms.append(pm.last_grad_norm)
        out[name] = {"losses": losses, "norms": norms, "params": _full_parameters(pm)}
    return out


@pytest.fixture(scope="module")
def clipped() -> list[dict[str, Any]]:
    return launch(_clip_worker, 4, args=(list(MODELS),), timeout=TIMEOUT)


@pytest.mark.parametrize("name", list(MODELS))
def test_clipping_under_a_mesh_equals_torch_s_on_one_process(
    clipped: list[dict[str, Any]], name: str
) -> None:
    ref_losses, ref_norms, ref_params = clipped_reference(name)
    assert min(ref_norms) > 10 * MAX_NORM  # every step is clipped
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(clipped):
        run = result[name]
        assert run["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        # the norm over every stage's shards, the same on all four ranks
        assert run["norms"] == pytest.approx(ref_norms, rel=1e-5), f"rank {rank}"
        merged.update(run["params"])
    assert sorted(merged) == sorted(ref_params)
    for n, value in ref_params.items():
        torch.testing.assert_close(merged[n], value, rtol=1e-5, atol=1e-6, msg=n)
