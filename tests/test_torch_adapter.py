"""graphpipe._torch: each adapter over a private torch API, against the installed torch.

Every test asserts the behaviour graphpipe relies on, so a torch release that renames or
changes one of these APIs fails here, naming it, before anything downstream misbehaves.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import fx, nn
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


def test_is_export_guard_finds_the_checks_export_inserts() -> None:
    gm, _, _ = _exported()
    guards = [n for n in gm.graph.nodes if _torch.is_export_guard(n)]
    assert [n.op for n in guards] == ["call_module"]  # torch >= 2.9 inserts one `_guards_fn`
    assert not any(_torch.is_export_guard(n) for n in fx.symbolic_trace(nn.ReLU()).graph.nodes)


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
