"""Stage modules: each stage's slice of the traced graph as an fx.GraphModule of its own.

    module, io = build_stage(gm, plan, s)
    outputs = module(*[inputs[name] for name in io.inputs])   # {value name: tensor, ...}

A stage module's placeholders are the model inputs its ops read (under their placeholder
names) followed by the values it receives from other stages (under the names of the fx nodes
that make them). It returns a dict: every value another stage needs, by node name, and, on the
stage holding the model's output node, the model output under `OUTPUT`. Its parameters keep
their names in the original model, so state dicts map one to one; `get_attr` nodes are copied
into every stage that reads them (tied weights are then held by several stages).

`micro_shapes` gives every value's shape and dtype for one micro-batch, from a fake-tensor run
(no memory, no compute), so receivers can allocate their buffers before anything arrives.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

import graphpipe._torch as _torch
from graphpipe.errors import ConfigError, PlanError
from graphpipe.ir import Plan
from graphpipe.tracing.annotate import is_meta
from graphpipe.tracing.bind import micro_example, model_output

__all__ = [
    "OUTPUT",
    "Specs",
    "StageIO",
    "arrive_as_traced",
    "build_stage",
    "drop_metadata_asserts",
    "micro_shapes",
    "model_output",
    "retarget",
    "shapes_at",
]

OUTPUT = "__output__"


@dataclass(frozen=True)
class StageIO:
    """What a stage module reads and returns."""

    model_inputs: tuple[str, ...]  # placeholder names of the model inputs it reads
    received: tuple[str, ...]  # values it receives, by producing node name
    sent: tuple[str, ...]  # values other stages need from it
    has_output: bool  # it holds the model's output node: the loss is computed here

    @property
    def inputs(self) -> tuple[str, ...]:
        """The stage module's positional arguments, by name."""
        return self.model_inputs + self.received


def build_stage(gm: fx.GraphModule, plan: Plan, index: int) -> tuple[fx.GraphModule, StageIO]:
    """Carve stage `index` of `plan` out of `gm`.

    Args:
        gm: The traced graph the plan was made for.
        plan: The plan.
        index: The stage.

    Returns:
        The stage module (sharing parameters with `gm`) and its inputs and outputs.

    Raises:
        PlanError: the plan names ops that are not in `gm`, or the stage reads a value that
            no edge of the plan brings to it.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    mine = set(plan.stages[index].nodes)
    unknown = sorted(mine - set(nodes))
    if unknown:
        raise PlanError(f"stage {index} names ops {unknown} that the traced graph does not have")
    sent = sorted(
        {t for e in plan.edges if e.src == index for t in e.tensors}, key=list(nodes).index
    )
    graph, env = fx.Graph(), dict[str, fx.Node]()
    model_inputs, received, output = _placeholders(gm, mine, graph, env)
    incoming = {t for e in plan.edges if e.dst == index for t in e.tensors}
    unfed = [name for name in received if name not in incoming]
    if unfed:
        raise PlanError(f"stage {index} reads {unfed}, but no stage edge brings them to it")
    for node in gm.graph.nodes:
        if node.name in mine and node.op != "output":
            _copy_inputs(node, graph, env)
            env[node.name] = graph.node_copy(node, lambda a: env[a.name])
    results: dict[str, Any] = {name: env[name] for name in sent}
    if output is not None:
        results[OUTPUT] = fx.node.map_arg(output.args[0], lambda a: env[a.name])
    graph.output(results)
    _clone_written(gm, graph, received)
    graph.lint()
    module = fx.GraphModule(gm, graph, f"Stage{index}")
    io = StageIO(tuple(model_inputs), tuple(received), tuple(sent), output is not None)
    return module, io


def arrive_as_traced(module: fx.GraphModule, io: StageIO, traced: dict[str, torch.dtype]) -> None:
    """Cast each value the stage receives back to the dtype it was traced in, as it arrives
    (`x.to(dtype)` after its placeholder: differentiable, a no-op when it came in that
    dtype), so a graph that fixed its dtypes (torch.export's) runs on values that crossed in
    a half-width dtype; the message and its gradient still cross in that dtype. Its checks of
    the traced dtypes go (`drop_metadata_asserts`): under autocast a layer's output is the
    half dtype where the trace saw float32 (LLaVA's projector before its `.to()`).

    Args:
        module: The stage module (`build_stage`), changed in place.
        io: Its inputs and outputs.
        traced: Value name -> its dtype in the trace (`micro_shapes`).
    """
    graph = module.graph
    for node in list(graph.nodes):
        dtype = traced.get(node.target) if node.op == "placeholder" else None
        if node.target in io.received and dtype is not None and dtype.is_floating_point:
            with graph.inserting_after(node):
                cast = graph.call_method("to", (node, dtype))
            node.replace_all_uses_with(cast, delete_user_cb=functools.partial(_not, cast))
    drop_metadata_asserts(module)  # under autocast an op's output is the half dtype


METADATA_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def drop_metadata_asserts(module: fx.GraphModule) -> None:
    """Remove torch.export's checks of each value's traced dtype and device
    (`aten._assert_tensor_metadata`, written before a `.to()`): a stage that computes in
    another dtype than it was traced in (bf16 under autocast, DTensors under tp) fails them
    where nothing is wrong. They compute nothing; the casts they guard stay."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is METADATA_ASSERT:
            graph.erase_node(node)
    graph.lint()
    module.recompile()


def _not(node: fx.Node, user: fx.Node) -> bool:
    return user is not node


# ops that return a view of their first argument: a write to the view writes the argument
_VIEWS = frozenset(
    {"view", "view_as", "reshape", "transpose", "permute", "flatten", "squeeze", "unsqueeze",
     "expand", "narrow", "select", "t", "unflatten", "__getitem__", "getitem", "contiguous"}
)  # fmt: skip
_IN_PLACE_OPERATORS = frozenset({"iadd", "isub", "imul", "itruediv", "__iadd__", "__isub__",
                                 "__imul__", "__itruediv__"})  # fmt: skip


def _clone_written(gm: fx.GraphModule, graph: fx.Graph, received: Sequence[str]) -> None:
    """Insert a clone after each received value the stage writes in place (directly or
    through a view: `nn.ReLU(inplace=True)`, `x.add_(...)`, `x += ...`).

    The executor hands a received floating value to the stage as a leaf that requires grad
    (its gradient goes back to the sender), and autograd refuses an in-place write to such
    a leaf; on one process the same value is an intermediate, which may be written. The
    clone makes it one here too (differentiable; one copy per micro-batch, only for such
    values).
    """
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.target in received and _written(gm, node):
            with graph.inserting_after(node):
                copy = graph.call_method("clone", (node,))
            node.replace_all_uses_with(copy, delete_user_cb=functools.partial(_not, copy))


def _written(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether an op writes `node`'s tensor in place, directly or through a view of it."""
    seen, todo = set(), [node]
    while todo:
        value = todo.pop()
        for user in value.users:
            if user in seen:
                continue
            seen.add(user)
            if user.args and user.args[0] is value and _in_place(gm, user):
                return True
            if user.args and user.args[0] is value and _name(user) in _VIEWS:
                todo.append(user)
    return False


def _in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` writes its first argument: a module or function called with
    inplace=True, a trailing-underscore method or function (`add_`, `torch.relu_`), or an
    augmented assignment operator."""
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(node.target)), "inplace", False) is True
    if node.kwargs.get("inplace") is True:
        return True
    name = _name(node)
    underscored = name.endswith("_") and not name.startswith("_")
    return node.op in ("call_method", "call_function") and (
        underscored or name in _IN_PLACE_OPERATORS
    )


def _name(node: fx.Node) -> str:
    """A call's op name: the method's, or the function's `__name__`."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _placeholders(
    gm: fx.GraphModule, mine: set[str], graph: fx.Graph, env: dict[str, fx.Node]
) -> tuple[list[str], list[str], fx.Node | None]:
    """Placeholders for the model inputs read and the values received; the output node."""
    model_inputs: list[str] = []
    received: list[str] = []
    output = None
    for node in gm.graph.nodes:  # graph order, so both lists come out in graph order
        if node.name not in mine:
            continue
        output = node if node.op == "output" else output
        for src in node.all_input_nodes:
            if src.op == "placeholder":
                if src.name not in model_inputs:
                    model_inputs.append(src.name)
            elif src.op != "get_attr" and src.name not in mine and src.name not in received:
                received.append(src.name)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    model_inputs.sort(key=order.__getitem__)
    received.sort(key=order.__getitem__)
    for name in model_inputs + received:
        env[name] = graph.placeholder(name)
    return model_inputs, received, output


def _copy_inputs(node: fx.Node, graph: fx.Graph, env: dict[str, fx.Node]) -> None:
    """Copy the get_attr nodes `node` reads into the stage graph (once each)."""
    for src in node.all_input_nodes:
        if src.op == "get_attr" and src.name not in env:
            env[src.name] = graph.node_copy(src)


def retarget(module: fx.GraphModule, device: torch.device) -> None:
    """Make the devices written into the graph `device`.

    torch.export records the device of every tensor a model creates (`arange(...,
    device=meta)` for a causal mask): the device it was traced on. A stage runs on its rank's
    device, so every device constant in its graph becomes that one, in the subgraphs of
    higher-order ops too (an autocast region).
    """
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule) and _retarget_graph(sub.graph, device):
            sub.recompile()


def _retarget_graph(graph: fx.Graph, device: torch.device) -> bool:
    changed = False
    for node in graph.nodes:
        args, kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda a: device if isinstance(a, torch.device) and a != device else a,
        )
        if (args, kwargs) != (node.args, node.kwargs):
            node.args, node.kwargs, changed = args, kwargs, True
    return changed


Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # node name -> shape, dtype


def micro_shapes(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], micro_batch_size: int
) -> Specs:
    """Shape and dtype of every tensor a node outputs, for one micro-batch.

    A fake-tensor run (no memory, no compute) on fake copies of the parameters and buffers,
    so the real ones are never touched (a BatchNorm's `num_batches_tracked` stays as it is).

    Raises:
        ConfigError: an op whose output shape depends on the values of its inputs
            (`nonzero`, boolean-mask indexing), named with its node: no rank could size
            the messages after it from the input shapes.
    """
    on_meta = is_meta(gm)
    with _torch.fake_mode() as mode, torch.no_grad():
        fakes = [
            mode.from_tensor(x.to("meta") if on_meta else x)
            for x in micro_example(gm, example_inputs, micro_batch_size)
        ]
        state = _fake_state(gm, mode)
        specs = _recorded(gm, state, fakes)
    # the fake mode memoises the real parameters (through weak references) until it is
    # collected: free it now rather than at some later collection
    del mode, fakes, state
    gc.collect()
    return specs


def shapes_at(
    gm: fx.GraphModule, inputs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device
) -> Specs:
    """`micro_shapes` at the input shapes `inputs`, without reading any real tensor.

    Every parameter, buffer and input is made inside the fake mode on `device` (the device
    the graph was traced on, whose device constants it holds), so the run works whatever
    device each real tensor has been moved to since.

    Raises:
        ConfigError: as `micro_shapes`; or the graph does not run at these shapes, naming
            the node that failed.
    """
    named = [
        *gm.named_parameters(remove_duplicate=False),
        *gm.named_buffers(remove_duplicate=False),
    ]
    with _torch.fake_mode(), torch.no_grad():
        made: dict[int, torch.Tensor] = {}
        for _, t in named:
            if id(t) not in made:
                made[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        state = {f"gm.{name}": made[id(t)] for name, t in named}
        fakes = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in inputs]
        return _recorded(gm, state, fakes)


def _recorded(
    gm: fx.GraphModule, state: dict[str, torch.Tensor], inputs: Sequence[torch.Tensor]
) -> Specs:
    """Run `gm` with `state` as its parameters and buffers, recording every tensor's spec."""
    specs: Specs = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            try:
                value = super().run_node(n)
            except Exception as exc:
                raise _refusal(n, exc) from exc
            if isinstance(value, torch.Tensor):
                specs[n.name] = (tuple(value.shape), value.dtype)
            return value

    class _Run(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gm = gm

        def forward(self, *inputs: torch.Tensor) -> Any:
            return _Recorder(self.gm).run(*inputs)

    torch.func.functional_call(_Run(), state, tuple(inputs), strict=False)
    return specs


def _refusal(n: fx.Node, exc: Exception) -> Exception:
    """A ConfigError naming node `n` for an op with a data-dependent shape; else `exc`."""
    if isinstance(exc, ConfigError):
        return exc
    op = _torch.data_dependent_op(exc)
    if op is None:
        return exc
    return ConfigError(
        f"op {op} (node {n.name}, {n.format_node()}) makes a shape that depends on the "
        "values of its input: no rank can size the messages after it from the input shapes, "
        "so graphpipe cannot pipeline it. Use a fixed-shape form (torch.where with a mask, "
        "a padded gather), or keep it inside a leaf module whose output shape is fixed"
    )


def _fake_state(gm: fx.GraphModule, mode: _torch.FakeTensorMode) -> dict[str, torch.Tensor]:
    """A fake of every parameter and buffer under each of its names (one fake per tensor)."""
    fakes: dict[int, torch.Tensor] = {}
    state = {}
    named = [
        *gm.named_parameters(remove_duplicate=False),
        *gm.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if id(t) not in fakes:
            fakes[id(t)] = mode.from_tensor(t)
        state[f"gm.{name}"] = fakes[id(t)]
    return state
