"""The zero-bubble split (input half, then weight half) equals one whole backward.

Each case builds one stage's autograd graph the way the executor does: received values are
leaves that require grad, the roots are the loss and/or the values sent on with their arriving
gradients. The hard cases are those a stage meets on real models: it sends b and f(b) (a
concatenation or a residual across the cut), a weight is used twice on one path, a node with
several outputs feeds a parameter's gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from graphpipe.runtime import backward

D = 6
Case = Callable[[nn.Module, torch.Tensor | None], list[torch.Tensor]]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x))


def _nested(m: Block, x: torch.Tensor | None) -> list[torch.Tensor]:
    """Sends b and a = f(b)."""
    base = x if x is not None else torch.ones(4, D)
    b = m(base)
    return [b, m.b(b)]


def _concat(m: Block, x: torch.Tensor | None) -> list[torch.Tensor]:
    """Sends h and cat(h, g(h)) (Inception/DenseNet-style concatenation across the cut)."""
    base = x if x is not None else torch.ones(4, D)
    h = m.bn(m(base))
    return [h, torch.cat([h, m.b(h)], dim=-1)]


def _residual(m: Block, x: torch.Tensor | None) -> list[torch.Tensor]:
    """Sends h and h + g(norm(h)) (a transformer residual across the cut)."""
    base = x if x is not None else torch.ones(4, D)
    h = m(base) + (base if x is not None else 0)
    return [h, h + m.b(m.norm(h))]


def _twice(m: Block, x: torch.Tensor | None) -> list[torch.Tensor]:
    """One Linear applied twice on one path: its bias accumulator has two parents in N."""
    base = x if x is not None else torch.ones(4, D)
    return [m.a(torch.tanh(m.a(base)))]


def _multi_output(m: Block, x: torch.Tensor | None) -> list[torch.Tensor]:
    """A split of (input + weight): one node with two outputs feeds the weight's gradient."""
    base = x if x is not None else torch.ones(4, D)
    left, right = (base @ m.a.weight).split(3, dim=-1)
    return [left * 2, right.exp()]


def _cross(m: Block, x: torch.Tensor | None) -> list[torch.Tensor]:
    """A decoder's residual around cross-attention: h, made from weights only, plus g(norm(h))
    times the received x (T5's decoder in a stage that receives the encoder's output): the
    sum's node reaches h's node directly and again through the product with x."""
    h = m(torch.ones(4, D))
    other = x if x is not None else torch.ones(4, D)
    return [h + m.b(m.norm(h)) * other]


CASES = {
    "cross": _cross,
    "nested": _nested,
    "concat": _concat,
    "residual": _residual,
    "twice": _twice,
    "multi_output": _multi_output,
}


def _run(case: Case, received: bool, loss: bool, split: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, D, requires_grad=True) if received else None
    outs = case(model, x)
    gen = torch.Generator().manual_seed(1)
    roots: list[torch.Tensor] = []
    seeds: list[torch.Tensor | None] = []
    for out in outs:
        roots.append(out)
        seeds.append(torch.randn(out.shape, generator=gen))
    if loss:
        roots.append(sum(o.pow(2).mean() for o in outs))  # type: ignore[arg-type]
        seeds.append(None)
    params = list(model.parameters())
    if split:
        _, half = backward.input_half(roots, seeds, [x] if x is not None else [], params)
        backward.weight_half(half)
    else:
        backward.full(roots, seeds)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if x is not None:
        grads["input"] = x.grad
    return grads


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("received", [False, True], ids=["first_stage", "middle_stage"])
@pytest.mark.parametrize("loss", [False, True], ids=["sends", "sends_and_loss"])
def test_split_equals_whole_backward(name: str, received: bool, loss: bool) -> None:
    whole = _run(CASES[name], received, loss, split=False)
    split = _run(CASES[name], received, loss, split=True)
    assert whole.keys() == split.keys()
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], rtol=1e-6, atol=1e-7, msg=key)


def test_input_half_defers_the_weight_gradients() -> None:
    """After the input half, parameters have no gradient yet; the input has its gradient."""
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, D, requires_grad=True)
    outs = _residual(model, x)
    seeds: list[torch.Tensor | None] = [torch.ones_like(o) for o in outs]
    backward.input_half(outs, seeds, [x], list(model.parameters()))
    assert x.grad is not None
    assert all(p.grad is None for p in model.parameters())


class Shared(nn.Module):
    """Two offsets summed (the engine hands both one gradient tensor) and a weight sent on
    transposed (its gradient is a view of the arriving seed), as a tied head's weight is."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, D))
        self.b = nn.Parameter(torch.randn(4, D))
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.tanh(x) + self.a + self.b, self.w.t()]


def _shared(
    split: bool, micro_batches: int, received: bool = True
) -> tuple[Shared, list[torch.Tensor]]:
    """Micro-batches' backwards through `Shared`, whole or split (its input needing a
    gradient if `received`); returns the last seeds."""
    torch.manual_seed(0)
    model = Shared()
    gen = torch.Generator().manual_seed(1)
    for _ in range(micro_batches):
        x = torch.randn(4, D, requires_grad=received)
        roots = model(x)
        seeds: list[torch.Tensor | None] = [torch.randn(r.shape, generator=gen) for r in roots]
        kept = [s.clone() for s in seeds if s is not None]
        if split:
            inputs = [x] if received else []
            _, half = backward.input_half(roots, seeds, inputs, list(model.parameters()))
            backward.weight_half(half)
        else:
            backward.full(roots, seeds)
        for s, k in zip(seeds, kept, strict=True):
            torch.testing.assert_close(s, k)  # the seeds were only read
    return model, [s for s in seeds if s is not None]


@pytest.mark.parametrize("received", [True, False], ids=["middle_stage", "first_stage"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_weight_half_gives_each_gradient_its_own_storage(
    micro_batches: int, received: bool
) -> None:
    """After the split, no `.grad` shares memory with another or with a seed, so adding the
    next micro-batch in place, or clipping one gradient, changes that gradient only (on a
    first stage the engine accumulates, as in the whole backward)."""
    whole, _ = _shared(split=False, micro_batches=micro_batches, received=received)
    split, seeds = _shared(split=True, micro_batches=micro_batches, received=received)
    grads = {n: p.grad for n, p in split.named_parameters()}
    assert all(g is not None for g in grads.values())
    ptrs = [t.untyped_storage().data_ptr() for t in [*grads.values(), *seeds] if t is not None]
    assert len(set(ptrs)) == len(ptrs)
    for n, p in whole.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-6, atol=1e-7, msg=n)
    before = {n: g.clone() for n, g in grads.items() if g is not None}
    split.a.grad.mul_(0.5)  # type: ignore[union-attr]  # as a clip does
    torch.testing.assert_close(split.b.grad, before["b"])


class _WeightGrads(TorchDispatchMode):
    """Records each matmul whose result has a parameter's shape (or its transpose): a weight
    gradient computed."""

    def __init__(self, shapes: dict[tuple[int, ...], str], events: list[str]) -> None:
        super().__init__()
        self.shapes, self.events = shapes, events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            for shape in (tuple(out.shape), tuple(reversed(out.shape))):
                if shape in self.shapes:
                    self.events.append(f"computed {self.shapes[shape]}")
        return out


@pytest.mark.parametrize("received", [True, False], ids=["middle_stage", "first_stage"])
def test_weight_half_adds_each_layers_gradient_before_computing_the_next(received: bool) -> None:
    """A chain of Linears: each layer's weight gradient is added into `.grad` (`on_grad`)
    before the next layer's is computed, as the whole backward does; the weight half does not
    hold every layer's at once (tens of MB a micro-batch on a real stage). On a first stage
    (no input needs a gradient: no boundary) as on a middle one."""
    torch.manual_seed(0)
    widths = [3, 4, 5, 6]
    chain = nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(widths)])
    x = torch.randn(2, widths[0], requires_grad=received)
    y = chain(x)
    shapes = {tuple(m.weight.shape): name for name, m in chain.named_children()}
    names = {id(m.weight): name for name, m in chain.named_children()}
    events: list[str] = []
    inputs = [x] if received else []
    _, half = backward.input_half([y], [torch.ones_like(y)], inputs, list(chain.parameters()))
    assert bool(half.boundaries) == received
    assert all(b.own for b in half.boundaries)  # each Linear owns its weight and bias
    with _WeightGrads(shapes, events):
        backward.weight_half(
            half, lambda p: events.append(f"added {names[id(p)]}") if id(p) in names else None
        )
    layers = [e.removeprefix("computed ") for e in events[::2]]
    assert sorted(layers) == ["0", "1", "2"]
    assert events == [f"{what} {n}" for n in layers for what in ("computed", "added")]


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_first_stage_weight_half_over_a_parameter_that_is_no_leaf_adds_it_by_hand() -> None:
    """No hook can be put on a tensor made in the graph (a weight version computed from
    another), so such a weight half adds its gradient by hand, as a middle stage's does."""
    torch.manual_seed(0)
    base = torch.randn(D, D, requires_grad=True)
    x = torch.randn(4, D)  # needs no gradient: no input half, no boundary
    seed = torch.randn(4, D)
    w = base * 1  # not a leaf
    y = torch.tanh(x @ w)
    added: list[torch.Tensor] = []
    _, half = backward.input_half([y], [seed], [], [w])
    backward.weight_half(half, added.append)
    w2 = base * 1
    (expected,) = torch.autograd.grad([torch.tanh(x @ w2)], [w2], [seed])
    assert len(added) == 1 and added[0] is w
    torch.testing.assert_close(w.grad, expected)
    assert base.grad is None  # the call stopped at the weight it was given
