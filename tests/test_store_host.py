"""The store host's death, named by every survivor (issue 29, item 2); and a stopped rank,
named by the store host within the timeout + 2 s as elsewhere.

Launched without a launcher's store (as under SLURM's srun with env://), rank 0 serves the
TCPStore that holds the failure board, and its death takes the board along. In the 3-rank
fan-in (two_branch: branch a on rank 0, branch b on rank 1, the head on rank 2) rank 0 is
killed between two steps or in its forward: rank 2 sees rank 0's connection close, rank 1
only sees rank 2 stop after it. Both must name rank 0, the store's host, within seconds,
and rank 1 must not blame rank 2, which only stopped because rank 0 died.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_failures import MATRIX_PINS, _clock_waits
from training import batch, optimizer_for
from zoo import ZOO, dict_loss

from graphpipe._torch import AGENT_STORE_ENV
from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import FailureKind, PipelineError

WORLD, LIMIT = 3, 120  # ranks; seconds the whole test may take
WAITED = 60  # RuntimeConfig.timeout: what a survivor left waiting for rank 0 would wait
TOLD = WAITED / 2  # a survivor told of the death: under a second idle, seconds when loaded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STALL = 3.0  # RuntimeConfig.timeout when rank 1 stops


def _worker(rank: int, port: int, out: str, moment: str) -> None:
    """One rank under env:// (rank 0 serves the store); rank 0 dies at `moment` of step 2,
    or ("stops") rank 1 stops (SIGSTOP) as it enters that step's loss all-reduce, and the
    survivors, rank 0 among them, time out waiting for it. A survivor writes its error's
    seconds (from step 2's start; when a rank stops, from its last wait's), fields and text
    to out/rank<r>."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ.pop(AGENT_STORE_ENV, None)
    torch.set_num_threads(1)
    stops = moment == "stops"
    model, inputs = ZOO["two_branch"]()
    pm = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=optimizer_for(),
        micro_batches=4,
        pins=MATRIX_PINS[WORLD],
        runtime=RuntimeConfig(timeout=STALL if stops else WAITED),
    )
    inputs, target = batch("two_branch", 0)
    pm.step(*inputs, target=target)
    if stops and rank == 1:
        stop = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGSTOP)  # noqa: E731
        pm._collectives.all_reduce = stop  # type: ignore[attr-defined]
    elif not stops and rank == 0:
        _arm(pm, moment)
    waits, start = _clock_waits(), time.monotonic()
    try:
        pm.step(*inputs, target=target)
    except PipelineError as exc:
        seconds = time.monotonic() - (waits[-1] if stops else start)
        fields = f"{exc.kind.value}|{exc.origin}|{exc.peers}"
        Path(out, f"rank{rank}").write_text(f"{seconds}\n{fields}\n{exc}")
        os._exit(1)
    except RuntimeError:  # rank 0's own error, posted by the executor
        os._exit(1)


def _die(*args: object, **kwargs: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _boom(*args: object, **kwargs: object) -> None:
    raise RuntimeError("boom in the stage")


def _arm(pm: object, moment: str) -> None:
    if moment == "between_steps":
        _die()
    for stage in pm._executor.stages.values():  # type: ignore[attr-defined]
        stage.module.forward = _boom if moment == "raises" else _die  # its next forward


def _run(
    moment: str, out: Path, survivors: tuple[int, ...] = (1, 2)
) -> dict[int, tuple[float, str, str]]:
    """Each survivor's seconds to its error, its fields and its text."""
    context = mp.start_processes(
        _worker,
        args=(_free_port(), str(out), moment),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    assert context is not None
    deadline = time.monotonic() + LIMIT
    awaited = [context.processes[r] for r in survivors]  # a stopped rank never exits
    while any(p.is_alive() for p in awaited) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in context.processes:  # none should be left; stop any that is
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    reports = {r: (out / f"rank{r}").read_text().split("\n", 2) for r in survivors}
    return {r: (float(seconds), fields, text) for r, (seconds, fields, text) in reports.items()}


@pytest.mark.parametrize("moment", ["between_steps", "forward"])
def test_every_survivor_names_the_dead_store_host(moment: str, tmp_path: Path) -> None:
    for rank, (seconds, fields, text) in _run(moment, tmp_path).items():
        assert seconds < TOLD, (rank, text)  # named, not left to time out
        assert fields == f"{FailureKind.DIED.value}|0|(0,)", (rank, fields, text)
        assert "rank 0, which served the store, is gone with it" in text, (rank, text)
        assert "rank 2 closed its connection" not in text, (rank, text)


def test_the_store_host_names_a_stopped_rank_within_the_timeout_and_two_seconds(
    tmp_path: Path,
) -> None:
    """Rank 0, serving the store, waits after its post for the others in a wait to read it,
    but not for a rank in none, as the stopped one (it waited SETTLE s for it: + 5 s)."""
    for rank, (seconds, fields, text) in _run("stops", tmp_path, survivors=(0, 2)).items():
        assert seconds < STALL + 2, (rank, seconds, text)  # from its last wait's start
        assert "rank 1 waits for no rank and posted no failure" in text, (rank, text)
        # its own timeout, or the other survivor's quoted (whichever posted first)
        kinds = (FailureKind.TIMED_OUT.value, FailureKind.ECHO.value)
        assert fields.split("|")[0] in kinds, (rank, fields, text)


def test_every_survivor_quotes_the_store_hosts_own_error(tmp_path: Path) -> None:
    """Rank 0 raises and exits: its post must reach the others before its store goes."""
    for rank, (seconds, fields, text) in _run("raises", tmp_path).items():
        assert seconds < TOLD, (rank, text)
        assert fields.startswith(f"{FailureKind.ECHO.value}|0|"), (rank, fields, text)
        assert "RuntimeError: boom in the stage" in text, (rank, text)
