"""Tensor parallelism inside stages: the "tp" dimension of a DeviceMesh, by DTensor.

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pm = graphpipe.compile(hf_llama, ..., mesh=mesh)   # the model's own base_model_tp_plan
    pm = graphpipe.compile(model, ..., mesh=mesh, tp_plan={"blocks.*.fc1": "colwise",
                                                           "blocks.*.fc2": "rowwise"})

A tensor-parallel plan names modules by path (`*` stands for one path component, as in
Hugging Face's `base_model_tp_plan`) and a style for each: "colwise" shards a Linear's weight
and bias along their output dimension (Shard(0)), "rowwise" its weight along the input
dimension (Shard(1)) and keeps its bias whole; "embedding_rowwise" (Hugging Face's for the
token embedding) keeps the table whole (see `STYLES`). Every other parameter of a stage is a
replicated DTensor over the stage's tp sub-mesh. A tied weight (an embedding read again as
the output layer) is one tensor with one layout: the one its uses agree on, else replicated
(`shared_placements`). A model's own plan is applied as far as graphpipe can (a mixture of
experts' packed-expert entries are dropped, the experts kept whole: `resolve_tp_plan`).

How the plan is applied, on both tracing paths alike: each stage's parameters become DTensors
placed as the plan says, and the stage graph runs as it was traced, on DTensors, under
torch's `implicit_replication` (a plain tensor meeting a DTensor counts as replicated: the
values received from other stages, the graph's own constants). DTensor's sharding
propagation then decides every collective from each op's global semantics, so a view with a
shape baked in by the trace (the global shape) is right, and so are the gradients: the
stage computes exactly what the unsharded model computes, whatever ops lie between the
planned layers. This is why graphpipe does not call `parallelize_module`: its styles shard
a Linear's *output* locally (`use_local_output`), which breaks every later op of an
exported or traced graph whose shapes are the global ones.

Values crossing a stage boundary are whole tensors on the wire (an output still sharded or
partial is made whole over tp as the stage returns it, in autograd), and each tp rank
sends to the same tp rank of the next stage. Gradients of replicated parameters come out
whole on every tp rank; FSDP2 (a "dp" dimension) shards the DTensors again over dp (2D).

Three rewrites make exported graphs runnable on DTensors: torch.export's metadata asserts
(`aten._assert_tensor_metadata`, checks of the traced dtype and device) are dropped from a
tensor-parallel stage, and scaled dot-product attention (`aten.scaled_dot_product_attention`,
or CPU's fused kernel it becomes, which DTensor has no sharding rule for in torch 2.13:
propagating through the kernel's decomposition took minutes, measured) is replaced by the
same attention in plain ops (matmul, softmax; `attention`), which DTensor shards by heads.
It computes what the fused kernel does, not in its memory: the (length x length) scores are
materialised per head shard. An op of a library's own (outside aten, e.g. transformers'
grouped matmul of the experts), which DTensor has no sharding rule for, runs on whole
tensors (`on_whole`).
"""

from __future__ import annotations

import contextlib
import math
import operator
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from graphpipe._torch import tree_leaves, tree_map
from graphpipe.errors import ConfigError
from graphpipe.planning.mesh import TP_LAYOUTS, path_matches
from graphpipe.runtime.stage import drop_metadata_asserts

__all__ = [
    "STYLES",
    "apply_tp",
    "for_dtensor",
    "model_tp_plan",
    "on_whole",
    "placements",
    "resolve_tp_plan",
    "shared_placements",
    "tp_context",
    "whole_tensor",
]

# a layout (`graphpipe.planning.mesh.TP_LAYOUTS`, which the planner costs) -> its (weight,
# bias) placements. "colwise_rep" and "colwise_gather_output" are "colwise": their output is
# made whole where it is read whole (the boundary does that anyway). "embedding_rowwise"
# (an Embedding's vocabulary rows) is kept whole: DTensor's vocabulary-sharded lookup gives
# a masked partial sum whose backward meets a plain partial one and stops ("Redistribution
# from P(sum) to MaskP(sum) is unsupported", torch 2.13, measured on Llama's embedding)
_PLACED: dict[str | None, tuple[Placement, Placement]] = {
    "colwise": (Shard(0), Shard(0)),
    "rowwise": (Shard(1), Replicate()),
    None: (Replicate(), Replicate()),
}
# style -> (weight placement, bias placement); Hugging Face's names for the layouts
STYLES: dict[str, tuple[Placement, Placement]] = {
    style: _PLACED[layout] for style, layout in TP_LAYOUTS.items()
}

_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
# the op namespaces DTensor shards by its own rules (and the graph's higher-order ops); an op
# of any other (a library's own, registered by torch.library) runs on whole tensors
_DTENSOR_NAMESPACES = ("aten", "prims", "higher_order")


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own tensor-parallel plan by full module path: a Hugging Face model's
    `config.base_model_tp_plan` (paths under its base model, e.g. `model.`) and its class's
    `_tp_plan` (the head); empty for a model without one."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    under = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    plan.update({f"{under}{k}": str(v) for k, v in base.items()})
    plan.update({str(k): str(v) for k, v in (getattr(model, "_tp_plan", None) or {}).items()})
    return plan


def resolve_tp_plan(model: nn.Module, tp_plan: Mapping[str, str] | None) -> dict[str, str]:
    """The plan to apply: `tp_plan`, or the model's own (`model_tp_plan`), checked.

    The model's own plan is read as far as graphpipe applies it: an entry of another style
    (Hugging Face's "packed_colwise" and "moe_tp_experts" for a mixture of experts' packed
    weights), one naming a parameter rather than a module, or one matching no module of
    this configuration (a dense MLP's where every layer is sparse) is dropped with a
    warning naming it, and what it names stays whole (replicated over tp). A `tp_plan`
    given is applied as written, every entry, or refused.

    Raises:
        ConfigError: no plan at all; in a `tp_plan` given, a style graphpipe does not apply
            or an entry that matches no module of the model.
    """
    modules = [name for name, _ in model.named_modules()]
    if tp_plan is None:
        plan, dropped = _applicable(model_tp_plan(model), modules)
        if dropped:
            warnings.warn(
                f"{type(model).__name__}'s own tp plan: entries {dropped} are not applied "
                f"(graphpipe applies the styles {sorted(STYLES)} to modules); what they name "
                "stays whole, replicated over tp",
                stacklevel=2,
            )
    else:
        plan = dict(tp_plan)
    if not plan:
        raise ConfigError(
            f"a 'tp' mesh dimension needs a tensor-parallel plan: {type(model).__name__} "
            "has no base_model_tp_plan; pass tp_plan={module path: 'colwise' | 'rowwise'}"
        )
    unknown = {k: v for k, v in plan.items() if v not in STYLES}
    if unknown:
        raise ConfigError(
            f"tp_plan entries {unknown}: graphpipe applies the styles {sorted(STYLES)}; "
            "drop or change these entries"
        )
    idle = [k for k in plan if not any(path_matches(k, m) for m in modules)]
    if idle:
        raise ConfigError(f"tp_plan entries {idle} match no module of {type(model).__name__}")
    return plan


def _applicable(
    plan: Mapping[str, str], modules: list[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """`plan` split into the entries graphpipe applies (a style of `STYLES` on a module of
    `modules`) and the rest."""
    kept: dict[str, str] = {}
    dropped: dict[str, str] = {}
    for pattern, style in plan.items():
        applies = style in STYLES and any(path_matches(pattern, m) for m in modules)
        (kept if applies else dropped)[pattern] = style
    return kept, dropped


def _style(param: str, plan: Mapping[str, str]) -> str | None:
    """The style of the module that owns parameter `param`, or None (replicated)."""
    module = param.rpartition(".")[0]
    return next((style for pattern, style in plan.items() if path_matches(pattern, module)), None)


def placements(param: str, plan: Mapping[str, str]) -> list[Placement]:
    """Where parameter `param` (the model's name) lies over the tp dimension.

    Example:
        >>> placements("layers.0.fc1.weight", {"layers.*.fc1": "colwise"})
        [Shard(dim=0)]
        >>> placements("layers.0.norm.weight", {"layers.*.fc1": "colwise"})
        [Replicate()]
    """
    style = _style(param, plan)
    if style is None:
        return [Replicate()]
    weight, bias = STYLES[style]
    return [bias if param.endswith(".bias") else weight]


def shared_placements(names: Sequence[str], plan: Mapping[str, str]) -> list[Placement]:
    """Where one tensor read under every name of `names` lies over tp: the placement its
    uses agree on, else replicated. A tied weight is one tensor, so it takes one layout
    that both of its readers accept: an embedding (kept whole) tied to a column-wise output
    layer (Shard(0) of the vocabulary) is replicated, and each of its readers computes on
    the whole table; two column-wise layers sharing a weight keep Shard(0).

    Example:
        >>> shared_placements(["embed.weight", "out.weight"], {"out": "colwise"})
        [Replicate()]
        >>> shared_placements(["a.weight", "b.weight"], {"a": "colwise", "b": "colwise"})
        [Shard(dim=0)]
    """
    each = {tuple(placements(n, plan)) for n in names}
    return list(each.pop()) if len(each) == 1 else [Replicate()]


def apply_tp(
    stage: fx.GraphModule,
    canon: Mapping[str, str],
    mesh: DeviceMesh,
    plan: Mapping[str, str],
    made: dict[int, nn.Parameter] | None = None,
) -> None:
    """Make a stage tensor-parallel over `mesh` (its tp sub-mesh), in place.

    Its parameters become DTensors placed by `plan` (every tp rank holds the whole model's
    values and keeps its shard), the graph is rewritten for DTensor (see the module's
    docstring), and its outputs come back whole. A tied weight takes the one placement
    `shared_placements` gives over all of the model's names for it, so every stage holding
    it, on this rank or another, shards it alike (the sums over tied copies add local
    shards of one layout, `graphpipe.runtime.groups`); read under two names in this stage,
    or by two stages of this rank sharing `made`, it stays one parameter.

    Args:
        stage: The stage module, on its device.
        canon: Every name of the model's tensors (the stage's among them) -> its first name.
        mesh: The tp mesh.
        plan: The checked plan (`resolve_tp_plan`).
        made: The DTensor parameter made of each tensor (by the id of the tensor as the
            model holds it), shared by the calls for one rank's stages: a weight tied
            across them is one DTensor. None: this stage's own.
    """
    every: dict[str, list[str]] = {}  # first name -> every name of the tensor
    for name, first in canon.items():
        every.setdefault(first, []).append(name)
    made = {} if made is None else made  # a tensor read under two names: one DTensor
    for name, p in list(stage.named_parameters(remove_duplicate=False)):
        *path, leaf = name.split(".")
        owner = stage.get_submodule(".".join(path))
        if id(p) not in made:
            first = canon.get(name, name)
            where = shared_placements(every.get(first, [first]), plan)
            # a meta tensor (a meta model, `materialize_sharded`) is split without a collective
            source = None if p.is_meta else 0
            sharded = distribute_tensor(p.detach(), mesh, where, src_data_rank=source)
            made[id(p)] = nn.Parameter(sharded, requires_grad=p.requires_grad)
        setattr(owner, leaf, made[id(p)])
    for_dtensor(stage)
    stage.register_forward_hook(_whole_outputs)


def for_dtensor(stage: fx.GraphModule) -> None:
    """Drop export's metadata asserts; replace scaled dot-product attention by plain ops;
    run a library's own ops on whole tensors (`on_whole`)."""
    drop_metadata_asserts(stage)
    graph = stage.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (_SDPA, _CPU_ATTENTION):
            _replace_attention(graph, node)
        elif getattr(node.target, "namespace", None) not in (None, *_DTENSOR_NAMESPACES):
            with graph.inserting_before(node):
                whole = graph.call_function(on_whole, (node.target, *node.args), node.kwargs)
            _in_place_of(whole, node)
            node.replace_all_uses_with(whole)
            graph.erase_node(node)
    stage.recompile()


def _in_place_of(new: fx.Node, old: fx.Node) -> None:
    """`new` stands where `old` did: it keeps `old`'s module path (`gp_module`), so an
    outlined block (`graphpipe.runtime.outline`) still holds it."""
    if "gp_module" in old.meta:
        new.meta["gp_module"] = old.meta["gp_module"]


def on_whole(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`op(*args, **kwargs)` on whole tensors: each DTensor argument made whole (replicated
    over its mesh, then its local tensor), each tensor `op` returns a replicated DTensor
    again. Every tp rank computes the same value, and autograd runs `op`'s own backward on
    plain tensors: the gradient of a replicated output is made whole before it, the
    gradients it gives are whole on every tp rank.

    Example: a mixture of experts' grouped matmul (`transformers::grouped_mm_fallback`),
    which DTensor has no sharding rule for, on replicated expert weights."""
    meshes = [a.device_mesh for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not meshes:
        return op(*args, **kwargs)
    mesh = meshes[0]

    def local(a: Any) -> Any:
        if not isinstance(a, DTensor):
            return a
        return a.redistribute(placements=[Replicate()] * a.device_mesh.ndim).to_local()

    def replicated(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)

    return tree_map(replicated, op(*tree_map(local, args), **tree_map(local, kwargs)))


def _replace_attention(graph: fx.Graph, node: fx.Node) -> None:
    """Call `attention` where `node` calls torch's scaled dot-product attention: the
    composite op export records (its output read as is), or CPU's fused kernel (whose
    readers may take only its output, item 0: the log-sum-exp serves the fused backward)."""
    q, k, v, *rest = node.args
    positional: tuple[str, ...]
    if node.target is _SDPA:
        positional, readers = ("attn_mask", "dropout_p", "is_causal"), [node]
    else:
        positional, readers = ("dropout_p", "is_causal"), list(node.users)
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in readers):
            raise ConfigError(
                f"{node.name} ({_CPU_ATTENTION}) has a reader of its log-sum-exp; graphpipe "
                "can run its output only under tensor parallelism"
            )
    kwargs = {**dict(zip(positional, rest, strict=False)), **node.kwargs}
    with graph.inserting_before(node):
        plain = graph.call_function(attention, (q, k, v), kwargs)
    _in_place_of(plain, node)
    for reader in readers:
        reader.replace_all_uses_with(plain)
        if reader is not node:
            graph.erase_node(reader)
    graph.erase_node(node)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention` in plain ops (matmul, softmax),
    in its (batch, heads, length, dim) layout and with its arguments.

    Raises:
        ConfigError: dropout (a random mask, which the fused kernel draws its own way).
    """
    if dropout_p:
        raise ConfigError(
            f"attention dropout_p={dropout_p} under tensor parallelism: the fused kernel's "
            "random mask cannot be reproduced; train with attention dropout 0"
        )
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    factor = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    if is_causal:
        length, keys = query.shape[-2], key.shape[-2]
        ones = torch.ones(length, keys, dtype=torch.bool, device=query.device)
        scores = scores.masked_fill(~ones.tril(keys - length), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def _whole_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: every DTensor among the stage's outputs made whole (in autograd)."""
    return tree_map(whole_tensor, output)


def whole_tensor(t: Any) -> Any:
    """A DTensor as the whole plain tensor it stands for (a collective over its mesh); any
    other value as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def tp_context(active: bool) -> Iterator[None]:
    """Where tensor-parallel stages run forward and backward: plain tensors meeting
    DTensors count as replicated (`implicit_replication`); nothing when not `active`."""
    if not active:
        yield
        return
    with implicit_replication():
        yield
