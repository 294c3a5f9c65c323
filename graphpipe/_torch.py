"""The one adapter over torch's private APIs: every use of one in graphpipe goes through here.

torch keeps no promise about its private names (a leading underscore, or an undocumented
attribute of a documented object); a release may rename one without warning. Each use is
therefore one small function below, whose docstring names the torch API, says what graphpipe
needs of it, and the torch version it was checked against. A missing API raises
`TorchAPIError`, naming it, the first time it is used; nothing here swallows an error. Each
function has a test in `tests/test_torch_adapter.py` that asserts, against the installed
torch, the behaviour graphpipe relies on, so an upgrade that changes one fails there first.

Pytree: torch's pytree API lives in the underscored `torch.utils._pytree`, which torch
documents as the pytree API (torch.export's docs register types with it) and which has no
public twin in torch 2.13. Its names graphpipe uses (`PYTREE`: `tree_flatten`,
`tree_unflatten`, `tree_map`, `tree_map_only`, `tree_leaves`, `tree_structure`,
`tree_flatten_with_path`, `keystr`, `TreeSpec`) are imported here once and re-exported;
every other module imports them from this adapter. `python -m graphpipe.tools.deps` fails
on any private torch name, pytree's included, outside this module.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.utils._pytree as _pytree
from torch import fx, nn

from graphpipe.errors import GraphPipeError

# torch's pytree API, re-exported (module docstring)
TreeSpec = _pytree.TreeSpec
keystr = _pytree.keystr
tree_flatten = _pytree.tree_flatten
tree_flatten_with_path = _pytree.tree_flatten_with_path
tree_leaves = _pytree.tree_leaves
tree_map = _pytree.tree_map
tree_map_only = _pytree.tree_map_only
tree_structure = _pytree.tree_structure
tree_unflatten = _pytree.tree_unflatten

PYTREE = (
    "TreeSpec",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "tree_structure",
    "tree_unflatten",
)

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

# -- autograd, fx and the profiler

CHECKED = "2.13"  # the torch version every function of this section was checked against


class TorchAPIError(GraphPipeError, RuntimeError):
    """A private torch API graphpipe relies on is missing or changed in the installed torch."""


def _missing(api: str, need: str, exc: BaseException | None = None) -> TorchAPIError:
    """The error for a private torch API that is gone: which, and what graphpipe needs it for."""
    found = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    return TorchAPIError(
        f"torch {torch.__version__} has no {api}{found}; graphpipe uses it to {need} "
        f"(checked against torch {CHECKED}): use a torch version graphpipe supports"
    )


def _private(obj: Any, attr: str, api: str, need: str) -> Any:
    """`obj.attr`, or `TorchAPIError` naming `api` when torch no longer has it."""
    try:
        return getattr(obj, attr)
    except AttributeError as exc:
        raise _missing(api, need, exc) from exc


# autograd: the zero-bubble split (graphpipe.runtime.backward) -------------------------------


class GradMeta(NamedTuple):
    """Shape, dtype and device of one gradient an autograd node takes."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def grad_inputs(node: Any) -> tuple[GradMeta, ...]:
    """What each gradient an autograd node takes looks like: one per output of its forward.

    torch API: `torch.autograd.graph.Node._input_metadata` (a tuple of `_InputMetadata`
    with `.shape`, `.dtype`, `.device`). graphpipe needs the count, to capture a node's
    output gradients as `GradientEdge(node, k)` for every k, and the shape, dtype and device,
    to seed a missing one with zeros and to sum a gradient over broadcast dimensions.

    Raises:
        TorchAPIError: torch no longer has `_input_metadata`.
    """
    metas = _private(
        node,
        "_input_metadata",
        "autograd Node._input_metadata",
        "count and shape the gradients a node takes (zero-bubble split backward)",
    )
    return tuple(GradMeta(torch.Size(m.shape), m.dtype, m.device) for m in metas)


ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"  # `Node.name()` of a leaf's accumulator


def accumulated(node: Any) -> torch.Tensor | None:
    """The tensor an autograd node accumulates into, if it is a leaf's AccumulateGrad node.

    torch API: `AccumulateGrad.variable`, the undocumented attribute of the accumulator
    node (`Node.name()` is "torch::autograd::AccumulateGrad"). graphpipe needs it to find
    which nodes reach a stage input's or a parameter's accumulator.

    Returns:
        The leaf tensor, or None for any other node.

    Raises:
        TorchAPIError: an AccumulateGrad node without `variable`.
    """
    if node.name() != ACCUMULATE_GRAD:
        return None
    variable: torch.Tensor = _private(
        node,
        "variable",
        "AccumulateGrad.variable",
        "find the leaf tensor an accumulator node adds into (zero-bubble split backward)",
    )
    return variable


def is_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view of another tensor's storage.

    torch API: `Tensor._base` (the tensor a view was made from; None otherwise). graphpipe
    needs it to copy a gradient the engine handed out as a view of a seed before making it a
    parameter's `.grad`, so an in-place clip or unscale never writes into the seed.

    Raises:
        TorchAPIError: torch no longer has `Tensor._base`.
    """
    base = _private(tensor, "_base", "Tensor._base", "tell a view from a tensor (split backward)")
    return base is not None


# fx: graphs from torch.export (graphpipe.tracing.tracer) ------------------------------------


_CALLING = "read or change the calling convention of an exported graph"


def _codegen(gm: fx.GraphModule) -> Any:
    """The object that writes the graph's Python code (`fx.Graph._codegen`)."""
    return _private(gm.graph, "_codegen", "fx.Graph._codegen", _CALLING)


def _pytree_info(gm: fx.GraphModule) -> Any | None:
    """The `_PyTreeInfo` of a graph that flattens its inputs and outputs; None for fx's plain
    `CodeGen` (a graph from `torch.fx.symbolic_trace`)."""
    codegen = _codegen(gm)
    if type(codegen) is fx.graph.CodeGen:
        return None
    return _private(codegen, "pytree_info", f"{type(codegen).__name__}.pytree_info", _CALLING)


def out_spec(gm: fx.GraphModule) -> TreeSpec | None:
    """The pytree structure of the graph's output, if its code builds one.

    torch API: `fx.Graph._codegen.pytree_info.out_spec` (`_PyTreeCodeGen`, the codegen of
    `torch.export.ExportedProgram.module()`). graphpipe needs it to rebuild a model's output
    (a dict, a tuple) from a stage's flat tensors.

    Returns:
        The output spec, or None for a graph from `torch.fx.symbolic_trace` (fx's plain
        `CodeGen`, which returns the output as it is).

    Raises:
        TorchAPIError: torch no longer has `_codegen` or `pytree_info`.
    """
    info = _pytree_info(gm)
    return None if info is None else info.out_spec


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """Every leaf of a pytree (a Hugging Face `ModelOutput`, a dict, a tuple) with its path
    as text (`['logits']`, `[0]`).

    torch API: `torch.utils._pytree.tree_flatten_with_path` and `keystr`, the registry that
    knows every container torch and its users registered (transformers registers its
    `ModelOutput`s there).
    """

    leaves, _ = tree_flatten_with_path(tree)
    return [(keystr(path), leaf) for path, leaf in leaves]


def in_spec(gm: fx.GraphModule) -> TreeSpec:
    """The pytree structure of an exported graph's inputs: `((args...), {kwargs...})`.

    torch API: `fx.Graph._codegen.pytree_info.in_spec`, as `ExportedProgram.module()`
    builds it. graphpipe needs it to know which placeholder each positional or keyword
    input becomes.

    Raises:
        TorchAPIError: the graph's code does not flatten its inputs (not from torch.export),
            or torch no longer has `_codegen` or `pytree_info`.
    """
    info = _pytree_info(gm)
    if info is None:
        raise _missing("pytree_info on this graph", _CALLING)
    spec: TreeSpec = info.in_spec
    return spec


def keyword_names(spec: TreeSpec) -> list[str]:
    """The keyword inputs of an exported graph's input spec, in its order.

    torch API: `TreeSpec.child(1).context`, the keys of the kwargs dict of the
    `((args...), {kwargs...})` spec torch.export builds.

    Raises:
        TorchAPIError: the spec is not an (args, kwargs) pair, or `TreeSpec` changed.
    """
    child = _private(spec, "child", "TreeSpec.child", _CALLING)
    try:
        kwargs = child(1)
    except (IndexError, TypeError) as exc:
        raise _missing("a ((args), {kwargs}) input spec", _CALLING, exc) from exc
    return list(_private(kwargs, "context", "TreeSpec.context", _CALLING))


def drop_inputs(gm: fx.GraphModule, names: Collection[str], spec: TreeSpec) -> None:
    """Make an exported graph's code take its inputs less `names`, flattened by `spec`.

    torch API: `fx.Graph._codegen.pytree_info`, a `_PyTreeInfo(orig_args, in_spec,
    out_spec)` named tuple (replaced with its `_replace`): `orig_args` are the forward's
    argument names in the generated signature. graphpipe needs it to drop the inputs
    torch.export specialised on (non-tensor keyword values), so the module is called with
    its tensor inputs only. Erase their placeholders, then call `gm.recompile()`.

    Args:
        gm: A graph from `ExportedProgram.module()`.
        names: The argument names to drop.
        spec: The structure of the inputs left, `((args...), {kwargs...})`.

    Raises:
        TorchAPIError: the graph does not flatten its inputs, or `_PyTreeInfo` changed.
    """
    info = _pytree_info(gm)
    if info is None:
        raise _missing("pytree_info on this graph", _CALLING)
    orig = list(_private(info, "orig_args", "_PyTreeInfo.orig_args", _CALLING))
    replace = _private(info, "_replace", "_PyTreeInfo._replace", _CALLING)
    _codegen(gm).pytree_info = replace(orig_args=[a for a in orig if a not in names], in_spec=spec)


def flatten_by_spec(tree: Any, spec: TreeSpec) -> list[Any]:
    """The leaves of `tree`, in the order `spec` flattens it (dict keys in the spec's order).

    torch API: `torch.fx._pytree.tree_flatten_spec`, what an exported module's code calls on
    its inputs. graphpipe needs it to label each placeholder with the input it comes from.

    Raises:
        TorchAPIError: torch no longer has it.
    """
    try:
        from torch.fx._pytree import tree_flatten_spec
    except ImportError as exc:
        raise _missing("torch.fx._pytree.tree_flatten_spec", "label placeholders", exc) from exc
    return list(tree_flatten_spec(tree, spec))


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """`copy.deepcopy(gm)`, sharing torch's one pytree leaf spec instead of rebuilding it.

    torch API: `torch.utils._pytree.treespec_leaf()`, the one `LeafSpec` every spec torch
    builds ends in (an exported graph's `_codegen.pytree_info`, its `_in_spec` and
    `_out_spec`, the tracer's `TraceInfo.out_spec`), and `fx.Graph._codegen`. torch 2.13
    deprecates the `LeafSpec` class with a FutureWarning from its `__new__`, which a plain
    deepcopy calls to rebuild that leaf. A leaf spec is immutable (a frozen dataclass with no
    children) and torch shares it itself, so the copy shares it too and builds none.
    `fx.Graph.__deepcopy__` copies its codegen with a memo of its own, so the graph is copied
    with a plain codegen in its place (restored at once) and given a copy of the codegen
    made with the shared leaf. graphpipe needs the copy to time a graph's nodes on a device
    without touching the caller's graph.

    Raises:
        TorchAPIError: torch no longer has `treespec_leaf` or `_codegen`.
    """
    from torch.utils import _pytree

    leaf = _private(_pytree, "treespec_leaf", "torch.utils._pytree.treespec_leaf", _COPYING)()
    memo: dict[int, Any] = {id(leaf): leaf}
    codegen = _codegen(gm)
    gm.graph.set_codegen(fx.graph.CodeGen())
    try:
        graph = copy.deepcopy(gm.graph, memo)
    finally:
        gm.graph.set_codegen(codegen)
    graph.set_codegen(copy.deepcopy(codegen, memo))
    memo[id(gm.graph)] = graph
    return copy.deepcopy(gm, memo)


_COPYING = "copy a graph to time its nodes on a device (the profiler)"


EXPORT_GUARD_PREFIX = "_guards"  # `ExportedProgram.module()`'s input-check submodule


def is_export_guard(node: fx.Node) -> bool:
    """Whether `node` calls the input checks `ExportedProgram.module()` inserts.

    torch API: the `_guards_fn` submodule that torch.export (2.9 and later) calls after the
    placeholders to check shapes and constants. graphpipe drops it: each stage runs at the
    shapes it was traced with, and the check would name inputs the stage does not have.
    """
    return node.op == "call_module" and str(node.target).startswith(EXPORT_GUARD_PREFIX)


class ValueDecision(NamedTuple):
    """A decision torch.export's draft mode took from the example's values."""

    kind: str  # "DATA_DEPENDENT_ERROR", "GUARD_ADDED", "MISMATCHED_FAKE_KERNEL", ...
    expr: str  # the symbolic expression decided ("Ne(16*u0, 256)"), "" where none
    where: str  # the user frame it was taken at ("modeling_qwen2_vl.py:403"), "" if unknown
    detail: str  # for a kernel failure, the op and the reason


def draft_export(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.export.ExportedProgram, list[ValueDecision]]:
    """`torch.export.draft_export`, and every decision it took from real values.

    torch API: `torch.export.draft_export` (public) and its program's `_report.failures`,
    each a `FailureReport` with `failure_type` and a `data` dict holding `expr` and
    `user_stack` (frames with `filename`, an index into the report's `str_to_filename`,
    `line` and `loc`, the source line). A file named before in the process is in no report:
    its index is read back from `torch._logging.structured.INTERN_TABLE` (file -> index),
    the table torch's structured logs intern names in. graphpipe needs the decisions to
    accept those about static inputs (`graphpipe.tracing.static`) and refuse any other.

    Raises:
        TorchAPIError: torch has no draft_export, or its report changed.
    """
    draft = getattr(torch.export, "draft_export", None)
    if draft is None:
        raise _missing("torch.export.draft_export", "trace a model with static inputs")
    exported = draft(model, args, kwargs)
    need = "read the decisions torch.export took from values"
    report = _private(exported, "_report", "ExportedProgram._report", need)
    files = dict(getattr(report, "str_to_filename", {}))
    files.update({i: name for name, i in _interned().items() if i not in files})
    decisions = []
    for failure in _private(report, "failures", "DraftExportReport.failures", need):
        data = _private(failure, "data", "FailureReport.data", need)
        stack = data.get("user_stack") or []
        frame = stack[-1] if stack else {}
        path = str(files.get(frame.get("filename"), frame.get("filename", "?")))
        where = f"{path}:{frame.get('line', '?')} ({frame.get('loc', '').strip()})" if frame else ""
        detail = f"{data.get('op', '')} {data.get('reason', '')}".strip()
        kind = str(failure.failure_type)
        decisions.append(ValueDecision(kind, str(data.get("expr", "")), where, detail))
    return exported, decisions


def _interned() -> dict[str, int]:
    """torch's interned names (`torch._logging.structured.INTERN_TABLE`), {} without it."""
    try:
        from torch._logging import structured
    except ImportError:
        return {}
    return dict(getattr(structured, "INTERN_TABLE", {}))


def stateful_norm() -> type[nn.Module]:
    """The base class of torch's normalisation modules that keep running statistics.

    torch API: `torch.nn.modules.batchnorm._NormBase`, the base of BatchNorm{1,2,3}d,
    SyncBatchNorm, InstanceNorm{1,2,3}d and their lazy forms (and of any library's subclass
    of them). graphpipe needs one class that covers them all, to keep every module that
    updates buffers in its forward a leaf of the fx trace.

    Raises:
        TorchAPIError: torch no longer has it.
    """
    base: type[nn.Module] = _private(
        nn.modules.batchnorm,
        "_NormBase",
        "torch.nn.modules.batchnorm._NormBase",
        "keep modules with running statistics leaves of the trace",
    )
    return base


def fake_mode() -> FakeTensorMode:
    """A fake-tensor mode that also accepts real tensors as inputs.

    torch API: `torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)`
    and its `from_tensor`. graphpipe needs it to run a stage at the micro-batch size without
    memory or compute, recording each value's shape and dtype on its real device.

    Raises:
        TorchAPIError: torch no longer has it.
    """
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as exc:
        raise _missing(
            "torch._subclasses.fake_tensor.FakeTensorMode", "run a stage on fake tensors", exc
        ) from exc
    return FakeTensorMode(allow_non_fake_inputs=True)


def data_dependent_op(error: BaseException) -> str | None:
    """The op a fake-tensor run refused because its output's shape (or a Python value it
    returns) depends on tensor values, when `error` is that refusal; else None.

    torch API: `torch._subclasses.fake_tensor.DynamicOutputShapeException` (`nonzero`,
    boolean-mask indexing, `unique`) and `DataDependentOutputException` (`item`,
    `tolist`), each with the op as `func`. graphpipe needs them to refuse, at compile, a
    model whose message shapes no rank can compute from the input shapes alone.

    Raises:
        TorchAPIError: torch no longer has them.
    """
    try:
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
        )
    except ImportError as exc:
        raise _missing(
            "torch._subclasses.fake_tensor.DynamicOutputShapeException",
            "name an op whose output shape depends on values",
            exc,
        ) from exc
    if isinstance(error, (DynamicOutputShapeException, DataDependentOutputException)):
        return str(getattr(error, "func", type(error).__name__))
    return None


# amp: fp16's loss scaler (graphpipe.runtime.precision) --------------------------------------


def unscale_and_check_(
    grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Multiply `grads` by `inv_scale` in place and set `found_inf` to 1 if one is not finite.

    torch API: `torch._amp_foreach_non_finite_check_and_unscale_`, the fused kernel
    `torch.amp.GradScaler.unscale_` runs. All of `grads`, `found_inf` (a one-element float32
    tensor) and `inv_scale` (likewise) must be on one device; group by device and dtype first.

    Raises:
        TorchAPIError: torch no longer has it.
    """
    op = _private(
        torch,
        "_amp_foreach_non_finite_check_and_unscale_",
        "torch._amp_foreach_non_finite_check_and_unscale_",
        "unscale fp16 gradients and find an inf or NaN among them",
    )
    op(list(grads), found_inf, inv_scale)


# profiler: measured timelines (graphpipe.runtime.profiling) ---------------------------------


class ProfilerEvent(NamedTuple):
    """One kineto event, as graphpipe reads it: times in ns since the Unix epoch."""

    name: str
    on_cpu: bool  # a host event (device_type CPU), not device work
    activity: str  # kineto's activity type: "cpu_op", "kernel", "cuda_runtime", ...
    start_ns: int
    end_ns: int
    correlation_id: int  # CUPTI's id linking a launch to its device work
    linked_correlation_id: int  # for device work, the torch op it belongs to


def profiler_enabled() -> bool:
    """Whether a torch profiler records now (on this thread).

    torch API: `torch._C._autograd._profiler_enabled()`, what `torch.autograd.profiler`
    itself asks. graphpipe needs it to label each action with a `record_function` range only
    while someone records: a range is two dispatched ops per action, host time on the
    critical path otherwise.

    Raises:
        TorchAPIError: torch no longer has it.
    """
    autograd = _private(torch._C, "_autograd", "torch._C._autograd", "ask if a profiler records")
    enabled = _private(
        autograd, "_profiler_enabled", "torch._C._autograd._profiler_enabled", "ask it"
    )
    return bool(enabled())


def kineto_events(prof: torch.profiler.profile) -> list[ProfilerEvent] | None:
    """The raw events of a finished profiler run; None while it has no results.

    torch API: `torch.profiler.profile.profiler.kineto_results` (set when the run ends) and
    its `events()`, torch's `_KinetoEvent`s with `name()`, `device_type()`,
    `activity_type()`, `start_ns()`, `end_ns()`, `correlation_id()` and
    `linked_correlation_id()`. graphpipe needs the epoch-nanosecond times and the CUPTI
    correlation ids, which the public `prof.events()` does not keep, to place each kernel in
    the action that launched it from any thread.

    Raises:
        TorchAPIError: torch no longer has one of these.
    """
    need = "read measured action times (profiling)"
    if prof.profiler is None:
        return None
    results = _private(prof.profiler, "kineto_results", "profile.kineto_results", need)
    if results is None:
        return None
    return [_event(e, need) for e in _private(results, "events", "kineto events()", need)()]


def _event(e: Any, need: str) -> ProfilerEvent:
    """One `_KinetoEvent` as a `ProfilerEvent`."""

    def read(method: str) -> Any:
        return _private(e, method, f"_KinetoEvent.{method}()", need)()

    return ProfilerEvent(
        name=read("name"),
        on_cpu=read("device_type") == torch.autograd.DeviceType.CPU,
        activity=read("activity_type"),
        start_ns=read("start_ns"),
        end_ns=read("end_ns"),
        correlation_id=read("correlation_id"),
        linked_correlation_id=read("linked_correlation_id"),
    )


# -- torch.distributed: the failure board, timeouts, gradient sums (graphpipe.runtime) ----------

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""The environment variable torch.distributed.rendezvous reads (`_torchelastic_use_agent_store`,
checked against torch 2.13): "True" makes every rank, rank 0 included, a client of a store
that the launcher serves at MASTER_ADDR:MASTER_PORT, as torchrun's agent does.
graphpipe.launch sets it so that the failure board on that store outlives any rank."""


def default_store() -> dist.Store:
    """The store the default process group rendezvoused with.

    torch API: `torch.distributed.distributed_c10d._get_default_store()`. graphpipe needs the
    very store every rank and the launcher share (the failure board lives on it), not a new
    one.

    Raises:
        TorchAPIError: the function is gone, or returns no Store.
        ValueError: no default process group (torch's own error).
    """
    api, need = "distributed_c10d._get_default_store()", "find the failure board's store"
    store = _private(dist.distributed_c10d, "_get_default_store", api, need)()
    if not isinstance(store, dist.Store):
        raise _missing(f"{api} returning a Store (got {type(store).__name__})", need)
    return store


def store_connection(store: dist.Store) -> dist.Store:
    """A connection of its own to the store under `store`'s prefixes.

    torch APIs: `PrefixStore.underlying_store` and `Store.clone()`. init_process_group wraps
    the rendezvous store in PrefixStores; the launcher writes to the bare store, so graphpipe
    unwraps down to it. A TCPStore client serves one call at a time and the process group's
    own blocking calls use it, so the failure board polls through a clone, a second connection
    to the same server.

    Raises:
        TorchAPIError: `underlying_store` or `clone` is gone.
    """
    need = "reach the failure board on a connection of its own"
    while isinstance(store, dist.PrefixStore):
        store = _private(store, "underlying_store", "PrefixStore.underlying_store", need)
    clone = _private(store, "clone", f"{type(store).__name__}.clone()", need)
    return clone()


def set_default_pg_timeout(seconds: float, group: dist.ProcessGroup | None = None) -> None:
    """Make `seconds` the timeout of a process group's collectives (default: the default
    group's), from now on.

    torch API: `torch.distributed.distributed_c10d._set_pg_timeout(timedelta, group)`.
    graphpipe needs `RuntimeConfig.timeout` to govern a process group that was created with
    another timeout (by init_process_group, or a DeviceMesh's dp groups, whose collectives
    FSDP2 runs; gloo's: later than the watch's, so the watch diagnoses first; NCCL's: the
    watchdog's limit).

    Raises:
        TorchAPIError: the function is gone.
    """
    api = "distributed_c10d._set_pg_timeout()"
    setter = _private(dist.distributed_c10d, "_set_pg_timeout", api, "apply RuntimeConfig.timeout")
    setter(datetime.timedelta(seconds=seconds), group)


CLOSED_WORDS = ("closed", "reset", "broken pipe")  # gloo: "Connection closed by peer", ...
TIMEOUT_WORDS = ("timed out", "timeout")  # gloo: "Timed out waiting 2000ms for recv ..."


def backend_failure(exc: BaseException) -> Literal["closed", "timeout"] | None:
    """What a backend's error says happened: a peer closed its connection, a timeout, or
    something else (None).

    torch API: the text of the RuntimeError gloo raises (torch 2.13: "Connection closed by
    peer [...]" when a peer's process ends, "Timed out waiting ...ms for recv operation" at
    the process group's timeout); gloo raises no exception type per cause. graphpipe needs it
    to tell a dead peer from a collective's own error.
    """
    text = str(exc).lower()
    if any(w in text for w in TIMEOUT_WORDS):
        return "timeout"
    if any(w in text for w in CLOSED_WORDS):
        return "closed"
    return None


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter: it grows at each in-place change of its data.

    torch API: `Tensor._version`, the counter autograd checks saved tensors with.
    graphpipe.runtime.sync needs it to refuse a gradient written after its bucket's
    all-reduce was launched.

    Raises:
        TorchAPIError: the attribute is gone.
    """
    version = _private(t, "_version", "Tensor._version", "check a launched gradient is unchanged")
    if not isinstance(version, int):
        raise _missing(f"Tensor._version as an int (got {type(version).__name__})", "sync")
    return version


# FSDP2: reducing gradients a split backward computed by hand (graphpipe.runtime.mesh) -------


def fsdp_post_backward(module: nn.Module) -> None:
    """Run FSDP2's post-backward on every unit under the root `module` now, then its root's
    end-of-backward callback: reduce-scatter (or all-reduce) the gradients accumulated on the
    unsharded parameters, reshard, and finish the step's backward.

    torch APIs: `fully_shard.state(module)`, its `_state_ctx.all_states`, each state's
    `_fsdp_param_groups` and `FSDPParamGroup.post_backward()`, and the root state's
    `_root_post_backward_final_callback()` (torch 2.13; torch's own pipelining calls the same
    in `_PipelineStageBase.perform_reduce_grad`). FSDP2 runs them from autograd hooks on each
    unit's forward inputs, which a zero-bubble weight half never reaches: it computes the
    parameter gradients with `torch.autograd.grad` after the input half has passed those
    hooks. Idempotent per unit: a unit already reduced is left alone by FSDP.

    Raises:
        TorchAPIError: one of those is gone.
    """
    from torch.distributed.fsdp import fully_shard

    need = "reduce the gradients of a split (zero-bubble) backward under FSDP2"
    state = _private(fully_shard, "state", "fully_shard.state()", need)(module)
    ctx = _private(state, "_state_ctx", "FSDPState._state_ctx", need)
    for unit in _private(ctx, "all_states", "FSDPStateContext.all_states", need):
        for group in _private(unit, "_fsdp_param_groups", "FSDPState._fsdp_param_groups", need):
            _private(group, "post_backward", "FSDPParamGroup.post_backward()", need)()
    api = "FSDPState._root_post_backward_final_callback()"
    _private(state, "_root_post_backward_final_callback", api, need)()
