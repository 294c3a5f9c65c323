"""Shape-changing batches on CPU: 2 processes, one thread each, gloo on 127.0.0.1.

    python -m benchmarks.shapes             # about two minutes on 2 cores

Two models, M = 4 micro-batches, 1f1b, SGD:

- gpt2: Hugging Face GPT-2 (random weights: 4 layers, width 128, 8 sequences), traced by
  torch.export, compiled at length 128 and stepped at length 96;
- cnn: a BatchNorm CNN (Inception-style blocks, 16 images), traced by torch.fx, compiled at
  32 x 32 pixels and stepped at 24 x 24.

Per model: the median step over STEPS steps after WARMUP, at the new shape, in the pipeline
compiled at the larger shape (`repeated new shape`), against a pipeline compiled at the new
shape itself (`fixed shape`), both with the same stage cut (pinned); and the first step at
the new shape, which makes its stages (for an exported graph: the export at that shape, its
check and its carving; for an fx graph: a fake-tensor run for the message shapes), against
that pipeline's step.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from benchmarks._common import log, machine, ratio
from graphpipe.compile import compile as pipeline
from graphpipe.runtime.launch import launch

M, WARMUP, STEPS = 4, 3, 20


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=512, n_embd=128, n_layer=4, n_head=4, n_positions=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _tokens(length: int) -> tuple[dict[str, Any], torch.Tensor]:
    ids = torch.randint(3, 512, (8, length))
    return {"input_ids": ids, "use_cache": False}, torch.randint(3, 512, (8, length))


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(c, c, 1), nn.BatchNorm2d(c), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], dim=1)


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(_Block(16), _Block(32), nn.Conv2d(64, 16, 1))
        self.head = nn.Linear(16, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(image)).mean(dim=(2, 3)))


def _images(side: int) -> tuple[dict[str, Any], torch.Tensor]:
    return {"image": torch.randn(16, 3, side, side)}, torch.randint(0, 10, (16,))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], Any, int, int]] = {
    # name: build, batch at a size, loss, compiled size, new size
    "gpt2": (_gpt2, _tokens, _lm_loss, 128, 96),
    "cnn": (_Cnn, _images, F.cross_entropy, 32, 24),
}
PINS = {  # one cut at both shapes, so the ratio is the runtime's, not another plan's
    "gpt2": {"transformer.h.0": 0, "transformer.h.1": 0, "transformer.h.2": 1},
    "cnn": {"stem": 0, "blocks.0": 0, "blocks.1": 1},
}


def _timed(pm: Any, batch: tuple[dict[str, Any], torch.Tensor]) -> float:
    inputs, target = batch
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    start = time.perf_counter()
    pm.step(**tensors, target=target)
    return time.perf_counter() - start


def _compiled(name: str, size: int) -> Any:
    build, batch, loss, _, _ = MODELS[name]
    torch.manual_seed(0)
    example, _ = batch(size)
    return pipeline(
        build(),
        example,
        loss_fn=loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        micro_batches=M,
        schedule="1f1b",
        pins=PINS[name],
    )


def _worker(name: str) -> dict[str, float]:
    """The fixed-shape pipeline's step, and the larger pipeline's first and later steps at
    the new shape (seconds). The two pipelines' steps alternate, so a change in the load of
    the machine reaches both alike."""
    _, batch, _, large, small = MODELS[name]
    torch.manual_seed(1)
    fixed = _compiled(name, small)
    changing = _compiled(name, large)
    for _ in range(WARMUP):
        _timed(fixed, batch(small))
        _timed(changing, batch(large))
    first = _timed(changing, batch(small))
    times: dict[str, list[float]] = {"fixed": [], "repeated": []}
    for _ in range(WARMUP + STEPS):
        times["fixed"].append(_timed(fixed, batch(small)))
        times["repeated"].append(_timed(changing, batch(small)))
    return {k: statistics.median(v[WARMUP:]) for k, v in times.items()} | {"first": first}


def report() -> str:
    """The section for BENCHMARKS.md."""
    rows = []
    for name, (_, _, _, large, small) in MODELS.items():
        log(f"shapes: {name}")
        r = launch(_worker, 2, args=(name,), timeout=600)[0]
        rows.append(
            [
                name,
                f"{large} -> {small}",
                f"{r['fixed'] * 1e3:.1f} ms",
                f"{r['repeated'] * 1e3:.1f} ms",
                ratio(r["repeated"], r["fixed"]),
                f"{r['first'] * 1e3:.0f} ms ({ratio(r['first'], r['fixed'])})",
            ]
        )
    table = tabulate(
        rows,
        headers=[
            "model",
            "compiled -> stepped",
            "fixed shape",
            "repeated new shape",
            "ratio",
            "first step at the new shape",
        ],
        tablefmt="github",
    )
    return (
        "## Shape-changing batches: 2 CPU processes, one thread each\n\n"
        f"{machine()}. `python -m benchmarks.shapes`. Median step of {STEPS} after {WARMUP} "
        f"warm-up steps, M = {M}, 1f1b: at the new shape in the pipeline compiled at the "
        "larger one, against a pipeline compiled at the new shape with the same (pinned) cut; "
        "and the first step at the "
        "new shape (it makes that shape's stages: an export for GPT-2, a fake-tensor run for "
        "the CNN).\n\n"
        f"{table}\n"
    )


if __name__ == "__main__":
    print(report())
    sys.exit(0)
