"""graphpipe.launch itself: its start methods, the environment workers see, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from graphpipe.errors import ConfigError, FailureKind, PipelineError
from graphpipe.runtime.launch import START_METHODS, _alive, launch

TESTS = Path(__file__).parent


def _rank() -> int:
    return dist.get_rank()


def _variable(name: str) -> str | None:
    return os.environ.get(name)


def _sleeper(folder: str) -> None:
    """Say this worker's pid, then outlive any test."""
    Path(folder, str(dist.get_rank())).write_text(str(os.getpid()))
    time.sleep(120)


@pytest.mark.parametrize("method", START_METHODS)
def test_each_start_method_runs_every_rank(method: str) -> None:
    assert launch(_rank, 2, start_method=method, timeout=60) == [0, 1]


def _speak() -> int:
    """Write a line to stdout and to stderr (through sys, as print does)."""
    print(f"out {dist.get_rank()}", flush=True)
    print(f"err {dist.get_rank()}", file=sys.stderr, flush=True)
    return dist.get_rank()


@pytest.mark.parametrize("method", START_METHODS)
def test_a_worker_writes_to_the_launchers_stdout_and_stderr(method: str) -> None:
    """Under "spawn" each worker closed its own stderr (the handed descriptor kept its
    number, 2, and was closed after installing it on itself): its first write to stderr
    raised EBADF."""
    script = (
        "from test_launch import _speak\n"
        "from graphpipe.runtime.launch import launch\n"
        f"if __name__ == '__main__':\n    print(launch(_speak, 2, start_method={method!r}, "
        "timeout=60))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # the two workers' lines may interleave ("out 1out 0"): each is looked for as text
    assert all(text in done.stdout for text in ("out 0", "out 1", "[0, 1]"))
    assert all(text in done.stderr for text in ("err 0", "err 1"))


def _nap() -> None:
    time.sleep(60)


def test_a_run_past_launchs_timeout_is_stopped_naming_the_limit() -> None:
    with pytest.raises(PipelineError, match=r"passed launch's timeout of 3 s") as err:
        launch(_nap, 2, timeout=3)
    assert err.value.kind is FailureKind.TIMED_OUT


def test_an_unknown_start_method_is_named() -> None:
    with pytest.raises(ConfigError, match=r"start_method must be one of .*got 'fork'"):
        launch(_rank, 2, start_method="fork")


def test_workers_see_the_launchers_environment_at_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forked from a server started before the variable was set, they still see it (and no
    longer see it once it is gone), as spawned workers would."""
    name = "GRAPHPIPE_TEST_LAUNCH_VARIABLE"
    launch(_rank, 2, timeout=60)  # the fork server is running from here on
    monkeypatch.setenv(name, "set at the call")
    assert launch(_variable, 2, args=(name,), timeout=60) == ["set at the call"] * 2
    monkeypatch.delenv(name)
    assert launch(_variable, 2, args=(name,), timeout=60) == [None, None]


def test_workers_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """A worker forked from the fork server is not the launcher's child: it watches the
    launcher's pid, and stops within seconds of the launcher's SIGKILL."""
    script = (
        "from test_launch import _sleeper\n"
        "from graphpipe.runtime.launch import launch\n"
        f"launch(_sleeper, 2, args=({str(tmp_path)!r},), timeout=300)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    launcher = subprocess.Popen([sys.executable, "-c", script], env=env)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            files = [tmp_path / str(r) for r in range(2)]
            pids = [int(f.read_text()) for f in files if f.exists() and f.read_text()]
            time.sleep(0.1)
        assert len(pids) == 2, "the workers did not start"
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        # the orphan watch polls each second; a worker it missed would sleep on to _sleeper's
        # 120 s, so 60 s is room for a loaded machine, not a tight margin
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]
    finally:
        launcher.kill()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
