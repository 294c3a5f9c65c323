"""The test suite beside a CPU hog: does it pass, and how long does it take.

    python -m benchmarks.under_load                      # twice, one hog, the whole suite
    python -m benchmarks.under_load --runs 1 --hogs 0    # alone, for the time on idle cores
    python -m benchmarks.under_load -- tests/test_mesh.py   # part of the suite

Users run the suite beside other work, so it must hold on a loaded machine: no assert on a
wall-clock duration that load stretches, timeouts with room. Each hog is a process spinning
on one core (pure Python, no sleep) from before the run starts until it ends. Prints, per
run, the outcome line pytest printed and the wall time, and the machine's cores.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


def _spin(stop: mp.synchronize.Event) -> None:
    """Keep one core busy until `stop` is set."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


def _run(pytest_args: Sequence[str]) -> tuple[int, str, float]:
    """One suite run: its exit status, pytest's last line (after each FAILED or ERROR
    line), and its wall seconds."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    last = lines[-1] if lines else done.stderr[-200:]
    return done.returncode, "\n".join([*failed, last]), time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="suite runs in a row (default: 2)")
    parser.add_argument("--hogs", type=int, default=1, help="busy processes beside (default: 1)")
    parser.add_argument("pytest_args", nargs="*", help="what to pass to pytest (default: all)")
    args = parser.parse_args(argv)
    print(f"cores: {os.cpu_count()}, hogs: {args.hogs}, runs: {args.runs}", flush=True)
    stop = mp.get_context("spawn").Event()
    hogs = [mp.get_context("spawn").Process(target=_spin, args=(stop,)) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    failed = 0
    try:
        for i in range(args.runs):
            code, last, seconds = _run(args.pytest_args)
            failed += code != 0
            print(f"run {i + 1}: exit {code} in {seconds:.0f} s: {last}", flush=True)
    finally:
        stop.set()
        for hog in hogs:
            hog.join(timeout=5)
            if hog.is_alive():
                hog.kill()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
