"""Soak: a long run on 3 ranks under torchrun's restarts, with ranks killed at random moments.

    python -m benchmarks.soak --steps 300 --kills 4      # about 100 s on 2 cores
    python -m benchmarks.soak --ranks 4 --dp 2 --steps 100 --kills 3   # pp 2 x dp 2 (FSDP2)

`models.mmt` (tiny: two branch stages and the fan-in head, one rank each) trains twice with
`graphpipe run --checkpoint-every N --resume auto` under `torchrun --standalone
--nproc-per-node 3`: once untouched, once under `--max-restarts K` with K kills. Kill i
happens on attempt i (TORCHELASTIC_RESTART_COUNT), on a random rank, a random delay (0 to
0.3 s: up to a few steps on, inside a step or a save) after that rank drew the batch of a
random step; the steps are drawn in increasing order, so each attempt reaches its kill. Each
kill is a SIGKILL of the rank's own process; torchrun's agent stops the others and restarts
the group, which resumes from the latest complete checkpoint. With `--ranks 4 --dp 2` the
same runs on a (2, 2) ("pp", "dp") mesh (`graphpipe run --dp`): stages sharded by FSDP2,
checkpoints of DTensor shards.

The figures: the wall time of both runs, the kills that landed (each leaves a mark file
first), the steps each attempt resumed from, and the checks: every tensor of the final
checkpoints (parameters, buffers, Adam's state) equal bit for bit, no process of the run
left, no temporary or half-removed checkpoint directory left.

`workload` is the MODEL both runs train (`benchmarks/soak.py:workload`): models.mmt with the
kill plan of the environment (KILLS_ENV) armed on the matching attempt and rank.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graphpipe.runtime import integrity
from graphpipe.runtime.resume import latest
from graphpipe.tools.train import STEP_SEEDS
from graphpipe.tools.workload import Workload
from models import mmt

KILLS_ENV = "GRAPHPIPE_SOAK_KILLS"  # "attempt:rank:step:delay;..."
MARKS_ENV = "GRAPHPIPE_SOAK_MARKS"  # a directory: each kill leaves a file there first
RANKS = 3
MODEL = "benchmarks/soak.py:workload"
LEFTOVERS = (".tmp", ".old", ".deleting")  # names of unfinished saves and removals


@dataclass(frozen=True)
class Kill:
    """Kill `rank` on attempt `attempt`, `delay` s after it drew step `step`'s batch."""

    attempt: int
    rank: int
    step: int
    delay: float

    def __str__(self) -> str:
        return f"{self.attempt}:{self.rank}:{self.step}:{self.delay:.3f}"

    @staticmethod
    def parse(text: str) -> Kill:
        attempt, rank, step, delay = text.split(":")
        return Kill(int(attempt), int(rank), int(step), float(delay))


# -- inside a rank: the workload with its kill armed -------------------------------------------


def workload(preset: str = "tiny", *, seed: int = 0, **options: Any) -> Workload:
    """models.mmt, whose make_batch kills this rank where KILLS_ENV says (a test fault)."""
    w = mmt.workload(preset, seed=seed, **options)
    kill = _my_kill()
    if kill is not None:
        w.make_batch = _armed(w.make_batch, kill, seed)
    return w


def _my_kill() -> Kill | None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "-1"))
    kills = [Kill.parse(k) for k in os.environ.get(KILLS_ENV, "").split(";") if k]
    return next((k for k in kills if (k.attempt, k.rank) == (attempt, rank)), None)


def _armed(make_batch: Any, kill: Kill, seed: int) -> Any:
    def draw(gen: torch.Generator) -> Any:
        if gen.initial_seed() - seed * STEP_SEEDS == kill.step:  # train's step_generator
            timer = threading.Timer(kill.delay, _die, args=(kill,))
            timer.daemon = True
            timer.start()
        return make_batch(gen)

    return draw


def _die(kill: Kill) -> None:
    marks = os.environ.get(MARKS_ENV)
    if marks:
        Path(marks, f"killed-{kill}").write_text(f"{time.time()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


# -- the driver ----------------------------------------------------------------------------------


def torchrun(
    run_args: Sequence[str], restarts: int, env: dict[str, str], timeout: float, ranks: int = RANKS
) -> tuple[int, str]:
    """`graphpipe run RUN_ARGS` on `ranks` ranks under torchrun; its exit status and output.

    The whole process session is killed when `timeout` passes (then TimeoutError).
    """
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *(f"--nproc-per-node={ranks}", f"--max-restarts={restarts}", "--monitor-interval=0.1"),
        *("-m", "graphpipe.tools.cli", "run", *run_args),
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"torchrun ran past {timeout} s:\n{out[-4000:]}") from None
    return proc.returncode, out


def run_args(
    root: Path, steps: int, every: int, keep: int = 2, ranks: int = RANKS, dp: int = 1
) -> list[str]:
    """`graphpipe run`'s arguments for one run writing under `root` (pp x dp = ranks)."""
    return [
        *(MODEL, "--devices", str(ranks), "--dp", str(dp), "--preset", "tiny"),
        "--profile=flops",
        *("--steps", str(steps), "--checkpoint-every", str(every), "--resume", "auto"),
        *("--keep-checkpoints", str(keep), "--checkpoint-dir", str(root / "ckpt")),
        *("--out", str(root / "out"), "--timeout", "30"),
    ]


def final_state(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the latest checkpoint under root/ckpt: parameters, buffers and the
    optimizer's state, by key."""
    path = latest(root / "ckpt")
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint under {root / 'ckpt'}")
    problems = integrity.verify(path)
    if problems:
        raise RuntimeError(f"{path}: {problems}")
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in saved.items()
        if isinstance(v, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "loading in a single process", as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors are not bit-identical (or not in both)."""
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k])]


def leftovers(root: Path) -> list[str]:
    """Processes still running with `root` in their command line, and directories of
    unfinished saves or removals under root/ckpt."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(root) in cmdline:
                found.append(f"process {proc.name}: {cmdline[:120]}")
    ckpt = root / "ckpt"
    if ckpt.is_dir():
        found += [f"directory {p}" for p in ckpt.iterdir() if p.name.endswith(LEFTOVERS)]
    return found


def kill_plan(steps: int, kills: int, seed: int, ranks: int = RANKS) -> list[Kill]:
    """`kills` kills at increasing random steps in [1, steps), one per attempt."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(1, steps), kills))
    return [Kill(i, rng.randrange(ranks), s, rng.uniform(0.0, 0.3)) for i, s in enumerate(at)]


def reference(
    root: Path, steps: int, every: int, timeout: float, ranks: int = RANKS, dp: int = 1
) -> float:
    """The untouched run under root/reference; its wall time in seconds."""
    began = time.monotonic()
    args = run_args(root / "reference", steps, every, ranks=ranks, dp=dp)
    code, out = torchrun(args, 0, {}, timeout, ranks)
    if code:
        raise RuntimeError(f"the reference run failed ({code}):\n{out[-4000:]}")
    return time.monotonic() - began


def killed(
    root: Path,
    steps: int,
    every: int,
    kills: Sequence[Kill],
    timeout: float,
    ranks: int = RANKS,
    dp: int = 1,
) -> dict[str, Any]:
    """The run under root/killed with `kills`, next to root/reference: the figures and the
    checks (see the module docstring)."""
    run = root / f"killed-{len(list(root.glob('killed-*')))}"
    marks = run / "marks"
    marks.mkdir(parents=True)
    env = {KILLS_ENV: ";".join(map(str, kills)), MARKS_ENV: str(marks)}
    began = time.monotonic()
    args = run_args(run, steps, every, ranks=ranks, dp=dp)
    code, out = torchrun(args, len(kills), env, timeout, ranks)
    seconds = time.monotonic() - began
    (run / "torchrun.log").write_text(out)
    if code:
        raise RuntimeError(f"the killed run failed ({code}), see {run / 'torchrun.log'}")
    resumed = re.findall(r"graphpipe.Checkpoints: resumed from \S+ \(step (\d+)\)", out)
    return {
        "seconds": seconds,
        "kills": sorted(p.name[len("killed-") :] for p in marks.iterdir()),
        "resumed_from": [int(s) for s in resumed],
        "differences": differences(final_state(root / "reference"), final_state(run)),
        "leftovers": leftovers(root / "reference") + leftovers(run),
        "checkpoints": sorted(p.name for p in (run / "ckpt").iterdir()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill plan")
    parser.add_argument("--dir", type=Path, default=Path("runs/soak"))
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--ranks", type=int, default=RANKS, help="processes: pp x dp")
    parser.add_argument("--dp", type=int, default=1, help="a (ranks / dp, dp) mesh: FSDP2")
    args = parser.parse_args(argv)
    layout = {"ranks": args.ranks, "dp": args.dp}
    kills = kill_plan(args.steps, args.kills, args.seed, args.ranks)
    print(f"kill plan (attempt:rank:step:delay): {' '.join(map(str, kills))}", flush=True)
    root = args.dir.resolve() / time.strftime("%Y%m%d-%H%M%S")
    print(f"reference: {reference(root, args.steps, args.every, args.timeout, **layout):.1f} s")
    result = killed(root, args.steps, args.every, kills, args.timeout, **layout)
    for key, value in result.items():
        print(f"{key}: {value}")
    ok = not result["differences"] and not result["leftovers"]
    print("equal bit for bit, nothing left behind" if ok else "FAILED")
    return 0 if ok and len(result["kills"]) == len(kills) else 1


if __name__ == "__main__":
    sys.exit(main())
