"""Resume by itself: checkpoints kept by step, the latest complete one, torchrun's restarts.

The torchrun tests train models.mmt (tiny: two branch stages and the fan-in head on 3 ranks)
for 20 steps with `graphpipe run --checkpoint-every 5 --keep-checkpoints 2 --resume auto`
under `torchrun --standalone --max-restarts K` (benchmarks/soak.py drives them), once
untouched and once with ranks killed (SIGKILL) where the kill plan says: every tensor of the
final checkpoint (parameters, buffers, Adam's state) must equal the untouched run's bit for
bit, the run must resume from the checkpoint before each kill, and no process and no
unfinished checkpoint directory may be left.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import soak
from graphpipe import Checkpoints, latest
from graphpipe.errors import ConfigError
from graphpipe.runtime import integrity
from graphpipe.runtime.resume import _prune, step_dir
from graphpipe.tools.train import TrainConfig, train

STEPS, EVERY, LIMIT = 20, 5, 240  # LIMIT: seconds for one torchrun


def _fake(root: Path, step: int) -> Path:
    """A checkpoint directory of `step` as a save leaves it (two files and graphpipe.json)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata %d" % step)
    (path / "__0_0.distcp").write_bytes(os.urandom(64))
    record = {"step": step, "files": integrity.describe(path, integrity.files_of(path))}
    (path / integrity.META).write_text(json.dumps(integrity.seal(record)))
    return path


def test_latest_takes_the_newest_complete_checkpoint_and_names_each_one_it_skips(
    tmp_path: Path,
) -> None:
    assert latest(tmp_path / "nothing") is None
    _fake(tmp_path, 5)
    truncated = _fake(tmp_path, 10)
    with open(truncated / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    unsealed = _fake(tmp_path, 15)
    (unsealed / integrity.META).unlink()  # killed before graphpipe.json
    (tmp_path / "step-00000020.tmp").mkdir()  # a save in progress: never a candidate
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert latest(tmp_path) == step_dir(tmp_path, 5)
    said = [str(w.message) for w in seen]
    assert len(said) == 2, said
    assert f"skipped {unsealed}" in said[0] and "graphpipe.json is missing" in said[0]
    assert f"skipped {truncated}" in said[1]
    assert "__0_0.distcp is 10 bytes, 64 when saved: truncated" in said[1]


def test_pruning_keeps_the_newest_and_removes_what_killed_saves_and_removals_left(
    tmp_path: Path,
) -> None:
    for step in (10, 20, 30, 40):
        _fake(tmp_path, step)
    (tmp_path / "step-00000050.tmp").mkdir()  # a save killed midway
    (tmp_path / "step-00000005.deleting").mkdir()  # a removal killed midway
    (tmp_path / "notes.txt").write_text("mine")  # not graphpipe's: left alone
    _prune(tmp_path, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step-00000030", "step-00000040"]


def test_checkpoints_refuse_a_negative_interval_and_keeping_none() -> None:
    with pytest.raises(ConfigError, match="every=-1, keep=3"):
        Checkpoints("ckpt", every=-1)
    with pytest.raises(ConfigError, match="every=5, keep=0"):
        Checkpoints("ckpt", every=5, keep=0)


def test_after_step_saves_every_nth_step_and_after_the_last() -> None:
    saved: list[int] = []

    class Recording(Checkpoints):
        def save(self, pm: Any) -> Path:
            saved.append(pm.steps_done)
            return Path(self.root)

    for done in range(1, 7):
        Recording("ckpt", every=4, steps=6).after_step(SimpleNamespace(steps_done=done))
    assert saved == [4, 6]  # 6 is no multiple of 4: the last step's save is the run's result
    Recording("ckpt", every=0, steps=6).after_step(SimpleNamespace(steps_done=6))
    assert saved == [4, 6]  # every=0: only explicit saves
    with pytest.raises(ConfigError, match="steps=-1"):
        Checkpoints("ckpt", every=2, steps=-1)


def test_the_training_loop_refuses_bad_resume_settings_and_a_world_it_was_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match="resume='sometimes'; known: \\['never', 'auto'\\]"):
        TrainConfig(model="models.mmt", resume="sometimes")
    with pytest.raises(ConfigError, match="every=-2, keep=3"):
        TrainConfig(model="models.mmt", checkpoint_every=-2)
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)  # as torchrun sets them, for 3 processes
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="--devices 2, but the launcher started 3 processes"):
        train(TrainConfig(model="models.mmt", preset="tiny", devices=2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the untouched 20-step run (root/reference)."""
    root = tmp_path_factory.mktemp("runs")
    soak.reference(root, STEPS, EVERY, LIMIT)
    return root


def test_a_rank_killed_under_torchrun_restarts_the_group_which_resumes_bit_identical(
    runs: Path,
) -> None:
    kill = soak.Kill(attempt=0, rank=1, step=7, delay=0.0)  # as it draws step 7's batch
    result = soak.killed(runs, STEPS, EVERY, [kill], LIMIT)
    assert result["kills"] == [str(kill)], result
    assert result["resumed_from"] == [5], result  # the checkpoint before the kill
    assert result["differences"] == [], result
    assert result["leftovers"] == [], result
    assert result["checkpoints"] == ["step-00000015", "step-00000020"], result  # keep=2


@pytest.mark.slow
def test_a_short_soak_with_two_kills_at_random_moments_ends_bit_identical(runs: Path) -> None:
    """CI's count of `python -m benchmarks.soak`: 20 steps, 2 kills (seeded)."""
    kills = soak.kill_plan(STEPS, 2, seed=1)
    result = soak.killed(runs, STEPS, EVERY, kills, LIMIT)
    assert result["kills"] == sorted(map(str, kills)), result
    resumed = result["resumed_from"]  # none when a kill came before the first checkpoint
    assert resumed == sorted(resumed) and len(resumed) <= 2, result
    # a checkpoint's step; a kill's delay (up to a second after its step began) may land it
    # steps later than its step on a fast machine, so the resumed step is not bounded by it
    assert all(r % EVERY == 0 and r <= STEPS for r in resumed), result
    assert result["differences"] == [], result
    assert result["leftovers"] == [], result
