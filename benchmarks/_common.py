"""Shared helpers for the benchmark scripts: machine facts, progress lines, markdown output."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import warnings
from typing import Any

import torch


def machine() -> str:
    """One line naming the machine, the software and the date."""
    cpus = os.cpu_count()
    return (
        f"{platform.node() or 'host'}: {platform.processor() or platform.machine()}, "
        f"{cpus} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{datetime.date.today().isoformat()}"
    )


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def ratio(a: float, b: float) -> str:
    """a / b as '1.23x'."""
    return f"{a / b:.2f}x" if b else "n/a"


def zero_target(w: Any) -> torch.Tensor:
    """A zero target the workload's loss accepts (found on the meta device)."""
    with torch.no_grad():
        out = w.model(*w.example_inputs)
    for shape, dtype in ((out.shape[:-1], torch.long), (out.shape, out.dtype)):
        try:
            with warnings.catch_warnings():  # e.g. MSE broadcasting [B, 1] against [B]
                warnings.simplefilter("error")
                w.loss_fn(out, torch.zeros(shape, dtype=dtype, device="meta"))
        except (RuntimeError, ValueError, UserWarning):
            continue
        return torch.zeros(shape, dtype=dtype)
    raise ValueError(f"no zero target fits the loss of an output shaped {list(out.shape)}")
