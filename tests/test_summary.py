"""compile's one line of what it chose (`graphpipe.compile.summary`), and the defaults the
API and the CLI share: a pipeline of distinct stages unless replication is asked for."""

from __future__ import annotations

import functools

import pytest
import torch
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.runtime.spec import RunSpec
from graphpipe.tools.train import TrainConfig

SGD = functools.partial(torch.optim.SGD, lr=0.1)


pytestmark = pytest.mark.usefixtures("one_rank")  # conftest: a one-rank gloo group


def test_compile_says_in_one_line_what_it_chose(capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs = ZOO["two_branch"]()
    pm = gp_compile(model, inputs, loss_fn=dict_loss, optimizer=SGD, micro_batches=4)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("graphpipe.compile")]
    assert len(lines) == 1, lines
    n = len(pm.plan.stages)
    assert lines[0].startswith(
        f"graphpipe.compile: {n} stage{'s' * (n != 1)} over 1 ranks (mesh none), layout "
    ), lines[0]
    for said in ("schedule 1f1b (", "M=4 x 2 rows", "weights flush", "fp32", "recompute none"):
        assert said in lines[0], lines[0]
    assert "no replicas (replication=False" in lines[0]


def test_a_named_schedule_is_said_to_be_named(capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs = ZOO["two_branch"]()
    gp_compile(model, inputs, loss_fn=dict_loss, optimizer=SGD, micro_batches=4, schedule="gpipe")
    assert "schedule gpipe (named)" in capsys.readouterr().err


def test_quiet_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs = ZOO["two_branch"]()
    quiet = RuntimeConfig(quiet=True)
    gp_compile(model, inputs, loss_fn=dict_loss, optimizer=SGD, micro_batches=4, runtime=quiet)
    assert "graphpipe.compile" not in capsys.readouterr().err


def test_compile_and_graphpipe_run_plan_a_pipeline_by_default() -> None:
    _, inputs = ZOO["two_branch"]()
    spec = RunSpec.build(inputs, loss_fn=dict_loss, optimizer=SGD, micro_batches=4)
    assert spec.plan_options["replication"] is False
    assert TrainConfig(model="models.mmt").option("replication") is False
    asked = RunSpec.build(
        inputs, loss_fn=dict_loss, optimizer=SGD, micro_batches=4, replication=True
    )
    assert asked.plan_options["replication"] is True
