"""train: the example training loop behind `graphpipe run` and `python -m models.<name>`.

    graphpipe run models.mmt --devices 2                 # the cpu preset, 40 steps
    graphpipe run models.mmt --devices 4 --dp 2          # pp 2 x dp 2: stages sharded by FSDP2
    python -m models.dlrm --devices 2 --schedule zb --steps 50
    torchrun --nproc-per-node 3 --max-restarts 3 -m graphpipe.tools.cli run models.mmt \
        --devices 3 --checkpoint-every 10 --resume auto  # a killed rank: resumed, same result

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) this process is one rank;
otherwise `graphpipe.launch` starts `devices` local processes.

Every rank builds the same workload and draws the same synthetic mini-batches; graphpipe.compile
plans it on rank 0 (op times measured on this machine by default) and every step trains it
pipelined. Rank 0 shows a progress bar (loss, samples/s, ETA) on a terminal, and a line per
step (loss, samples/s, step time) otherwise. At the end it
prints the plan table and the measured vs simulated step time, and writes into `out`:

    plan.svg         the stage graph          ops.svg        the op graph, by stage
    timeline.svg     the last steps, measured  timeline.json  the same, Chrome/Perfetto trace
    simulated.svg    the schedule, simulated   plan.json      the plan

The data of step s is drawn from a generator seeded by (seed, s), and torch's global RNG is
seeded the same way before the step, so a run resumed at step s sees what it would have seen.
With `checkpoint_every` a checkpoint is kept every N steps and after the last one
(`graphpipe.Checkpoints` under `checkpoint_dir`); with `resume="auto"` a run starts from the
latest complete one, under the plan it was saved with (the same stages, hence the same
arithmetic), and ends bit-identical to a run never interrupted (flushed weight policies).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from tqdm import tqdm

from graphpipe._units import format_time
from graphpipe.compile import compile as pipeline
from graphpipe.compile import schedule_for
from graphpipe.errors import ConfigError
from graphpipe.ir import ParallelDims, Plan
from graphpipe.planning.options import Parallelism, default, split
from graphpipe.planning.partition import micro_batch_size
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.clip import check_clipping
from graphpipe.runtime.launch import launch
from graphpipe.runtime.resume import Checkpoints, latest, saved_plan
from graphpipe.runtime.spec import RUN_GROUPS, check_mesh
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.calibrate import calibrated, measure_link
from graphpipe.tools.render import render
from graphpipe.tools.report import modules_of, plan_summary, plan_table
from graphpipe.tools.timeline import chrome_trace, timeline_svg
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

__all__ = ["TrainConfig", "TrainResult", "train"]

PROFILES = ("measure", "flops")
RESUME = ("never", "auto")
STEP_SEEDS = 1 << 32  # the seed of step s: seed * STEP_SEEDS + s
LAUNCHED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # torchrun's, per process
RECORDED_STEPS = 2  # the last steps whose actions the measured timeline shows


@dataclass(frozen=True)
class TrainConfig:
    """One example run."""

    model: str  # models.NAME or path/file.py:function
    preset: str = "cpu"  # the workload preset
    options: dict[str, Any] = field(default_factory=dict)  # workload options
    devices: int = 2  # processes: pp x dp x tp (one stage or replica per pp rank)
    # compile's options by name (`graphpipe.planning.options`: micro_batches, schedule,
    # weights, dp, tp, precision, recompute, max_grad_norm, timeout, ...), checked here
    compile_options: Mapping[str, Any] = field(default_factory=dict)
    steps: int = 40
    lr: float = 3e-3  # Adam's learning rate
    profile: str = "measure"  # op times for planning: "measure" (this machine) or "flops"
    out: str | None = None  # where pictures go; None: runs/<model name>
    seed: int = 0
    deadline: float = 3600.0  # seconds the local run may take (under torchrun: torchrun's)
    checkpoint_every: int = 0  # keep a checkpoint every N steps and after the last (0: none)
    checkpoint_dir: str | None = None  # where; None: <out>/checkpoints
    keep_checkpoints: int = 3  # the newest kept
    resume: str = "never"  # "auto": from the latest complete checkpoint, when there is one

    def __post_init__(self) -> None:
        """Refuse bad settings here, in the launching process: one error, not one per rank.

        Raises:
            ConfigError: every bad setting, naming its value.
        """
        problems = [
            f"{name}={value!r} must be positive"
            for name, value in {
                "devices": self.devices, "steps": self.steps, "lr": self.lr,
                "deadline": self.deadline,
            }.items()
            if not value > 0
        ]  # fmt: skip
        if self.profile not in PROFILES:
            problems.append(f"profile={self.profile!r}; known: {list(PROFILES)}")
        if self.resume not in RESUME:
            problems.append(f"resume={self.resume!r}; known: {list(RESUME)}")
        groups, found = split({}, self.compile_options, RUN_GROUPS)
        problems.extend(found)
        if not found:
            problems.extend(_run_problems(groups, self.devices))
        if problems:
            raise ConfigError("; ".join(problems))
        Checkpoints(".", self.checkpoint_every, self.keep_checkpoints)  # checks both

    def option(self, name: str) -> Any:
        """Compile's option `name` as this run sets it, or its default."""
        return self.compile_options.get(name, default(name, RUN_GROUPS))

    @property
    def dims(self) -> ParallelDims:
        """The run's layout on its devices (checked by `__post_init__`)."""
        groups, _ = split({}, self.compile_options, RUN_GROUPS)
        parallelism = cast(Parallelism, groups["parallelism"])
        return check_mesh(parallelism).on(self.devices, f"devices={self.devices}")


def _run_problems(groups: Mapping[str, Any], devices: int) -> list[str]:
    """What compile would refuse of these options on `devices` processes."""
    problems: list[str] = []
    numerics, parallel = groups["numerics"], groups["parallelism"]
    for check, args in (
        (schedule_for, (numerics.weights, groups["planning"].schedule)),
        (check_clipping, (numerics.max_grad_norm, numerics.grad_norm_type, numerics.weights)),
        (lambda: check_mesh(parallel).on(devices, f"devices={devices}"), ()),  # the layout
    ):
        try:
            check(*args)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


@dataclass(frozen=True)
class TrainResult:
    """What rank 0 saw."""

    losses: list[float]
    step_times: list[float]
    simulated_step: float
    out: str


def train(config: TrainConfig) -> TrainResult | None:
    """Run the example on `config.devices` local processes, or as one rank under torchrun.

    Returns:
        What rank 0 saw (None on the other ranks under torchrun).

    Raises:
        ConfigError: a bad model, preset, option or micro-batch count (checked here once,
            on the meta device, before any process starts), or under torchrun a world size
            other than `devices`.
        PipelineError: a rank failed (the message says which and why).
    """
    _check_workload(config)
    if all(v in os.environ for v in LAUNCHED):
        return _one_rank(config)
    results = launch(
        _rank_main,
        config.devices,
        args=(config,),
        timeout=config.deadline,
        comm_timeout=config.option("timeout"),
    )
    result: TrainResult = results[0]
    return result


def _one_rank(config: TrainConfig) -> TrainResult | None:
    """This process as one rank of a run torchrun (or another launcher) started.

    Raises:
        ConfigError: the launcher's world size is not `config.devices`.
    """
    world = int(os.environ["WORLD_SIZE"])
    if world != config.devices:
        raise ConfigError(
            f"--devices {config.devices}, but the launcher started {world} processes "
            f"(WORLD_SIZE={world}): give both the same number"
        )
    result = _rank_main(config)
    dist.destroy_process_group()
    return result


def _check_workload(config: TrainConfig) -> None:
    """Build the workload on the meta device (no memory, no values) to refuse a bad preset,
    option, micro-batch count or dp degree in one line. A factory that cannot build on the
    meta device is left to the ranks.

    Raises:
        ConfigError: what the factory, the micro-batch split or the dp split refuses.
    """
    try:
        with torch.device("meta"):
            w = load_workload(config.model, config.preset, seed=config.seed, **config.options)
    except ConfigError:
        raise
    except Exception:
        return
    m = config.option("micro_batches") or w.micro_batches
    rows, dp = micro_batch_size(w.batch_size, m), config.option("dp") or 1
    if rows % dp:
        raise ConfigError(
            f"dp={dp} does not divide a micro-batch of {rows} rows (batch "
            f"{w.batch_size} / M {m}): each dp rank takes 1/dp of every micro-batch"
        )


def _rank_main(config: TrainConfig) -> TrainResult | None:
    w = load_workload(config.model, config.preset, seed=config.seed, **config.options)
    # for the report, traced before compile: under a mesh FSDP2 wraps the model's modules
    gm = trace(w.model, w.example_inputs, w.leaf_modules)
    out = Path(config.out or f"runs/{w.name}")
    saver = Checkpoints(
        config.checkpoint_dir or out / "checkpoints",
        config.checkpoint_every,
        config.keep_checkpoints,
        steps=config.steps,  # the last step's checkpoint: the run's result
    )
    m = config.option("micro_batches") or w.micro_batches
    asked = dict(config.compile_options)
    asked.setdefault("profile", ProfileConfig(mode=config.profile, warmup=2, repeats=5))
    asked.setdefault("leaf_modules", tuple(w.leaf_modules))
    pm = pipeline(
        w.model,
        w.example_inputs,
        loss_fn=w.loss_fn,
        optimizer=functools.partial(torch.optim.Adam, lr=config.lr),
        plan=_resumed_plan(config, saver, m),
        **(asked | {"micro_batches": m}),
    )
    first = dist.get_rank() == 0  # pm.rank is the plan device: dp ranks share it
    say = _printer(first)
    say(f"{config.model} ({config.preset}): {plan_summary(pm.plan)}")
    start = saver.resume(pm) if config.resume == "auto" else 0  # it says from where
    losses, times = _train_steps(pm, w, config, saver, start, say)
    if not losses:
        say(f"the run ended at step {start}: nothing left to do")
        return TrainResult([], [], 0.0, str(out)) if first else None
    measured = pm.timeline()
    link = measure_link() if pm.plan.num_devices > 1 else None
    if not first:
        return None
    simulated = simulate(calibrated(pm.plan, measured, link), pm.schedule.name)
    _report(pm, gm, losses, times, measured, simulated, out, say)
    return TrainResult(losses, times, simulated.iteration_time, str(out))


def _train_steps(
    pm: Any, w: Any, config: TrainConfig, saver: Checkpoints, start: int, say: Any
) -> tuple[list[float], list[float]]:
    """Steps `start` to `config.steps`, each on its own data, checkpointed by `saver`.

    Returns:
        The losses and the step times.
    """
    losses, times = [], []
    bar = progress_bar(dist.get_rank() == 0, config.steps - start)
    for step in range(start, config.steps):
        torch.manual_seed(config.seed * STEP_SEEDS + step)  # dropout and the like
        inputs, target = w.make_batch(step_generator(config.seed, step))
        pm.recording = step >= config.steps - RECORDED_STEPS
        began = time.perf_counter()
        losses.append(pm.step(*inputs, target=target))
        times.append(time.perf_counter() - began)
        saver.after_step(pm)
        rate = w.batch_size / times[-1]
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", samples_s=f"{rate:.1f}")
            bar.update(1)
        else:
            say(
                f"step {step + 1:>4}/{config.steps}  loss {losses[-1]:.4f}  "
                f"{rate:8.1f} samples/s  {times[-1] * 1e3:7.1f} ms"
            )
    if bar is not None:
        bar.close()
    return losses, times


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator step `step`'s mini-batch is drawn from: a function of the step only,
    so a resumed run draws what an uninterrupted one would."""
    return torch.Generator().manual_seed(seed * STEP_SEEDS + step)


def _resumed_plan(config: TrainConfig, saver: Checkpoints, micro_batches: int) -> Plan | None:
    """The plan of the checkpoint a run with resume="auto" goes on from, when it fits the
    devices and micro-batches (None: plan anew, and the load reshards by name)."""
    if config.resume != "auto":
        return None
    with warnings.catch_warnings():
        if os.environ.get("RANK", "0") != "0":  # rank 0 says what latest() skipped
            warnings.simplefilter("ignore")
        path = latest(saver.root)
    if path is None:
        return None
    plan = saved_plan(path)
    pp = config.dims.pp  # the plan's devices: pp of the mesh
    fits = (plan.num_devices, plan.micro_batches) == (pp, micro_batches)
    return plan if fits else None


def progress_bar(active: bool, steps: int) -> tqdm | None:
    """A progress bar (loss, samples/s, ETA) for rank 0 on a terminal; None elsewhere, where
    a line per step is printed instead."""
    if not (active and sys.stdout.isatty()):
        return None
    return tqdm(total=steps, unit="step", file=sys.stdout, dynamic_ncols=True)


def _printer(active: bool) -> Any:
    def say(line: str) -> None:
        if active:
            print(line, flush=True)

    return say


def _report(
    pm: Any,
    gm: Any,
    losses: list[float],
    times: list[float],
    measured: Any,
    simulated: Any,
    out: Path,
    say: Any,
) -> None:
    steady = statistics.median(times[len(times) // 2 :]) if times else 0.0
    predicted = simulate(pm.plan, pm.schedule.name).iteration_time
    say("\n" + plan_table(pm.plan, modules_of(gm.graph.nodes)))
    say(f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    say(
        f"step time: measured {format_time(steady)} (median of the second half); simulated "
        f"{format_time(simulated.iteration_time)} with the action costs measured in the last "
        f"steps ({(simulated.iteration_time - steady) / steady:+.0%}); the plan's prediction "
        f"from the op profile {format_time(predicted)}"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(pm.plan.to_json())
    (out / "timeline.svg").write_text(timeline_svg(measured))
    (out / "timeline.json").write_text(json.dumps(chrome_trace(measured)))
    (out / "simulated.svg").write_text(timeline_svg(simulated.timeline))
    try:
        (out / "plan.svg").write_bytes(render(pm.plan).pipe(format="svg"))
        (out / "ops.svg").write_bytes(render(gm, pm.plan).pipe(format="svg"))
    except Exception as exc:  # graphviz's `dot` missing: say so, keep the rest
        say(f"could not draw the plan ({type(exc).__name__}: {exc}); is graphviz installed?")
    say(f"wrote {out}/: plan.svg ops.svg timeline.svg timeline.json simulated.svg plan.json")
