"""graphpipe._torch: each adapter over a private torch API, against the installed torch.

Every test asserts the behaviour graphpipe relies on, so a torch release that renames or
changes one of these APIs fails here, naming it, before anything downstream misbehaves.

The torch.distributed part runs a one-rank gloo group in this process (made and destroyed by
a fixture), and two-rank gloo groups in spawned processes for what only a peer can show (a
closed connection, a timeout).
"""

from __future__ import annotations

import copy
import datetime
import importlib
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import fx, nn
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.utils._pytree import tree_structure

import graphpipe._torch as _torch
from graphpipe._torch import TorchAPIError

# -- autograd, fx and the profiler


def test_grad_inputs_gives_one_meta_per_output_of_the_forward_op() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    (y,) = [x * 2.0]
    (meta,) = _torch.grad_inputs(y.grad_fn)
    assert meta == _torch.GradMeta(torch.Size([4, 3]), torch.float32, torch.device("cpu"))
    first, _ = x.split([1, 3], dim=0)  # one node, two outputs
    assert [m.shape for m in _torch.grad_inputs(first.grad_fn)] == [(1, 3), (3, 3)]


def test_accumulated_finds_the_leaf_of_an_accumulator_node_only() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 2.0
    accumulator, _ = y.grad_fn.next_functions[0]
    assert accumulator.name() == _torch.ACCUMULATE_GRAD
    assert _torch.accumulated(accumulator) is x
    assert _torch.accumulated(y.grad_fn) is None


def test_is_view_tells_a_view_from_a_tensor_with_its_own_storage() -> None:
    x = torch.randn(2, 3)
    assert _torch.is_view(x.t()) and _torch.is_view(x[0])
    assert not _torch.is_view(x) and not _torch.is_view(x.t().clone())


def test_a_missing_private_api_raises_naming_it() -> None:
    with pytest.raises(TorchAPIError, match=r"_input_metadata.*zero-bubble"):
        _torch.grad_inputs(object())
    with pytest.raises(TorchAPIError, match=r"Tensor\._base"):
        _torch.is_view(object())  # type: ignore[arg-type]


class _Kwargs(nn.Module):
    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, flag: bool = True) -> dict:
        return {"a": x * mask, "b": (x + 1,)}


def _exported() -> tuple[fx.GraphModule, torch.Tensor, torch.Tensor]:
    x, mask = torch.randn(2, 3), torch.ones(2, 3)
    ep = torch.export.export(_Kwargs(), (x,), {"mask": mask, "flag": True}, strict=False)
    return ep.module(), x, mask


def test_out_spec_is_the_exported_output_structure_and_none_for_symbolic_trace() -> None:
    gm, _, _ = _exported()
    assert _torch.out_spec(gm) == tree_structure({"a": 0, "b": (0,)})
    assert _torch.out_spec(fx.symbolic_trace(nn.Linear(2, 2))) is None


def test_leaves_with_paths_names_each_leaf_of_a_model_output() -> None:
    from transformers.modeling_outputs import CausalLMOutput

    out = CausalLMOutput(logits=torch.ones(1), loss=torch.zeros(()))
    assert [p for p, _ in _torch.leaves_with_paths(out)] == ["['loss']", "['logits']"]
    nested = _torch.leaves_with_paths({"a": (1, torch.ones(2)), "b": None})
    assert [p for p, _ in nested] == ["['a'][0]", "['a'][1]", "['b']"]


def test_in_spec_and_keyword_names_read_an_exported_calling_convention() -> None:
    gm, x, mask = _exported()
    spec = _torch.in_spec(gm)
    assert spec == tree_structure(((x,), {"mask": mask, "flag": True}))
    assert _torch.keyword_names(spec) == ["mask", "flag"]
    with pytest.raises(TorchAPIError, match="pytree_info"):
        _torch.in_spec(fx.symbolic_trace(nn.Linear(2, 2)))


def test_flatten_by_spec_orders_dict_leaves_by_the_spec() -> None:
    spec = tree_structure(((0,), {"mask": 0, "flag": 0}))
    leaves = _torch.flatten_by_spec(((0,), {"flag": "F", "mask": "M"}), spec)
    assert leaves == [0, "M", "F"]


def test_drop_inputs_makes_an_exported_module_take_its_tensor_inputs_only() -> None:
    gm, x, mask = _exported()
    expected = gm(x, mask=mask, flag=True)
    for node in [n for n in gm.graph.nodes if _torch.is_export_guard(n)]:
        gm.graph.erase_node(node)  # it reads `flag`; the tracer drops it so
    flag = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "flag")
    gm.graph.erase_node(flag)
    _torch.drop_inputs(gm, {"flag"}, tree_structure(((x,), {"mask": mask})))
    gm.recompile()
    out = gm(x, mask=mask)
    assert torch.equal(out["a"], expected["a"]) and torch.equal(out["b"][0], expected["b"][0])


def test_copy_graph_copies_an_exported_graph_and_builds_no_leaf_spec() -> None:
    gm, x, mask = _exported()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copied = _torch.copy_graph(gm)
    assert [str(w.message) for w in caught] == []  # torch 2.13: LeafSpec() warns FutureWarning
    assert copied is not gm and copied.graph is not gm.graph
    assert _torch.in_spec(copied) == _torch.in_spec(gm)
    assert _torch.out_spec(copied) == _torch.out_spec(gm)
    out, expected = copied(x, mask=mask, flag=True), gm(x, mask=mask, flag=True)
    assert torch.equal(out["a"], expected["a"]) and torch.equal(out["b"][0], expected["b"][0])
    plain = fx.symbolic_trace(nn.Linear(2, 2))  # fx's own CodeGen: a plain deepcopy
    assert _torch.copy_graph(plain).weight is not plain.weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copy.deepcopy(gm)  # what copy_graph avoids: drop copy_graph once this stops warning
    assert any("LeafSpec" in str(w.message) for w in caught)


def test_is_export_guard_finds_the_checks_export_inserts() -> None:
    gm, _, _ = _exported()
    guards = [n for n in gm.graph.nodes if _torch.is_export_guard(n)]
    assert [n.op for n in guards] == ["call_module"]  # torch >= 2.9 inserts one `_guards_fn`
    assert not any(_torch.is_export_guard(n) for n in fx.symbolic_trace(nn.ReLU()).graph.nodes)


def test_the_pytree_api_is_torchs_own_through_the_adapter() -> None:
    import torch.utils._pytree as pytree

    assert all(getattr(_torch, n) is getattr(pytree, n) for n in _torch.PYTREE)
    tree = {"a": torch.ones(2), "b": (torch.zeros(1), 3)}
    leaves, spec = _torch.tree_flatten(tree)
    assert _torch.tree_unflatten(leaves, spec)["b"][1] == 3
    paths = [_torch.keystr(p) for p, _ in _torch.tree_flatten_with_path(tree)[0]]
    assert paths == ["['a']", "['b'][0]", "['b'][1]"]


def test_profiler_enabled_is_true_only_while_a_profiler_records() -> None:
    assert not _torch.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _torch.profiler_enabled()
    assert not _torch.profiler_enabled()


def test_draft_export_reports_each_decision_it_took_from_values() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
            parts = torch.split(x, sizes.tolist())
            return torch.cat([p * 2 if p.shape[0] > 1 else p for p in parts])

    x, sizes = torch.randn(5, 2), torch.tensor([2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported, decisions = _torch.draft_export(Split(), (x, sizes), {})
    torch.testing.assert_close(exported.module()(x, sizes), x * 2)
    assert decisions and all(d.kind == "DATA_DEPENDENT_ERROR" for d in decisions)
    branch = [d for d in decisions if "p.shape[0] > 1" in d.where]  # the user's own line
    assert branch and ">" in branch[0].expr and "test_torch_adapter.py:" in branch[0].where
    assert all(d.where for d in decisions), decisions


def test_stateful_norm_covers_every_norm_with_running_statistics() -> None:
    base = _torch.stateful_norm()
    stateful = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    stateful += (nn.InstanceNorm2d, nn.LazyBatchNorm1d)
    assert all(issubclass(t, base) for t in stateful)
    assert not issubclass(nn.LayerNorm, base) and not issubclass(nn.GroupNorm, base)


def test_fake_mode_runs_real_parameters_on_fake_inputs_without_memory() -> None:
    linear = nn.Linear(3, 5)
    with _torch.fake_mode() as mode, torch.no_grad():
        x = mode.from_tensor(torch.randn(7, 3))
        y = linear(x)  # a real parameter meets a fake input
    assert (tuple(y.shape), y.dtype, y.device) == ((7, 5), torch.float32, torch.device("cpu"))
    assert type(y).__name__ == "FakeTensor"


def test_unscale_and_check_unscales_and_flags_an_inf_or_nan() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found = torch.zeros(1)
    _torch.unscale_and_check_(grads, found, torch.full((1,), 0.5))
    assert [g.tolist() for g in grads] == [[1.0, 2.0], [4.0]] and found.item() == 0.0
    for bad in (float("inf"), float("nan")):
        found = torch.zeros(1)
        _torch.unscale_and_check_([torch.tensor([1.0, bad])], found, torch.ones(1))
        assert found.item() == 1.0


def test_kineto_events_are_the_runs_ranges_in_epoch_nanoseconds() -> None:
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    assert _torch.kineto_events(prof) is None  # not started
    before = time.time_ns()
    with prof:
        assert _torch.kineto_events(prof) is None  # still running
        with torch.profiler.record_function("graphpipe::0F0"):
            torch.ones(64, 64).sum()
    after = time.time_ns()
    events = _torch.kineto_events(prof)
    assert events is not None
    (mine,) = [e for e in events if e.name == "graphpipe::0F0"]
    assert mine.on_cpu and mine.activity == "user_annotation"
    assert before <= mine.start_ns <= mine.end_ns <= after
    ops = [e for e in events if e.activity == "cpu_op"]
    assert ops and all(isinstance(e.correlation_id, int) for e in ops)
    assert all(isinstance(e.linked_correlation_id, int) for e in events)


# -- torch.distributed


@pytest.fixture
def launcher_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    """A store served here, as graphpipe.launch serves it, and a one-rank gloo group that
    rendezvoused with it as a client (the agent-store convention)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv(_torch.AGENT_STORE_ENV, "True")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def test_the_agent_store_variable_is_the_one_torch_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # the module, which the package's rendezvous() function shadows as an attribute
    read = importlib.import_module("torch.distributed.rendezvous")._torchelastic_use_agent_store
    monkeypatch.setenv(_torch.AGENT_STORE_ENV, "True")
    assert read()
    monkeypatch.setenv(_torch.AGENT_STORE_ENV, "False")
    assert not read()


def test_the_default_store_reaches_the_launchers_store(launcher_store: dist.TCPStore) -> None:
    """What the board writes through its connection, the launcher reads, and back."""
    store = _torch.default_store()
    assert isinstance(store, dist.Store)
    board = _torch.store_connection(store)
    assert board is not store  # a connection of its own
    board.set("graphpipe/test/from-rank", "dead")
    assert launcher_store.get("graphpipe/test/from-rank") == b"dead"
    launcher_store.set("graphpipe/test/from-launcher", "posted")
    assert board.get("graphpipe/test/from-launcher") == b"posted"
    board.compare_set("graphpipe/test/from-rank", "", "second")  # the first post is kept
    assert launcher_store.get("graphpipe/test/from-rank") == b"dead"


def test_store_connection_unwraps_prefix_stores() -> None:
    bare = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    wrapped = dist.PrefixStore("outer", dist.PrefixStore("inner", bare))
    _torch.store_connection(wrapped).set("key", "value")
    assert bare.get("key") == b"value"  # no prefix added


def test_the_default_store_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not been initialized"):
        _torch.default_store()


def test_set_default_pg_timeout_changes_the_gloo_timeout(launcher_store: dist.TCPStore) -> None:
    gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    _torch.set_default_pg_timeout(3.5)
    assert gloo.options._timeout == datetime.timedelta(seconds=3.5)


def test_set_default_pg_timeout_changes_a_subgroups_gloo_timeout(
    launcher_store: dist.TCPStore,
) -> None:
    """A DeviceMesh's dp group (here a one-rank subgroup), whose collectives FSDP2 runs."""
    group = dist.new_group([0])
    gloo = group._get_backend(torch.device("cpu"))
    default = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    before = default.options._timeout
    _torch.set_default_pg_timeout(4.5, group)
    assert gloo.options._timeout == datetime.timedelta(seconds=4.5)
    assert default.options._timeout == before  # the default group's is its own


def test_a_missing_api_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
    with pytest.raises(TorchAPIError, match=r"_set_pg_timeout\(\).*RuntimeConfig.timeout"):
        _torch.set_default_pg_timeout(1.0)
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(TorchAPIError, match="_get_default_store"):
        _torch.default_store()


STALLED = 6.0  # seconds rank 1 stalls past rank 0's 1 s timeout before it exits


def _gloo_failure(rank: int, port: int, how: str, out: str) -> None:
    """Rank 0 waits in an all-reduce for rank 1, which exits ("closed") or stalls past a
    timeout of 1 s set after init ("timeout"); rank 0 writes what the adapter makes of it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)  # torch's default timeout
    _torch.set_default_pg_timeout(1.0)
    dist.all_reduce(torch.zeros(1))  # both connected
    if rank == 1:
        if how == "timeout":
            time.sleep(STALLED)
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.zeros(1))
        seen = "no error"
    except RuntimeError as exc:
        seen = f"{_torch.backend_failure(exc)}|{time.monotonic() - start:.1f}|{exc}"
    Path(out).write_text(seen)
    os._exit(0)


@pytest.mark.parametrize("how", ["closed", "timeout"])
def test_backend_failure_reads_the_gloo_errors(how: str, tmp_path: Path) -> None:
    out = tmp_path / "seen"
    port = get_free_port()  # for rank 0's store
    mp.start_processes(
        _gloo_failure, args=(port, how, str(out)), nprocs=2, join=True, start_method="spawn"
    )
    kind, seconds, text = out.read_text().split("|", 2)
    assert kind == how, text
    if how == "timeout":  # the 1 s timeout set after init governs (torch's default: 30 min)
        # an ordering, not a duration: the error came before rank 1 exits at STALLED s
        # (which would read "closed", as `kind` checks too)
        assert float(seconds) < STALLED, text


def test_tensor_version_counts_in_place_changes() -> None:
    """sync.py's check: a gradient accumulated in place after its bucket's launch."""
    p = torch.nn.Parameter(torch.ones(3))
    (p * 2).sum().backward()
    assert p.grad is not None
    grad, seen = p.grad, _torch.tensor_version(p.grad)
    (p * 3).sum().backward()  # accumulates into the same tensor
    assert p.grad is grad and _torch.tensor_version(p.grad) > seen
    before = _torch.tensor_version(grad)
    grad.mul_(2)
    assert _torch.tensor_version(grad) == before + 1


def test_fsdp_post_backward_reduces_a_gradient_added_by_hand(
    launcher_store: dist.TCPStore,
) -> None:
    """A gradient added to a gathered parameter outside autograd (a zero-bubble weight half)
    reaches the sharded parameter's `.grad` and the unit reshards: what FSDP2's hooks would
    have done at the end of a backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=False)
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    out = model(torch.randn(3, 4))
    gathered = [p for p in model.parameters() if not isinstance(p, DTensor)]
    assert len(gathered) == 4  # kept gathered after the forward
    grads = torch.autograd.grad(out.sum(), gathered)  # by hand: no hook sees these
    for p, g in zip(gathered, grads, strict=True):
        p.grad = g
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    model.set_is_last_backward(True)  # type: ignore[operator]
    model.set_reshard_after_backward(True)  # type: ignore[operator]
    _torch.fsdp_post_backward(model)
    sharded = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in sharded)  # resharded
    for p, g in zip(sharded, grads, strict=True):
        assert isinstance(p.grad, DTensor)
        torch.testing.assert_close(p.grad.full_tensor(), g)  # one rank: the sum is itself


def test_data_dependent_op_names_the_op_a_fake_run_refuses() -> None:
    with _torch.fake_mode() as mode, pytest.raises(Exception) as err:
        x = mode.from_tensor(torch.randn(4))
        torch.nonzero(x)
    assert _torch.data_dependent_op(err.value) == "aten.nonzero.default"
    assert _torch.data_dependent_op(RuntimeError("aten.nonzero.default")) is None
