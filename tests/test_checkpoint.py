"""Checkpoints: DCP directories keyed by name, saved atomically, resharded on load.

A 3-rank two_branch pipeline with Adam saves after 2 steps. Resumed for 2 more steps it must
end exactly where the uninterrupted 4-step run ends: under the same plan, under a plan with
the two branches on swapped ranks (Adam's state must follow each branch by name), and on 2
ranks. The export loads strictly into the plain model.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from training import batch
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError
from graphpipe.planning.partition import plan
from graphpipe.runtime.checkpoint import _publish, resolve
from graphpipe.runtime.launch import launch
from graphpipe.tools.cli import main

NAME, M = "two_branch", 4
PINS = {
    "same": {"a": 0, "b": 1, "cat": 2, "head": 2},
    "swapped": {"b": 0, "a": 1, "cat": 2, "head": 2},  # branch a now on rank 1
    "two_ranks": {"a": 0, "b": 0, "cat": 1, "head": 1},
}


def _pipeline(pins: str, weights: str = "flush") -> Any:
    model, inputs = ZOO[NAME]()
    devices = 2 if pins == "two_ranks" else 3
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=functools.partial(torch.optim.Adam, lr=0.01),
        weights=weights,
        plan=plan(model, inputs, devices=devices, micro_batches=M, pins=PINS[pins]),
        runtime=RuntimeConfig(timeout=60),
    )


def _steps(pm: Any, steps: range) -> None:
    for s in steps:
        pm.step(*batch(NAME, s)[0], target=batch(NAME, s)[1])


def _three_ranks(path: str) -> dict[str, Any]:
    first = _pipeline("same")
    _steps(first, range(2))
    at_save = first.state_dict()
    first.save(path)
    _steps(first, range(2, 4))
    out = {"at_save": at_save, "uninterrupted": first.state_dict()}
    for pins in ("same", "swapped"):
        resumed = _pipeline(pins)
        record = resumed.load(path)
        _steps(resumed, range(2, 4))
        out[pins] = resumed.state_dict()
        out["step"] = (record["step"], resumed.steps_done)
    return out


def _two_ranks(path: str) -> dict[str, Any]:
    resumed = _pipeline("two_ranks")
    resumed.load(path)
    _steps(resumed, range(2, 4))
    try:
        _pipeline("two_ranks", weights="stash").load(path)
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    return {"state": resumed.state_dict(), "refused": refused}


def test_a_checkpoint_resumes_exactly_under_the_same_plan_swapped_branches_and_two_ranks(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "ckpt")
    three = launch(_three_ranks, 3, args=(path,), timeout=300)[0]
    two = launch(_two_ranks, 2, args=(path,), timeout=300)[0]
    expected = three["uninterrupted"]
    for resumed in (three["same"], three["swapped"], two["state"]):
        assert list(resumed) == list(expected)
        for key, value in expected.items():
            torch.testing.assert_close(resumed[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert three["step"] == (2, 4)
    assert "weights='flush'" in two["refused"] and "weights='stash'" in two["refused"]

    record = json.loads((tmp_path / "ckpt" / "graphpipe.json").read_text())
    assert (record["world_size"], record["weights"], record["step"]) == (3, "flush", 2)
    assert len(record["plan"]["stages"]) == 3
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary or old directory left
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 2

    out = tmp_path / "plain.pt"
    assert main(["export", str(tmp_path / "ckpt"), str(out)]) == 0  # export_checkpoint
    model, _ = ZOO[NAME]()
    model.load_state_dict(torch.load(out), strict=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, three["at_save"][key], rtol=0, atol=0, msg=key)


def _fake_checkpoint(path: Path, tag: str) -> Path:
    path.mkdir()
    (path / ".metadata").write_text(tag)
    (path / "graphpipe.json").write_text(tag)
    return path


def test_a_kill_at_any_moment_of_a_save_leaves_a_checkpoint_that_load_finds(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt"
    _fake_checkpoint(path, "first")
    tmp = tmp_path / "ckpt.tmp"
    tmp.mkdir()  # killed while DCP wrote: no .metadata yet
    assert resolve(path) == path
    (tmp / ".metadata").write_text("second")  # killed before graphpipe.json
    assert resolve(path) == path
    (tmp / "graphpipe.json").write_text("second")
    os.rename(path, tmp_path / "ckpt.old")  # killed between the two renames
    assert (resolve(path) / ".metadata").read_text() == "first"
    os.rename(tmp, path)  # killed before the old one was removed
    assert (resolve(path) / ".metadata").read_text() == "second"
    _fake_checkpoint(tmp_path / "ckpt.tmp", "third")
    _publish(tmp_path / "ckpt.tmp", path)  # a whole publish cleans up
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert (resolve(path) / ".metadata").read_text() == "third"
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve(tmp_path / "elsewhere")
