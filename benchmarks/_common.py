"""Shared helpers for the benchmark scripts: machine facts, progress lines, markdown output."""

from __future__ import annotations

import datetime
import os
import platform
import sys

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
