"""Trace: turn an `nn.Module` into a `torch.fx.GraphModule` annotated with planning facts.

    gm = graphpipe.trace(model, (tokens, image), leaf_modules=[nn.TransformerEncoderLayer])

Tracing tries `torch.fx.symbolic_trace` first. Where that fails (Python control flow on shapes,
as in many Hugging Face models) it falls back to `torch.export.export(..., strict=False)`, which
also yields an fx graph, at ATen granularity. Where both fail, `TraceError` quotes both reasons.

Inputs. `example_inputs` is a tensor, a tuple of tensors (positional), or a dict of keyword
inputs, as Hugging Face models take them: `{"input_ids": ids, "attention_mask": mask}`. In a
dict, non-tensor values (`use_cache=False`) are constants of the trace, and so are the
forward's optional arguments left out: both are traced as the values they have (fx's
`concrete_args`), so no input is left that nobody feeds. Each tensor input becomes one
placeholder; `TraceInfo.sources` says where each comes from, and `flat_inputs` binds a call's
arguments to them.

Shapes. With `micro_batch_size=b` the model is traced and annotated on the first b rows of
the example inputs: the size the pipeline runs at. torch.export specialises every shape it
sees, so an exported graph holds its batch size as a literal (in views, expands, cats); traced
at the micro-batch size, that literal is the one every stage runs with, and no symbol ever
crosses a stage. A model whose own code fixes the batch size fails here, at compile time,
with a `TraceError` that says so.

Meta. A model built on the meta device (too big for one device) is traced and annotated with
its example inputs moved to the meta device: shapes, bytes and FLOPs need no values.

State. Tracing must not change the model. Modules that update buffers in their forward
(BatchNorm and its subclasses from any library) are leaves of the fx trace, so their updates
run as the module runs; torch.export records such updates in the graph. A trace that still
changed a buffer is refused, naming the buffer, and the buffer is restored.

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
    gp_mutates    frozenset[str]: buffers the node updates in place (BatchNorm statistics),
                  by canonical name. A stage holding such a node is not replicated.
    gp_grad       bool: its float output requires a gradient (it uses a trainable parameter,
                  `gp_trains`, or an input that requires one, `gp_grad_in`). A frozen
                  encoder's nodes have none: no backward runs through them.

"Per sample" is per row of the traced batch (the micro-batch with `micro_batch_size`).

Keys written on `gm.meta`:
    graphpipe     `TraceInfo`: how the graph was traced, the batch size, the input names and
                  the bytes of every parameter and buffer of the model.
    gp_constants  dict[str, Any]: the non-tensor keyword inputs as given (`use_cache=False`),
                  which `retrace` passes again.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

import graphpipe._torch as _torch
from graphpipe._torch import tree_structure
from graphpipe.errors import ConfigError, TraceError
from graphpipe.tracing import bind
from graphpipe.tracing.annotate import (
    Source,
    TensorSpec,
    TraceInfo,
    annotate,
    frozen,
    has_float_output,
    is_meta,
    param_bytes,
    restore,
    snapshot,
    trace_info,
)
from graphpipe.tracing.bind import flat_inputs, model_output
from graphpipe.tracing.checks import drop_value_checks, is_check
from graphpipe.tracing.split import InputSplit
from graphpipe.tracing.static import fold_static, specialised
from graphpipe.tracing.verify import verify_trace

__all__ = [
    "TensorSpec",
    "TraceInfo",
    "flat_inputs",
    "has_float_output",
    "model_output",
    "retrace",
    "trace",
    "trace_info",
]

LeafSpec = type | str


def trace(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any],
    leaf_modules: Iterable[LeafSpec] = (),
    *,
    micro_batch_size: int | None = None,
    input_split: InputSplit | None = None,
) -> fx.GraphModule:
    """Trace `model` into an fx graph and annotate every node with shapes, bytes and FLOPs.

    Args:
        model: The model. Its parameters are shared with the result, not copied.
        example_inputs: One mini-batch: a tensor, a tuple of positional tensors, or a dict
            of keyword inputs (non-tensor values are constants); dim 0 is the batch.
        leaf_modules: Module types or module paths to keep as single nodes.
        micro_batch_size: Trace and annotate at this many rows (the size the pipeline runs
            at); default the whole example batch.
        input_split: How each input splits into micro-batches where its dim 0 is not the
            batch (`graphpipe.tracing.split`); None: dim 0, or the dim inferred.

    Returns:
        The traced `GraphModule`, computing exactly what `model` computes, with the
        `node.meta` keys listed in this module's docstring. It takes the tensor inputs
        (`flat_inputs` binds a call to them).

    Raises:
        ConfigError: bad inputs, a micro-batch size that does not divide the batch, or a leaf
            module path that does not exist.
        TraceError: both torch.fx and torch.export failed (the message quotes both), the
            graph does not run at the micro-batch size, tracing changed a buffer, or the
            graph's output on the example differs from the model's own forward
            (`graphpipe.tracing.verify`).

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> gm = trace(m, torch.randn(3, 4))
        >>> [n.name for n in gm.graph.nodes]
        ['input_1', '_0', '_1', '_2', 'output']
    """
    args, kwargs = bind.normalise(example_inputs)
    split = bind.split_of(args, kwargs, input_split)
    batch = bind.batch_of(args, kwargs, split)
    b = batch if micro_batch_size is None else _checked_micro(batch, micro_batch_size)
    full = (args, kwargs)
    args, kwargs = bind.rows(args, kwargs, batch // b, split, "meta" if is_meta(model) else None)
    leaf_types, leaf_paths = _split_leaves(model, leaf_modules)
    concrete = bind.concrete_args(model, args, kwargs)
    static = _static_inputs(split, args, kwargs, model)
    fx_error = None
    if static:
        fx_error = f"not tried: static inputs {sorted(static)} are constants of an export trace"
    else:
        try:
            with _unchanged(model, "torch.fx.symbolic_trace"):
                gm, sources = _fx_trace(model, args, kwargs, concrete, leaf_types, leaf_paths)
            method = "fx"
        except TraceError:
            raise
        except Exception as fx_exc:  # any other failure here means "try torch.export"
            fx_error = f"{type(fx_exc).__name__}: {fx_exc}"
    if fx_error is not None:
        with _unchanged(model, "torch.export"):
            gm, sources = _export_trace(model, (args, kwargs), full, fx_error, (b, batch), static)
        method = "export"
    _drop_dead_getitems(gm)
    flat = [args[s] if isinstance(s, int) else kwargs[s] for s in sources]
    annotate(gm, model, flat, b, _batch_hint((b, batch)))
    gm.meta["graphpipe"] = TraceInfo(
        method=method,
        batch_size=batch,
        input_names=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        param_bytes=param_bytes(model),
        fx_error=fx_error,
        micro_batch_size=b,
        sources=tuple(sources),
        constants={k: repr(v) for k, v in concrete.items() if k in kwargs},
        out_spec=_torch.out_spec(gm),
        frozen=frozen(model),
    )
    gm.meta["gp_constants"] = {k: v for k, v in concrete.items() if k in kwargs}
    gm.meta["gp_split"] = split  # the rules, those inferred included
    gm.meta["gp_static"] = {k: kwargs[k].detach().clone() for k in sorted(static)}
    gm.meta["gp_example"] = [x.detach() for x in flat]  # the micro-batch it ran at
    verify_trace(model, gm, (args, kwargs))
    return gm


def retrace(model: nn.Module, gm: fx.GraphModule, flat: Sequence[torch.Tensor]) -> fx.GraphModule:
    """`model` exported again, as `trace` exported `gm`, at the shapes of `flat`.

    torch.export writes every shape into its graph, so a graph `trace` exported runs at its
    traced shapes only. At other input shapes (another sequence length, another micro-batch
    size) the same model exports to a graph of the same ops with other literals; the runtime
    carves it with the same plan. Nothing is annotated (the plan already exists).

    Args:
        model: The model (or a stand-in with its structure, `graphpipe.runtime.shapes`).
        gm: The graph `trace` exported: its inputs' sources and the trace's constants.
        flat: One tensor per placeholder of `gm`, at the new shapes.

    Returns:
        The exported graph, taking the tensor inputs, with `gm`'s `TraceInfo`.

    Raises:
        TraceError: `gm` was not exported, or torch.export fails at these shapes.
    """
    info = trace_info(gm)
    if info.method != "export":
        raise TraceError(f"retrace is for exported graphs; this one was traced by {info.method}")
    if gm.meta.get("gp_static"):
        raise TraceError(
            f"the graph holds the values of its static inputs {sorted(gm.meta['gp_static'])} "
            "as traced; it runs at the shapes it was traced at only"
        )
    by_source = list(zip(info.sources, flat, strict=True))
    positional = {s: x for s, x in by_source if isinstance(s, int)}
    args = tuple(positional[i] for i in sorted(positional))
    kwargs: dict[str, Any] = {s: x for s, x in by_source if isinstance(s, str)}
    kwargs.update(gm.meta.get("gp_constants", {}))
    new, _ = _export_trace(model, (args, kwargs), (args, kwargs), info.fx_error or "", (1, 1))
    _drop_dead_getitems(new)
    new.meta["graphpipe"] = info
    return new


def _checked_micro(batch: int, micro_batch_size: int) -> int:
    if micro_batch_size < 1 or batch % micro_batch_size:
        raise ConfigError(
            f"micro_batch_size {micro_batch_size} does not divide the example batch of {batch}"
        )
    return micro_batch_size


def _batch_hint(sizes: tuple[int, int]) -> str:
    b, batch = sizes
    if b == batch:
        return ""
    return (
        f" graphpipe runs the model at the micro-batch size ({b} rows of the example batch of "
        f"{batch}): if its code fixes the batch size (a literal {batch} in a view or reshape), "
        "derive it from the input's shape instead."
    )


def _batch_diagnosis(
    model: nn.Module,
    inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    full: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    sizes: tuple[int, int],
) -> str:
    """Why an export at the micro-batch size failed, if the whole batch exports: the model's
    code fixes the batch size. Empty when the whole batch fails too (another cause).
    `sizes`: the micro-batch's rows and the whole batch's."""
    b, batch = sizes
    if b == batch:
        return ""
    try:
        with _quiet_torch(), _unchanged(model, "torch.export"):
            torch.export.export(model, full[0], full[1], strict=False)
    except Exception:
        return ""
    return (
        f"It exports at the whole example batch of {batch} but not at the micro-batch size "
        f"{b}: the model's code fixes the batch size (a literal {batch} in a view, reshape or "
        "expand). graphpipe runs every stage on micro-batches; derive the batch size from the "
        "input's shape instead."
    )


def _export_advice(message: str) -> str:
    if "which is not a known type" in message:
        return (
            "The model returns an object that is not a tensor or a container of tensors (for "
            "Hugging Face models, a key/value cache: pass use_cache=False as a keyword input)."
        )
    return (
        "Control flow that depends on tensor values cannot be traced: move it out of "
        "forward(), replace it with torch.where/torch.cond, or name the module that holds it in "
        "leaf_modules so it stays one opaque node."
    )


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


# Modules whose forward updates their buffers in place (running statistics): traced as leaves,
# so the update runs when the module runs; a subclass from another library (timm's
# BatchNormAct2d) would otherwise be traced through and its update lost from the graph.
STATEFUL_LEAVES: tuple[type, ...] = (_torch.stateful_norm(),)


class _Tracer(fx.Tracer):
    """symbolic_trace with user leaf modules, recording each node's module path."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str]) -> None:
        super().__init__()
        self._leaf_types = leaf_types
        self._leaf_paths = leaf_paths
        self._scope = [""]

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            isinstance(m, self._leaf_types + STATEFUL_LEAVES)
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
    model: nn.Module,
    args: tuple[torch.Tensor, ...],
    kwargs: dict[str, Any],
    concrete: dict[str, Any],
    leaf_types: tuple[type, ...],
    leaf_paths: frozenset[str],
) -> tuple[fx.GraphModule, list[Source]]:
    """symbolic_trace with the constants as `concrete_args`; their placeholders are dropped."""
    tracer = _Tracer(leaf_types, leaf_paths)
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _drop_constants(gm, set(concrete))
    _spread_varargs(gm, len(args))
    return gm, _fx_sources(gm, model, args, kwargs)


def _drop_constants(gm: fx.GraphModule, names: set[str]) -> None:
    """Remove the placeholders fx keeps for the concrete arguments `names` (it renames them,
    `mask` -> `mask_1`), with the checks that read them.

    Raises:
        TraceError: a concrete argument is used by the computation, not only by checks.
    """
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or not _is_concrete(str(node.target), names):
            continue
        _erase_dead_users(node)
        if node.users:
            raise TraceError(
                f"the constant input {node.target!r} is used by {[u.name for u in node.users]}"
            )
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _is_concrete(target: str, names: set[str]) -> bool:
    base, _, suffix = target.rpartition("_")
    return target in names or (suffix.isdigit() and base in names)


def _erase_dead_users(node: fx.Node) -> None:
    """Erase the nodes that only check `node` (no path from them to the output)."""
    below: set[fx.Node] = set()
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user not in below:
            below.add(user)
            stack.extend(user.users)
    if any(u.op == "output" for u in below):
        return
    for user in reversed(list(node.graph.nodes)):  # users before what they read
        if user in below and not user.users:
            node.graph.erase_node(user)


def _fx_sources(
    gm: fx.GraphModule, model: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, Any]
) -> list[Source]:
    """Each placeholder's source: a positional index or a keyword, by the forward's signature.

    Placeholders come in signature order; `forward(*inputs)`'s spread ones follow the named
    positional parameters.
    """
    params = inspect.signature(model.forward).parameters.values()
    positional = [p.name for p in params if p.kind in bind.POSITIONAL][: len(args)]
    sources: list[Source] = []
    spread = len(positional)
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op != "placeholder":
            continue
        if name in kwargs:
            sources.append(name)
        elif name in positional:
            sources.append(positional.index(name))
        else:
            sources.append(spread)
            spread += 1
    return sources


def _static_inputs(
    split: InputSplit, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module
) -> frozenset[str]:
    """The keyword inputs the trace takes as constants (`Static` rules).

    Raises:
        ConfigError: a static rule for a positional input or a non-tensor, or a model on
            the meta device (whose trace computes no values to fold), naming it.
    """
    if not split.static:
        return frozenset()
    bad = [s for s in split.static if isinstance(s, int) or not _is_tensor(kwargs.get(s))]
    if bad:
        raise ConfigError(
            f"input_split makes inputs {sorted(map(str, bad))} static, but a static input "
            "must be a tensor given as a keyword input"
        )
    if is_meta(model):
        raise ConfigError(
            f"static inputs {sorted(split.static)} need a model with real weights: on the "
            "meta device the trace computes no values to make constants of"
        )
    return frozenset(str(s) for s in split.static)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _export_trace(
    model: nn.Module,
    inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    full: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    fx_error: str,
    sizes: tuple[int, int],
    static: frozenset[str] = frozenset(),
) -> tuple[fx.GraphModule, list[Source]]:
    """torch.export at the micro-batch size (`inputs`; `full` is the whole example batch;
    `sizes` their rows, for the diagnosis of a failure). With `static` inputs, draft_export
    and the values computed from them folded into the graph (`tracing.static`)."""
    args, kwargs = inputs
    decisions: list[_torch.ValueDecision] = []
    try:
        with _quiet_torch():
            if static:
                exported, decisions = _torch.draft_export(model, args, kwargs)
            else:
                exported = torch.export.export(model, args, kwargs, strict=False)
    except _torch.TorchAPIError:
        raise
    except Exception as exc:
        raise TraceError(
            f"could not trace {type(model).__name__}. torch.fx.symbolic_trace failed "
            f"({_first_line(fx_error)}) and torch.export (non-strict) failed "
            f"({type(exc).__name__}: {_first_line(str(exc))}). "
            + (_batch_diagnosis(model, inputs, full, sizes) or _export_advice(str(exc)))
        ) from exc
    gm = exported.module()
    for node in list(gm.graph.nodes):
        if _torch.is_export_guard(node):
            gm.graph.erase_node(node)
        else:
            node.meta["gp_module"] = _export_module_path(node)
    if static:
        _fold_static(gm, (args, kwargs), static, decisions)
        _refuse_specialised(gm, static, decisions)
    gm.meta["gp_value_checks"] = drop_value_checks(gm, drop=not static)
    sources = _drop_exported_constants(gm, args, kwargs, static)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, sources


def _fold_static(
    gm: fx.GraphModule,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    static: frozenset[str],
    decisions: Sequence[_torch.ValueDecision],
) -> None:
    """Fold what the static inputs compute into the graph (`tracing.static.fold_static`).

    Raises:
        TraceError: draft_export met an op it could not run on fake tensors, naming it.
    """
    args, kwargs = inputs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = _torch.flatten_by_spec(list(bind.labels(args, kwargs)), _torch.in_spec(gm))
    values = {n: kwargs[s] for n, s in zip(placeholders, sources, strict=True) if s in static}
    fold_static(gm, values)
    for decision in decisions:
        if decision.kind == "MISMATCHED_FAKE_KERNEL":  # metadata only: annotate runs values
            warnings.warn(
                f"torch.export's fake kernel disagrees with the real one: {decision.detail} "
                f"(tracing with static inputs "
                f"{sorted(static)}); graphpipe takes every shape and dtype from a run on the "
                "example's values and checks the graph's output against the model's",
                stacklevel=4,
            )
        elif not decision.expr:
            raise TraceError(
                f"torch.export could not trace {type(gm).__name__} with static inputs "
                f"{sorted(static)}: {decision.kind} {decision.detail} at "
                f"{decision.where or 'an unknown place'}"
            )


def _refuse_specialised(
    gm: fx.GraphModule, static: frozenset[str], decisions: Sequence[_torch.ValueDecision]
) -> None:
    """Refuse a graph draft_export specialised on the values of a non-static input.

    Raises:
        TraceError: naming the decision and where it was taken (`static.specialised`).
    """
    found = specialised(gm, [(d.expr, d.where) for d in decisions if d.expr], is_check)
    if found:
        raise TraceError(
            f"with static inputs {sorted(static)}, torch.export decided {found} from the "
            "values of another input: the graph would be right for this example only. Make "
            "the input it reads static too, or move the decision out of forward()"
        )


def _drop_exported_constants(
    gm: fx.GraphModule,
    args: tuple[torch.Tensor, ...],
    kwargs: dict[str, Any],
    static: frozenset[str] = frozenset(),
) -> list[Source]:
    """Drop the placeholders of non-tensor inputs (export specialised on their values) and
    of static ones (folded), so the module's calling convention is the other tensor inputs
    only; return the sources."""
    spec = _torch.in_spec(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources: list[Source] = _torch.flatten_by_spec(list(bind.labels(args, kwargs)), spec)
    constants = {k for k, v in kwargs.items() if not isinstance(v, torch.Tensor)} | static
    if not constants:
        return sources
    kept: list[Source] = []
    for node, source in zip(placeholders, sources, strict=True):
        if source in constants:
            if node.users:
                raise TraceError(f"the constant input {source!r} is used by {list(node.users)}")
            gm.graph.erase_node(node)
        else:
            kept.append(source)
    keys = [k for k in _torch.keyword_names(spec) if k not in constants]
    _torch.drop_inputs(gm, constants, tree_structure((args, {k: kwargs[k] for k in keys})))
    return kept


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
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = placeholders.index(star)  # named positional inputs come before it
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
def _unchanged(model: nn.Module, how: str) -> Iterator[None]:
    """Tracing must not change the model: restore every buffer afterwards and, if tracing
    succeeded but changed one, refuse the trace, naming the buffers.

    Raises:
        TraceError: a buffer changed while tracing (its update would be missing from the
            graph).
    """
    saved = snapshot(model)
    try:
        yield
    except BaseException:
        restore(model, saved)
        raise
    changed = restore(model, saved)
    if changed:
        raise TraceError(
            f"{how} changed buffers {changed} of the model in place while tracing, so the "
            "graph would not update them. Name the module that updates them in leaf_modules "
            "(BatchNorm and its subclasses already are leaves)"
        )


def _drop_dead_getitems(gm: fx.GraphModule) -> None:
    """Remove unused tuple-unpacking nodes (e.g. the attention weights of `a, _ = attn(...)`)."""
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and node.op == "call_function" and node.target is operator.getitem:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
