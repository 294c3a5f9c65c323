"""Every bad input is refused at compile or step time, with a typed error naming the value.

Compile-time and step-time refusals run in this process, in a one-rank gloo group: they are
decided before any communication, from what every rank sees alike. The refusals only a rank
can detect (a non-finite loss or gradient, `nan_check=True`) run in one 2-rank launch, where
every rank must raise the same PipelineError and none may be left waiting.
"""

from __future__ import annotations

import functools
import importlib
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError, FailureKind, PipelineError, PlanError
from graphpipe.planning.partition import plan
from graphpipe.runtime.launch import launch
from graphpipe.tools.cli import main

TIMEOUT = 240  # seconds for the launch
SGD = functools.partial(torch.optim.SGD, lr=0.1)


pytestmark = pytest.mark.usefixtures("one_rank")  # conftest: a one-rank gloo group


def _compile(model: nn.Module, inputs: Any, **kw: Any) -> Any:
    kw.setdefault("loss_fn", dict_loss)
    kw.setdefault("micro_batches", 4)
    return gp_compile(model, inputs, optimizer=SGD, **kw)


class Tokens(nn.Module):
    """A per-position MLP: the same graph traces for any sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class Returns(nn.Module):
    """A model whose forward returns `what(h)`: None, an integer tensor, a string..."""

    def __init__(self, what: Any) -> None:
        super().__init__()
        self.lin, self.what = nn.Linear(16, 16), what

    def forward(self, x: torch.Tensor) -> Any:
        return self.what(self.lin(x))


# -- compile time ----------------------------------------------------------------------------


def test_micro_batches_must_be_a_positive_integer() -> None:
    model, inputs = ZOO["two_branch"]()
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ConfigError, match=f"micro_batches={bad!r}"):
            _compile(model, inputs, micro_batches=bad)


def test_every_bad_argument_is_named_at_once() -> None:
    model, inputs = ZOO["two_branch"]()
    with pytest.raises(ConfigError) as err:
        gp_compile(
            model,
            inputs,
            loss_fn=dict_loss,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            micro_batches=0,
            weights="stash",
            schedule="1f1b",
            precision="fp8",
        )
    message = str(err.value)
    assert message.startswith("4 problems: ")
    for named in ("optimizer=", "micro_batches=0", "schedule='1f1b'", "'fp8'"):
        assert named in message


def test_a_plan_for_another_world_size_or_an_uneven_split_is_refused() -> None:
    model, inputs = ZOO["two_branch"]()
    made = plan(model, inputs, devices=2, micro_batches=4)
    with pytest.raises(ConfigError, match="the plan is for 2 devices but the process group has 1"):
        _compile(model, inputs, plan=made, micro_batches=None)
    with pytest.raises(ConfigError, match="batch of 8 does not split into 3 equal micro-batches"):
        _compile(model, inputs, micro_batches=3)


def test_devices_must_be_the_world_size() -> None:
    model, inputs = ZOO["two_branch"]()
    with pytest.raises(ConfigError, match="devices=2, but the process group has 1 ranks"):
        _compile(model, inputs, devices=2)
    assert _compile(model, inputs, devices=1).plan.num_devices == 1


def test_pins_imply_the_manual_partitioner() -> None:
    model, inputs = ZOO["two_branch"]()
    pm = _compile(model, inputs, pins={"a": 0, "b": 0, "head": 0})
    assert pm.plan.partitioner == "manual"
    with pytest.raises(ConfigError, match="pins=.*partitioner='manual'.*not 'graph'"):
        _compile(model, inputs, partitioner="graph", pins={"a": 0})


def test_a_plan_for_another_batch_shape_or_micro_batch_count_is_refused() -> None:
    model = Tokens()
    x = torch.randn(8, 5, 16)
    made = plan(model, x, devices=1, micro_batches=4)
    assert made.input_shapes == {"x": (2, 5, 16)}  # the micro-batch shapes it was made for
    with pytest.raises(ConfigError, match=r"micro_batches=2, but the plan was made for 4"):
        _compile(model, x, plan=made, micro_batches=2)
    with pytest.raises(ConfigError, match=r"micro-batches of 2 samples.*batch of 16.*gives 4"):
        _compile(model, torch.randn(16, 5, 16), plan=made, micro_batches=None)
    with pytest.raises(
        ConfigError, match=r"input x of shape \[2, 5, 16\].*traces it at \[2, 7, 16\]"
    ):
        _compile(model, torch.randn(8, 7, 16), plan=made, micro_batches=None)
    again = type(made).from_json(made.to_json())
    assert again == made
    assert _compile(model, x, plan=again, micro_batches=None).plan == made


@pytest.mark.parametrize(
    ("what", "named"),
    [
        (lambda h: None, "returned NoneType"),
        (lambda h: (h.argmax(-1), "label"), r"returned tuple.*\[1\] is a str"),
        (lambda h: {"ids": h.argmax(-1)}, "no floating-point tensor"),
    ],
)
def test_a_model_output_that_is_not_tensors_is_refused_at_compile(what: Any, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        _compile(Returns(what), torch.randn(8, 16))


def test_a_nested_output_with_none_entries_is_accepted() -> None:
    pm = _compile(
        Returns(lambda h: (h, {"aux": None, "ids": h.argmax(-1)})),
        torch.randn(8, 16),
        loss_fn=lambda out, t: F.mse_loss(out[0], t),
    )
    assert pm.step(torch.randn(8, 16), target=torch.randn(8, 16)) > 0


def test_nan_check_needs_the_flush_policy() -> None:
    model, inputs = ZOO["two_branch"]()
    with pytest.raises(ConfigError, match="nan_check=True.*weights='stash'"):
        _compile(model, inputs, weights="stash", nan_check=True)


# -- step time -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pm() -> Any:
    model, inputs = ZOO["two_branch"]()
    return _compile(model, inputs)


def _untouched(pm: Any, call: Any) -> str:
    """`call` raises ConfigError before anything runs: no state, parameters as they were."""
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        call()
    assert pm._executor.state == {} and not pm._executor.losses
    after = pm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return str(err.value)


def test_inputs_that_are_not_tensors_are_named(pm: Any) -> None:
    x = torch.randn(8, 16)
    text = _untouched(pm, lambda: pm.step(x.tolist(), target=torch.randn(8, 4)))
    assert "input 0 (x) is a list, not a tensor" in text
    text = _untouched(pm, lambda: pm.step(x.numpy(), target=torch.randn(8, 4)))
    assert "input 0 (x) is a ndarray, not a tensor" in text
    text = _untouched(pm, lambda: pm.step(x.double(), target=torch.randn(8, 4)))
    assert (
        "input x is torch.float64[8, 16], the pipeline was compiled for torch.float32[8, 16]"
        in text
    )
    text = _untouched(pm, lambda: pm.step(torch.randn(10, 16), target=torch.randn(10, 4)))
    assert "input x is [10, 16]: dim 0 is beyond the compiled example's [8, 16]" in text
    text = _untouched(pm, lambda: pm.step(x, x, target=torch.randn(8, 4)))
    assert "got 2 positional inputs, the model was compiled with 1" in text


def test_a_target_without_the_batch_rows_is_named(pm: Any) -> None:
    x = torch.randn(8, 16)
    text = _untouched(pm, lambda: pm.step(x, target=torch.randn(6, 4)))
    assert "target has 6 rows, the batch has 8" in text
    text = _untouched(pm, lambda: pm.step(x, target=torch.tensor(1.0)))
    assert "target is a scalar" in text
    text = _untouched(pm, lambda: pm.step(x, target=[1.0] * 8))
    assert "target holds no tensor" in text and "list" in text
    text = _untouched(pm, lambda: pm.step(x))
    assert "needs target=" in text


@pytest.mark.parametrize(
    ("loss_fn", "named"),
    [
        (lambda out, t: (out - t) ** 2, "loss_fn returned a torch.float32 tensor of shape [2, 4]"),
        (lambda out, t: (out - t).abs().sum().long(), "loss_fn returned a torch.int64 tensor"),
        (lambda out, t: {"loss": F.mse_loss(out, t)}, "loss_fn returned a dict"),
    ],
)
def test_a_loss_that_is_not_a_real_scalar_is_refused_before_the_step(
    loss_fn: Any, named: str
) -> None:
    model, inputs = ZOO["two_branch"]()
    pm = _compile(model, inputs, loss_fn=loss_fn)
    text = _untouched(pm, lambda: pm.step(*inputs, target=torch.randn(8, 4)))
    assert named in text


def test_a_good_step_still_runs_after_refusals(pm: Any) -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    loss = pm.step(x, target=y)
    assert torch.isfinite(torch.tensor(loss))
    assert loss == pytest.approx(F.mse_loss(pm(x), y).item(), rel=0.2)


# -- graphpipe run -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--weights", "bogus"], "unknown weight policy 'bogus'"),
        (["-m", "0"], "micro_batches=0: it must be a positive int, 'auto' or None"),
        (["-m", "3"], "a batch of 8 does not split into 3 equal micro-batches"),
        (["--steps", "0"], "steps=0 must be positive"),
        (["--timeout", "-1"], "timeouts must be positive, got timeout=-1.0"),
        (["--max-grad-norm", "-1"], "max_grad_norm=-1.0: it must be a positive number or None"),
        (["--preset", "bogus"], "nbranch: unknown preset 'bogus'"),
        (["--weights", "stash", "--schedule", "1f1b"], "runs with async, not schedule='1f1b'"),
    ],
)
def test_graphpipe_run_refuses_a_bad_flag_in_one_line(
    flags: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused in the launching process, before any rank starts: one line, exit status 2."""
    status = main(["run", "models.nbranch", "--preset", "tiny", "--profile", "flops", *flags])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("graphpipe: error: ") and line in err and "\n" not in err, err


# -- two ranks ------------------------------------------------------------------------------


def test_misspelt_plan_options_are_named_at_once_before_profiling(monkeypatch: Any) -> None:
    """Plan options are checked by every rank in compile's first step, every problem at once;
    rank 0 used to meet them only after profiling."""

    def no_profiling(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("profiled before the plan options were checked")

    monkeypatch.setattr(importlib.import_module("graphpipe.compile.steps"), "profile", no_profiling)
    model, inputs = ZOO["two_branch"]()
    with pytest.raises(ConfigError) as err:
        _compile(model, inputs, memory_budjet=2e9, max_units=0, placement="w", profile=None)
    message = str(err.value)
    assert message.startswith("4 problems: "), message
    for named in (
        "unknown option 'memory_budjet' (did you mean 'memory_budget'?)",
        "max_units=0: it must be a positive int",
        "placement must be one of ('loop', 'v'), got 'w'",
        "profile=None: it must be a ProfileConfig",
    ):
        assert named in message


def _crash_on_rank_0_worker() -> str:
    """rank 0's planning crashes with an error that is not graphpipe's own (as a profiler
    crash would): what each rank raises."""

    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a leaf Variable that requires grad is used in an in-place op")

    if dist.get_rank() == 0:
        importlib.import_module("graphpipe.compile.steps")._plan = crash
    model, inputs = ZOO["two_branch"]()
    try:  # the others would wait in the broadcast for plan_timeout, past the launch's limit
        _compile(model, inputs, runtime=RuntimeConfig(timeout=30, plan_timeout=3600))
    except PlanError as exc:
        return str(exc)
    return "no error"


def test_any_failure_while_rank_0_plans_reaches_every_rank_named() -> None:
    said = launch(_crash_on_rank_0_worker, 2, timeout=TIMEOUT, comm_timeout=30)
    for text in said:
        assert text == (
            "planning on rank 0 failed: RuntimeError: a leaf Variable that requires grad "
            "is used in an in-place op"
        ), said


def _value_reading_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Not reduced, and it reads a value, so only the stage that computes it can tell."""
    return (out - target) ** 2 * float(target.abs().max() > 0)


def _runtime_loss_worker() -> None:
    model, inputs = ZOO["two_branch"]()
    pm = gp_compile(
        model,
        inputs,
        loss_fn=_value_reading_loss,
        optimizer=SGD,
        micro_batches=4,
        pins={"a": 0, "b": 1, "cat": 1, "head": 1},
        runtime=RuntimeConfig(timeout=20),
    )
    pm.step(*inputs, target=torch.randn(8, 4))


def test_a_loss_only_its_stage_can_check_is_named_by_that_rank() -> None:
    with pytest.raises(PipelineError) as err:
        launch(_runtime_loss_worker, 2, timeout=TIMEOUT, comm_timeout=20)
    lines = err.value.problems
    culprit = "loss_fn returned a torch.float32 tensor of shape [2, 4] for micro-batch 0"
    assert any(line.startswith("rank 1: ConfigError: " + culprit) for line in lines), lines
    waiting = [line for line in lines if line.startswith("rank 0:")]  # left waiting for rank 1
    assert (
        waiting and f"another rank failed: rank 1, action 1F0: ConfigError: {culprit}" in waiting[0]
    ), lines


WAITED = 60  # seconds a rank left waiting for a refused peer waits (run and comm timeouts)


def _tied_worker(policies: list[str]) -> dict[str, str]:
    """Compile the tied model across 2 ranks under each policy: what each refusal says."""
    said = {}
    for policy in policies:
        model, inputs = ZOO["tied"]()
        try:
            _compile(model, inputs, weights=policy, runtime=RuntimeConfig(timeout=WAITED))
        except ConfigError as exc:
            said[policy] = str(exc)
    return said


def test_a_weight_tied_across_ranks_is_refused_under_asynchronous_policies_at_once() -> None:
    policies = ["stash", "2bw", "pipemare"]
    start = time.perf_counter()
    results = launch(_tied_worker, 2, args=(policies,), timeout=TIMEOUT, comm_timeout=WAITED)
    # refused, not left to time out (it hung before): a rank left waiting waits WAITED s;
    # two ranks' start and three refusals take seconds, tens on a loaded machine
    assert time.perf_counter() - start < WAITED
    for said in results:  # every rank alike, before any collective
        assert set(said) == set(policies), said
        for policy, text in said.items():
            assert f"weights={policy!r} cannot keep a weight tied across ranks" in text
            assert "embed.weight is held on ranks [0, 1]" in text


# -- nan_check, two ranks --------------------------------------------------------------------


def _bomb_loss(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The MSE, plus 0 * sqrt(|out| * mask): a finite value whose gradient is NaN wherever the
    mask is 0 (0 / 0), so a gradient goes non-finite while the loss stays finite."""
    y, mask = target
    return F.mse_loss(out, y) + 0.0 * torch.sqrt(out.abs() * mask[:, None]).sum()


def _nan_pipeline(pins: dict[str, int], schedule: str) -> Any:
    model, inputs = ZOO["two_branch"]()
    return gp_compile(
        model,
        inputs,
        loss_fn=_bomb_loss,
        optimizer=SGD,
        micro_batches=4,
        schedule=schedule,
        pins=pins,
        nan_check=True,
        runtime=RuntimeConfig(timeout=60),
    )


def _nan_worker() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    x, y, ones = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen), torch.ones(8)
    bad_x = x.clone()
    bad_x[4, 3] = float("nan")  # row 4: micro-batch 2 of 4
    mask = ones.clone()
    mask[2] = 0.0  # row 2: micro-batch 1's gradient
    result: dict[str, Any] = {}
    for label, pins, schedule in (
        ("1f1b", {"a": 0, "b": 1, "cat": 1, "head": 1}, "1f1b"),
        ("zb", {"a": 0, "b": 1, "cat": 1, "head": 1}, "zb"),  # gradients in the W halves
        ("idle", {"a": 0, "b": 0, "cat": 0, "head": 0}, "1f1b"),  # rank 1 holds no stage
    ):
        pm = _nan_pipeline(pins, schedule)
        got: dict[str, Any] = {"good": pm.step(x, target=(y, ones))}
        before = pm.state_dict()
        for name, args in (("loss", (bad_x, (y, ones))), ("grad", (x, (y, mask)))):
            try:
                pm.step(args[0], target=args[1])
                got[name] = "no error"
            except PipelineError as exc:
                got[name] = str(exc)
                got[name + " kind"] = exc.kind
        after = pm.state_dict()
        got["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        got["again"] = pm.step(x, target=(y, ones))  # every rank still in step
        result[label] = got
    return result


def test_nan_check_stops_every_rank_before_the_update_and_names_the_culprit() -> None:
    results = launch(_nan_worker, 2, timeout=TIMEOUT, comm_timeout=60)
    loss_stage = {"1f1b": 1, "zb": 1, "idle": 0}
    first_param = {"1f1b": "b.0.0.weight", "zb": "b.0.0.weight", "idle": "a.0.0.weight"}
    for label, stage in loss_stage.items():
        for r in (results[0][label], results[1][label]):
            assert r["good"] == results[0][label]["good"]
            assert r["loss"].startswith(
                f"non-finite loss nan at stage {stage}, micro-batch 2 (nan_check)"
            ), (label, r["loss"])
            assert r["grad"].startswith(  # every parameter of the last stage: its first named
                f"non-finite gradient of {first_param[label]} at stage {stage}, micro-batch 1"
            ), (label, r["grad"])
            assert "the optimizer step was skipped" in r["loss"]
            assert r["loss kind"] == r["grad kind"] == FailureKind.NONFINITE
            assert r["unchanged"]
            assert r["again"] < r["good"]  # trained on from where it stopped
