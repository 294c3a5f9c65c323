"""Profile: forward and backward time of every node for one micro-batch size.

Three ways, chosen by `ProfileConfig.mode`; the default, "auto", measures a real model on its
device and estimates a model on the meta device (which cannot run) from its FLOPs:

- "flops" (the fast path): time = FLOPs / `device_flops` + `node_overhead`, backward = twice
  the forward FLOPs for nodes on the gradient path. No model run beyond the trace.
- "measure": runs every node alone on `device` (by default the model's own) with real-shaped
  inputs (the example batch resized to the micro-batch size; float values redrawn at random,
  integer and boolean values kept so that indices stay valid), and takes the median of
  `repeats` runs after `warmup`.
  The forward is timed as training runs it, recording for autograd; the backward is the
  forward-and-backward time minus that.
- "roofline": the roofline of a device preset (`graphpipe.planning.devices`, `preset`), aware of the
  micro-batch size b. A node's forward is one kernel with
      flops = gp_flops * b
      bytes = weights read + b * (input bytes + output bytes), per sample as traced
  where the weights read are its parameters and buffers in full, except for an embedding
  lookup (nn.Embedding(Bag), F.embedding(_bag)), which reads the rows it gathers:
  b * indices per sample * row bytes. Its backward (nodes on the gradient path) takes twice
  the FLOPs and twice the bytes (gradients of the inputs and of the weights), in two kernels
  when the node has weights, one otherwise. Views and size queries (`VIEWS`) cost nothing.
  Weight reads and launches do not shrink with b, so small micro-batches are less efficient.

Measured profiles are cached as JSON under `cache_dir`, keyed by the graph's code, the input
shapes, the micro-batch size, the device, the settings and the torch version, so planning a
model twice profiles it once.

    prof = profile(gm, example_inputs, micro_batch_size=8, config=ProfileConfig(mode="measure"))

Measured times carry the machine's noise, so two plans of one model may differ; pass
`ProfileConfig(mode="flops")` where a plan must be the same on every run (tests, pinned
plans). A measured profile of a tiny model takes milliseconds (GPT-2 with 2 layers of width
16, 133 ops: about 20 ms on one CPU core at the default warmup and repeats).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from graphpipe._torch import tensor_version
from graphpipe.errors import ConfigError
from graphpipe.planning.devices import DEVICES, device_preset, roofline
from graphpipe.tracing.annotate import TensorSpec, has_float_output, is_meta, trace_info

__all__ = ["VIEWS", "NodeTime", "Profile", "ProfileConfig", "model_device", "profile", "resolved"]

MODES = ("auto", "flops", "measure", "roofline")
# ops that alias or describe their input without a kernel: free under the roofline
VIEWS = frozenset(
    {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand",
     "getitem", "getattr", "size", "dim", "chunk", "split", "unflatten", "t", "narrow",
     "select", "unbind", "view_as", "expand_as"}
)  # fmt: skip
_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)
_EMBEDDING_FNS = ("embedding", "embedding_bag")

Log = Callable[[str], None]


@dataclass(frozen=True)
class ProfileConfig:
    """How to obtain per-node times."""

    # "auto" (measure, or flops on the meta device), "flops" (estimate), "measure" (time
    # every node) or "roofline"
    mode: str = "auto"
    device: str | None = None  # where "measure" runs; None: the model's own device
    preset: str = "a100"  # "roofline": the device preset (graphpipe.planning.devices.DEVICES)
    device_flops: float = 50e12  # FLOP/s the estimate assumes
    node_overhead: float = 2e-6  # seconds per node and pass the estimate adds
    warmup: int = 1  # untimed runs before measuring
    repeats: int = 3  # timed runs; the median is kept
    cache_dir: str | None = None  # where measured profiles are cached; None disables the cache

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"profile mode must be one of {MODES}, got {self.mode!r}")
        if self.preset not in DEVICES:
            raise ConfigError(f"unknown device preset {self.preset!r}; known: {sorted(DEVICES)}")
        if self.repeats < 1 or self.warmup < 0 or self.device_flops <= 0:
            raise ConfigError(
                f"need repeats >= 1, warmup >= 0 and device_flops > 0, got repeats="
                f"{self.repeats}, warmup={self.warmup}, device_flops={self.device_flops}"
            )


@dataclass(frozen=True)
class NodeTime:
    """Seconds for one micro-batch through one node."""

    forward: float
    backward: float


@dataclass(frozen=True)
class Profile:
    """Per-node times for one micro-batch size on one device."""

    micro_batch_size: int
    mode: str
    device: str
    times: dict[str, NodeTime]

    def total(self) -> float:
        """Forward + backward seconds of the whole model for one micro-batch."""
        return sum(t.forward + t.backward for t in self.times.values())

    def to_json(self) -> str:
        """Serialise to JSON text."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Parse `to_json` output."""
        data = json.loads(text)
        times = {k: NodeTime(**v) for k, v in data.pop("times").items()}
        return cls(times=times, **data)


def profile(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    micro_batch_size: int,
    config: ProfileConfig | None = None,
    log: Log | None = None,
) -> Profile:
    """Forward and backward time of every node of a traced graph for one micro-batch.

    Args:
        gm: A graph made by `graphpipe.tracing.tracer`.
        example_inputs: The inputs it was traced with (dim 0 is the batch).
        micro_batch_size: Samples per micro-batch to profile for.
        config: How to profile; by default measured on the model's device, or for a model
            on the meta device estimated from FLOPs (`resolved`).
        log: Called with progress lines while measuring (e.g. `print`).

    Returns:
        A `Profile` with a `NodeTime` for every node (0 for placeholders and the output).

    Raises:
        ConfigError: `micro_batch_size` < 1, or `gm` was not made by `graphpipe.tracing.tracer`.

    Example:
        >>> from graphpipe.tracing.tracer import trace
        >>> m = torch.nn.Linear(4, 4)
        >>> prof = profile(trace(m, torch.randn(2, 4)), (torch.randn(2, 4),), 1)
        >>> prof.times["linear"].forward > 0
        True
    """
    config = resolved(gm, example_inputs, config or ProfileConfig())
    trace_info(gm)
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if config.mode == "flops":
        return _estimate(gm, micro_batch_size, config)
    if config.mode == "roofline":
        return _roofline(gm, micro_batch_size, config)
    if config.device == "meta":
        raise ConfigError(
            "cannot measure a model on the meta device (e.g. a paper preset): "
            "profile it with mode='flops' (graphpipe plan --profile flops)"
        )
    path = _cache_path(gm, example_inputs, micro_batch_size, config)
    if path is not None and path.exists():
        return Profile.from_json(path.read_text())
    result = _measure(gm, example_inputs, micro_batch_size, config, log or (lambda _: None))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.to_json())
    return result


def resolved(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], config: ProfileConfig
) -> ProfileConfig:
    """`config` with its mode and device decided: device None becomes the model's device
    (`model_device`); mode "auto" becomes "flops" on the meta device, else "measure".

    Example:
        >>> from graphpipe.tracing.tracer import trace
        >>> gm = trace(torch.nn.Linear(4, 4, device="meta"), torch.randn(2, 4, device="meta"))
        >>> c = resolved(gm, (), ProfileConfig())
        >>> c.mode, c.device
        ('flops', 'meta')
    """
    device = config.device or model_device(gm, example_inputs)
    mode = config.mode
    if mode == "auto":
        mode = "flops" if device == "meta" else "measure"
    return replace(config, mode=mode, device=device)


def model_device(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor] = ()) -> str:
    """ "meta" if any parameter or buffer is on the meta device, else the device of the
    model's first parameter or buffer, else of its first example input, else "cpu"."""
    if is_meta(gm):
        return "meta"
    tensors = itertools.chain(gm.parameters(), gm.buffers(), example_inputs)
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    return "cpu" if first is None else str(first.device)


def _is_compute(node: fx.Node) -> bool:
    return node.op in ("call_module", "call_function", "call_method")


def _on_grad_path(node: fx.Node) -> bool:
    """Whether a backward runs through the node: it has parameters or float outputs."""
    return bool(node.meta.get("gp_params")) or has_float_output(node)


def _estimate(gm: fx.GraphModule, b: int, config: ProfileConfig) -> Profile:
    times = {}
    for node in gm.graph.nodes:
        if not _is_compute(node):
            times[node.name] = NodeTime(0.0, 0.0)
            continue
        fwd = node.meta.get("gp_flops", 0) * b / config.device_flops + config.node_overhead
        bwd = 2 * (fwd - config.node_overhead) + config.node_overhead if _on_grad_path(node) else 0
        times[node.name] = NodeTime(fwd, bwd)
    return Profile(b, "flops", str(config.device), times)


def _roofline(gm: fx.GraphModule, b: int, config: ProfileConfig) -> Profile:
    device = device_preset(config.preset)
    times = {}
    for node in gm.graph.nodes:
        if not _is_compute(node) or _short_name(node) in VIEWS:
            times[node.name] = NodeTime(0.0, 0.0)
            continue
        flops = node.meta.get("gp_flops", 0) * b
        nbytes = _weights_read(gm, node, b) + b * _activation_bytes(node)
        fwd = roofline(flops, nbytes, device)
        kernels = 2 if node.meta.get("gp_params") else 1
        bwd = roofline(2 * flops, 2 * nbytes, device, kernels) if _on_grad_path(node) else 0.0
        times[node.name] = NodeTime(fwd, bwd)
    return Profile(b, "roofline", config.preset, times)


def _short_name(node: fx.Node) -> str:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.rsplit(".", 1)[-1]


def _activation_bytes(node: fx.Node) -> int:
    """Bytes per sample the node reads (its inputs, not weights) and writes (its outputs)."""
    inputs = sum(a.meta.get("gp_out_bytes", 0) for a in node.all_input_nodes if a.op != "get_attr")
    return inputs + node.meta.get("gp_out_bytes", 0)


def _weights_read(gm: fx.GraphModule, node: fx.Node, b: int) -> float:
    """Parameter bytes the node reads for a micro-batch of b: all of them, or for an
    embedding lookup the rows it gathers (indices per sample x row bytes x b)."""
    params = node.meta.get("gp_params", {})
    table = _embedding_table(gm, node)
    if table is None or not node.all_input_nodes:
        return float(sum(params.values()))
    indices = node.all_input_nodes[0]  # the first argument of a module call and F.embedding
    return b * _elements_per_sample(indices) * table


def _embedding_table(gm: fx.GraphModule, node: fx.Node) -> float | None:
    """Bytes per row of the table an embedding node looks up in, else None."""
    weight: Any = None
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        weight = module.weight if isinstance(module, _EMBEDDINGS) else None
    elif node.op == "call_function" and _short_name(node) in _EMBEDDING_FNS and len(node.args) > 1:
        arg = node.args[1]
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            weight = gm.get_parameter(str(arg.target))
    if weight is None:
        return None
    return float(weight.shape[1] * weight.element_size())


def _elements_per_sample(node: fx.Node) -> float:
    spec = node.meta.get("gp_outputs")
    if not isinstance(spec, TensorSpec):
        return 0.0
    itemsize = getattr(torch, spec.dtype.removeprefix("torch.")).itemsize
    return node.meta.get("gp_out_bytes", 0) / itemsize


def _cache_path(
    gm: fx.GraphModule, inputs: Sequence[torch.Tensor], b: int, config: ProfileConfig
) -> Path | None:
    if config.cache_dir is None:
        return None
    key = json.dumps(
        {
            "code": gm.code,
            "inputs": [(tuple(x.shape), str(x.dtype)) for x in inputs],
            "b": b,
            "config": {k: v for k, v in asdict(config).items() if k != "cache_dir"},
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return Path(config.cache_dir) / f"profile-{digest}.json"


def resize_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """Take `size` rows of `x` along dim 0, cycling when `size` exceeds the batch."""
    index = torch.arange(size, device=x.device) % x.shape[0]
    return x.index_select(0, index)


def _randomise(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return torch.randn_like(x)
    return x


@contextmanager
def _inputs_kept(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """A node's tensor inputs as they were before it was timed: an in-place op run again
    and again writes into the values later nodes read (T5's relative-position buckets, added
    to in place, outgrew their embedding table). Parameters are not copied."""
    leaves, _ = tree_flatten((args, kwargs))
    kept = [
        (t, tensor_version(t), t.detach().clone())
        for t in leaves
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, version, value in kept:
                if tensor_version(t) != version:
                    t.copy_(value)


class _Recorder(fx.Interpreter):
    """Runs the graph once, keeping every node's inputs for per-node timing."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if _is_compute(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.inputs[n.name] = (args, kwargs)
        return super().run_node(n)


def _callable(gm: fx.GraphModule, node: fx.Node) -> Callable[..., Any]:
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_method":
        return lambda obj, *a, **kw: getattr(obj, str(node.target))(*a, **kw)
    return node.target  # type: ignore[return-value]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], config: ProfileConfig, device: torch.device) -> float:
    for _ in range(config.warmup):
        fn()
    samples = []
    for _ in range(config.repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _forward_backward(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params: Sequence[torch.Tensor],
    backward: bool = True,
) -> Callable[[], None]:
    """A closure that runs fn forward as training does (recording for autograd) and, with
    `backward`, back-propagates ones through it."""

    def run() -> None:
        leaves = [
            a.detach().requires_grad_()
            if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a
            for a in args
        ]
        out, _ = tree_flatten(fn(*leaves, **kwargs))
        if not backward:
            return
        outs = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
        wrt = [*grads, *params]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)

    return run


def _time_node(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backward: bool,
    config: ProfileConfig,
    device: torch.device,
) -> NodeTime:
    if not backward:
        with torch.no_grad():
            return NodeTime(_median_time(lambda: fn(*args, **kwargs), config, device), 0.0)
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    fwd = _median_time(_forward_backward(fn, args, kwargs, params, backward=False), config, device)
    both = _median_time(_forward_backward(fn, args, kwargs, params), config, device)
    return NodeTime(fwd, max(both - fwd, 0.0))


def _measure(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    b: int,
    config: ProfileConfig,
    log: Log,
) -> Profile:
    device = torch.device(str(config.device))
    local = copy.deepcopy(gm).to(device)
    inputs = [_randomise(resize_batch(x.to(device), b)) for x in example_inputs]
    recorder = _Recorder(local)
    with torch.no_grad():
        recorder.run(*inputs)
    nodes = [n for n in local.graph.nodes if _is_compute(n)]
    times = {n.name: NodeTime(0.0, 0.0) for n in local.graph.nodes}
    for i, node in enumerate(nodes):
        args, kwargs = recorder.inputs[node.name]
        with _inputs_kept(args, kwargs):
            times[node.name] = _time_node(
                _callable(local, node), args, kwargs, _on_grad_path(node), config, device
            )
        if (i + 1) % 50 == 0 or i + 1 == len(nodes):
            log(f"profiled {i + 1}/{len(nodes)} nodes on {device}")
    return Profile(b, "measure", str(device), times)
