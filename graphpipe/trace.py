"""Trace: turn an `nn.Module` into a `torch.fx.GraphModule` annotated with planning facts.

    gm = graphpipe.trace(model, (tokens, image), leaf_modules=[nn.TransformerEncoderLayer])

Tracing tries `torch.fx.symbolic_trace` first. Where that fails (Python control flow on shapes,
as in many Hugging Face models) it falls back to `torch.export.export(..., strict=False)`, which
also yields an fx graph, at ATen granularity. Where both fail, `TraceError` quotes both reasons.

Granularity: every module in `leaf_modules` (a type, or a module path such as `"encoder.3"`)
becomes one node, and so one indivisible unit for the planner. torch.nn's own modules are always
leaves (fx's default), so `nn.TransformerEncoderLayer` is already one node.

The batch dimension is dim 0 of every tensor input; "per sample" below means divided by the
example batch size.

Keys written on `node.meta` (every node):
    gp_module     str: the module path the node belongs to ("" for the top level).
    gp_outputs    pytree of `TensorSpec` (None for non-tensors): output shapes and dtypes.
    gp_out_bytes  int: bytes of the node's tensor outputs, per sample.
    gp_params     dict[str, int]: parameters and buffers the node uses directly, by canonical
                  name (the model's `named_parameters()` name), with their bytes.
    gp_shared     frozenset[str]: those of `gp_params` that other nodes use too (tied weights,
                  a module called twice). Count their bytes once per stage that holds them.
    gp_flops      int: forward FLOPs per sample, from `torch.utils.flop_counter`.

Key written on `gm.meta`:
    graphpipe     `TraceInfo`: how the graph was traced, the batch size, the input names and
                  the bytes of every parameter and buffer of the model.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from graphpipe.errors import ConfigError, TraceError

__all__ = ["TensorSpec", "TraceInfo", "trace"]

LeafSpec = type | str


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor value (the example batch's shape)."""

    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        dtype = self.dtype.removeprefix("torch.")
        return f"{dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class TraceInfo:
    """Facts about one trace, stored as `gm.meta["graphpipe"]`.

    Attributes:
        method: "fx" (symbolic_trace) or "export" (torch.export fallback).
        batch_size: dim 0 of the example inputs.
        input_names: the placeholder names, in order.
        param_bytes: bytes of every parameter and buffer, by canonical name.
        fx_error: why symbolic_trace failed, when method is "export".
    """

    method: str
    batch_size: int
    input_names: tuple[str, ...]
    param_bytes: dict[str, int] = field(default_factory=dict)
    fx_error: str | None = None


def trace(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    leaf_modules: Iterable[LeafSpec] = (),
) -> fx.GraphModule:
    """Trace `model` into an fx graph and annotate every node with shapes, bytes and FLOPs.

    Args:
        model: The model. Its parameters are shared with the result, not copied.
        example_inputs: One mini-batch of positional inputs; dim 0 is the batch.
        leaf_modules: Module types or module paths to keep as single nodes.

    Returns:
        The traced `GraphModule`, computing exactly what `model` computes, with the
        `node.meta` keys listed in this module's docstring.

    Raises:
        ConfigError: the inputs are not tensors, or a leaf module path does not exist.
        TraceError: both torch.fx and torch.export failed; the message quotes both.

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> gm = trace(m, torch.randn(3, 4))
        >>> [n.name for n in gm.graph.nodes]
        ['input_1', '_0', '_1', '_2', 'output']
    """
    inputs = _normalise_inputs(example_inputs)
    leaf_types, leaf_paths = _split_leaves(model, leaf_modules)
    try:
        gm, method, fx_error = _fx_trace(model, leaf_types, leaf_paths), "fx", None
    except Exception as fx_exc:  # any failure here means "try torch.export"
        fx_error = f"{type(fx_exc).__name__}: {fx_exc}"
        gm, method = _export_trace(model, inputs, fx_error), "export"
    _spread_varargs(gm, len(inputs))
    _drop_dead_getitems(gm)
    with _untouched(model):
        _annotate(gm, model, inputs)
    gm.meta["graphpipe"] = TraceInfo(
        method=method,
        batch_size=inputs[0].shape[0],
        input_names=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        param_bytes=_all_param_bytes(model),
        fx_error=fx_error,
    )
    return gm


def trace_info(gm: fx.GraphModule) -> TraceInfo:
    """The `TraceInfo` of a graph made by `trace`.

    Raises:
        ConfigError: `gm` was not made by `graphpipe.trace`.
    """
    info = gm.meta.get("graphpipe")
    if not isinstance(info, TraceInfo):
        raise ConfigError("this GraphModule was not made by graphpipe.trace(); trace it first")
    return info


def _normalise_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(inputs, (tuple, list)) or not inputs:
        raise ConfigError(
            f"example_inputs must be a tensor or a non-empty tuple of tensors, got {type(inputs)}"
        )
    bad = [
        f"#{i}: {type(x).__name__}" for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)
    ]
    if bad:
        raise ConfigError("every example input must be a tensor", bad)
    if inputs[0].dim() == 0:
        raise ConfigError("example input #0 is a scalar; dim 0 of the inputs must be the batch")
    return tuple(inputs)


def _split_leaves(
    model: nn.Module, leaf_modules: Iterable[LeafSpec]
) -> tuple[tuple[type, ...], frozenset[str]]:
    types: list[type] = []
    paths: set[str] = set()
    names = {name for name, _ in model.named_modules()}
    for leaf in leaf_modules:
        if isinstance(leaf, str):
            if leaf not in names:
                raise ConfigError(f"leaf module path {leaf!r} is not a submodule of the model")
            paths.add(leaf)
        elif isinstance(leaf, type) and issubclass(leaf, nn.Module):
            types.append(leaf)
        else:
            raise ConfigError(
                f"leaf_modules entries must be nn.Module types or paths, got {leaf!r}"
            )
    return tuple(types), frozenset(paths)


class _Tracer(fx.Tracer):
    """symbolic_trace with user leaf modules, recording each node's module path."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str]) -> None:
        super().__init__()
        self._leaf_types = leaf_types
        self._leaf_paths = leaf_paths
        self._scope = [""]

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            isinstance(m, self._leaf_types)
            or module_qualified_name in self._leaf_paths
            or super().is_leaf_module(m, module_qualified_name)
        )

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        self._scope.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._scope.pop()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["gp_module"] = self._scope[-1]
        return node


def _fx_trace(
    model: nn.Module, leaf_types: tuple[type, ...], leaf_paths: frozenset[str]
) -> fx.GraphModule:
    tracer = _Tracer(leaf_types, leaf_paths)
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _export_trace(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], fx_error: str
) -> fx.GraphModule:
    try:
        with _quiet_torch():
            exported = torch.export.export(model, inputs, strict=False)
    except Exception as exc:
        raise TraceError(
            f"could not trace {type(model).__name__}. torch.fx.symbolic_trace failed "
            f"({_first_line(fx_error)}) and torch.export (non-strict) failed "
            f"({type(exc).__name__}: {_first_line(str(exc))}). Control flow that depends on "
            "tensor values cannot be traced: move it out of forward(), replace it with "
            "torch.where/torch.cond, or name the module that holds it in leaf_modules so it "
            "stays one opaque node."
        ) from exc
    gm = exported.module()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target.startswith("_guards"):
            gm.graph.erase_node(node)
        else:
            node.meta["gp_module"] = _export_module_path(node)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """Silence torch.export's warnings and log dumps while we only probe whether it works."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _export_module_path(node: fx.Node) -> str:
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no message"


def _spread_varargs(gm: fx.GraphModule, count: int) -> None:
    """Give `forward(self, *inputs)` one placeholder per example input.

    fx traces `*inputs` as one tuple placeholder read through `inputs[i]`. Each input then
    becomes a placeholder of its own (`inputs_0`, ...), so every input is one tensor with
    dim 0 the batch, as the runtime needs; the module is still called as gm(*inputs).

    Raises:
        TraceError: the tuple is used other than by indexing with a constant.
    """
    star = next(
        (n for n in gm.graph.nodes if n.op == "placeholder" and str(n.target).startswith("*")),
        None,
    )
    if star is None:
        return
    fixed = sum(1 for n in gm.graph.nodes if n.op == "placeholder") - 1
    bad = [
        u.name
        for u in star.users
        if u.target is not operator.getitem or not isinstance(u.args[1], int)
    ]
    if bad:
        raise TraceError(f"forward(*{star.name}) is used by {bad}, not only as inputs[i]")
    base = str(star.target).lstrip("*")
    with gm.graph.inserting_before(star):
        spread = [gm.graph.placeholder(f"{base}_{i}") for i in range(count - fixed)]
    for new in spread:
        new.meta["gp_module"] = ""
    for user in list(star.users):
        user.replace_all_uses_with(spread[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(star)
    gm.graph.lint()
    gm.recompile()


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Run the example pass without side effects: buffers (BatchNorm statistics) and the
    random number generator are restored afterwards."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(saved[name])


def _drop_dead_getitems(gm: fx.GraphModule) -> None:
    """Remove unused tuple-unpacking nodes (e.g. the attention weights of `a, _ = attn(...)`)."""
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and node.op == "call_function" and node.target is operator.getitem:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def has_float_output(node: fx.Node) -> bool:
    """Whether `node.meta["gp_outputs"]` holds a floating-point tensor (gradients flow)."""
    leaves, _ = tree_flatten(node.meta.get("gp_outputs"))
    return any(spec is not None and "float" in spec.dtype for spec in leaves)


def _canonical_names(model: nn.Module) -> dict[int, str]:
    """Map each parameter/buffer tensor (by identity) to its first, canonical name."""
    names: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(id(t), name)
    return names


def _all_param_bytes(model: nn.Module) -> dict[str, int]:
    return {
        name: t.numel() * t.element_size()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }


def _tensor_bytes(value: Any) -> int:
    leaves, _ = tree_flatten(value)
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def _spec(value: Any) -> Any:
    return tree_map(
        lambda x: TensorSpec(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else None,
        value,
    )


class _Annotator(fx.Interpreter):
    """Runs the graph once on the example inputs, writing the gp_* keys on every node."""

    def __init__(self, gm: fx.GraphModule, canonical: dict[int, str], batch: int) -> None:
        super().__init__(gm)
        self._canonical = canonical
        self._batch = batch

    def run_node(self, n: fx.Node) -> Any:
        with FlopCounterMode(display=False) as flops:
            try:
                result = super().run_node(n)
            except Exception as exc:
                raise TraceError(
                    f"running node {n.name!r} ({n.format_node()}) on the example inputs failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        n.meta["gp_outputs"] = _spec(result)
        n.meta["gp_out_bytes"] = _tensor_bytes(result) // self._batch
        n.meta["gp_flops"] = flops.get_total_flops() // self._batch
        n.meta["gp_params"] = self._params_of(n)
        return result

    def _params_of(self, n: fx.Node) -> dict[str, int]:
        tensors: list[torch.Tensor] = []
        if n.op == "call_module":
            sub = self.module.get_submodule(str(n.target))
            tensors = [*sub.parameters(recurse=True), *sub.buffers(recurse=True)]
        elif n.op == "get_attr":
            value = self.fetch_attr(str(n.target))
            tensors = [value] if isinstance(value, torch.Tensor) else []
        return {
            self._canonical.get(id(t), str(n.target)): t.numel() * t.element_size() for t in tensors
        }


def _annotate(gm: fx.GraphModule, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    with torch.no_grad():
        _Annotator(gm, _canonical_names(model), inputs[0].shape[0]).run(*inputs)
    _attribute_get_attrs(gm)
    _flag_shared(gm)


def _attribute_get_attrs(gm: fx.GraphModule) -> None:
    """A get_attr node's tensor counts as a parameter of each node that consumes it."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.meta.get("gp_params"):
            for user in node.users:
                user.meta.setdefault("gp_params", {}).update(node.meta["gp_params"])


def _flag_shared(gm: fx.GraphModule) -> None:
    users: dict[str, int] = {}
    compute = [n for n in gm.graph.nodes if n.op not in ("get_attr", "placeholder", "output")]
    for node in compute:
        for name in node.meta.get("gp_params", {}):
            users[name] = users.get(name, 0) + 1
    for node in gm.graph.nodes:
        params = node.meta.setdefault("gp_params", {})
        node.meta["gp_shared"] = frozenset(p for p in params if users.get(p, 0) > 1)
