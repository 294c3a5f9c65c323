"""Parameter memory of a meta model on a pp2 x dp2 mesh, measured on 4 local processes.

    python -m benchmarks.mesh_memory                 # 2 GiB of fp32 linear blocks
    python -m benchmarks.mesh_memory --init          # values from an init callback instead

A model of `--blocks` blocks (Linear(width, width) and Tanh; 32 x 4096 by default: 2 GiB of
fp32 parameters) is built under torch.device("meta") on every rank, compiled over a
("pp", "dp") = (2, 2) mesh with each half of the blocks pinned to one pp device, and given
its values by reset_parameters() (or `--init`: a callback drawing each tensor whole, whose
documented peak is the whole stage). Each rank prints its local parameter bytes (the sum of
`p.to_local().numel() * element_size` over its stage's parameters), its stage's whole bytes,
and its resident memory: before compile, at its peak during compile (Linux's VmHWM, reset
just before compile) and at its peak during one training step. Not part of the test suite
(tests/test_mesh_meta.py holds the small, asserted version); about a minute on 2 CPUs.
"""

from __future__ import annotations

import argparse
import functools
import re
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._common import log, machine
from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch

MIB = 2**20
ROWS = 8  # mini-batch rows: 2 micro-batches of 4, 2 rows per dp rank


def blocks(width: int, count: int) -> nn.Module:
    """`count` blocks of Linear(width, width) and Tanh, in a Sequential (each an FSDP unit)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count)])


def init_by_name(model: nn.Module) -> None:
    """Every real parameter drawn whole from a generator seeded by its name."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_meta:
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


def _status(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM), in bytes."""
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(found.group(1)) * 1024 if found else 0


def _reset_peak() -> None:
    """Make Linux's high-water mark of resident memory (VmHWM) the current VmRSS."""
    Path("/proc/self/clear_refs").write_text("5")


def _worker(width: int, count: int, use_init: bool) -> dict[str, Any]:
    """Build on meta, compile over pp2 x dp2, one step; this rank's bytes and memory."""
    with torch.device("meta"):
        model = blocks(width, count)
    x = torch.randn(ROWS, width, generator=torch.Generator().manual_seed(0))
    before = _status("VmRSS")
    _reset_peak()
    pm = gp_compile(
        model,
        x,
        loss_fn=F.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.01),
        micro_batches=2,
        pins={str(i): i * 2 // count for i in range(count)},
        dp=2,
        init_weights=init_by_name if use_init else None,
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=300),
    )
    compile_peak = _status("VmHWM")
    params = list(pm.module.parameters())
    _reset_peak()
    pm.step(x, target=torch.zeros_like(x))
    return {
        "rank": dist.get_rank(),
        "coords": (pm.rank, dist.get_rank() % 2),  # dp=2: mesh rows of 2 ranks
        "local": sum(p.to_local().numel() * p.element_size() for p in params),
        "stage": sum(p.numel() * p.element_size() for p in params),  # whole (global) shape
        "before": before,
        "compile_peak": compile_peak,
        "step_peak": _status("VmHWM"),
    }


def report(width: int = 4096, count: int = 32, use_init: bool = False) -> str:
    """Run the 4 processes and return the figures as a markdown table."""
    total = count * (width * width + width) * 4
    log(f"mesh memory: {total / MIB:.0f} MiB model on pp2 x dp2 (init={use_init})")
    results = launch(_worker, 4, args=(width, count, use_init), timeout=600, comm_timeout=300)
    way = "an init callback (whole tensors)" if use_init else "reset_parameters()"
    lines = [
        f"## Parameter memory on a pp2 x dp2 mesh ({way})",
        "",
        f"{machine()}; `python -m benchmarks.mesh_memory{' --init' if use_init else ''}`",
        "",
        f"Model: {count} blocks of Linear({width}, {width}) built on meta, "
        f"{total / MIB:.0f} MiB of fp32 parameters; 1/(pp * dp) = {total / 4 / MIB:.0f} MiB.",
        "",
        "| rank | (pp, dp) | stage whole MiB | local params MiB | RSS before compile MiB "
        "| peak RSS in compile MiB (+growth) | peak RSS in a step MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r["rank"]):
        grown = r["compile_peak"] - r["before"]
        lines.append(
            f"| {r['rank']} | {r['coords']} | {r['stage'] / MIB:.0f} | {r['local'] / MIB:.1f} "
            f"| {r['before'] / MIB:.0f} | {r['compile_peak'] / MIB:.0f} (+{grown / MIB:.0f}) "
            f"| {r['step_peak'] / MIB:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--init", action="store_true", help="an init callback, not reset")
    args = parser.parse_args()
    print(report(args.width, args.blocks, args.init))


if __name__ == "__main__":
    main()
