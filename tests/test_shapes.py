"""Batches whose shapes change train exactly as one process does (issue 27).

GPT-2 and Llama (tiny, Hugging Face, traced by torch.export) are compiled at sequence length
32 and stepped at lengths 16, 24, 32 and 20; an Inception-style CNN with BatchNorm (traced by
torch.fx) at images of 8 and 6 pixels; GPT-2 and the CNN with a last batch of 10 rows in
M = 4 micro-batches (3, 3, 2, 2 rows, as torch.tensor_split cuts them). Under 1f1b, zb and
interleaved at 2 ranks (and 1f1b at 3), the losses and every parameter equal single-process
gradient accumulation over the same micro-batches, each micro-batch's loss weighted by its
share of the rows. The plan is never remade: the stage cut stays as compiled. A shape seen
before reuses its stages; a model whose shapes depend on values is refused at compile,
naming the op; a batch beyond the compiled example is refused before any communication.

Each world size is one launch running every case, to pay the process start-up once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from real_models import CASES, V, optimizer

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.runtime.launch import launch

M = 4
LENGTHS = (16, 24, 32, 20)  # the compiled example is the largest, 32
SIZES = (8, 6, 6, 8)  # image sides; the example is 8
TIMEOUT = 240

Batches = list[tuple[dict[str, torch.Tensor], torch.Tensor]]


def _lm_batches(rows: tuple[int, ...], lengths: tuple[int, ...]) -> Batches:
    """One (inputs, target) per step: rows[i] sequences of lengths[i] tokens."""
    out = []
    for step, (b, n) in enumerate(zip(rows, lengths, strict=True)):
        gen = torch.Generator().manual_seed(200 + step)
        ids = torch.randint(3, V, (b, n), generator=gen)
        out.append(({"input_ids": ids}, torch.randint(3, V, (b, n), generator=gen)))
    return out


def _image_batches(rows: tuple[int, ...], sides: tuple[int, ...]) -> Batches:
    out = []
    for step, (b, side) in enumerate(zip(rows, sides, strict=True)):
        gen = torch.Generator().manual_seed(300 + step)
        image = torch.randn(b, 3, side, side, generator=gen)
        out.append(({"image": image}, torch.randint(0, 5, (b,), generator=gen)))
    return out


# name -> (model case, the batches of its steps; the first is the compiled example)
RUNS: dict[str, tuple[str, Callable[[], Batches]]] = {
    "gpt2": ("gpt2", lambda: _lm_batches((8,) * 5, (32, *LENGTHS))),
    "llama": ("llama", lambda: _lm_batches((8,) * 5, (32, *LENGTHS))),
    "cnn": ("inception", lambda: _image_batches((8,) * 5, (8, *SIZES))),
    "gpt2_odd": ("gpt2", lambda: _lm_batches((12, 10, 12, 10), (16, 16, 12, 16))),
    "cnn_odd": ("inception", lambda: _image_batches((12, 10, 6, 10), (8, 8, 6, 6))),
}


def _pipelined(run: str, schedule: str) -> dict[str, Any]:
    case_name, batches = RUNS[run]
    case = CASES[case_name]
    steps = batches()
    example, _ = steps[0]
    options: dict[str, Any] = {"replication": False}
    if schedule == "graph_interleaved":  # stages of a DAG folded onto the ranks
        options["interleave"] = True
    pm = gp_compile(
        case.build(),
        {**example, **case.constants},
        loss_fn=case.loss,
        optimizer=optimizer,
        micro_batches=M,
        schedule=schedule,
        runtime=RuntimeConfig(timeout=120),
        **options,
    )
    losses = [pm.step(**inputs, target=target) for inputs, target in steps[1:]]
    state = pm.state_dict()
    seen = pm._stepper.inputs.stages
    return {
        "losses": losses,
        "state": state if pm.rank == 0 else None,
        "signatures": None if seen is None else len(seen.seen),
        "stages": [s.nodes for s in pm.plan.stages],
    }


def _reference(run: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: each step's micro-batches (torch.tensor_split) accumulated, each loss
    weighted by its rows' share of the batch."""
    case_name, batches = RUNS[run]
    case = CASES[case_name]
    model = case.build()
    opt = optimizer(model.parameters())
    losses = []
    for inputs, target in batches()[1:]:
        rows = target.shape[0]
        total = 0.0
        for j in range(M):
            part = {k: v.tensor_split(M)[j] for k, v in inputs.items()}
            piece = target.tensor_split(M)[j]
            loss = case.loss(model(**part, **case.constants), piece)
            (loss * (piece.shape[0] / rows)).backward()
            total += loss.item() * piece.shape[0] / rows
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


CASES_2 = [
    (run, schedule)
    for run in ("gpt2", "llama", "cnn")
    for schedule in ("1f1b", "zb", "graph_interleaved")
] + [("gpt2_odd", "1f1b"), ("cnn_odd", "zb")]
CASES_3 = [("gpt2", "1f1b"), ("cnn_odd", "1f1b")]


def _worker(cases: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(run, schedule): _pipelined(run, schedule) for run, schedule in cases}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[tuple[str, str], dict[str, Any]]]:
    return launch(_worker, 2, args=(CASES_2,), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    return {run: _reference(run) for run in RUNS}


def _assert_equal(result: dict[str, Any], reference: tuple[list[float], Any]) -> None:
    losses, expected = reference
    torch.testing.assert_close(result["losses"], losses, rtol=1e-5, atol=1e-7)
    state = result["state"]
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(("run", "schedule"), CASES_2, ids=[f"{r}-{s}" for r, s in CASES_2])
def test_new_shapes_train_as_one_process_at_2_ranks(
    two_ranks: list[dict[tuple[str, str], dict[str, Any]]],
    references: dict[str, tuple[list[float], dict[str, torch.Tensor]]],
    run: str,
    schedule: str,
) -> None:
    _assert_equal(two_ranks[0][(run, schedule)], references[run])
