"""The planner's view of a traced graph: a networkx DiGraph of ops with their costs.

The fx graph stays the IR. This view is derived from it, for graph algorithms only. Its nodes
are the fx compute nodes plus the output node (named by fx node name); placeholders and
get_attr nodes are left out, because every stage can read the model inputs and holds the
parameters it uses.

Node attributes:
    forward, backward  seconds for one micro-batch (from a `Profile`)
    act                bytes of the node's outputs for one micro-batch (0 for the output node)
    params             frozenset of canonical parameter/buffer names the node uses
    order              position in the fx graph (a topological order)
    module             module path, for labels
    float              whether the node outputs a floating-point tensor (gradients flow back)
Edge attribute:
    bytes              bytes the edge carries for one micro-batch (the producer's `act`)
Graph attribute:
    param_bytes        bytes of every parameter and buffer, by canonical name
"""

from __future__ import annotations

import hashlib

import networkx as nx
from torch import fx

from graphpipe.profile import NodeTime, Profile
from graphpipe.trace import has_float_output, trace_info

__all__ = ["graph_hash", "op_graph", "target_name"]


def op_graph(gm: fx.GraphModule, prof: Profile) -> nx.DiGraph:
    """Derive the cost-annotated networkx view of `gm` for micro-batches of `prof`'s size.

    Args:
        gm: A graph made by `graphpipe.trace`.
        prof: Per-node times from `graphpipe.profile.profile`.

    Returns:
        The DiGraph described in this module's docstring.
    """
    info = trace_info(gm)
    b = prof.micro_batch_size
    g = nx.DiGraph(param_bytes=dict(info.param_bytes))
    for order, node in enumerate(gm.graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        t = prof.times.get(node.name, NodeTime(0.0, 0.0))
        act = 0 if node.op == "output" else node.meta.get("gp_out_bytes", 0) * b
        g.add_node(
            node.name,
            forward=t.forward,
            backward=t.backward,
            act=act,
            params=frozenset(node.meta.get("gp_params", {})),
            order=order,
            module=node.meta.get("gp_module", ""),
            float=has_float_output(node),
        )
        for src in node.all_input_nodes:
            if src.name in g:
                g.add_edge(src.name, node.name, bytes=g.nodes[src.name]["act"])
    return g


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
