"""Profile: forward and backward time of every node for one micro-batch size.

Three ways, chosen by `ProfileConfig.mode`; the default, "auto", measures a real model on its
device and estimates a model on the meta device (which cannot run) from its FLOPs:

- "flops" (the fast path): time = FLOPs / `device_flops` + `node_overhead`, backward = twice
  the forward FLOPs for nodes on the gradient path. No model run beyond the trace.
- "measure": runs every node alone on `device` (by default the model's own) with real-shaped
  inputs (the example batch resized to the micro-batch size; float values redrawn at random,
  integer and boolean values kept so that indices stay valid), and keeps the least of
  `repeats` or more runs after `warmup` (`graphpipe.planning.measure`: ops with one signature
  timed once, in-place ops on copies of their inputs). The forward is timed as training runs
  it, recording for autograd; the backward is the forward-and-backward time minus that. An op
  that cannot be timed is estimated from its FLOPs at the rate measured on the others, and
  the profile says which and why (`Profile.fallbacks`); so does it when the host's noise
  was large (`Profile.spread`, `Profile.summary`, printed by `print(plan)`).
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

Measured times carry the machine's noise, so two plans of one model may differ (less since
repeated ops share one time and the least run is kept); pass `ProfileConfig(mode="flops")`
where a plan must be the same on every run (tests, pinned plans).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import fx

from graphpipe.errors import ConfigError
from graphpipe.ir.plan import Plan
from graphpipe.planning.devices import DEVICES, device_preset, roofline
from graphpipe.planning.measure import (
    NodeTime,
    backward_factor,
    is_compute,
    measure,
    resize_batch,
)
from graphpipe.tracing.annotate import TensorSpec, is_meta, trace_info

__all__ = [
    "NOISY",
    "VIEWS",
    "NodeTime",
    "Profile",
    "ProfileConfig",
    "model_device",
    "noted",
    "profile",
    "resize_batch",
    "resolved",
]

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
# a measured profile's spread (median / least run - 1, weighted by the ops' times) above
# which a plan says the host was noisy
NOISY = 0.5


@dataclass(frozen=True)
class ProfileConfig:
    """How to obtain per-node times.

    Attributes:
        mode: "auto" (measure, or flops on the meta device), "flops" (estimate), "measure"
            (time every node) or "roofline".
        device: Where "measure" runs; None: the model's own device.
        preset: "roofline": the device preset (`graphpipe.planning.devices.DEVICES`).
        device_flops: FLOP/s the estimate assumes.
        node_overhead: Seconds per node and pass the estimate adds.
        warmup: Untimed runs of each op and pass before measuring.
        repeats: Timed runs of each op and pass at least; the least is kept.
        budget: Seconds of timed runs each op and pass gets: runs beyond `repeats` go on
            until they add up to it (a loaded host's unlucky runs are outnumbered).
        max_repeats: Timed runs of each op and pass at most.
        shared: Ops with one signature (`graphpipe.planning.measure.signature`: the same
            callable on the same input shapes, dtypes and parameter shapes, as a
            transformer's repeated blocks are) are timed once and share the time, so equal
            blocks cost the same and are cut alike.
        cache_dir: Where measured profiles are cached; None disables the cache.
    """

    mode: str = "auto"
    device: str | None = None
    preset: str = "a100"
    device_flops: float = 50e12
    node_overhead: float = 2e-6
    warmup: int = 1
    repeats: int = 3
    budget: float = 2e-3
    max_repeats: int = 25
    shared: bool = True
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"profile mode must be one of {MODES}, got {self.mode!r}")
        if self.preset not in DEVICES:
            raise ConfigError(f"unknown device preset {self.preset!r}; known: {sorted(DEVICES)}")
        if (
            self.repeats < 1
            or self.warmup < 0
            or self.device_flops <= 0
            or self.budget < 0
            or self.max_repeats < self.repeats
        ):
            raise ConfigError(
                f"need repeats >= 1, warmup >= 0, device_flops > 0, budget >= 0 and "
                f"max_repeats >= repeats, got repeats={self.repeats}, warmup={self.warmup}, "
                f"device_flops={self.device_flops}, budget={self.budget}, "
                f"max_repeats={self.max_repeats}"
            )


@dataclass(frozen=True)
class Profile:
    """Per-node times for one micro-batch size on one device.

    Attributes:
        micro_batch_size: Rows per micro-batch the times are for.
        mode: "flops", "measure" or "roofline".
        device: The device measured on, or the preset.
        times: fx node name -> its time.
        fallbacks: Measured profiles: nodes that could not be timed and were estimated from
            their FLOPs instead -> why ("RuntimeError: ...").
        spread: Measured profiles: each timed node's spread over its repeats (median /
            least - 1): how much the host added to the least run.
    """

    micro_batch_size: int
    mode: str
    device: str
    times: dict[str, NodeTime]
    fallbacks: dict[str, str] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)

    def total(self) -> float:
        """Forward + backward seconds of the whole model for one micro-batch."""
        return sum(t.forward + t.backward for t in self.times.values())

    def summary(self, noisy: float = NOISY) -> dict[str, Any]:
        """What a plan made from this profile should say about it (`plan.info["profile"]`):
        the ops estimated instead of measured and why ("fallbacks"), and, when the spread
        weighted by the ops' times exceeds `noisy`, that spread and the op that added the
        most time ("spread": {"weighted", "op", "op_spread"}). Empty when there is nothing
        to say.

        Example:
            >>> p = Profile(1, "measure", "cpu", {"a": NodeTime(1.0, 0.0)}, spread={"a": 2.0})
            >>> p.summary()
            {'spread': {'weighted': 2.0, 'op': 'a', 'op_spread': 2.0}}
        """
        note: dict[str, Any] = {}
        if self.fallbacks:
            note["fallbacks"] = dict(self.fallbacks)
        weights = {n: self.times[n].forward + self.times[n].backward for n in self.spread}
        total = sum(weights.values())
        if total > 0:
            weighted = sum(self.spread[n] * w for n, w in weights.items()) / total
            worst = max(weights, key=lambda n: self.spread[n] * weights[n])
            if weighted > noisy:
                note["spread"] = {
                    "weighted": weighted,
                    "op": worst,
                    "op_spread": self.spread[worst],
                }
        return note

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
    result = _measured(gm, example_inputs, micro_batch_size, config, log or (lambda _: None))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.to_json())
    return result


def noted(plan: Plan, prof: Profile) -> Plan:
    """`plan` with what its profile has to say (`Profile.summary`: ops estimated instead of
    measured, a noisy host) in `plan.info["profile"]`, which `print(plan)` shows."""
    note = prof.summary()
    return replace(plan, info={**plan.info, "profile": note}) if note else plan


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


def _estimate(gm: fx.GraphModule, b: int, config: ProfileConfig) -> Profile:
    times = {
        n.name: _flop_time(n, b, config.device_flops, config.node_overhead) for n in gm.graph.nodes
    }
    return Profile(b, "flops", str(config.device), times)


def _flop_time(node: fx.Node, b: int, flops: float, overhead: float) -> NodeTime:
    """The node's time at `flops` FLOP/s plus `overhead` per pass; its backward twice the
    forward's FLOPs on the gradient path (once where its parameters are frozen, none off
    it: `backward_factor`). Nothing for a node that runs no code."""
    if not is_compute(node):
        return NodeTime(0.0, 0.0)
    work = node.meta.get("gp_flops", 0) * b / flops
    factor = backward_factor(node)
    return NodeTime(work + overhead, factor * work + overhead if factor else 0.0)


def _roofline(gm: fx.GraphModule, b: int, config: ProfileConfig) -> Profile:
    device = device_preset(config.preset)
    times = {}
    for node in gm.graph.nodes:
        if not is_compute(node) or _short_name(node) in VIEWS:
            times[node.name] = NodeTime(0.0, 0.0)
            continue
        flops = node.meta.get("gp_flops", 0) * b
        nbytes = _weights_read(gm, node, b) + b * _activation_bytes(node)
        fwd = roofline(flops, nbytes, device)
        factor = backward_factor(node)
        kernels = 2 if node.meta.get("gp_params") and factor == 2 else 1
        bwd = roofline(factor * flops, factor * nbytes, device, kernels) if factor else 0.0
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


def _measured(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    b: int,
    config: ProfileConfig,
    log: Log,
) -> Profile:
    """The measured profile (`graphpipe.planning.measure`), the ops that could not be timed
    estimated from their FLOPs at the rate measured on the rest (`_measured_rate`)."""
    found = measure(gm, example_inputs, b, config, log)
    times = dict(found.times)
    if found.failed:
        rate = _measured_rate(gm, found.times, b) or config.device_flops
        nodes = {n.name: n for n in gm.graph.nodes}
        for name, why in found.failed.items():
            times[name] = _flop_time(nodes[name], b, rate, config.node_overhead)
            log(f"could not time {name} ({why}): estimated from its FLOPs at {rate:.3g} FLOP/s")
    return Profile(b, "measure", str(config.device), times, dict(found.failed), found.spread)


def _measured_rate(gm: fx.GraphModule, times: dict[str, NodeTime], b: int) -> float | None:
    """FLOP/s of the timed ops that do arithmetic (forward FLOPs over forward time), or None
    without any."""
    flops = {n.name: n.meta.get("gp_flops", 0) * b for n in gm.graph.nodes if n.name in times}
    busy = [n for n, f in flops.items() if f > 0 and times[n].forward > 0]
    seconds = sum(times[n].forward for n in busy)
    return sum(flops[n] for n in busy) / seconds if seconds > 0 else None
