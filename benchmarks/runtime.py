"""Runtime benchmark on CPU: 2 processes, one thread each, gloo on 127.0.0.1.

    python -m benchmarks.runtime            # about two minutes

Three measurements, each the median step time after warm-up steps:

1. graphpipe vs torch.distributed.pipelining's Schedule1F1B on the same sequential 2-stage
   split of an MLP (8 x Linear(1024) + ReLU, batch 256, 4 micro-batches).
2. A two-branch model (two towers of 4 x Linear(768) + ReLU, concatenated, a head): the
   graph plan (op times measured on this machine) vs PyTorch's best sequential split
   (branch a | branch b and the head; the input is passed through stage 0 because PyTorch's
   stages only read their predecessor, and stage 1 computes h * 1.0 to work around its
   failure on non-contiguous gradients), and vs plain training in one process with one
   thread (2 processes can at most double it).
3. Simulated vs measured step time of graphpipe on the two-branch model: costs calibrated
   from a measured timeline (per-action medians, waits excluded) and a ping-pong of the link;
   the simulator then has to predict the bubbles, transfers and order.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from benchmarks._common import log, machine, ratio
from graphpipe.calibrate import calibrated, measure_link
from graphpipe.compile import compile as pipeline
from graphpipe.launch import launch
from graphpipe.partition import plan
from graphpipe.profile import ProfileConfig
from graphpipe.simulate import simulate

BATCH, M, WARMUP, STEPS = 256, 4, 5, 20


def mlp(width: int = 1024, depth: int = 8) -> nn.Sequential:
    """The sequential baseline model."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])


class TwoTowers(nn.Module):
    """x -> tower a | tower b -> concatenate -> head."""

    def __init__(self, width: int = 768, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = mlp(width, depth)
        self.b = mlp(width, depth)
        self.head = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(x), self.b(x)], dim=-1))


def _data(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)


def _timed(step: Callable[[], Any]) -> float:
    times = []
    for _ in range(WARMUP + STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


# -- graphpipe -------------------------------------------------------------------------------


def _graphpipe(model_name: str, pins: dict[str, int] | None) -> dict[str, float]:
    model = mlp() if model_name == "mlp" else TwoTowers()
    x, y = _data(1024 if model_name == "mlp" else 768)
    options: dict[str, Any] = (
        {"plan": plan(model, x, devices=2, micro_batches=M, pins=pins)}
        if pins
        else {"replication": False, "profile_config": ProfileConfig(mode="measure")}
    )
    pm = pipeline(
        model,
        x,
        loss_fn=F.mse_loss,
        micro_batches=M,
        schedule="1f1b",
        optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
        **options,
    )
    measured = _timed(lambda: pm.step(x, target=y))
    pm.recording = True
    for _ in range(5):
        pm.step(x, target=y)
    timeline = pm.timeline()
    link = measure_link()
    predicted = simulate(calibrated(pm.plan, timeline, link), pm.schedule.name)
    return {
        "step": measured,
        "simulated": predicted.iteration_time,
        "latency": link.latency,
        "bandwidth": link.bandwidth,
    }


# -- torch.distributed.pipelining --------------------------------------------------------------


class _PassThrough(nn.Module):
    """Stage 0 of the sequential two-tower split: tower a, and x for the next stage."""

    def __init__(self, model: TwoTowers) -> None:
        super().__init__()
        self.a = model.a

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), x


class _Rest(nn.Module):
    """Stage 1: tower b on the passed-through x, then the head."""

    def __init__(self, model: TwoTowers) -> None:
        super().__init__()
        self.b, self.head = model.b, model.head

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # `* 1.0`: the gradient cat gives h is a non-contiguous view, which PyTorch's
        # pipelining cannot send back over gloo ("input tensor has to be contiguous")
        return self.head(torch.cat([h * 1.0, self.b(x)], dim=-1))


def _torch_pipelining(model_name: str) -> dict[str, float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = dist.get_rank()
    if model_name == "mlp":
        model = mlp()
        part: nn.Module = model[:4] if rank == 0 else model[4:]
        width = 1024
    else:
        towers = TwoTowers()
        part = _PassThrough(towers) if rank == 0 else _Rest(towers)
        width = 768
    x, y = _data(width)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)

    def step() -> None:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
        opt.zero_grad()

    return {"step": _timed(step)}


def _single_process() -> float:
    torch.set_num_threads(1)
    model = TwoTowers()
    x, y = _data(768)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return _timed(step)


def _sequential_pins() -> dict[str, int]:
    return {str(i): 0 if i < 4 else 1 for i in range(8)}


def report() -> str:
    """All three tables as one markdown section."""
    log("MLP: graphpipe")
    gp_mlp = launch(_graphpipe, 2, args=("mlp", _sequential_pins()))[0]
    log("MLP: torch.distributed.pipelining")
    pt_mlp = launch(_torch_pipelining, 2, args=("mlp",))[0]
    log("two towers: graphpipe")
    gp_two = launch(_graphpipe, 2, args=("two", None))[0]
    log("two towers: torch.distributed.pipelining")
    pt_two = launch(_torch_pipelining, 2, args=("two",))[0]
    log("two towers: one process")
    single = _single_process()
    rows = [
        [
            "MLP, same 2-stage split",
            "graphpipe 1f1b",
            _rate(gp_mlp["step"]),
            "torch pipelining Schedule1F1B",
            _rate(pt_mlp["step"]),
            ratio(pt_mlp["step"], gp_mlp["step"]),
        ],
        [
            "two towers",
            "graphpipe graph plan",
            _rate(gp_two["step"]),
            "torch pipelining, best sequential split",
            _rate(pt_two["step"]),
            ratio(pt_two["step"], gp_two["step"]),
        ],
        [
            "two towers",
            "graphpipe graph plan",
            _rate(gp_two["step"]),
            "one process, one thread",
            _rate(single),
            ratio(single, gp_two["step"]),
        ],
    ]
    sims = [
        [
            name,
            f"{r['step'] * 1e3:.2f}",
            f"{r['simulated'] * 1e3:.2f}",
            f"{(r['simulated'] - r['step']) / r['step']:+.0%}",
        ]
        for name, r in (("MLP", gp_mlp), ("two towers", gp_two))
    ]
    link = (
        f"gloo loopback: latency {gp_two['latency'] * 1e6:.0f} us, "
        f"bandwidth {gp_two['bandwidth'] / 1e9:.2f} GB/s"
    )
    return (
        f"## Runtime: 2 CPU processes, one thread each\n\n{machine()}\n\n"
        f"Command: `python -m benchmarks.runtime`\n\n"
        + tabulate(
            rows,
            headers=["model", "ours", "samples/s", "baseline", "samples/s", "speed-up"],
            tablefmt="github",
        )
        + "\n\nSimulated vs measured step time (graphpipe, 1f1b; "
        + link
        + ")\n\n"
        + tabulate(
            sims, headers=["model", "measured ms", "simulated ms", "error"], tablefmt="github"
        )
        + "\n"
    )


def _rate(step: float) -> str:
    return f"{BATCH / step:,.0f}"


def main(argv: Sequence[str] | None = None) -> None:
    """Print the tables."""
    print(report())


if __name__ == "__main__":
    main()
