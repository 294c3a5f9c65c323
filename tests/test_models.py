"""Tests of the example models in `models/`: tracing, determinism, data, presets, options."""

from __future__ import annotations

import importlib
import time
from types import ModuleType
from typing import Any

import pytest
import torch

from graphpipe.errors import ConfigError
from graphpipe.tools.workload import Workload, load_workload
from graphpipe.tracing.tracer import trace

NAMES = ["mmt", "dlrm", "candle_uno", "nbranch", "inception", "vlm"]

# Parameter and buffer bytes of each paper preset: (at least, at most).
PAPER_BYTES = {
    "mmt": (1e9, 3e9),
    "dlrm": (4e9, 8e9),  # 8 tables of 1e6 × 128 floats alone are 4.1e9
    "candle_uno": (1e9, 4e9),
    "nbranch": (2e9, 5e9),
    "inception": (5e7, 5e8),
    "vlm": (2.6e10, 3.0e10),  # LLaVA-1.5-7B's 7 B parameters, a 0.3 B ViT among them
}

# An option of each model that changes its graph, with a small value.
OVERRIDES: dict[str, dict[str, Any]] = {
    "mmt": {"branches": 3},
    "dlrm": {"tables": 2},
    "candle_uno": {"towers": 2},
    "nbranch": {"branches": 3},
    "inception": {"blocks": 3},
    "vlm": {"images": 2, "frozen": True},
}


def model_module(name: str) -> ModuleType:
    """The module `models.<name>`."""
    return importlib.import_module(f"models.{name}")


def tiny(name: str, **kwargs: Any) -> Workload:
    """The tiny preset of model `name`."""
    return model_module(name).workload("tiny", **kwargs)


def batch(w: Workload, seed: int = 1) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A fresh mini-batch of `w`, from a generator seeded with `seed`."""
    return w.make_batch(torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_presets_are_complete(name: str) -> None:
    presets = model_module(name).PRESETS
    assert set(presets) == {"tiny", "cpu", "paper"}
    for options in presets.values():
        assert options["batch"] % options["micro_batches"] == 0
        assert set(options) == set(presets["tiny"])


@pytest.mark.parametrize("name", NAMES)
def test_traced_graph_computes_the_model(name: str) -> None:
    w = tiny(name)
    gm = trace(w.model, w.example_inputs, leaf_modules=w.leaf_modules)
    assert gm.meta["graphpipe"].method == "fx"  # module granularity, not ATen ops
    for training in (True, False):  # BatchNorm: batch statistics, then running statistics
        w.model.train(training)
        gm.train(training)
        with torch.no_grad():
            torch.testing.assert_close(gm(*w.example_inputs), w.model(*w.example_inputs))


def test_conv_bn_relu_is_one_node() -> None:
    w = tiny("inception")
    gm = trace(w.model, w.example_inputs, leaf_modules=w.leaf_modules)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert "stem.0" in targets
    assert not [t for t in targets if t.endswith((".conv", ".bn"))]


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_weights_and_data(name: str) -> None:
    rng = torch.get_rng_state()
    a, b, other = tiny(name, seed=0), tiny(name, seed=0), tiny(name, seed=1)
    assert torch.equal(rng, torch.get_rng_state())  # the global RNG is untouched
    state_a, state_b = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert all(torch.equal(x, y) for x, y in zip(a.example_inputs, b.example_inputs, strict=True))
    (inputs_a, target_a), (inputs_b, target_b) = batch(a), batch(b)
    assert all(torch.equal(x, y) for x, y in zip(inputs_a, inputs_b, strict=True))
    assert torch.equal(target_a, target_b)
    state_o = other.model.state_dict()
    assert not all(torch.equal(state_a[k], state_o[k]) for k in state_a)


@pytest.mark.parametrize("name", NAMES)
def test_make_batch_matches_the_example_and_loss_is_finite(name: str) -> None:
    w = tiny(name)
    inputs, target = batch(w)
    assert [(x.shape, x.dtype) for x in inputs] == [(x.shape, x.dtype) for x in w.example_inputs]
    assert target.shape[0] == w.batch_size
    assert not any(torch.equal(x, y) for x, y in zip(inputs, w.example_inputs, strict=True))
    loss = w.loss_fn(w.model(*inputs), target)
    assert loss.dim() == 0
    assert torch.isfinite(loss)


def held_out_loss(
    w: Workload, batches: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]
) -> float:
    """The mean loss of `w.model` over `batches`."""
    with torch.no_grad():
        return sum(w.loss_fn(w.model(*x), t).item() for x, t in batches) / len(batches)


@pytest.mark.parametrize("name", NAMES)
def test_loss_falls_when_training(name: str) -> None:
    w = tiny(name)
    held_out = [batch(w, seed=100 + i) for i in range(8)]
    before = held_out_loss(w, held_out)
    optimizer = torch.optim.Adam(w.model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(80):
        inputs, target = w.make_batch(gen)
        w.loss_fn(w.model(*inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert held_out_loss(w, held_out) < 0.9 * before


@pytest.mark.parametrize("name", [n for n in NAMES if n != "inception"])  # BatchNorm couples
def test_micro_batch_losses_average_to_the_batch_loss(name: str) -> None:
    w = tiny(name)
    inputs, target = batch(w)
    m = w.micro_batches
    with torch.no_grad():
        whole = w.loss_fn(w.model(*inputs), target)
        parts = [
            w.loss_fn(w.model(*xs), t)
            for *xs, t in zip(*(x.chunk(m) for x in inputs), target.chunk(m), strict=True)
        ]
    torch.testing.assert_close(torch.stack(parts).mean(), whole)


@pytest.mark.parametrize("name", NAMES)
def test_paper_preset_traces_quickly_on_meta(name: str) -> None:
    start = time.process_time()  # this process's CPU time: other processes' load adds none
    w = model_module(name).workload("paper")
    gm = trace(w.model, w.example_inputs, leaf_modules=w.leaf_modules)
    # a few seconds on meta at most; materialised, the paper's billions of parameters would
    # take minutes to allocate and initialise (and more memory than a CI machine has)
    assert time.process_time() - start < 10
    assert all(p.is_meta for p in w.model.parameters())
    low, high = PAPER_BYTES[name]
    assert low <= sum(gm.meta["graphpipe"].param_bytes.values()) <= high
    assert w.batch_size % w.micro_batches == 0
    with pytest.raises(ConfigError, match="planning only"):
        batch(w)


@pytest.mark.parametrize("name", NAMES)
def test_options_override_the_preset(name: str) -> None:
    w = tiny(name, **OVERRIDES[name])
    assert OVERRIDES[name].items() <= w.options.items()
    trace(w.model, w.example_inputs, leaf_modules=w.leaf_modules)
    inputs, target = batch(w)
    assert torch.isfinite(w.loss_fn(w.model(*inputs), target))


@pytest.mark.parametrize("name", NAMES)
def test_unknown_preset_and_option_are_named(name: str) -> None:
    factory = model_module(name).workload
    with pytest.raises(ConfigError, match=r"'huge'.*tiny, cpu, paper"):
        factory("huge")
    with pytest.raises(ConfigError, match=r"bogus.*known options: .*batch"):
        factory("tiny", bogus=1)


@pytest.mark.parametrize(
    ("name", "options", "bad"),
    [
        ("mmt", {"batch": 6, "micro_batches": 4}, "batch=6"),
        ("dlrm", {"rows": 0}, "rows=0"),
        ("candle_uno", {"features": (8, -1)}, r"features=\(8, -1\)"),
        ("nbranch", {"heads": 3}, "heads=3"),
        ("inception", {"widths": (2, 8)}, r"widths=\(2, 8\)"),
        ("inception", {"blocks": 1}, "blocks=1"),
        ("vlm", {"frozen": 1}, "frozen=1 must be True or False"),
        ("vlm", {"merge": 3}, "merge=3 does not divide patches=4"),
    ],
)
def test_invalid_option_values_are_named(name: str, options: dict[str, Any], bad: str) -> None:
    with pytest.raises(ConfigError, match=bad):
        tiny(name, **options)


def test_load_workload_finds_a_model_module() -> None:
    w = load_workload("models.mmt", "tiny", branches=3)
    assert isinstance(w, Workload)
    assert w.name == "mmt"
    assert len(w.example_inputs) == 3
