"""The planner's view of a traced graph: a networkx DiGraph of ops with their costs.

The fx graph stays the IR. This view is derived from it, for graph algorithms only. Its nodes
are the fx compute nodes plus the output node (named by fx node name); placeholders and
get_attr nodes are left out, because every stage can read the model inputs and holds the
parameters it uses.

Node attributes:
    forward, backward  seconds for one micro-batch (from a `Profile`)
    act                bytes of the node's outputs for one micro-batch (0 for the output node)
                       kept on this device (1/t of it where tensor parallelism splits it)
    wire               bytes of the node's outputs sent to another stage, when not `act`
                       (`wire_bytes`; set by `mesh.tp_rank_graph`: boundaries carry them whole)
    tp_split           (tp only) the output is split by tensor parallelism: kept with its
                       users by the search (`fold.folded_groups`)
    params             frozenset of canonical parameter/buffer names the node uses
    order              position in the fx graph (a topological order)
    module             module path, for labels
    float              whether the node outputs a floating-point tensor (gradients flow back)
    tensor             whether the output is exactly one tensor: only such values may cross
                       a stage boundary (the runtime sends single tensors)
    value              what the output is, for messages: "tensor", or e.g. "tuple", "int",
                       "torch.Size", "bool", "None" (`value_kind`)
    constant           whether the output depends on no model input, only on parameters,
                       buffers and constants (an `arange`, a mask or rotary table built from
                       it, a transposed weight)
Edge attribute:
    bytes              bytes the edge carries for one micro-batch (the producer's `act`)
Graph attribute:
    param_bytes        bytes of every parameter and buffer, by canonical name
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any

import networkx as nx
import torch
from torch import fx

from graphpipe.planning.profile import NodeTime, Profile
from graphpipe.tracing.annotate import TensorSpec, has_float_output, trace_info

__all__ = [
    "graph_hash",
    "input_shapes",
    "op_graph",
    "target_name",
    "value_kind",
    "wire_bytes",
]

_COMPARISONS = (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge)
_INT_METHODS = ("dim", "numel", "nelement", "ndimension")
_SYMBOLIC = {torch.SymInt: "int", torch.SymBool: "bool", torch.SymFloat: "float"}


def op_graph(gm: fx.GraphModule, prof: Profile, precision: str | None = None) -> nx.DiGraph:
    """Derive the cost-annotated networkx view of `gm` for micro-batches of `prof`'s size.

    Args:
        gm: A graph made by `graphpipe.tracing.tracer`.
        prof: Per-node times from `graphpipe.planning.profile.profile`.
        precision: "bf16" or "fp16": a node with a floating output keeps and sends it in 2
            bytes per element instead of float32's 4 (`graphpipe.runtime.precision`).

    Returns:
        The DiGraph described in this module's docstring.
    """
    info = trace_info(gm)
    b = prof.micro_batch_size
    g = nx.DiGraph(param_bytes=dict(info.param_bytes), frozen=info.frozen)
    constant: set[fx.Node] = set()
    for order, node in enumerate(gm.graph.nodes):
        if node.op == "get_attr" or (
            node.op != "placeholder" and all(a in constant for a in node.all_input_nodes)
        ):
            constant.add(node)
        if node.op in ("placeholder", "get_attr"):
            continue
        t = prof.times.get(node.name, NodeTime(0.0, 0.0))
        act = 0 if node.op == "output" else node.meta.get("gp_out_bytes", 0) * b
        if precision is not None and has_float_output(node):
            act //= 2
        values = _value_attributes(node)
        if not _kept_for_backward(node):  # a frozen encoder's values: nothing saved
            values.setdefault("wire", act)
            act = 0
        g.add_node(
            node.name,
            forward=t.forward,
            backward=t.backward,
            act=act,
            params=frozenset(node.meta.get("gp_params", {})),
            order=order,
            module=node.meta.get("gp_module", ""),
            float=has_float_output(node),
            stateful=bool(node.meta.get("gp_mutates")),
            constant=node in constant and node.op != "output",
            grad=bool(node.meta.get("gp_grad", has_float_output(node))),
            **values,
        )
        for src in node.all_input_nodes:
            if src.name in g:
                g.add_edge(src.name, node.name, bytes=wire_bytes(g, src.name))
    return g


def _kept_for_backward(node: fx.Node) -> bool:
    """Whether autograd keeps the node's output: it, or a node that reads it, takes a
    gradient (graphs annotated before `gp_grad`: always)."""
    if "gp_grad" not in node.meta:
        return True
    return bool(node.meta["gp_grad"]) or any(u.meta.get("gp_grad") for u in node.users)


def wire_bytes(g: nx.DiGraph, n: str) -> float:
    """Bytes op `n`'s outputs take on the wire to another stage: its `wire`, else its `act`."""
    data = g.nodes[n]
    return data.get("wire", data["act"])


def value_kind(node: fx.Node) -> str:
    """What `node` outputs: "tensor" for exactly one tensor, else a short description.

    Read from `node.meta["gp_outputs"]` (written by `graphpipe.tracing.tracer`): a container of
    tensors is "tuple", "list" or "dict". A non-tensor leaf there is None, so its kind comes
    from torch.export's `val` when present, else from the op: a size query is "torch.Size" or
    "int", a comparison "bool", an op without users "None"; anything else is "non-tensor".
    A node without `gp_outputs` (not traced by graphpipe) counts as a tensor unless it is a
    size query.

    Example:
        >>> g = fx.symbolic_trace(lambda x: x.view(x.shape[0], -1))
        >>> [value_kind(n) for n in g.graph.nodes if n.op == "call_function"]
        ['torch.Size', 'int']
    """
    if "gp_outputs" not in node.meta:
        if "val" in node.meta:
            return _kind_of(node.meta["val"])
        return _size_query_kind(node) or "tensor"
    spec = node.meta["gp_outputs"]
    if isinstance(spec, TensorSpec):
        return "tensor"
    if _is_size_query(node):  # a torch.Size is a tuple to pytree
        return "torch.Size" if _whole_size(node) else "int"
    if isinstance(spec, tuple | list | dict):
        return "tuple" if isinstance(spec, tuple) else type(spec).__name__
    if spec is not None:
        return type(spec).__name__
    if "val" in node.meta:
        return _kind_of(node.meta["val"])
    if node.op == "call_function" and node.target in _COMPARISONS:
        return "bool"
    return _size_query_kind(node) or ("None" if not node.users else "non-tensor")


def _kind_of(val: Any) -> str:
    """The kind of an example value (torch.export's `val`: a FakeTensor, a SymInt, ...)."""
    if isinstance(val, torch.Tensor):
        return "tensor"
    if isinstance(val, tuple | list | dict):
        return "tuple" if isinstance(val, tuple) else type(val).__name__
    return _SYMBOLIC.get(type(val), "None" if val is None else type(val).__name__)


def _size_query_kind(node: fx.Node) -> str | None:
    """The kind of a size query (`x.shape`, `x.size(1)`, `x.dim()`, `shape[0]`), else None."""
    if _is_size_query(node):
        return "torch.Size" if _whole_size(node) else "int"
    if node.op == "call_method" and node.target in _INT_METHODS:
        return "int"
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if isinstance(source, fx.Node) and _is_size_query(source) and _whole_size(source):
            return "int" if isinstance(node.args[1], int) else "torch.Size"
    return None


def _is_size_query(node: fx.Node) -> bool:
    shape_attr = node.target is getattr and node.args[1:] == ("shape",)
    return (node.op == "call_function" and shape_attr) or (
        node.op == "call_method" and node.target == "size"
    )


def _whole_size(node: fx.Node) -> bool:
    """Whether a size query returns the whole torch.Size (not one dimension)."""
    return node.op == "call_function" or (len(node.args) < 2 and "dim" not in node.kwargs)


def _value_attributes(node: fx.Node) -> dict[str, Any]:
    kind = value_kind(node)
    return {"tensor": kind == "tensor", "value": kind}


def target_name(node: fx.Node) -> str:
    """A process-independent name for a node's target (no memory addresses)."""
    target = node.target
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else str(target)


def graph_hash(gm: fx.GraphModule) -> str:
    """A digest of the graph's structure; equal on every rank for the same model and trace."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        inputs = ",".join(n.name for n in node.all_input_nodes)
        h.update(f"{node.name}|{node.op}|{target_name(node)}|{inputs};".encode())
    return h.hexdigest()[:16]


def input_shapes(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Each placeholder's shape as traced (per micro-batch), by name: what a plan is for
    besides its graph (`graph_hash` covers no shapes)."""
    shapes = {}
    for node in gm.graph.nodes:
        spec = node.meta.get("gp_outputs")
        if node.op == "placeholder" and hasattr(spec, "shape"):
            shapes[node.name] = tuple(int(d) for d in spec.shape)
    return shapes
