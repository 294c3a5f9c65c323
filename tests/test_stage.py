"""Stage modules carved from the trace (`graphpipe.runtime.stage`): a received value the
stage writes in place is cloned first, so a cut right before `nn.ReLU(inplace=True)` (as
torchvision's CNNs have after every convolution) trains as one process."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.planning.partition import plan
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch
from graphpipe.runtime.stage import build_stage
from graphpipe.tracing.tracer import trace

M, STEPS = 2, 3
PINS = {"0": 0, "1": 1, "2": 1, "3": 1, "4": 1, "5": 1}  # stage 1 starts with the ReLU
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class Written(nn.Module):
    """Writes its input in place through a view, then adds in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.view(-1).mul_(2.0)
        x += 1.0
        return x


def cnn() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Flatten(),
            nn.Linear(4 * 6 * 6, 3),
        )


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 6, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = cnn()
    opt = SGD(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        total = 0.0
        for j in range(M):
            loss = F.cross_entropy(model(x.chunk(M)[j]), y.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _worker() -> dict[str, object]:
    pm = gp_compile(
        cnn(),
        (data(0)[0],),
        loss_fn=F.cross_entropy,
        optimizer=SGD,
        micro_batches=M,
        pins=PINS,
        runtime=RuntimeConfig(timeout=60, quiet=True),
    )  # the default (measured) profile: its in-place ops are timed on copies
    losses = [pm.step(data(s)[0], target=data(s)[1]) for s in range(STEPS)]
    return {"losses": losses, "state": pm.state_dict()}


def test_a_cut_before_an_in_place_relu_trains_as_one_process() -> None:
    ref_losses, ref_state = _reference()
    for rank, result in enumerate(launch(_worker, 2, timeout=240)):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        for name, value in ref_state.items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", [cnn(), nn.Sequential(nn.Linear(4, 4), Written(), nn.Tanh())])
def test_a_received_value_written_in_place_is_cloned_and_no_other(model: nn.Module) -> None:
    names = [name for name, _ in model.named_children()]
    pins = {name: int(name != names[0]) for name in names}
    x = torch.randn(4, 3, 6, 6) if isinstance(model[0], nn.Conv2d) else torch.randn(4, 4)
    gm = trace(model, (x,), micro_batch_size=2)
    made = plan(model, (x,), devices=2, micro_batches=2, pins=pins,
                profile=ProfileConfig(mode="flops"))  # fmt: skip
    first, _ = build_stage(gm, made, 0)
    second, io = build_stage(gm, made, 1)
    clones = [n for n in second.graph.nodes if n.op == "call_method" and n.target == "clone"]
    assert [c.args[0].target for c in clones] == list(io.received)
    assert not any(n.target == "clone" for n in first.graph.nodes)  # it writes none
    sent = first(x[:2])
    leaves = [sent[name].detach().requires_grad_() for name in io.received]
    second(*leaves)["__output__"].sum().backward()  # no in-place write to a leaf
    assert all(leaf.grad is not None for leaf in leaves)
