"""Annotate: run a traced graph once on example inputs and write the planning facts on every
node (the `gp_*` keys that `graphpipe.tracing.tracer` documents).

The run is an `fx.Interpreter`: a failure names the node. It leaves the model as it was:
buffers (BatchNorm statistics) and the random number generator are restored afterwards. It
also records which nodes update a buffer in place (`gp_mutates`), by the tensors' version
counters, so the planner can keep such a node's stage unreplicated: replicas would each see
only some micro-batches, and their statistics would differ from a single device's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from graphpipe._torch import TreeSpec, tree_flatten, tree_map
from graphpipe.errors import ConfigError, TraceError

__all__ = [
    "Source",
    "TensorSpec",
    "TraceInfo",
    "annotate",
    "has_float_output",
    "is_meta",
    "param_bytes",
    "restore",
    "snapshot",
    "trace_info",
]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor value (the example batch's shape)."""

    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        dtype = self.dtype.removeprefix("torch.")
        return f"{dtype}[{','.join(map(str, self.shape))}]"


def annotate(
    gm: fx.GraphModule, model: nn.Module, inputs: list[torch.Tensor], rows: int, hint: str = ""
) -> None:
    """Run `gm` once on `inputs` (`rows` samples) and write the gp_* keys on every node.

    Args:
        gm: The traced graph.
        model: The model it was traced from (for canonical parameter names).
        inputs: One tensor per placeholder.
        rows: dim 0 of the inputs: "per sample" values are divided by it.
        hint: Appended to the error when a node fails.

    Raises:
        TraceError: a node failed, naming it.
    """
    with _untouched(model), torch.no_grad():
        _Annotator(gm, _canonical_names(model), rows, hint).run(*inputs)
    _attribute_get_attrs(gm)
    _flag_shared(gm)
    _flag_grads(gm, trainable(model))


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Run the example pass without side effects: buffers (BatchNorm statistics) and the
    random number generator are restored afterwards."""
    saved = snapshot(model)
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            restore(model, saved)


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` lives on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_meta or b.is_meta:  # no values to change
        return True
    if a.is_floating_point():
        return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def restore(model: nn.Module, saved: dict[str, torch.Tensor]) -> list[str]:
    """Put the saved buffer values back; return the names of those that had changed."""
    changed = []
    with torch.no_grad():
        for name, b in model.named_buffers():
            if not _same(b, saved[name]):
                changed.append(name)
                b.copy_(saved[name])
    return changed


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


def param_bytes(model: nn.Module) -> dict[str, int]:
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

    def __init__(self, gm: fx.GraphModule, canonical: dict[int, str], rows: int, hint: str) -> None:
        super().__init__(gm)
        self._canonical = canonical
        self._batch = rows
        self._hint = hint
        self._buffer_ids = {id(b) for b in gm.buffers()}

    def run_node(self, n: fx.Node) -> Any:
        before = self._touched(n)
        with FlopCounterMode(display=False) as flops:
            try:
                result = super().run_node(n)
            except Exception as exc:
                raise TraceError(
                    f"running node {n.name!r} ({n.format_node()}) on the example inputs failed: "
                    f"{type(exc).__name__}: {exc}.{self._hint}"
                ) from exc
        n.meta["gp_outputs"] = _spec(result)
        n.meta["gp_out_bytes"] = _tensor_bytes(result) // self._batch
        n.meta["gp_flops"] = flops.get_total_flops() // self._batch
        n.meta["gp_params"] = self._params_of(n)
        n.meta["gp_mutates"] = frozenset(
            self._canonical.get(id(b), "?") for b, saved in before if not _same(b, saved)
        )
        return result

    def _touched(self, n: fx.Node) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The buffers node `n` can write, each with a copy of its value now."""
        if n.op == "call_module":
            found = list(self.module.get_submodule(str(n.target)).buffers())
        elif n.op in ("call_function", "call_method"):
            args, _ = tree_flatten((n.args, n.kwargs))
            values = [self.env[a] for a in args if isinstance(a, fx.Node) and a in self.env]
            found = [v for v in values if isinstance(v, torch.Tensor)]
            found = [v for v in found if id(v) in self._buffer_ids]
        else:
            found = []
        return [(b, b.detach().clone()) for b in found]

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


def _attribute_get_attrs(gm: fx.GraphModule) -> None:
    """A get_attr node's tensor counts as a parameter of each node that consumes it."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.meta.get("gp_params"):
            for user in node.users:
                user.meta.setdefault("gp_params", {}).update(node.meta["gp_params"])


def trainable(model: nn.Module) -> frozenset[str]:
    """The canonical names of the parameters that take a gradient (`requires_grad`)."""
    return frozenset(name for name, p in model.named_parameters() if p.requires_grad)


def frozen(model: nn.Module) -> frozenset[str]:
    """The canonical names of the parameters that take no gradient (a frozen encoder)."""
    return frozenset(name for name, p in model.named_parameters() if not p.requires_grad)


def _flag_grads(gm: fx.GraphModule, trains: frozenset[str]) -> None:
    """Which nodes a backward runs through, from the trainable parameters forward (graph
    order is topological): `gp_trains` (uses a trainable parameter), `gp_grad_in` (an input
    requires a gradient), `gp_grad` (its float output requires one: either of those)."""
    for node in gm.graph.nodes:
        uses = node.meta.get("gp_params", {})
        node.meta["gp_trains"] = any(p in trains for p in uses)
        node.meta["gp_grad_in"] = any(a.meta.get("gp_grad") for a in node.all_input_nodes)
        node.meta["gp_grad"] = (
            node.op not in ("placeholder", "output")
            and has_float_output(node)
            and (node.meta["gp_trains"] or node.meta["gp_grad_in"])
        )


def _flag_shared(gm: fx.GraphModule) -> None:
    users: dict[str, int] = {}
    compute = [n for n in gm.graph.nodes if n.op not in ("get_attr", "placeholder", "output")]
    for node in compute:
        for name in node.meta.get("gp_params", {}):
            users[name] = users.get(name, 0) + 1
    for node in gm.graph.nodes:
        params = node.meta.setdefault("gp_params", {})
        node.meta["gp_shared"] = frozenset(p for p in params if users.get(p, 0) > 1)


Source = int | str  # where a placeholder's value comes from: a positional index or a keyword


@dataclass(frozen=True)
class TraceInfo:
    """Facts about one trace, stored as `gm.meta["graphpipe"]`.

    Attributes:
        method: "fx" (symbolic_trace) or "export" (torch.export fallback).
        batch_size: dim 0 of the example inputs (the mini-batch).
        input_names: the placeholder names, in order.
        param_bytes: bytes of every parameter and buffer, by canonical name.
        fx_error: why symbolic_trace failed, when method is "export".
        micro_batch_size: rows the graph was traced and annotated at (the batch size when
            no micro-batch size was given).
        sources: per placeholder, its positional index or keyword name in the call.
        constants: keyword inputs traced as constants, with their values' repr.
        out_spec: how the output's leaves nest (graphs from torch.export return them flat).
        frozen: the parameters that take no gradient (`requires_grad=False`), by canonical
            name: no gradient and no optimizer state for them.
    """

    method: str
    batch_size: int
    input_names: tuple[str, ...]
    param_bytes: dict[str, int] = field(default_factory=dict)
    fx_error: str | None = None
    micro_batch_size: int = 0
    sources: tuple[Source, ...] = ()
    constants: dict[str, str] = field(default_factory=dict)
    out_spec: TreeSpec | None = None
    frozen: frozenset[str] = frozenset()


def trace_info(gm: fx.GraphModule) -> TraceInfo:
    """The `TraceInfo` of a graph made by `trace`.

    Raises:
        ConfigError: `gm` was not made by `graphpipe.tracing.tracer`.
    """
    info = gm.meta.get("graphpipe")
    if not isinstance(info, TraceInfo):
        raise ConfigError("this GraphModule was not made by graphpipe.trace(); trace it first")
    return info
