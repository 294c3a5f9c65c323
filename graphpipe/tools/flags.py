"""Command-line flags made from the options' own definitions (`graphpipe.planning.options`).

An option with a flag (`option(..., flag="--micro-batches")`) is one flag of `graphpipe plan`
and `graphpipe run` under that name, with the option's meaning and default as its help, so
the command line, compile and plan() cannot drift apart. Each flag's value parses to the
value the API takes (`--memory-budget 16GiB` is 16 * 2**30 bytes, `--recompute all` is
True) and is checked where the API's is (`graphpipe: error: micro_batches=0: it must be a
positive int or None`); a flag not given leaves the option at its one default.

    add_flags(parser, ("micro_batches", "dp", "precision"))
    options = given(parser.parse_args(argv), ("micro_batches", "dp", "precision"))
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from graphpipe.ir import schedule_names
from graphpipe.ir.registry import POLICIES
from graphpipe.planning.options import OptionGroup, field_default, fields_of
from graphpipe.runtime.spec import RUN_GROUPS

__all__ = ["add_flags", "flagged", "given", "nbytes"]

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
# --recompute's words -> the option's values
RECOMPUTE: dict[str, bool | str] = {"all": True, "auto": "auto", "none": False}


def nbytes(text: str) -> float:
    """A byte count: a number with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB).

    Raises:
        argparse.ArgumentTypeError: not such a count, or not positive.
    """
    found = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).lower() if found else ""
    try:
        value = float(found.group(1)) * UNITS[unit] if found else 0.0
    except (ValueError, KeyError):
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive byte count such as 16GiB, 512MiB or 1e9, got {text!r}"
        )
    return value


def _dp(text: str) -> int | str:
    try:
        return text if text == "auto" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dp takes an int or 'auto', got {text!r}") from None


def _tp_plan(text: str) -> dict[str, str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--tp-plan is not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise argparse.ArgumentTypeError(
            f'--tp-plan takes {{"module path": "colwise" | "rowwise"}}, got {text!r}'
        )
    return value


def _input_split(text: str) -> dict[str, Any]:
    """--input-split's JSON: input -> a dim, "replicate", or "module:function" (imported)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--input-split is not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'--input-split takes {{"input": dim | "replicate" | "module:function"}}, got {text!r}'
        )
    return {name: _split_rule(name, rule) for name, rule in value.items()}


def _split_rule(name: str, rule: Any) -> Any:
    if isinstance(rule, int) or rule == "replicate":
        return rule
    module, _, attr = str(rule).partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"--input-split {name!r}: {rule!r} is not a dim, 'replicate' or an importable "
            f"module:function ({exc})"
        ) from None


def _recompute(text: str) -> bool | str:
    if text not in RECOMPUTE:
        raise argparse.ArgumentTypeError(
            f"--recompute takes one of {list(RECOMPUTE)}, got {text!r}"
        )
    return RECOMPUTE[text]


# option name -> (parse, metavar or choices); an option not named is a bool (--x / --no-x)
PARSE: dict[str, tuple[Callable[[str], Any], str | Sequence[str]]] = {
    "micro_batches": (int, "M"),
    "devices": (int, "N"),
    "dp": (_dp, "K|auto"),
    "tp": (int, "T"),
    "tp_plan": (_tp_plan, "JSON"),
    "input_split": (_input_split, "JSON"),
    "memory_budget": (nbytes, "BYTES"),
    "max_grad_norm": (float, "NORM"),
    "timeout": (float, "SECONDS"),
    "schedule": (str, tuple(schedule_names(training=True))),
    "weights": (str, "|".join(POLICIES)),
    "precision": (str, ("bf16", "fp16")),
    "partitioner": (str, ("graph", "sequential", "manual")),
    "recompute": (_recompute, "|".join(RECOMPUTE)),
}


SHORT = {"micro_batches": "-m"}  # one-letter flags


def add_flags(
    parser: argparse.ArgumentParser,
    names: Sequence[str],
    *,
    help_extra: dict[str, str] | None = None,
) -> None:
    """Add the flags of options `names` to `parser` (dest: the option's name; not given:
    None, the option's default).

    Args:
        parser: The subcommand's parser.
        names: Options that have a flag.
        help_extra: Option name -> a sentence the flag's help adds (what it means here).
    """
    known = fields_of(RUN_GROUPS)
    for name in names:
        _group, f = known[name]
        flag = f.metadata["flag"]
        assert flag, f"option {name} has no command-line flag"
        shown = field_default(f)
        help_text = f"{f.metadata['doc']} (default: {shown!r})"
        if help_extra and name in help_extra:
            help_text += f"; {help_extra[name]}"
        help_text = help_text.replace("%", "%%")
        if name not in PARSE:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text
            )
            continue
        parse, shape = PARSE[name]
        extra: dict[str, Any] = {"metavar": shape} if isinstance(shape, str) else {"choices": shape}
        names_of = (flag, SHORT[name]) if name in SHORT else (flag,)
        parser.add_argument(*names_of, dest=name, type=parse, help=help_text, **extra)


def given(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options the command line gave, by name (a flag not given is left out)."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def flagged(groups: Sequence[type[OptionGroup]] = RUN_GROUPS) -> list[str]:
    """Every option that has a flag."""
    return [f.name for g in groups for f in fields(g) if f.metadata["flag"]]  # type: ignore[arg-type]
