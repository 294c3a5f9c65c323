"""Inputs and outputs of a traced model: how a call's arguments reach the graph's placeholders,
and how the graph's output leaves become the model's output again.

    args, kwargs = normalise(example_inputs)         # tensor, tuple, or dict of keyword inputs
    flat = flat_inputs(gm, *args, **kwargs)          # one tensor per placeholder, checked
    out = model_output(gm, value)                    # the model's own output structure

A trace records, per placeholder, its *source*: the index of a positional argument or the name
of a keyword argument (`TraceInfo.sources`). Non-tensor keyword values and optional arguments
left out are constants of the trace (`concrete_args`), so they are not placeholders and
`flat_inputs` refuses them at run time, naming them, rather than silently ignoring a change.

Every tensor input has the batch on dim 0; `rows` cuts the example down to the micro-batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from graphpipe._torch import tree_flatten, tree_unflatten
from graphpipe.errors import ConfigError
from graphpipe.tracing.annotate import Source, TensorSpec, trace_info
from graphpipe.tracing.split import InputSplit

__all__ = [
    "batch_of",
    "check_output",
    "concrete_args",
    "example_output",
    "flat_inputs",
    "micro_example",
    "model_output",
    "named",
    "normalise",
    "rows",
    "split_of",
]

Args = tuple[torch.Tensor, ...]
Kwargs = dict[str, Any]
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def normalise(example_inputs: Any) -> tuple[Args, Kwargs]:
    """Positional and keyword inputs from a tensor, a tuple of tensors or a dict.

    Raises:
        ConfigError: no tensor at all, a positional input that is not a tensor, a key that is
            not a string, or a tensor without a batch dimension.
    """
    if isinstance(example_inputs, torch.Tensor):
        args: Args = (example_inputs,)
        kwargs: Kwargs = {}
    elif isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
        bad_keys = [k for k in kwargs if not isinstance(k, str)]
        if bad_keys:
            raise ConfigError(f"keyword inputs need string keys, got {bad_keys}")
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
        bad = [
            f"#{i}: {type(x).__name__}"
            for i, x in enumerate(args)
            if not isinstance(x, torch.Tensor)
        ]
        if bad:
            raise ConfigError(
                "every positional example input must be a tensor (pass a dict for keyword "
                "inputs and constants)",
                bad,
            )
    else:
        raise ConfigError(
            "example_inputs must be a tensor, a tuple of tensors or a dict of keyword inputs, "
            f"got {type(example_inputs).__name__}"
        )
    if not any(isinstance(x, torch.Tensor) for x in (*args, *kwargs.values())):
        raise ConfigError("example_inputs holds no tensor; dim 0 of the inputs must be the batch")
    return args, kwargs


def _tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def named(args: Args, kwargs: Kwargs) -> dict[Source, torch.Tensor]:
    """Every tensor input by its source: a positional index or a keyword name."""
    out: dict[Source, torch.Tensor] = dict(enumerate(args))
    out.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
    return out


def split_of(
    args: Args, kwargs: Kwargs, rules: InputSplit | Mapping[Any, Any] | None
) -> InputSplit:
    """`rules` (input_split's mapping, an InputSplit, or None: dim 0) resolved against these
    inputs, its inferred batch dims included (`InputSplit.resolved`).

    Raises:
        ConfigError: a rule of another kind, or an input whose batch dim cannot be told.
    """
    split = rules if isinstance(rules, InputSplit) else InputSplit(rules)
    return split.resolved(named(args, kwargs))


def batch_of(args: Args, kwargs: Kwargs, split: InputSplit) -> int:
    """The batch size: the dimension each input's rule names (dim 0 unless `split` says
    otherwise: `graphpipe.tracing.split`), which every input split by a dimension shares.

    Raises:
        ConfigError: no input carries the batch, or inputs that disagree on it (naming
            them).
    """
    return split.batch(named(args, kwargs))


def rows(
    args: Args,
    kwargs: Kwargs,
    pieces: int,
    split: InputSplit | None = None,
    device: torch.device | str | None = None,
) -> tuple[Args, Kwargs]:
    """The first of `pieces` micro-batches of every tensor input (by `split`'s rules, else
    its first rows along dim 0), moved to `device` when given (e.g. the meta device for a
    model built there); constants as they are."""
    first = (split or InputSplit()).first(named(args, kwargs), pieces)

    def cut(source: Source) -> torch.Tensor:
        x = first[source]
        return x if device is None else x.to(device)

    return (
        tuple(cut(i) for i in range(len(args))),
        {k: cut(k) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
    )


def micro_example(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], rows: int
) -> list[torch.Tensor]:
    """One tensor per placeholder of `gm` for a micro-batch of `rows` rows: the micro-batch
    the trace ran at where `gm` was traced at `rows` (its input_split rules applied), else
    each example input's first `rows` rows along dim 0, cycling where it has fewer.

    Raises:
        ConfigError: an input that does not split on dim 0, at a size the graph was not
            traced at (trace it at that micro-batch size).
    """
    traced = gm.meta.get("gp_example")
    info = trace_info(gm)
    if traced is not None and info.micro_batch_size == rows:
        return list(traced)
    split = gm.meta.get("gp_split")
    if split:
        raise ConfigError(
            f"the graph was traced at micro-batches of {info.micro_batch_size} rows, with "
            f"input_split ({split.describe()}); it runs at that size only, not at {rows}"
        )
    return [resize_batch(x, rows) for x in example_inputs]


def resize_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """Take `size` rows of `x` along dim 0, cycling when `size` exceeds the batch."""
    index = torch.arange(size, device=x.device) % x.shape[0]
    return x.index_select(0, index)


def concrete_args(model: nn.Module, args: Args, kwargs: Kwargs) -> dict[str, Any]:
    """fx's `concrete_args`: non-tensor keyword values, and optional arguments left out.

    Raises:
        ConfigError: a keyword the forward does not take, or a required argument missing.
    """
    params = list(inspect.signature(model.forward).parameters.values())
    positional = [p.name for p in params if p.kind in POSITIONAL]
    given = set(positional[: len(args)])
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    unknown = sorted(set(kwargs) - {p.name for p in params})
    if unknown and not takes_any:
        raise ConfigError(
            f"{type(model).__name__}.forward() takes no inputs named {unknown}; "
            f"it takes {[p.name for p in params]}"
        )
    concrete = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    for p in params:
        if p.kind in _VARIADIC or p.name in given or p.name in kwargs:
            continue
        if p.default is inspect.Parameter.empty:
            raise ConfigError(f"{type(model).__name__}.forward() needs input {p.name!r}")
        concrete[p.name] = p.default
    return concrete


def flat_inputs(gm: fx.GraphModule, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """One tensor per placeholder of `gm`, from a call as the model takes it. Static inputs
    (`gm.meta["gp_static"]`, constants of the graph) must be given and are left out.

    Raises:
        ConfigError: a wrong number of positional inputs, a keyword input missing or unknown,
            a constant of the trace passed again, or an input that is not a tensor.
    """
    info = trace_info(gm)
    wanted = [s for s in info.sources if isinstance(s, int)]
    names = [s for s in info.sources if isinstance(s, str)]
    if len(args) != len(wanted):
        raise ConfigError(
            f"got {len(args)} positional inputs, the model was compiled with {len(wanted)}"
            + (f" (and keyword inputs {names})" if names else "")
        )
    constants = sorted(set(kwargs) & set(info.constants))
    if constants:
        raise ConfigError(
            f"inputs {constants} are constants of the trace "
            f"({', '.join(f'{k}={info.constants[k]}' for k in constants)}); "
            "compile again to change them"
        )
    static = set(gm.meta.get("gp_static", {}))  # given, and checked by the runtime
    expected = set(names) | static
    missing, unknown = sorted(expected - set(kwargs)), sorted(set(kwargs) - expected)
    if missing or unknown:
        raise ConfigError(
            f"keyword inputs differ from the compiled ones {names}: "
            f"missing {missing}, unknown {unknown}"
        )
    flat = [args[s] if isinstance(s, int) else kwargs[s] for s in info.sources]
    bad = [
        (f"input {s} ({name})" if isinstance(s, int) else f"keyword input {s!r}")
        + f" is a {type(x).__name__}, not a tensor"
        for s, name, x in zip(info.sources, info.input_names, flat, strict=True)
        if not isinstance(x, torch.Tensor)
    ]
    if bad:
        raise ConfigError("; ".join(bad))
    return flat


def _output_leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, leaf) of the output node's argument: fx nodes and constants in tuples, lists
    and dicts."""
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _output_leaves(v, f"{path}[{i}]")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _output_leaves(v, f"{path}[{k!r}]")
    else:
        yield path, value


def _output_arg(gm: fx.GraphModule) -> Any:
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


def check_output(gm: fx.GraphModule) -> None:
    """The model's output must be a tensor, or a (nested) tuple, list or dict of tensors
    (None entries allowed), with a floating-point tensor among them for the loss's gradient.

    Raises:
        ConfigError: naming what the model returned and the first leaf that is not a tensor.
    """
    value = _output_arg(gm)
    need = "its output must be a tensor or a (nested) tuple/dict of tensors"
    if value is None:
        raise ConfigError(f"the model returned NoneType; {need}")
    kind = "dict" if isinstance(value, Mapping) else type(value).__name__
    dtypes = {}
    for path, leaf in _output_leaves(value, "output"):
        if leaf is None:
            continue
        spec = leaf.meta.get("gp_outputs") if isinstance(leaf, fx.Node) else None
        if not isinstance(spec, TensorSpec):
            what = (
                f"non-tensor (node {leaf.name})"
                if isinstance(leaf, fx.Node)
                else f"{type(leaf).__name__} ({leaf!r})"
            )
            raise ConfigError(f"the model returned {kind} whose {path} is a {what}; {need}")
        dtypes[path] = spec.dtype.removeprefix("torch.")
    if not any(_dtype(d).is_floating_point for d in dtypes.values()):
        raise ConfigError(
            f"the model's output holds no floating-point tensor ({dtypes or 'nothing'}), so "
            "no loss on it has a gradient; return the scores, not labels"
        )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


def example_output(
    gm: fx.GraphModule,
    device: torch.device | str = "meta",
    shapes: Mapping[str, Any] | None = None,
) -> Any:
    """The model's output for one micro-batch as empty tensors of the traced shapes and dtypes
    on `device` (by default the meta device: no memory), nested as the model returns it.
    `shapes` (node name -> (shape, dtype)) gives other shapes, where it names every leaf."""
    leaves = [n for _, n in _output_leaves(_output_arg(gm), "") if isinstance(n, fx.Node)]
    known = shapes is not None and all(n.name in shapes for n in leaves)

    def fake(leaf: Any) -> Any:
        spec = leaf.meta.get("gp_outputs") if isinstance(leaf, fx.Node) else None
        if not isinstance(spec, TensorSpec):
            return leaf
        shape = shapes[leaf.name][0] if known and shapes is not None else spec.shape
        return torch.empty(shape, dtype=_dtype(spec.dtype), device=device)

    return model_output(gm, fx.node.map_aggregate(_output_arg(gm), fake))


def model_output(gm: fx.GraphModule, value: Any) -> Any:
    """The model's output as the original module returns it, from the output node's value.

    fx graphs return the output node's argument as it is; graphs from torch.export return the
    leaves flat, and their `TraceInfo.out_spec` nests them again (a Hugging Face
    `ModelOutput`, a dict, a tuple).
    """
    spec = trace_info(gm).out_spec
    if spec is None:
        return value
    leaves, _ = tree_flatten(value)
    return tree_unflatten(leaves, spec)


def labels(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[int, ...], Kwargs]:
    """The call's structure with each input replaced by its source (index or keyword)."""
    return tuple(range(len(args))), {k: k for k in kwargs}
