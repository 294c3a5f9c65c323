"""Options: each defined once (`graphpipe.planning.options`), under one name that compile,
plan(), PlanConfig and the command line share, checked at once with every problem named."""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graphpipe import compile as gp_compile
from graphpipe import plan
from graphpipe.errors import ConfigError
from graphpipe.planning.options import (
    GROUPS,
    Memory,
    Numerics,
    Parallelism,
    Planning,
    group_of,
    split,
    table,
)
from graphpipe.planning.partition import PlanConfig
from graphpipe.runtime.spec import RUN_GROUPS, RunSpec, RuntimeConfig
from graphpipe.tools.cli import PLAN_OPTIONS, RUN_OPTIONS, _parser

SGD = functools.partial(torch.optim.SGD, lr=0.1)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def _names(groups: tuple[type, ...] = RUN_GROUPS) -> list[str]:
    return [f.name for g in groups for f in fields(g)]


def test_every_option_has_one_name_in_one_group() -> None:
    names = _names()
    assert len(names) == len(set(names))
    assert all(group_of(n) in GROUPS for n in _names(GROUPS))


def test_the_planners_config_uses_the_options_names() -> None:
    """PlanConfig is the planner's resolved options: every field but devices is an option
    of the same name, and where the option's default is not "decided later" (None), the
    same default."""
    options = {f.name: f for g in GROUPS for f in fields(g)}
    for f in fields(PlanConfig):
        if f.name == "devices":
            continue
        assert f.name in options, f"PlanConfig.{f.name} is not an option"
        mine, theirs = f.default, options[f.name].default
        if theirs is not None and not callable(f.default_factory):
            assert mine == theirs, f"PlanConfig.{f.name}: {mine!r} != option default {theirs!r}"


def test_compile_and_plan_take_the_groups_by_their_names() -> None:
    compile_params = set(inspect.signature(gp_compile).parameters)
    assert {g.name for g in RUN_GROUPS} <= compile_params
    plan_params = set(inspect.signature(plan).parameters)
    assert {g.name for g in (Planning, Parallelism, Numerics, Memory)} <= plan_params
    # no option is a loose argument of its own: they all come through the groups
    assert not (compile_params & set(_names())) and not (plan_params & set(_names()) - {"devices"})


def test_a_keyword_and_its_group_make_the_same_run() -> None:
    x = torch.randn(8, 4)
    flat = RunSpec.build(
        x, loss_fn=F.mse_loss, optimizer=SGD, micro_batches=2, dp=2, precision="bf16"
    )
    grouped = RunSpec.build(
        x,
        loss_fn=F.mse_loss,
        optimizer=SGD,
        groups={
            "planning": Planning(micro_batches=2),
            "parallelism": Parallelism(dp=2),
            "numerics": Numerics(precision="bf16"),
        },
    )
    assert flat == grouped
    assert (flat.micro_batch_size, flat.dims.dp, flat.numerics.precision) == (2, 2, "bf16")


def test_every_problem_is_named_at_once_with_the_closest_name() -> None:
    with pytest.raises(ConfigError) as err:
        RunSpec.build(
            torch.randn(8, 4),
            loss_fn=F.mse_loss,
            optimizer=SGD,
            groups={"numerics": Numerics(precision="bf16")},
            precision="fp16",  # also in its group
            micro_batchs=2,  # misspelt
            timeout=-1,  # the runtime's group checks itself
            dp_shard="yes",
        )
    message = str(err.value)
    assert message.startswith("4 problems: "), message
    for part in (
        "precision= given as a keyword and in numerics=",
        "unknown option 'micro_batchs' (did you mean 'micro_batches'?)",
        "timeouts must be positive, got timeout=-1",
        "dp_shard='yes': it must be True or False",
    ):
        assert part in message


def test_an_old_name_still_works_and_says_its_new_one() -> None:
    with pytest.warns(FutureWarning, match="data_parallel= is now called dp="):
        got, problems = split({}, {"data_parallel": 2})
    assert not problems and got["parallelism"].dp == 2  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, problems = split({}, {"data_parallel": 2, "dp": 2})
    assert problems == ["data_parallel= is the old name of dp=, which is given too; pass dp="]


def test_plan_refuses_a_compile_only_option_by_name() -> None:
    with pytest.raises(ConfigError, match="max_shapes= is compile's"):
        plan(torch.nn.Linear(4, 4), torch.randn(8, 4), devices=1, max_shapes={"x": (8, 4)})


def test_the_command_line_flags_are_the_options() -> None:
    """Each flag of `graphpipe plan` and `graphpipe run` that sets an option is that option's
    own flag, with its meaning as help (`graphpipe.tools.flags`)."""
    commands = _parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    defined = {f.name: f for g in RUN_GROUPS for f in fields(g)}
    for command, names in (("plan", PLAN_OPTIONS), ("run", RUN_OPTIONS)):
        actions = {a.dest: a for a in commands[command]._actions}
        for name in names:
            action, f = actions[name], defined[name]
            assert f.metadata["flag"] in action.option_strings, (command, name)
            assert f.metadata["doc"].replace("%", "%%") in action.help, (command, name)
            assert action.default is None  # not given: the option's own default
    args = commands["run"].parse_args(["m", "--memory-budget", "2GiB", "--recompute", "all"])
    assert (args.memory_budget, args.recompute) == (2 * 2**30, True)


def test_the_docs_quote_the_option_table() -> None:
    text = DOCS.read_text()
    begin, end = "<!-- options: begin -->\n", "<!-- options: end -->"
    quoted = text[text.index(begin) + len(begin) : text.index(end)].strip()
    assert quoted == table(RUN_GROUPS)


def test_the_runtime_group_checks_itself_when_built() -> None:
    with pytest.raises(ConfigError, match="timer must be"):
        RuntimeConfig(timer="wall")


def test_the_planner_chooses_the_mesh_when_asked() -> None:
    """mesh="auto" chooses pp x dp x tp and M itself, so plan() and compile refuse dp= and
    tp= beside it by name (compile's run on the mesh chosen: tests/test_mesh.py)."""
    from graphpipe.planning.profile import ProfileConfig

    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(16, 16)
    flops = ProfileConfig(mode="flops")
    chosen = plan(model, x, devices=4, mesh="auto", micro_batches="auto", profile=flops)
    assert chosen.dims.devices == 4  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="dp=2 with mesh='auto', which chooses it"):
        plan(model, x, devices=4, mesh="auto", dp=2, profile=flops)
    with pytest.raises(ConfigError, match="tp=2 with mesh='auto', which chooses it"):
        RunSpec.build(x, loss_fn=F.mse_loss, optimizer=SGD, mesh="auto", tp=2)
    with pytest.raises(ConfigError, match="micro_batches='auto' is chosen with the mesh"):
        RunSpec.build(x, loss_fn=F.mse_loss, optimizer=SGD, micro_batches="auto")
