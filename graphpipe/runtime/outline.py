"""Outline: each block of a flat stage graph called as a submodule of its own, for FSDP2.

    paths = outline_blocks(stage, model)   # ["model.layers.0", "model.layers.1"]
    stage_blocks(stage, model)             # now one FSDP2 unit per path

FSDP2 shards and gathers parameters by module: a unit's all-gather runs in its forward
pre-hook. A stage traced by torch.export (every Hugging Face Llama) is a flat aten graph
that reads its parameters by `get_attr` and calls no module, so without this pass its root
would be its one unit: every parameter of the stage gathered at once. Here each block (an
element of the model's outermost ModuleList or Sequential, `block_prefixes`) whose nodes the
stage runs becomes a small `fx.GraphModule` registered on the stage at the block's own path,
and the block's nodes in the stage graph become one `call_module` node. The block module
holds the block's tensors under their names relative to that path, so every name of
`stage.named_parameters()` (and their order) is unchanged: checkpoints, optimizer state, the
tp plan's patterns, the tied-weight sums and state dicts all key on those names. Values from
outside the block (the rotary embedding's cos and sin, a mask, the residual stream) are the
block module's inputs; every value read outside it is an output (several are a tuple).

Why outline rather than `torch.export.unflatten`: unflatten rebuilds the whole module
hierarchy from the exported program (every module called, with its own calling convention),
but a stage is a slice of the graph carved by the plan, possibly through the middle of a
block, with graphpipe's own nodes added (received values cast back, in-place-written inputs
cloned, tp's rewrites); outlining works on any such slice, touches only whole groups of
nodes, and keeps the stage module (and its identity, which callers hold) as it is.

A block is outlined only when that is safe, else its nodes stay in the root as before:

- its nodes read at least one tensor by `get_attr` and call no module (a block of called
  modules is already a unit of its own: `graphpipe.runtime.mesh.stage_blocks`);
- no node outside it reads one of its tensors, under any name (a tied weight stays with the
  stage root), and it reads no other module attribute (a higher-order op's subgraph);
- it holds no tensor under its path that its nodes do not read;
- its nodes are convex: no path leaves the block and comes back into it, so one call can
  stand for them (the nodes outside that use its outputs and lie between its nodes move
  after the call).

A node's block is the block its `gp_module` (the module path the tracer writes on every node)
falls under; a node without one (graphpipe's own, added after tracing) belongs to the root.

The stage records the paths it outlined in `stage.meta["gp_blocks"]`, so a stage graph made
for other input shapes is outlined alike (`outline_like`) and run through the same units.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from graphpipe.errors import ConfigError

__all__ = ["BLOCKS", "block_prefixes", "outline_blocks", "outline_like", "outlined"]

BLOCKS = "gp_blocks"  # stage.meta key: the paths of the blocks outlined, in call order


def block_prefixes(model: nn.Module) -> list[str]:
    """Paths of the elements of the model's outermost ModuleLists and Sequentials.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
        >>> block_prefixes(m)
        ['0', '1']
    """
    found: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and not any(
            name.startswith(f + ".") or name == f for f in found
        ):
            found.extend(f"{name}.{child}" if name else child for child, _ in m.named_children())
    return found


def outlined(stage: nn.Module) -> tuple[str, ...]:
    """The paths of the blocks `outline_blocks` outlined in `stage` (none for any other)."""
    meta = getattr(stage, "meta", None)
    return tuple(meta.get(BLOCKS, ())) if isinstance(meta, dict) else ()


def outline_blocks(stage: nn.Module, model: nn.Module) -> list[str]:
    """Outline, in place, every block of `stage` that can be (the module docstring says when).

    Args:
        stage: The stage's GraphModule (its tensors under the model's names); anything else
            (an emulated stage) is left alone.
        model: The original model (which containers are lists of blocks).

    Returns:
        The paths outlined, in the stage's call order (also `stage.meta["gp_blocks"]`).
    """
    if not isinstance(stage, fx.GraphModule):
        return []
    done = [
        path
        for path, nodes in _groups(stage, block_prefixes(model))
        if _outline(stage, path, nodes)
    ]
    stage.meta[BLOCKS] = tuple(_call_order(stage, [*outlined(stage), *done]))
    return list(stage.meta[BLOCKS])


def outline_like(stage: fx.GraphModule, paths: Sequence[str]) -> None:
    """Outline, in place, the blocks `paths` of `stage` (another stage graph of the same ops,
    e.g. traced at other input shapes, as a stage `outline_blocks` outlined them).

    Raises:
        ConfigError: one of `paths` cannot be outlined in `stage`, naming it.
    """
    groups = dict(_groups(stage, list(paths)))
    failed = [p for p in paths if p not in groups or not _outline(stage, p, groups[p])]
    if failed:
        raise ConfigError(
            f"the blocks {failed} of the stage cannot be outlined in its graph at these "
            "shapes as they were at the compiled ones (their nodes differ)"
        )
    stage.meta[BLOCKS] = tuple(paths)


def _call_order(stage: fx.GraphModule, paths: Iterable[str]) -> list[str]:
    wanted = set(paths)
    return [
        str(n.target) for n in stage.graph.nodes if n.op == "call_module" and n.target in wanted
    ]


def _owner(node: fx.Node, prefixes: set[str]) -> str:
    """The block `node` belongs to (its `gp_module` under one of `prefixes`), or ""."""
    path = str(node.meta.get("gp_module", ""))
    parts = path.split(".") if path else []
    return next(
        (p for p in (".".join(parts[: i + 1]) for i in range(len(parts))) if p in prefixes), ""
    )


def _groups(stage: fx.GraphModule, prefixes: list[str]) -> list[tuple[str, list[fx.Node]]]:
    """Each block's nodes in `stage` (graph order), for the blocks that may be outlined."""
    known = set(prefixes)
    groups: dict[str, list[fx.Node]] = {}
    for node in stage.graph.nodes:
        if node.op not in ("placeholder", "output"):
            groups.setdefault(_owner(node, known), []).append(node)
    groups.pop("", None)
    readers = _tensor_readers(stage)
    return [
        (path, nodes) for path, nodes in groups.items() if _movable(stage, path, nodes, readers)
    ]


def _tensor_readers(stage: fx.GraphModule) -> dict[int, set[fx.Node]]:
    """The get_attr nodes reading each tensor of `stage`, by the tensor's id."""
    readers: dict[int, set[fx.Node]] = {}
    for node in stage.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(str(node.target))(stage)
            readers.setdefault(id(value), set()).add(node)
    return readers


def _movable(
    stage: fx.GraphModule, path: str, nodes: list[fx.Node], readers: dict[int, set[fx.Node]]
) -> bool:
    """Whether block `path`'s tensors may move into a module of its own: it reads tensors,
    calls no module, and no node outside it reads its tensors or their get_attr nodes."""
    inside = set(nodes)
    reads = [n for n in nodes if n.op == "get_attr"]
    if not reads or any(n.op == "call_module" for n in nodes):
        return False
    if any(not str(n.target).startswith(path + ".") for n in reads):
        return False  # a tensor of another path (fx names a tied weight by its first name)
    values = [operator.attrgetter(str(n.target))(stage) for n in reads]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    if any(not readers[id(v)] <= inside for v in values):
        return False  # read under another name too (a tied weight)
    if any(not set(n.users) <= inside for n in reads):
        return False  # the tensor itself is used outside the block
    fed = {a for n in nodes for a in n.all_input_nodes if a not in inside and a.op == "get_attr"}
    if any(not isinstance(operator.attrgetter(str(a.target))(stage), torch.Tensor) for a in fed):
        return False  # a higher-order op's subgraph, read from the root
    held = {name for name, _ in _named_tensors(stage.get_submodule(path))}
    return held == {str(n.target)[len(path) + 1 :] for n in reads}


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]


@dataclass(frozen=True)
class _Cut:
    """Where one block's nodes meet the rest of the stage graph."""

    inputs: list[fx.Node]  # nodes outside read by the block, in graph order
    outputs: list[fx.Node]  # block nodes read outside, in graph order
    moved: list[fx.Node]  # nodes outside between the block's nodes that read its outputs


def _cut(graph: fx.Graph, nodes: list[fx.Node]) -> _Cut | None:
    """The block's inputs, outputs and the nodes to move after its call; None when the block
    is not convex (a node between its nodes reads it and feeds it back)."""
    inside = set(nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = sorted(
        {a for n in nodes for a in n.all_input_nodes if a not in inside}, key=order.__getitem__
    )
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    moved: dict[fx.Node, None] = {}  # what depends on the block: moved behind its call
    for node in list(graph.nodes)[order[nodes[0]] : order[nodes[-1]] + 1]:
        if node in inside and any(a in moved for a in node.all_input_nodes):
            return None
        if node not in inside and any(a in inside or a in moved for a in node.all_input_nodes):
            moved[node] = None
    return _Cut(inputs, outputs, list(moved)) if outputs else None


def _outline(stage: fx.GraphModule, path: str, nodes: list[fx.Node]) -> bool:
    """Outline block `path` (its `nodes`, in graph order) into a module at `path`; False
    (and nothing changed) when it cannot be."""
    order = {n: i for i, n in enumerate(stage.graph.nodes)}
    nodes = sorted(nodes, key=order.__getitem__)  # an earlier block's outlining moves nodes
    cut = _cut(stage.graph, nodes)
    if cut is None:
        return False
    block = fx.GraphModule(stage.get_submodule(path), _block_graph(path, nodes, cut), "Block")
    parent, _, name = path.rpartition(".")
    setattr(stage.get_submodule(parent), name, block)  # the same slot: names keep their order
    _replace(stage.graph, path, nodes, cut)
    stage.recompile()
    return True


def _block_graph(path: str, nodes: list[fx.Node], cut: _Cut) -> fx.Graph:
    """The block's own graph: its inputs as placeholders, its nodes (tensors read by their
    names under `path`), its outputs (one value, or a tuple of several)."""
    graph = fx.Graph()
    env = {a: graph.placeholder(a.name) for a in cut.inputs}
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        if node.op == "get_attr":
            env[node].target = str(node.target)[len(path) + 1 :]
    results = [env[n] for n in cut.outputs]
    graph.output(results[0] if len(results) == 1 else tuple(results))
    graph.lint()
    return graph


def _replace(graph: fx.Graph, path: str, nodes: list[fx.Node], cut: _Cut) -> None:
    """In `graph`: one call of the block module after its last node, its outputs read from
    the call, the nodes that read them moved behind it, and the block's nodes erased."""
    inside = set(nodes)
    with graph.inserting_after(nodes[-1]):
        call = graph.call_module(path, tuple(cut.inputs))
    call.meta["gp_module"] = path
    values = [call]
    if len(cut.outputs) > 1:
        values, anchor = [], call
        for k in range(len(cut.outputs)):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (call, k))
            anchor.meta["gp_module"] = path
            values.append(anchor)
    for out, value in zip(cut.outputs, values, strict=True):
        out.replace_all_uses_with(value, delete_user_cb=lambda user: user not in inside)
    anchor = values[-1]
    for node in cut.moved:
        anchor.append(node)  # moves it: after the call, in its order
        anchor = node
    for node in reversed(nodes):
        graph.erase_node(node)
    graph.lint()
