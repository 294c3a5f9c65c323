"""Damaged and unwritable checkpoints: refused by name, never loaded wrong; failed saves agreed.

A 3-rank two_branch pipeline with Adam (tests/test_checkpoint.py's) saves a checkpoint, then
each damage below is made to a copy of it and every rank tries `pm.load` on the copy: each
must raise CheckpointError naming the file and what is wrong with it, and leave the
pipeline's parameters as they were. A save that fails on one rank (the disk full on rank 1's
shard; permission refused on rank 0's directory, both simulated by patching: the tests run as
root, whom chmod does not stop) must raise CheckpointError on every rank and leave the
previous checkpoint loadable, with no unfinished directory left.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import _pipeline, _steps
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from graphpipe import Checkpoints, latest
from graphpipe.errors import CheckpointError
from graphpipe.runtime.checkpoint import export_checkpoint, resolve
from graphpipe.runtime.launch import launch


def _truncate(path: Path) -> None:
    shard = path / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)


def _edit_step(path: Path) -> None:
    record = json.loads((path / "graphpipe.json").read_text())
    record["step"] = 7  # e.g. to skip ahead in the data
    (path / "graphpipe.json").write_text(json.dumps(record, indent=1))


def _garble(path: Path) -> None:
    (path / "graphpipe.json").write_text('{"format": 2, "plan": ')


def _other(name: str) -> Callable[[Path], None]:
    """Copy `name` from the other run's checkpoint over this one's (or beside it)."""

    def damage(path: Path) -> None:
        shutil.copy(path.parent / "other" / name.split(">")[0], path / name.split(">")[-1])

    return damage


# case -> (the damage, what the error must say; parts joined by "|" must all be there)
DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated shard": (_truncate, "__1_0.distcp is {half} bytes, {full} when saved: truncated"),
    "missing shard": (lambda p: (p / "__2_0.distcp").unlink(), "__2_0.distcp is missing"),
    "edited graphpipe.json": (
        _edit_step,
        "graphpipe.json was changed after the save: its content does not match its digest",
    ),
    "unreadable graphpipe.json": (_garble, "graphpipe.json is unreadable: Expecting value"),
    "graphpipe.json of another save": (  # .metadata: another size, or another hash
        _other("graphpipe.json"),
        "/.metadata is |not the file saved",
    ),
    "shard of another run": (_other("__0_0.distcp"), "__0_0.distcp is not the file saved"),
    "extra shard of another run": (
        _other("__0_0.distcp>__3_0.distcp"),
        "__3_0.distcp is no file of this save (another save's or run's)",
    ),
}


def _refusals(root: str) -> dict[str, Any]:
    """Save `good` at step 2 and `other` (another run: other data) at step 3, then try to
    load each damaged copy of `good`; returns each refusal and whether the weights moved."""
    base = Path(root)
    pm = _pipeline("same")
    _steps(pm, range(2))
    pm.save(base / "good")
    other = _pipeline("same")
    _steps(other, range(5, 8))
    other.save(base / "other")
    before = pm.state_dict()
    said: dict[str, tuple[str, str]] = {}
    for case, (damage, _) in DAMAGES.items():
        copy = base / case.replace(" ", "_")
        if pm.rank == 0:
            shutil.copytree(base / "good", copy)
            damage(copy)
        dist.barrier()
        try:
            pm.load(copy)
            said[case] = ("loaded", "")
        except CheckpointError as exc:
            said[case] = (type(exc).__name__, str(exc))
    after = pm.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    return {"said": said, "moved": moved, "full": (base / "good" / "__1_0.distcp").stat().st_size}


def test_every_damage_is_refused_by_name_on_every_rank_and_loads_nothing(tmp_path: Path) -> None:
    results = launch(_refusals, 3, args=(str(tmp_path),), timeout=300)
    full = results[0]["full"]
    for rank, result in enumerate(results):
        assert result["moved"] == [], (rank, result["moved"])
        for case, (_, expected) in DAMAGES.items():
            kind, text = result["said"][case]
            assert kind == "CheckpointError", (rank, case, kind)
            folder = tmp_path / case.replace(" ", "_")
            assert f"refusing to load {folder}" in text, (rank, case, text)
            for part in expected.format(half=full // 2, full=full).split("|"):
                assert part in text, (rank, case, text)
        truncated = result["said"]["truncated shard"][1]
        assert truncated.count("__1_0.distcp") == 1, truncated  # its size, not its hash too
    # one process, no process group: the export refuses the same
    with pytest.raises(CheckpointError, match="__2_0.distcp is missing"):
        export_checkpoint(tmp_path / "missing_shard", tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def _full_disk(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "__1_0.distcp")


def _failed_saves(root: str) -> dict[str, Any]:
    """A save at step 1, then one that fails on rank 1's shard (no space) and one under
    Checkpoints that fails on rank 0's directory (no permission); each error, and what is
    left on disk."""
    base = Path(root)
    pm = _pipeline("same")
    saver = Checkpoints(base / "steps", every=1, keep=2)
    _steps(pm, range(1))
    pm.save(base / "ckpt")
    saver.save(pm)
    _steps(pm, range(1, 2))
    said = {}
    write, mkdir = FileSystemWriter.write_data, pathlib.Path.mkdir
    if pm.rank == 1:
        FileSystemWriter.write_data = _full_disk  # type: ignore[method-assign]
    try:
        pm.save(base / "ckpt")
    except CheckpointError as exc:
        said["no space"] = str(exc)
    FileSystemWriter.write_data = write  # type: ignore[method-assign]
    if pm.rank == 0:

        def refused(self: Path, *args: Any, **kwargs: Any) -> None:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

        pathlib.Path.mkdir = refused  # type: ignore[method-assign]
    try:
        saver.save(pm)
    except CheckpointError as exc:
        said["no permission"] = str(exc)
    pathlib.Path.mkdir = mkdir  # type: ignore[method-assign]
    resumed = _pipeline("same")
    step = resumed.load(base / "ckpt")["step"]
    saver.save(pm)  # the disk is back: the next save goes through
    return {"said": said, "step": step, "files": sorted(os.listdir(base))}


def test_a_save_failing_on_one_rank_fails_on_every_rank_and_keeps_the_previous(
    tmp_path: Path,
) -> None:
    results = launch(_failed_saves, 3, args=(str(tmp_path),), timeout=300)
    for rank, result in enumerate(results):
        space, permission = result["said"]["no space"], result["said"]["no permission"]
        assert f"could not save the checkpoint {tmp_path / 'ckpt'}" in space, (rank, space)
        assert "rank 1: OSError: [Errno 28] No space left on device" in space, (rank, space)
        assert "the previous one is kept" in space
        step_2 = tmp_path / "steps" / "step-00000002"
        assert f"could not save the checkpoint {step_2} (making its directory)" in permission
        assert "rank 0: PermissionError: [Errno 13] Permission denied" in permission
        assert result["step"] == 1, rank  # the previous checkpoint, loaded
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "steps"]  # no ckpt.tmp
    assert resolve(tmp_path / "ckpt") == tmp_path / "ckpt"
    assert sorted(os.listdir(tmp_path / "steps")) == ["step-00000001", "step-00000002"]
    assert latest(tmp_path / "steps") == tmp_path / "steps" / "step-00000002"
