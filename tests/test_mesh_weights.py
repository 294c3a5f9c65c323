"""Versioned weight policies over a ("pp", "dp") mesh: PipeDream-2BW's own setting.

Four gloo processes, pp 2 x dp 2 (`dp=2`): each stage on two data-parallel ranks that keep
it whole (a version aliases whole weight tensors: no FSDP2) and run half of every
micro-batch, their gradients of one weight version averaged over the two at that version's
update (`graphpipe.runtime.groups.sum_groups`). The run must follow the policy's recurrence
on the whole micro-batches, written as a plain loop in one process by tests/test_weights.py
(the mean of the halves' gradients of their mean losses is the whole micro-batch's): losses
and parameters after 4 step() calls of 4 micro-batches (16 stash updates, 4 2bw updates).
A checkpoint of such a run resumes it exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_weights import (
    CALLS,
    OPTIMIZERS,
    PINS,
    M,
    _plan,
    mini_batches,
    stash_reference,
    twobw_reference,
    zoo_model,
)
from torch.distributed.tensor import DTensor
from zoo import dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.ir.cost import weight_copies
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.generators import warmups

NAME = "skip_across/2"  # two stages, a skip from the first into the second
CASES = [("stash", "sgd"), ("2bw", "adam")]  # (policy, optimizer)


def _compile(policy: str, optimizer: str) -> Any:
    model, _ = zoo_model(NAME)
    return gp_compile(
        model,
        mini_batches(NAME)[0][0],
        loss_fn=dict_loss,
        optimizer=OPTIMIZERS[optimizer],
        weights=policy,
        micro_batches=M,
        pins=PINS[NAME],
        profile=ProfileConfig(mode="flops"),
        dp=2,
        runtime=RuntimeConfig(timeout=60, quiet=True),
    )


def _resumed(policy: str, optimizer: str, path: str) -> list[dict[str, torch.Tensor]]:
    """Two calls, a checkpoint, two more; and a fresh pipeline resumed from it, two calls."""
    mbs = mini_batches(NAME)
    first = _compile(policy, optimizer)
    for x, y in mbs[:2]:
        first.step(*x, target=y)
    first.save(path)
    for x, y in mbs[2:4]:
        first.step(*x, target=y)
    second = _compile(policy, optimizer)
    second.load(path)
    for x, y in mbs[2:4]:
        second.step(*x, target=y)
    return [first.state_dict(), second.state_dict()]


def _worker(cases: list[tuple[str, str]], where: str) -> list[dict[str, Any]]:
    results = []
    for policy, optimizer in cases:
        pm = _compile(policy, optimizer)
        losses = [pm.step(*x, target=y) for x, y in mini_batches(NAME)]
        stage = pm.plan.stage_on(pm.rank)
        assert pm.module is not None and stage is not None  # every pp rank holds a stage
        params = list(pm.module.parameters())
        results.append(
            {
                "state": pm.state_dict(),  # drains the pipeline: every update applied
                "losses": losses,
                "versions": pm.versions(),
                "stage": stage.index,
                "warmups": warmups(pm.plan),
                "whole": not any(isinstance(p, DTensor) for p in params),
                "resumed": _resumed(policy, optimizer, str(Path(where) / policy)),
            }
        )
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    where = str(tmp_path_factory.mktemp("mesh_weights"))
    return launch(_worker, 4, args=(CASES, where), timeout=300)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_a_versioned_policy_over_dp_follows_its_recurrence_on_whole_micro_batches(
    runs: list[list[dict[str, Any]]], case: int
) -> None:
    policy, optimizer = CASES[case]
    ref_losses: list[float] = []
    reference = stash_reference if policy == "stash" else twobw_reference
    expected = reference(NAME, optimizer, ref_losses)
    per_call = [sum(ref_losses[c * M : (c + 1) * M]) / M for c in range(CALLS)]
    initial = dict(zoo_model(NAME)[0].named_parameters())
    assert any(not torch.equal(expected[k], initial[k]) for k in expected)  # it trains
    for rank, result in enumerate(r[case] for r in runs):
        assert result["whole"], f"rank {rank}: a versioned stage is kept whole over dp"
        assert result["warmups"] == warmups(_plan(NAME))  # the reference's schedule
        assert result["losses"] == pytest.approx(per_call, rel=1e-5), f"rank {rank}"
        assert list(result["state"]) == list(expected), f"rank {rank}"
        for key, value in expected.items():
            torch.testing.assert_close(
                result["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}"
            )


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_each_dp_rank_uses_the_versions_of_its_pipeline_and_no_more_copies(
    runs: list[list[dict[str, Any]]], case: int
) -> None:
    policy, _ = CASES[case]
    for result in (r[case] for r in runs):
        v, w = result["versions"], result["warmups"][result["stage"]]
        assert v["backward"] == v["forward"]
        if policy == "stash":
            assert v["forward"] == {j: max(0, j - w) for j in range(CALLS * M)}
        else:
            assert v["forward"] == {j: max(0, j // M - 1) for j in range(CALLS * M)}
        assert v["peak_copies"] == weight_copies(policy, w), v


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_a_checkpoint_of_a_versioned_policy_over_dp_resumes_exactly(
    runs: list[list[dict[str, Any]]], case: int
) -> None:
    for rank, result in enumerate(r[case] for r in runs):
        uninterrupted, resumed = result["resumed"]
        assert list(resumed) == list(uninterrupted)
        for key, value in uninterrupted.items():
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=f"{rank} {key}")
