"""train: the example training loop behind `graphpipe run` and `python -m models.<name>`.

    graphpipe run models.mmt --devices 2                 # the cpu preset, 40 steps
    graphpipe run models.mmt --devices 4 --dp 2          # pp 2 x dp 2: stages sharded by FSDP2
    python -m models.dlrm --devices 2 --schedule zb --steps 50

Every rank builds the same workload and draws the same synthetic mini-batches; graphpipe.compile
plans it on rank 0 (op times measured on this machine by default) and every step trains it
pipelined. Rank 0 shows a progress bar (loss, samples/s, ETA) on a terminal, and a line per
step (loss, samples/s, step time) otherwise. At the end it
prints the plan table and the measured vs simulated step time, and writes into `out`:

    plan.svg         the stage graph          ops.svg        the op graph, by stage
    timeline.svg     the last steps, measured  timeline.json  the same, Chrome/Perfetto trace
    simulated.svg    the schedule, simulated   plan.json      the plan
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from graphpipe._units import format_time
from graphpipe.compile import RuntimeConfig, schedule_for
from graphpipe.compile import compile as pipeline
from graphpipe.errors import ConfigError
from graphpipe.planning.partition import micro_batch_size
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.clip import check_clipping
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.calibrate import calibrated, measure_link
from graphpipe.tools.render import render
from graphpipe.tools.report import modules_of, plan_summary, plan_table
from graphpipe.tools.timeline import chrome_trace, timeline_svg
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

__all__ = ["TrainConfig", "TrainResult", "train"]

PROFILES = ("measure", "flops")
RECORDED_STEPS = 2  # the last steps whose actions the measured timeline shows


@dataclass(frozen=True)
class TrainConfig:
    """One example run."""

    model: str  # models.NAME or path/file.py:function
    preset: str = "cpu"  # the workload preset
    options: dict[str, Any] = field(default_factory=dict)  # workload options
    devices: int = 2  # processes, one stage (or replica) each; pp x dp with a mesh
    data_parallel: int = 1  # dp: > 1 is a (devices / dp, dp) mesh, stages sharded by FSDP2
    schedule: str | None = None  # None: 1f1b, or the one the weight policy needs
    weights: str = "flush"
    steps: int = 40
    lr: float = 3e-3  # Adam's learning rate
    micro_batches: int | None = None  # default: the preset's
    profile: str = "measure"  # op times for planning: "measure" (this machine) or "flops"
    replication: bool = False  # allow data-parallel stages (off: a pipeline of distinct stages)
    out: str | None = None  # where pictures go; None: runs/<model name>
    seed: int = 0
    timeout: float = 120.0  # seconds a receive may wait
    deadline: float = 3600.0  # seconds the whole run may take before every process is stopped
    max_grad_norm: float | None = None  # clip the global gradient norm (compile's argument)
    recompute: bool | str = False  # activation checkpointing: True, False or "auto"
    compile_stages: bool = False  # torch.compile each stage
    precision: str | None = None  # "bf16" or "fp16" (compile's argument); None: float32

    def __post_init__(self) -> None:
        """Refuse bad settings here, in the launching process: one error, not one per rank.

        Raises:
            ConfigError: the first bad setting, naming its value.
        """
        positive = {"devices": self.devices, "steps": self.steps, "lr": self.lr}
        positive |= {"data_parallel": self.data_parallel}
        positive |= {"timeout": self.timeout, "deadline": self.deadline}
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name}={value!r} must be positive")
        m = self.micro_batches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ConfigError(f"micro_batches={m!r} must be a positive integer")
        if self.profile not in PROFILES:
            raise ConfigError(f"profile={self.profile!r}; known: {list(PROFILES)}")
        if self.devices % self.data_parallel:
            raise ConfigError(
                f"data_parallel={self.data_parallel} does not divide devices={self.devices} "
                "into pp x dp"
            )
        schedule_for(self.weights, self.schedule)
        check_clipping(self.max_grad_norm, 2.0, self.weights)


@dataclass(frozen=True)
class TrainResult:
    """What rank 0 saw."""

    losses: list[float]
    step_times: list[float]
    simulated_step: float
    out: str


def train(config: TrainConfig) -> TrainResult:
    """Run the example on `config.devices` local processes.

    Raises:
        ConfigError: a bad model, preset, option or micro-batch count (checked here once,
            on the meta device, before any process starts).
        PipelineError: a rank failed (the message says which and why).
    """
    _check_workload(config)
    results = launch(
        _rank_main,
        config.devices,
        args=(config,),
        timeout=config.deadline,
        comm_timeout=config.timeout,
    )
    result: TrainResult = results[0]
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
    m = config.micro_batches or w.micro_batches
    rows, dp = micro_batch_size(w.batch_size, m), config.data_parallel
    if rows % dp:
        raise ConfigError(
            f"data_parallel={dp} does not divide a micro-batch of {rows} rows (batch "
            f"{w.batch_size} / M {m}): each dp rank takes 1/dp of every micro-batch"
        )


def _rank_main(config: TrainConfig) -> TrainResult | None:
    w = load_workload(config.model, config.preset, seed=config.seed, **config.options)
    # for the report, traced before compile: under a mesh FSDP2 wraps the model's modules
    gm = trace(w.model, w.example_inputs, w.leaf_modules)
    pm = pipeline(
        w.model,
        w.example_inputs,
        loss_fn=w.loss_fn,
        optimizer=functools.partial(torch.optim.Adam, lr=config.lr),
        micro_batches=config.micro_batches or w.micro_batches,
        schedule=config.schedule,
        weights=config.weights,
        leaf_modules=w.leaf_modules,
        profile_config=ProfileConfig(mode=config.profile, warmup=2, repeats=5),
        runtime=RuntimeConfig(timeout=config.timeout),
        replication=config.replication,
        data_parallel=config.data_parallel if config.data_parallel > 1 else None,
        max_grad_norm=config.max_grad_norm,
        recompute=config.recompute,
        compile_stages=config.compile_stages,
        precision=config.precision,
    )
    first = dist.get_rank() == 0  # pm.rank is the plan device: dp ranks share it
    say = _printer(first)
    say(f"{config.model} ({config.preset}): {plan_summary(pm.plan)}")
    gen = torch.Generator().manual_seed(config.seed + 1)
    losses, times = [], []
    bar = progress_bar(first, config.steps)
    for step in range(config.steps):
        inputs, target = w.make_batch(gen)
        pm.recording = step >= config.steps - RECORDED_STEPS
        start = time.perf_counter()
        loss = pm.step(*inputs, target=target)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        rate = w.batch_size / times[-1]
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.1f}")
            bar.update(1)
        else:
            say(
                f"step {step + 1:>4}/{config.steps}  loss {loss:.4f}  "
                f"{rate:8.1f} samples/s  {times[-1] * 1e3:7.1f} ms"
            )
    if bar is not None:
        bar.close()
    measured = pm.timeline()
    link = measure_link() if pm.plan.num_devices > 1 else None
    if not first:
        return None
    simulated = simulate(calibrated(pm.plan, measured, link), pm.schedule.name)
    out = Path(config.out or f"runs/{w.name}")
    _report(pm, gm, losses, times, measured, simulated, out, say)
    return TrainResult(losses, times, simulated.iteration_time, str(out))


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
