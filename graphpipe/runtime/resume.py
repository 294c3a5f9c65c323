"""Checkpoints kept by step, the latest complete one, and a run that resumes by itself.

    ckpt/step-00000040/        one `pm.save` directory per saved step (graphpipe.json holds
    ckpt/step-00000050/        the step: the data position, with the data a function of it)
    ckpt/step-00000060.tmp/    a save cut short: never read, removed by the next save

    saver = graphpipe.Checkpoints("ckpt", every=10, keep=3, steps=steps)
    start = saver.resume(pm)                 # loads graphpipe.latest("ckpt"): its step, or 0
    for step in range(start, steps):
        pm.step(*batch(step), target=...)    # the data of a step depends on the step only
        saver.after_step(pm)                 # every 10th step and the last: a save, then the
                                             # 3 newest kept

Under `torchrun --max-restarts=K`, a rank that dies restarts the whole group; each new
process runs the script from the top, `resume` loads the last complete checkpoint, and the
run goes on from its step: with the data a function of the step and a flushed weight policy,
it ends with the parameters an uninterrupted run ends with, bit for bit. The restarted
process plans again; a flushed policy's checkpoint loads under any plan (resharded by name),
but an asynchronous policy's per-stage state loads only under the plan it was saved with,
and plans made from measured op times (the default) may differ from run to run: compile
such a run with `plan=graphpipe.saved_plan(graphpipe.latest(root))` when there is one
(`graphpipe run --resume auto` does).

Removal is by rename first (`step-N` -> `step-N.deleting`), so a kill during it leaves either
a whole checkpoint or a name `latest` never reads; leftovers of killed saves and removals
are removed by rank 0 at the next save.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.runtime import integrity
from graphpipe.runtime.failures import guarded
from graphpipe.runtime.pipeline import PipelinedModel

__all__ = ["Checkpoints", "latest", "saved_plan", "step_dir"]

STEP = re.compile(r"step-(\d+)")  # a checkpoint's directory name
LEFTOVER = re.compile(r"step-\d+\.(tmp|old|deleting)")  # a killed save's or removal's


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint of `step` under `root`."""
    return Path(root) / f"step-{step:08d}"


def _steps(root: Path) -> list[tuple[int, Path]]:
    """The checkpoint directories under `root` by step, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP.fullmatch(p.name))]
    return sorted(found, reverse=True)


def latest(root: str | Path) -> Path | None:
    """The checkpoint of the highest step under `root` that is complete, or None.

    A directory whose graphpipe.json is missing, changed or unreadable, or whose files are
    missing or of another size than saved, is skipped with a warning that names it and says
    what is wrong; an unfinished save (`step-N.tmp`) is never a candidate. The files' hashes
    are checked by the load.

    Example:
        >>> path = graphpipe.latest("ckpt")
        >>> if path is not None:
        ...     pm.load(path)
    """
    for _, path in _steps(Path(root)):
        problems = integrity.verify(path, deep=False)
        if not problems:
            return path
        warnings.warn(
            f"graphpipe.latest: skipped {path}, incomplete: {'; '.join(problems)}", stacklevel=2
        )
    return None


def saved_plan(path: Path) -> Plan:
    """The plan the checkpoint at `path` was saved under.

    Raises:
        CheckpointError: its graphpipe.json is missing, unreadable or changed.
    """
    return Plan.from_json(json.dumps(integrity.read_record(path)["plan"]))


def _prune(root: Path, keep: int) -> None:
    """Rank 0: remove all but the `keep` newest checkpoints and any leftovers.

    Best effort: a directory that cannot be removed is named in a warning, and the run goes
    on (the checkpoint just saved is complete).
    """
    try:
        for _, path in _steps(root)[keep:]:
            gone = path.with_name(path.name + ".deleting")
            path.rename(gone)  # atomic: `latest` sees the whole checkpoint or nothing
            shutil.rmtree(gone)
        for path in root.iterdir():
            if LEFTOVER.fullmatch(path.name):
                shutil.rmtree(path)
    except OSError as exc:
        warnings.warn(f"graphpipe.Checkpoints: could not remove an old one: {exc}", stacklevel=3)


@dataclass(frozen=True)
class Checkpoints:
    """A run's checkpoints under `root`, one per `every` steps, the `keep` newest kept.

    Args:
        root: The directory holding one `step-N` directory per checkpoint.
        every: Save after every `every`-th step (0: only when `save` is called).
        keep: How many checkpoints to keep (the newest).
        steps: The run's number of steps, if known: `after_step` saves after the last one
            too (with `every`), so the run's result is a checkpoint when `every` does not
            divide it.
    """

    root: str | Path
    every: int = 0
    keep: int = 3
    steps: int | None = None

    def __post_init__(self) -> None:
        """Raises:
        ConfigError: a negative `every` or `steps`, or a `keep` below 1.
        """
        if self.every < 0 or self.keep < 1 or (self.steps is not None and self.steps < 0):
            raise ConfigError(
                f"Checkpoints(every={self.every}, keep={self.keep}, steps={self.steps}): "
                "every and steps must be >= 0 and keep >= 1"
            )

    def resume(self, pm: PipelinedModel) -> int:
        """Load the latest complete checkpoint into `pm` (a collective): rank 0 chooses it,
        every rank loads the same one.

        Rank 0 prints which: `graphpipe.Checkpoints: resumed from ckpt/step-00000006 (step
        6)`, or that there is none under the root.

        Returns:
            The step to go on from: the checkpoint's, or 0 when there is none.
        """
        first = dist.get_rank() == 0
        chosen = [str(latest(self.root) or "") if first else None]
        guarded(
            "the broadcast of the checkpoint to resume",
            lambda: dist.broadcast_object_list(chosen, src=0),
        )
        if not chosen[0]:
            if first:
                print(f"graphpipe.Checkpoints: no checkpoint under {self.root}: from step 0")
            return 0
        pm.load(chosen[0])
        if first:
            print(f"graphpipe.Checkpoints: resumed from {chosen[0]} (step {pm.steps_done})")
        return int(pm.steps_done)

    def save(self, pm: PipelinedModel) -> Path:
        """Save `pm` as the checkpoint of its step and keep the `keep` newest (a collective).

        Raises:
            CheckpointError: the save failed (every rank; the older checkpoints are kept).
        """
        path = pm.save(step_dir(self.root, pm.steps_done))
        if dist.get_rank() == 0:
            _prune(Path(self.root), self.keep)
        return Path(path)

    def after_step(self, pm: PipelinedModel) -> Path | None:
        """`save` when `pm`'s step count is a multiple of `every`, or is `steps` (the last
        step, with `every` set); the path, or None."""
        done = pm.steps_done
        if self.every and (done % self.every == 0 or done == self.steps):
            return self.save(pm)
        return None
