"""Shapes: a step at input shapes other than the compiled ones, made once per shape and cached.

    shapes = Shapes(gm, plan, modules, compiled, specs, ...)
    lowered = shapes.lowered(signature)     # specs of every value; this rank's stage modules

Every rank receives the whole mini-batch in step(), so every rank knows each micro-batch's
input shapes (its *signature*: shape and dtype of each model input, at this rank's rows) and
computes the shape of every message from them: no rank asks another, and every receive buffer
is sized before its receive. The plan, its stage cut and the schedule stay as compiled.

For a signature compile did not see:

    fx-traced graph   shape-generic (fx records `x.size(1)` as a node), so the stage modules
                      run as they are; the specs of the values that cross stages come from a
                      fake-tensor run of the whole graph at the signature (`stage.shapes_at`).
    exported graph    torch.export wrote the traced shapes into the graph as literals, so the
                      model is exported again at the signature (`tracing.tracer.retrace`), on
                      a stand-in of the model made at the first new shape: its structure with
                      empty tensors on the device it was traced on (`stand_in`), since by then
                      each rank has moved or materialised its own stage's tensors. The new
                      graph must hold the same ops under the same names as the compiled one,
                      so the plan's cut applies to it; it is carved with the same plan, and
                      each of this rank's stages runs its new graph on the stage module's own
                      (live) parameters; under a mesh through the live module itself
                      (`OnLive`: its FSDP2 units, its outlined blocks, tp's hooks).

Both are cached by signature: a shape seen before costs one dictionary lookup. Every rank
makes the same checks (idle ranks too), so a refusal is the same ConfigError everywhere,
before any communication.

How large a step may be: up to `compile(..., max_shapes=...)`, input name -> its largest
whole-batch shape (`check_max_shapes`), in every dimension, else up to the example. The
planner plans memory at that largest batch (`planned_at`): each rank traces the model once
more at it (each example input tiled to its largest shape, so its values stay valid), and
the plan's activation and message bytes are that trace's; op times stay the example's.
"""

from __future__ import annotations

import copy
import math
import operator
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from graphpipe.errors import ConfigError, GraphPipeError
from graphpipe.ir import Plan
from graphpipe.planning.opgraph import graph_hash
from graphpipe.runtime.comm import Spec
from graphpipe.runtime.outline import outline_like, outlined
from graphpipe.runtime.stage import arrive_as_traced, build_stage, retarget, shapes_at
from graphpipe.tracing import bind
from graphpipe.tracing.annotate import trace_info
from graphpipe.tracing.tracer import LeafSpec, retrace, trace

__all__ = [
    "Lowered",
    "Shapes",
    "Signature",
    "check_max_shapes",
    "describe",
    "planned_at",
    "signature_of",
    "stand_in",
]

Signature = tuple[Spec, ...]  # per model input (placeholder order): its micro-batch shape, dtype


@dataclass(frozen=True)
class Lowered:
    """What this rank runs a micro-batch of one signature with."""

    specs: Mapping[str, Spec]  # value name -> shape and dtype (as it crosses stages)
    modules: Mapping[int, nn.Module]  # this rank's stage modules, by stage


def describe(signature: Signature) -> str:
    """`[2, 24] int64, [2, 24] int64`: a signature as text."""
    return ", ".join(
        f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in signature
    )


def stand_in(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy of `model` whose parameters and buffers are empty tensors of the same shapes,
    strides and dtypes on `device` (tied ones stay tied), for exporting it again.

    `device` is the one the model was traced on, wherever its tensors are now. Empty CPU
    tensors are address space only: no page is touched, since torch.export reads no value.
    """
    memo: dict[int, object] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for _, t in named:
        if id(t) not in memo:
            empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            memo[id(t)] = (
                nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
            )
    return copy.deepcopy(model, memo)


class Shapes:
    """The stages at every signature a step brings, cached.

    Args:
        gm: The whole traced graph.
        plan: The plan (its cut is kept at every shape).
        modules: This rank's stage modules at the compiled shapes, by stage (none: idle).
        compiled: The compiled signature.
        specs: The specs at the compiled signature.
        traced_on: The device the graph was traced on (meta for a meta model).
        device: This rank's device.
        crossing: A value's dtype as it crosses stages (the precision's `spec_dtype`).
        model: The model, to export again at new shapes (through a `stand_in` made at the
            first one); None for an fx-traced graph.
        compile_stages: torch.compile each new stage module, as compile did the others.
        fixed: Why shapes cannot change in this run (emulated stages); None: they can.
        on_live: Under a mesh: a new shape's stage graph runs on the live stage module
            (`OnLive`), whose hooks gather its FSDP2 shards and make its tp outputs whole;
            `rewrite` (tp's for DTensors) is applied to the graph first.
        rewrite: A rewrite of each new stage graph, as the live one had (None: none).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        plan: Plan,
        modules: Mapping[int, nn.Module],
        compiled: Signature,
        specs: Mapping[str, Spec],
        traced_on: torch.device,
        device: torch.device,
        crossing: Callable[[torch.dtype], torch.dtype],
        model: nn.Module | None = None,
        compile_stages: bool = False,
        fixed: str | None = None,
        on_live: bool = False,
        rewrite: Callable[[fx.GraphModule], None] | None = None,
    ) -> None:
        self.gm, self.plan, self.modules, self.compiled = gm, plan, dict(modules), compiled
        self.traced_on, self.device, self.crossing = traced_on, device, crossing
        self.model, self.compile_stages, self.fixed = model, compile_stages, fixed
        self.on_live, self.rewrite = on_live, rewrite
        self._stand_in: nn.Module | None = None
        self._cache: dict[Signature, Lowered] = {compiled: Lowered(specs, self.modules)}

    @property
    def seen(self) -> tuple[Signature, ...]:
        """The signatures made so far, the compiled one first."""
        return tuple(self._cache)

    def lowered(self, signature: Signature) -> Lowered:
        """This rank's stages and every value's spec at `signature` (made once, then cached).

        Raises:
            ConfigError: shapes cannot change in this run; the model does not run at these
                shapes; or torch.export traces another graph at them (naming the first op
                that differs).
        """
        made = self._cache.get(signature)
        if made is None:
            made = self._cache[signature] = self._make(signature)
        return made

    def _make(self, signature: Signature) -> Lowered:
        if self.fixed is not None:
            raise ConfigError(
                f"the inputs are {describe(signature)} per micro-batch, the pipeline was "
                f"compiled for {describe(self.compiled)}: {self.fixed}"
            )
        try:
            gm = self.gm if self.model is None else self._exported(signature)
            specs = shapes_at(gm, signature, self.traced_on)
        except GraphPipeError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"the model does not run at inputs {describe(signature)} per micro-batch: "
                f"{type(exc).__name__}: {_first_line(exc)}"
            ) from exc
        crossing = {name: (shape, self.crossing(dtype)) for name, (shape, dtype) in specs.items()}
        if self.model is None:
            return Lowered(crossing, self.modules)
        traced = {name: dtype for name, (_, dtype) in specs.items()}
        return Lowered(crossing, {i: self._carved(gm, i, traced) for i in self.modules})

    def _exported(self, signature: Signature) -> fx.GraphModule:
        """The model exported again at `signature`, checked to have the compiled ops."""
        assert self.model is not None
        if self._stand_in is None:
            self._stand_in = stand_in(self.model, self.traced_on)
        inputs = [
            torch.zeros(shape, dtype=dtype, device=self.traced_on) for shape, dtype in signature
        ]
        gm = retrace(self._stand_in, self.gm, inputs)
        differs = _difference(self.gm, gm)
        if differs:
            raise ConfigError(
                f"at inputs {describe(signature)} per micro-batch torch.export traces another "
                f"graph than at the compiled {describe(self.compiled)} ({differs}), so the "
                "plan's stage cut does not apply to it. torch.export drops ops that do "
                "nothing at the shapes it traces: at a dimension of size 1 (a micro-batch of "
                "one row, a sequence of one token), or a slice that takes the whole of a "
                "buffer (positions up to the model's maximum length); compile at an example "
                "that avoids those sizes, or step at the compiled shapes only"
            )
        return gm

    def _carved(self, gm: fx.GraphModule, index: int, traced: dict[str, torch.dtype]) -> nn.Module:
        """Stage `index` of the new graph, on the live stage module's tensors (through the
        live module itself under a mesh); values arriving in a half-width dtype cast back
        to their traced one, as compile's stages do (`arrive_as_traced`)."""
        carved, io = build_stage(gm, self.plan, index)
        live = self.modules[index]
        _check_constants(carved, live, index)
        module = fx.GraphModule(live, carved.graph, f"Stage{index}")
        if any(self.crossing(d) != d for d in traced.values()):
            arrive_as_traced(module, io, traced)
        retarget(module, self.device)
        if self.on_live:
            if self.rewrite is not None:
                self.rewrite(module)
            outline_like(module, outlined(live))  # the live stage's FSDP2 units, alike
            return OnLive(live, module)
        if self.compile_stages:
            module.compile()
        return module


class OnLive(nn.Module):
    """A stage graph made for other shapes, run as the live stage module's forward for the
    call: the live module's hooks (FSDP2's all-gather of its shards before, the reshard
    after; tp's whole outputs) run around it, as they do around the compiled graph. Both
    graphs read the same tensors by name (`_check_constants`). So do the blocks outlined in
    both (`graphpipe.runtime.outline`): each live block runs the new graph's block as its
    forward, inside its own FSDP2 unit's hooks.

    Args:
        live: The stage module compile built (wrapped by FSDP2 or tp); not registered as a
            submodule here (its parameters are its own).
        shaped: The stage module at the new shapes, with the live one's blocks outlined.
    """

    def __init__(self, live: nn.Module, shaped: fx.GraphModule) -> None:
        super().__init__()
        swaps = [(live, shaped)] + [
            (live.get_submodule(path), shaped.get_submodule(path)) for path in outlined(live)
        ]
        forwards = [(m, types.MethodType(type(new).forward, m)) for m, new in swaps]
        object.__setattr__(self, "_forwards", forwards)

    def forward(self, *args: Any) -> Any:
        forwards: list[tuple[nn.Module, Any]] = self.__dict__["_forwards"]
        for module, forward in forwards:
            module.forward = forward  # an instance attribute: __call__ reads it
        try:
            return forwards[0][0](*args)
        finally:
            for module, _ in forwards:
                del module.forward


def _difference(compiled: fx.GraphModule, new: fx.GraphModule) -> str:
    """The first op where `new` differs from `compiled` (name, kind, target); empty if none."""
    a = [(n.name, n.op, str(n.target)) for n in compiled.graph.nodes]
    b = [(n.name, n.op, str(n.target)) for n in new.graph.nodes]
    for x, y in zip(a, b, strict=False):
        if x != y:
            return f"op {x[0]} ({x[2]}) of the compiled graph is {y[0]} ({y[2]}) there"
    if len(a) != len(b):
        return f"{len(a)} ops in the compiled graph, {len(b)} there"
    return ""


def _check_constants(carved: fx.GraphModule, live: nn.Module, index: int) -> None:
    """The tensors the new stage reads by name must have the shapes the live ones have: a
    constant torch.export computed at the traced shapes would be stale.

    Raises:
        ConfigError: naming the tensor and both shapes.
    """
    for node in carved.graph.nodes:
        if node.op != "get_attr":
            continue
        new, old = (operator.attrgetter(str(node.target))(m) for m in (carved, live))
        if isinstance(new, torch.Tensor) and (new.shape, new.dtype) != (old.shape, old.dtype):
            raise ConfigError(
                f"stage {index} reads {node.target}, a {list(old.shape)} tensor at the "
                f"compiled shapes but {list(new.shape)} at these: a constant of the trace that "
                "depends on the input shapes"
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def signature_of(flat: Sequence[torch.Tensor], rows: int) -> Signature:
    """The signature of a micro-batch of `rows` rows of the inputs `flat`."""
    return tuple(((rows, *x.shape[1:]), x.dtype) for x in flat)


def check_max_shapes(
    gm: fx.GraphModule, example: Sequence[torch.Tensor], max_shapes: Mapping[str, Sequence[int]]
) -> None:
    """`max_shapes` must name inputs of `gm`, each with the example's number of dimensions
    and at least its size in every one.

    Raises:
        ConfigError: every problem at once, naming the input, its bound and the example's shape.
    """
    names = trace_info(gm).input_names
    problems = [
        f"max_shapes names {name!r}, which is not an input (the inputs: {list(names)})"
        for name in max_shapes
        if name not in names
    ]
    for name, x in zip(names, example, strict=True):
        bound = max_shapes.get(name)
        if bound is not None and (len(bound) != x.dim() or any(map(operator.lt, bound, x.shape))):
            problems.append(
                f"max_shapes[{name!r}] is {list(bound)}, the example's {name} is "
                f"{list(x.shape)}: it needs its {x.dim()} dimensions, each at least the example's"
            )
    if problems:
        raise ConfigError("; ".join(problems))


@contextmanager
def planned_at(
    model: nn.Module,
    gm: fx.GraphModule,
    example_inputs: Any,
    max_shapes: Mapping[str, Sequence[int]],
    micro_batches: int,
    leaf_modules: Sequence[LeafSpec] = (),
) -> Iterator[None]:
    """While inside, every node of `gm` counts the bytes of its outputs at the largest batch
    (`gp_out_bytes`, which the planner reads), rather than at the example's.

    The model is traced once more at the largest batch: each example input tiled to its
    bound in `max_shapes` (its values stay the example's), the rows rounded up to a multiple
    of the micro-batches (times the data-parallel slices of the trace). A node's new count is
    its bytes for the largest micro-batch over the traced micro-batch size, so that the
    planner's `act` (the count times that size) is the largest micro-batch's bytes.

    Raises:
        ConfigError: the model traces to another graph at the largest batch.
    """
    info = trace_info(gm)
    slices = info.batch_size // (info.micro_batch_size * micro_batches)  # dp slices traced
    split = micro_batches * slices
    rows = math.ceil(max([info.batch_size, *(b[0] for b in max_shapes.values())]) / split)
    largest = trace(
        model,
        _tiled(example_inputs, gm, max_shapes, rows * split),
        leaf_modules,
        micro_batch_size=rows,
    )
    if graph_hash(largest) != graph_hash(gm):
        raise ConfigError(
            f"at max_shapes {dict(max_shapes)} the model traces to another graph than at the "
            f"example ({_difference(gm, largest) or 'other inputs'}), so one plan cannot hold "
            "both; give max_shapes at which the model traces to the same ops"
        )
    counts = {n.name: n.meta.get("gp_out_bytes", 0) for n in largest.graph.nodes}
    saved = {n: n.meta.get("gp_out_bytes", 0) for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        node.meta["gp_out_bytes"] = -(-counts[node.name] * rows // info.micro_batch_size)
    try:
        yield
    finally:
        for node, count in saved.items():
            node.meta["gp_out_bytes"] = count


def _tiled(
    example_inputs: Any, gm: fx.GraphModule, max_shapes: Mapping[str, Sequence[int]], rows: int
) -> Any:
    """The example in its own form (positional or keyword), each input tiled to its bound
    in `max_shapes` (else its own shape) with `rows` rows."""
    args, kwargs = bind.normalise(example_inputs)
    info = trace_info(gm)
    named = dict(zip(info.sources, info.input_names, strict=True))

    def tile(source: int | str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or source not in named:
            return x
        shape = (rows, *max_shapes.get(named[source], x.shape)[1:])
        reps = [math.ceil(n / d) for n, d in zip(shape, x.shape, strict=True)]
        return x.repeat(reps)[tuple(slice(0, n) for n in shape)]

    if args:
        return tuple(tile(i, x) for i, x in enumerate(args))
    return {k: tile(k, v) for k, v in kwargs.items()}
