"""A zoo of small models with the shapes that make pipelining hard, shared by the tests.

Each factory returns (model, example_inputs). Sizes are tiny; no dropout; weights are seeded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Factory = Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
D = 16  # hidden width of every zoo model
B = 8  # example batch size


def _seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class TwoBranch(nn.Module):
    """x -> (branch a | branch b) -> concat -> head: a symmetric two-branch model."""

    def __init__(self, width: int = D, depth: int = 3) -> None:
        super().__init__()
        self.a = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        )
        self.b = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        )
        self.head = nn.Linear(2 * width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(x), self.b(x)], dim=-1))  # (B, 4)


class SkipAcross(nn.Module):
    """A chain of four layers whose first output is also added after the last (a long skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.layers[0](x))
        h = h0
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return self.head(h + h0)


class LateInput(nn.Module):
    """The second input is consumed only by the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, late: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x) * late)


class Tied(nn.Module):
    """Token embedding whose weight is reused by the output projection (tied weights)."""

    def __init__(self, vocab: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)])
        self.out = nn.Linear(D, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.embed(tokens)).mean(dim=1))  # (B, vocab)


class MultiOutput(nn.Module):
    """Two heads on different branches, returned as a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(D, D)
        self.left = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 3))
        self.right = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 2))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return {"left": self.left(h), "right": self.right(h)}


class Masked(nn.Module):
    """Integer tokens and a boolean mask that cross the graph without gradients."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.bag = nn.EmbeddingBag(vocab, D, mode="sum")
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, 4)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        reversed_ids = tokens.flip(1)  # int64, made early, read by the last layer
        keep = mask.logical_not()  # bool, made early, read later
        h = torch.tanh(self.mix(self.embed(tokens)))  # (B, T, D)
        h = h.masked_fill(keep.logical_not().unsqueeze(-1), 0.0)
        return self.head(h.sum(dim=1) + self.bag(reversed_ids))


def two_branch() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(TwoBranch), (_x(B, D),)


def skip_across() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(SkipAcross), (_x(B, D),)


def late_input() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(LateInput), (_x(B, D), _x(B, D, seed=2))


def tied() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    tokens = torch.randint(0, 12, (B, 5), generator=torch.Generator().manual_seed(3))
    return _seeded(Tied), (tokens,)


def multi_output() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(MultiOutput), (_x(B, D),)


def masked() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 10, (B, 6), generator=gen)
    mask = torch.rand(B, 6, generator=gen) > 0.7
    return _seeded(Masked), (tokens, mask)


ZOO: dict[str, Factory] = {
    "two_branch": two_branch,
    "skip_across": skip_across,
    "late_input": late_input,
    "tied": tied,
    "multi_output": multi_output,
    "masked": masked,
}


def dict_loss(out: dict[str, torch.Tensor] | torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE against `target` for one output, or for the sum of every output's mean."""
    if isinstance(out, dict):
        pooled = sum(v.mean(dim=-1, keepdim=True) for v in out.values())
        return F.mse_loss(pooled.expand_as(target), target)  # type: ignore[union-attr]
    return F.mse_loss(out, target)
