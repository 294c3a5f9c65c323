"""Convergence of the weight policies: a student regressing a fixed random teacher, 2 ranks.

    python -m benchmarks.convergence             # about a minute; writes convergence.svg

The model is a two-tower network (two branches of 3 x Linear(256) + Tanh, concatenated, a
head); the teacher has the same shape and other random weights; inputs are fresh random
batches (64 samples, 4 micro-batches), the loss is MSE. Every policy starts from the same
weights and sees the same batches, with Adam (lr 3e-3), on 2 processes (branch a | branch b
and the head). Reported per policy: the loss after the last step, the steps and the seconds
until the loss (averaged over 5 steps) first falls below a quarter of the first step's, and
the throughput. A policy that never gets there is reported as such.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from benchmarks._common import log, machine
from benchmarks._plot import line_chart, stacked
from graphpipe.compile import compile as pipeline
from graphpipe.planning.partition import plan
from graphpipe.runtime.launch import launch
from graphpipe.runtime.weights import PolicyOptions

STEPS, BATCH, M, WIDTH = 150, 64, 4, 256
RUNS = {  # label -> (weights, schedule, PipeMare options)
    "flush 1f1b": ("flush", "1f1b", None),
    "flush zb": ("flush", "zb", None),
    "stash": ("stash", "async", None),
    "2bw": ("2bw", "2bw", None),
    "pipemare": ("pipemare", "async", PolicyOptions(warmup_updates=100)),
    "pipemare, no fixes": ("pipemare", "async", PolicyOptions(False, False)),
}


class Towers(nn.Module):
    """Two branches of 3 x Linear + Tanh, concatenated, then a linear head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.a, self.b = _tower(), _tower()
            self.head = nn.Linear(2 * WIDTH, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(x), self.b(x)], dim=-1))


def _tower() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    teacher, gen = Towers(seed=123), torch.Generator().manual_seed(5)
    out = []
    with torch.no_grad():
        for _ in range(STEPS):
            x = torch.randn(BATCH, WIDTH, generator=gen)
            out.append((x, teacher(x)))
    return out


def _train(label: str) -> dict[str, Any]:
    weights, schedule, options = RUNS[label]
    model, batches = Towers(seed=0), _batches()
    pins = {"a": 0, "b": 1, "cat": 1, "head": 1}
    the_plan = plan(model, batches[0][0], devices=2, micro_batches=M, pins=pins)
    pm = pipeline(
        model,
        batches[0][0],
        loss_fn=F.mse_loss,
        plan=the_plan,
        weights=weights,
        schedule=schedule,
        weight_options=options,
        optimizer=functools.partial(torch.optim.Adam, lr=3e-3),
    )
    losses, clock = [], []
    start = time.perf_counter()
    for x, y in batches:
        losses.append(pm.step(x, target=y))
        clock.append(time.perf_counter() - start)
    return {"losses": losses, "clock": clock}


def _reached(losses: list[float], clock: list[float]) -> tuple[str, str]:
    target = losses[0] / 4
    for i in range(4, len(losses)):
        if statistics.mean(losses[i - 4 : i + 1]) <= target:
            return str(i + 1), f"{clock[i]:.2f}"
    return "not reached", "not reached"


def report(out: Path = Path("benchmarks")) -> str:
    """The table, and the plot written to `out`/convergence.svg."""
    runs = {}
    for label in RUNS:
        log(f"policy {label}")
        runs[label] = launch(_train, 2, args=(label,))[0]
    rows = []
    for label, r in runs.items():
        steps, seconds = _reached(r["losses"], r["clock"])
        step_time = statistics.median(b - a for a, b in itertools.pairwise(r["clock"]))
        rows.append(
            [
                label,
                f"{r['losses'][0]:.4f}",
                f"{r['losses'][-1]:.4f}",
                steps,
                seconds,
                f"{BATCH / step_time:,.0f}",
            ]
        )
    by_step = {k: list(enumerate(r["losses"], 1)) for k, r in runs.items()}
    by_time = {k: list(zip(r["clock"], r["losses"], strict=True)) for k, r in runs.items()}
    out.mkdir(parents=True, exist_ok=True)
    charts = [
        line_chart(by_step, "loss vs step", "step", "MSE (log)"),
        line_chart(by_time, "loss vs time", "seconds", "MSE (log)"),
    ]
    (out / "convergence.svg").write_text(stacked(charts))
    table = tabulate(
        rows,
        headers=[
            "policy",
            "first loss",
            "last loss",
            "steps to 1/4",
            "seconds to 1/4",
            "samples/s",
        ],
        tablefmt="github",
    )
    return (
        f"## Weight policies: convergence on 2 CPU processes\n\n{machine()}\n\n"
        f"Command: `python -m benchmarks.convergence` (plot: convergence.svg)\n\n{table}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table and write the plot."""
    print(report())


if __name__ == "__main__":
    main()
