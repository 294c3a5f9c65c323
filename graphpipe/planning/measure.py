"""Measure: every op of a traced graph timed alone on a device (`ProfileConfig(mode="measure")`).

The graph runs once on real-shaped inputs (`_Recorder`), keeping each op's inputs and noting
which inputs the op writes into. Then each op is timed alone:

- Ops with one signature (`signature`: what runs, its inputs' shapes, dtypes and strides, its
  parameters' shapes, its constant arguments) are timed once and share the time: a
  transformer's repeated blocks cost the same, so a plan cuts them alike.
- The forward, then the forward and backward, run at least `repeats` times after `warmup`, and
  again until `budget` seconds went to them (at most `max_repeats` runs); the minimum is kept.
  A loaded host only adds time (another process held the core), so the least is the op's own
  cost; the spread (median / minimum - 1) says how much the host added.
- An op that writes into its inputs (`x.div_(...)`, `nn.ReLU(inplace=True)`), found by the
  tensors' version counters in the recording run, runs on copies of them: autograd refuses an
  in-place op on a leaf that requires grad, and repeating it would move the values later ops
  read. The copies' own time is measured the same way and taken off.
- An op that cannot be timed (it raises) is left out with the reason, for the caller to
  estimate (`graphpipe.planning.profile` falls back to its FLOPs).

    measured = measure(gm, inputs, 8, ProfileConfig(mode="measure", device="cpu"), log=print)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import fx

from graphpipe._torch import copy_graph, tensor_version, tree_flatten, tree_map, tree_unflatten
from graphpipe.tracing.annotate import has_float_output
from graphpipe.tracing.bind import micro_example, resize_batch

__all__ = [
    "Measured",
    "NodeTime",
    "Op",
    "Settings",
    "backward_factor",
    "is_compute",
    "measure",
    "on_grad_path",
    "resize_batch",
    "signature",
]

Log = Callable[[str], None]


class Settings(Protocol):
    """What measuring reads of a `graphpipe.planning.profile.ProfileConfig` (see there)."""

    @property
    def device(self) -> str | None: ...
    @property
    def warmup(self) -> int: ...
    @property
    def repeats(self) -> int: ...
    @property
    def budget(self) -> float: ...
    @property
    def max_repeats(self) -> int: ...
    @property
    def shared(self) -> bool: ...


@dataclass(frozen=True)
class NodeTime:
    """Seconds for one micro-batch through one node."""

    forward: float
    backward: float


@dataclass(frozen=True)
class Measured:
    """What `measure` found, by fx node name.

    Attributes:
        times: Every node's time, but those in `failed` (0 for placeholders and the output).
        failed: Nodes that could not be timed: why ("RuntimeError: ...").
        spread: Every timed op's spread over its repeats: median / minimum - 1.
    """

    times: dict[str, NodeTime]
    failed: dict[str, str]
    spread: dict[str, float]


@dataclass(frozen=True)
class Op:
    """One op as recorded: its callable, inputs, and the flat input positions it writes."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    written: frozenset[int]
    backward: bool  # whether a backward runs through it


def is_compute(node: fx.Node) -> bool:
    """Whether the node runs code (a module, function or method call)."""
    return node.op in ("call_module", "call_function", "call_method")


def on_grad_path(node: fx.Node) -> bool:
    """Whether a backward runs through the node (`backward_factor` > 0)."""
    return backward_factor(node) > 0


def backward_factor(node: fx.Node) -> float:
    """The node's backward work over its forward's: 2 on the gradient path (its input's and
    its weights' gradients), 1 where its parameters are frozen and its input takes a
    gradient (LoRA's frozen base layers), 0 where its output takes none (a frozen encoder:
    the trace's `gp_grad`). A graph annotated before `gp_grad`: 2 for a node with
    parameters or a float output."""
    if "gp_grad" not in node.meta:
        return 2.0 if node.meta.get("gp_params") or has_float_output(node) else 0.0
    if not node.meta["gp_grad"]:
        return 0.0
    return 1.0 if node.meta.get("gp_params") and not node.meta.get("gp_trains") else 2.0


def measure(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    b: int,
    config: Settings,
    log: Log,
) -> Measured:
    """Time every compute node of `gm` alone for micro-batches of `b` rows on `config.device`.

    Args:
        gm: A graph made by `graphpipe.tracing.tracer` (left as it is: a copy is timed).
        example_inputs: The inputs it was traced with (dim 0 is the batch).
        b: Rows per micro-batch: the inputs are resized to it, float values redrawn.
        config: The device, warmup, repeats, budget, max_repeats and shared settings.
        log: Called with progress lines.

    Returns:
        The times, the ops that could not be timed and why, and the spread of the rest.
    """
    device = torch.device(str(config.device))
    local = copy_graph(gm).to(device)
    inputs = [_randomise(x.to(device)) for x in micro_example(gm, example_inputs, b)]
    recorder = _Recorder(local)
    with torch.no_grad():
        recorder.run(*inputs)
    nodes = [n for n in local.graph.nodes if is_compute(n)]
    times = {n.name: NodeTime(0.0, 0.0) for n in local.graph.nodes}
    failed: dict[str, str] = {}
    spread: dict[str, float] = {}
    done: dict[str, tuple[NodeTime, float] | str] = {}  # by signature
    for i, node in enumerate(nodes):
        op = recorder.ops[node.name]
        key = signature(local, node, op) if config.shared else node.name
        if key not in done:
            done[key] = _timed_or_why(op, config, device)
        found = done[key]
        if isinstance(found, str):
            failed[node.name] = found
            del times[node.name]
        else:
            times[node.name], spread[node.name] = found
        if (i + 1) % 50 == 0 or i + 1 == len(nodes):
            log(f"profiled {i + 1}/{len(nodes)} nodes on {device} ({len(done)} distinct)")
    return Measured(times, failed, spread)


def signature(gm: fx.GraphModule, node: fx.Node, op: Op) -> str:
    """What decides an op's time, as text: ops with one signature take one time.

    The callable (a module's repr, which names its settings, and its parameters' and buffers'
    shapes and dtypes; a function or method name), every tensor input's shape, dtype, strides
    and device, every other argument's value, and whether a backward runs through it.

    Example:
        >>> from graphpipe.tracing.tracer import trace
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> gm = trace(m, torch.randn(2, 4))
        >>> r = _Recorder(gm)
        >>> _ = r.run(torch.randn(2, 4))
        >>> a, b = (n for n in gm.graph.nodes if is_compute(n))
        >>> signature(gm, a, r.ops[a.name]) == signature(gm, b, r.ops[b.name])
        True
    """
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        state = [(k, _spec(v)) for k, v in module.state_dict(keep_vars=True).items()]
        what = f"{module!r} {_settings(module)} {state}"
    else:
        what = f"{node.op} {node.target!r}"
    values = tree_map(_spec, (op.args, op.kwargs))
    return f"{what} {values!r} written={sorted(op.written)} backward={op.backward}"


def _settings(module: torch.nn.Module) -> list[tuple[str, str, Any]]:
    """The plain attributes (numbers, strings, tuples, None) of the module and its children:
    settings a module's repr may leave out (a causal flag, a scale)."""
    plain = (int, float, bool, str, tuple, type(None))
    return [
        (name, key, value)
        for name, sub in module.named_modules()
        for key, value in vars(sub).items()
        if isinstance(value, plain) and not key.startswith("_")
    ]


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype), x.stride(), str(x.device))
    return x


def _randomise(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return torch.randn_like(x)
    return x


class _Recorder(fx.Interpreter):
    """Runs the graph once, keeping every compute node's inputs and the flat positions of
    the input tensors it writes into (their version counters moved)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.ops: dict[str, Op] = {}

    def run_node(self, n: fx.Node) -> Any:
        if not is_compute(n):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        flat, _ = tree_flatten((args, kwargs))
        before = [tensor_version(x) if isinstance(x, torch.Tensor) else None for x in flat]
        result = super().run_node(n)
        written = frozenset(
            i
            for i, (x, v) in enumerate(zip(flat, before, strict=True))
            if v is not None and tensor_version(x) != v
        )
        self.ops[n.name] = Op(_callable(self.module, n), args, kwargs, written, on_grad_path(n))
        return result


def _callable(gm: torch.nn.Module, node: fx.Node) -> Callable[..., Any]:
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_method":
        return lambda obj, *a, **kw: getattr(obj, str(node.target))(*a, **kw)
    return node.target  # type: ignore[return-value]


def _timed_or_why(op: Op, config: Settings, device: torch.device) -> tuple[NodeTime, float] | str:
    """The op's time and spread, or why it could not be timed."""
    try:
        return _time_op(op, config, device)
    except Exception as exc:  # any failure: the caller estimates the op instead
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _time_op(op: Op, config: Settings, device: torch.device) -> tuple[NodeTime, float]:
    """The op's time and its spread (the larger of its passes'). The forward is timed as
    training runs it, recording for autograd; the backward is the forward-and-backward time
    minus that. An op off the gradient path is timed without autograd."""
    params = list(op.fn.parameters()) if isinstance(op.fn, torch.nn.Module) else []
    if not op.backward:
        with torch.no_grad():
            forward, spread = _least(op, params, False, config, device)
        return NodeTime(forward, 0.0), spread
    forward, forward_spread = _least(op, params, False, config, device)
    both, both_spread = _least(op, params, True, config, device)
    return NodeTime(forward, max(both - forward, 0.0)), max(forward_spread, both_spread)


def _least(
    op: Op, params: Sequence[torch.Tensor], backward: bool, config: Settings, device: torch.device
) -> tuple[float, float]:
    """The least run of one pass of the op, less the least run of its input copies alone
    (an op that writes into its inputs), and the pass's spread."""
    samples = _samples(_run(op, params, backward), config, device)
    copies = 0.0
    if op.written:
        copies = min(_samples(_run(replace(op, fn=_nothing), [], backward), config, device))
    return max(min(samples) - copies, 0.0), _spread(samples)


def _nothing(*args: Any, **kwargs: Any) -> Any:
    """An op that returns its inputs: timed in an op's place, it times the op's copies."""
    return args


def _spread(samples: list[float]) -> float:
    least = min(samples)
    return statistics.median(samples) / least - 1 if least > 0 else 0.0


def _run(op: Op, params: Sequence[torch.Tensor], backward: bool) -> Callable[[], None]:
    """A closure that runs the op forward as training does (recording for autograd: every
    float tensor input a fresh leaf that requires grad) on copies of the inputs it writes,
    and with `backward` back-propagates ones through it to its inputs and `params`."""
    flat, spec = tree_flatten((op.args, op.kwargs))

    def run() -> None:
        leaves = [_leaf(x) for x in flat]
        used = [x.clone() if i in op.written else x for i, x in enumerate(leaves)]
        args, kwargs = tree_unflatten(used, spec)
        out, _ = tree_flatten(op.fn(*args, **kwargs))
        if not backward:
            return
        outs = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        wrt += list(params)
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)

    return run


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_grad_enabled():
        return x.detach().requires_grad_()
    return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _samples(fn: Callable[[], Any], config: Settings, device: torch.device) -> list[float]:
    """Seconds of each timed run of `fn`: `config.repeats` after `config.warmup`, then more
    until `config.budget` seconds went to them or there are `config.max_repeats`."""
    for _ in range(config.warmup):
        fn()
    samples: list[float] = []
    while len(samples) < config.repeats or (
        sum(samples) < config.budget and len(samples) < config.max_repeats
    ):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return samples
