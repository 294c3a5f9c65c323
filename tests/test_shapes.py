"""Batches whose shapes change train exactly as one process does (issue 27).

GPT-2 and Llama (tiny, Hugging Face, traced by torch.export; Llama's rows packed with two
sequences each, by position_ids) are compiled at 12 rows of length 32 and stepped at lengths
16, 24, 32 and 20, with 8 rows (fewer than compiled) and once 10 rows (3, 3, 2, 2 per
micro-batch, as torch.tensor_split cuts them); BERT likewise (up to length 30), with a
padding mask of each batch's length; an Inception-style CNN with BatchNorm (traced by
torch.fx) at images of 6 and 8 pixels, also with 10 rows once; a chain of four exported
blocks at GPT-2's lengths. Under 1f1b, zb and graph_interleaved (stages of a DAG folded,
several per rank) at 2 ranks, Megatron's interleaved (the chain, two stages per rank), and
1f1b at 3, the losses and every parameter equal single-process gradient accumulation over
the same micro-batches, each micro-batch's loss weighted by its share of the rows; under 2bw
(the CNN, and an exported GPT-2 with a head of its own) they equal 2BW's recurrence, under
stash (that GPT-2) PipeDream's, under PipeMare (that GPT-2 with its correction, the CNN
without) PipeMare's, whose backward runs each stage again at its micro-batch's shapes
(BatchNorm's statistics updated by the forward only). The plan is
never remade: the stage cut stays as compiled. A shape seen before reuses its stages; a
model whose shapes depend on values is refused at compile, naming the op; a batch beyond the
compiled example, or beyond `max_shapes` (at which the plan's memory is then planned), is
refused before any communication.

Each world size is one launch running every case, to pay the process start-up once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from real_models import CASES, Case, V, optimizer
from torch import fx, nn

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError, GraphPipeError, ScheduleError
from graphpipe.ir import Plan, Schedule, parse_ranks
from graphpipe.planning.partition import plan
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch
from graphpipe.runtime.shapes import Shapes, check_max_shapes, signature_of
from graphpipe.runtime.spec import RunSpec
from graphpipe.runtime.stage import OUTPUT, StageIO, build_stage, micro_shapes, model_output
from graphpipe.runtime.weights import PolicyOptions
from graphpipe.scheduling.dryrun import check_run, check_shapes
from graphpipe.scheduling.generators import warmups
from graphpipe.tracing.tracer import trace, trace_info

M = 4
ROWS = (12, 8, 8, 10, 8)  # the example's 12, a smaller batch, and 10 rows: 3, 3, 2, 2
LENGTHS = (16, 24, 32, 20)  # the example's length is the largest, 32
SIDES = (6, 6, 8, 8)  # image sides; the example's is 8
TIMEOUT = 240

Batches = list[tuple[dict[str, torch.Tensor], torch.Tensor]]


def _lm_batches(rows: tuple[int, ...], lengths: tuple[int, ...]) -> Batches:
    """One (inputs, target) per step: rows[i] sequences of lengths[i] tokens."""
    out = []
    for step, (b, n) in enumerate(zip(rows, lengths, strict=True)):
        gen = torch.Generator().manual_seed(200 + step)
        ids = torch.randint(3, V, (b, n), generator=gen)
        out.append(({"input_ids": ids}, torch.randint(3, V, (b, n), generator=gen)))
    return out


def _packed_batches(rows: tuple[int, ...], lengths: tuple[int, ...]) -> Batches:
    """Packed sequences: each row holds two sequences, its position ids restarting at the
    second (at a row-dependent point), with `_lm_batches`' tokens and targets."""
    out = []
    for (inputs, target), b, n in zip(_lm_batches(rows, lengths), rows, lengths, strict=True):
        starts = torch.arange(b) % (n // 2) + n // 4  # where each row's second sequence starts
        columns = torch.arange(n).expand(b, n)
        positions = torch.where(columns < starts[:, None], columns, columns - starts[:, None])
        out.append(({**inputs, "position_ids": positions}, target))
    return out


def _masked_batches(rows: tuple[int, ...], lengths: tuple[int, ...]) -> Batches:
    """BERT's: tokens with a padding mask of each batch's length (its last two columns
    padded at random), and a target per token."""
    out = []
    for step, (b, n) in enumerate(zip(rows, lengths, strict=True)):
        gen = torch.Generator().manual_seed(400 + step)
        ids = torch.randint(3, V, (b, n), generator=gen)
        mask = torch.ones(b, n, dtype=torch.long)
        mask[:, n - 2 :] = (torch.rand(b, 2, generator=gen) > 0.5).long()
        out.append(({"input_ids": ids, "attention_mask": mask}, torch.randn(b, n, generator=gen)))
    return out


def _image_batches(rows: tuple[int, ...], sides: tuple[int, ...]) -> Batches:
    out = []
    for step, (b, side) in enumerate(zip(rows, sides, strict=True)):
        gen = torch.Generator().manual_seed(300 + step)
        image = torch.randn(b, 3, side, side, generator=gen)
        out.append(({"image": image}, torch.randint(0, 5, (b,), generator=gen)))
    return out


def _untied_gpt2() -> nn.Module:
    """Tiny GPT-2 with an output projection of its own: the asynchronous policies refuse a
    weight tied across ranks, as GPT-2's embedding and head are."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=False,
        )  # fmt: skip
        return GPT2LMHeadModel(config)


class _Mix(nn.Module):
    """Mixes neighbouring positions when there are several (control flow on a shape, which
    torch.fx cannot trace: torch.export does, writing the reshapes' sizes as literals)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[1] > 1:
            h = h + h.roll(1, dims=1)
        return torch.tanh(self.mix(h.reshape(-1, 8))).reshape(h.shape[0], h.shape[1], 8)


class Blocks(nn.Module):
    """A chain of four modules over a sequence (B, L, 4) -> (B, 3), exported."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Linear(4, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList([_Mix(), _Mix()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).mean(1)


def _blocks() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Blocks()


def _sequence_batches(rows: tuple[int, ...], lengths: tuple[int, ...]) -> Batches:
    out = []
    for step, (b, n) in enumerate(zip(rows, lengths, strict=True)):
        gen = torch.Generator().manual_seed(500 + step)
        out.append(({"x": torch.randn(b, n, 4, generator=gen)}, torch.randn(b, 3, generator=gen)))
    return out


MODELS: dict[str, Case] = {
    **CASES,
    "gpt2_untied": replace(CASES["gpt2"], build=_untied_gpt2),
    "blocks": replace(CASES["gpt2"], build=_blocks, loss=F.mse_loss, constants={}),
}
# PipeMare, by the name a case gives it: with its fixes (at two ranks tau = max(w_i, 1) is 1,
# so the rate's rescheduling changes nothing; the correction w - w_i * delta does, on stage 0)
# and without (the backward then recomputes on the live parameters, not on corrected copies)
PIPEMARE = {
    "pipemare": PolicyOptions(warmup_updates=8, ema=0.8),
    "pipemare_plain": PolicyOptions(lr_reschedule=False, correction=False),
}
POLICIES = ("2bw", "stash", *PIPEMARE)  # a "schedule" of a run that names a weight policy

# name -> (model case, the batches of its steps; the first is the compiled example, 12 rows)
RUNS: dict[str, tuple[str, Callable[[], Batches]]] = {
    "gpt2": ("gpt2", lambda: _lm_batches(ROWS, (32, *LENGTHS))),
    # the asynchronous policies on an exported model: 8 rows at lengths 16, then 24
    "gpt2_untied": ("gpt2_untied", lambda: _lm_batches((12, 8, 8), (32, 16, 24))),
    "llama": ("llama", lambda: _packed_batches(ROWS, (32, *LENGTHS))),
    # at its maximum length 32 BERT's export slices none of its position ids: another graph
    "bert": ("bert", lambda: _masked_batches(ROWS, (30, 16, 24, 30, 20))),
    "cnn": ("inception", lambda: _image_batches((12, 8, 10, 8, 8), (8, *SIDES))),
    "blocks": ("blocks", lambda: _sequence_batches(ROWS, (32, *LENGTHS))),
}


FLOPS = ProfileConfig(mode="flops")  # the same plan every run (measured times vary)
CHAIN_PINS = {"embed": 0, "blocks.0": 1, "blocks.1": 2, "out": 3}  # 4 stages, for interleaved


def _compiled(run: str, schedule: str) -> Any:
    """The run's model compiled at its first batch (a schedule in POLICIES: that weight
    policy, with the schedule it runs by default)."""
    case_name, batches = RUNS[run]
    case = MODELS[case_name]
    example, _ = batches()[0]
    options: dict[str, Any] = {"replication": False}
    if schedule == "graph_interleaved":  # stages of a DAG folded onto the ranks: FLOP
        options.update(interleave=True, profile=FLOPS)  # costs, so that it folds
    if schedule == "interleaved":  # Megatron's: a chain of 4 stages, 2 per rank, looped
        options.update(virtual_stages=2, placement="loop", pins=CHAIN_PINS)
    if schedule in PIPEMARE:
        options.update(weights="pipemare", weight_options=PIPEMARE[schedule])
    elif schedule in POLICIES:
        options["weights"] = schedule
    else:
        options["schedule"] = schedule
    return gp_compile(
        case.build(),
        {**example, **case.constants},
        loss_fn=case.loss,
        optimizer=optimizer,
        micro_batches=M,
        runtime=RuntimeConfig(timeout=120),
        **options,
    )


def _refusals(pm: Any) -> list[str]:
    """Steps refused before any communication (the CNN's): an image larger than the
    example, fewer rows than micro-batches, another dtype."""
    x, y = torch.randn(8, 3, 10, 10), torch.randint(0, 5, (8,))
    calls = [
        lambda: pm.step(image=x, target=y),
        lambda: pm.step(image=x[:3, :, :8, :8], target=y[:3]),
        lambda: pm.step(image=x[:, :, :8, :8].double(), target=y),
    ]
    texts = []
    for call in calls:
        try:
            call()
        except ConfigError as err:
            texts.append(str(err))
    return texts


def _pipelined(run: str, schedule: str) -> dict[str, Any]:
    pm = _compiled(run, schedule)
    steps = RUNS[run][1]()
    refused = _refusals(pm) if (run, schedule) == ("cnn", "1f1b") else []
    losses = [pm.step(**inputs, target=target) for inputs, target in steps[1:]]
    state = pm.state_dict()
    signatures = len(pm._stepper.inputs.stages.seen)  # the shapes the steps made
    evaluated = None
    if (run, schedule) == ("gpt2", "1f1b"):  # forward only at a shape not trained at
        inputs, target = _lm_batches((10,), (12,))[0]
        evaluated = (pm.eval_step(**inputs, target=target), pm(**inputs).logits)
    executor = pm._executor
    return {
        "losses": losses,
        "state": state if pm.rank == 0 else None,
        "signatures": signatures,
        "stages": len(pm.plan.stages),
        "method": trace_info(pm._stepper.inputs.gm).method,
        "activations": sum(s.activation_bytes for s in pm.plan.stages),
        "refused": refused,
        "evaluated": evaluated,
        "warmups": warmups(pm.plan),
        "plan": pm.plan,
        "where": {  # parameter -> the stage holding it, this rank's
            n: i for i in pm._stage_indices for n, _ in executor.stages[i].module.named_parameters()
        },
    }


class ValueShaped(nn.Module):
    """Keeps the rows whose first feature is positive: a shape that depends on values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        kept = h[h[:, 0] > 0]  # boolean-mask indexing: aten.nonzero underneath
        return self.b(kept).sum(0, keepdim=True).expand(x.shape[0], 4)


def _value_shaped() -> str:
    """The refusal at compile of a model whose shapes depend on values ('' if none)."""
    try:
        gp_compile(
            ValueShaped(),
            torch.randn(8, 4),
            loss_fn=F.mse_loss,
            optimizer=optimizer,
            micro_batches=M,
            pins={"a": 0, "b": 1},
            runtime=RuntimeConfig(timeout=60),
        )
    except GraphPipeError as err:
        return str(err)
    return ""


def _micro_batches(
    batch: tuple[dict[str, torch.Tensor], torch.Tensor],
) -> list[tuple[dict[str, torch.Tensor], torch.Tensor, float]]:
    """The batch's M micro-batches as torch.tensor_split cuts them: inputs, target, and the
    share of the batch's rows."""
    inputs, target = batch
    return [
        (
            {k: v.tensor_split(M)[j] for k, v in inputs.items()},
            target.tensor_split(M)[j],
            target.tensor_split(M)[j].shape[0] / target.shape[0],
        )
        for j in range(M)
    ]


def _loss_grads(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    case: Case,
    inputs: dict[str, Any],
    target: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch at `weights`, and its gradient (zero where unused)."""
    leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
    out = torch.func.functional_call(model, leaves, (), {**inputs, **case.constants})
    loss = case.loss(out, target)
    found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    zeros = {n: torch.zeros_like(w) for n, w in weights.items()}  # BERT's pooler: unused
    return loss.detach(), {
        n: zeros[n] if g is None else g for n, g in zip(leaves, found, strict=True)
    }


def _grads_at(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    case: Case,
    batch: tuple[dict[str, torch.Tensor], torch.Tensor],
) -> tuple[float, dict[str, torch.Tensor]]:
    """The batch's loss and gradient at `weights`, accumulated over its micro-batches (each
    loss weighted by its rows' share)."""
    total, grads = 0.0, {n: torch.zeros_like(w) for n, w in weights.items()}
    for inputs, target, share in _micro_batches(batch):
        loss, found = _loss_grads(model, weights, case, inputs, target)
        for n, g in found.items():
            grads[n] += g * share
        total += loss.item() * share
    return total, grads


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _step(model: nn.Module, opt: torch.optim.Optimizer, grads: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        p.grad = grads[n]
    opt.step()
    opt.zero_grad()


def _fresh(run: str) -> tuple[Case, Batches, nn.Module, torch.optim.Optimizer]:
    """The run's case, its batches, a fresh model and its optimizer."""
    case_name, batches = RUNS[run]
    case = MODELS[case_name]
    model = case.build()
    return case, batches(), model, optimizer(model.parameters())


def _reference(run: str, delay: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, each step's gradient at the weights of `delay` updates before: 0 is
    gradient accumulation; 1 is PipeDream-2BW's W(t+1) = W(t) - step(grad f(W(t-1)))."""
    case, batches, model, opt = _fresh(run)
    history, losses = [_snapshot(model)], []
    for batch in batches[1:]:
        loss, grads = _grads_at(model, history[max(0, len(history) - 1 - delay)], case, batch)
        _step(model, opt, grads)
        history.append(_snapshot(model))
        losses.append(loss)
    return losses, model.state_dict()


def _stash_reference(
    run: str, where: dict[str, int], warm: dict[int, int]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, PipeDream's rule: micro-batch j (counted over the steps) reads each
    parameter at the weights after max(0, j - w_i) updates of its stage i, and is an update
    of its own (its loss unscaled); a step's loss weights its micro-batches by their rows.
    One SGD over every stage: it updates each parameter by itself."""
    case, batches, model, opt = _fresh(run)
    history, losses = [_snapshot(model)], []
    for batch in batches[1:]:
        total = 0.0
        for inputs, target, share in _micro_batches(batch):
            j = len(history) - 1
            weights = {n: history[max(0, j - warm[where[n]])][n] for n in history[0]}
            loss, grads = _loss_grads(model, weights, case, inputs, target)
            _step(model, opt, grads)
            history.append(_snapshot(model))
            total += loss.item() * share
        losses.append(total)
    return losses, model.state_dict()


Stages = tuple[fx.GraphModule, dict[int, tuple[nn.Module, StageIO]]]


def _stages_at(model: nn.Module, case: Case, the_plan: Plan, inputs: dict[str, Any]) -> Stages:
    """The model traced at one micro-batch (an exported graph then holds its shapes), cut
    into the plan's stages."""
    rows = next(iter(inputs.values())).shape[0]
    gm = trace(model, {**inputs, **case.constants}, micro_batch_size=rows)
    return gm, {s.index: build_stage(gm, the_plan, s.index) for s in the_plan.stages}


def _delayed_forward(
    stages: Stages, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]
) -> tuple[Any, dict[int, list[Any]]]:
    """The stages run in order without a graph, each parameter at `weights`: the model's
    output, and each stage's inputs."""
    gm, modules = stages
    info = trace_info(gm)
    values = {n: inputs[str(src)] for src, n in zip(info.sources, info.input_names, strict=True)}
    saved = {}
    for i, (module, io) in sorted(modules.items()):
        saved[i] = [values[n] for n in io.inputs]
        w = {n: weights[n] for n, _ in module.named_parameters()}
        with torch.no_grad():
            values.update(torch.func.functional_call(module, w, tuple(saved[i])))
    return model_output(gm, values[OUTPUT]), saved


def _recomputed_backward(
    stages: Stages,
    saved: dict[int, list[Any]],
    weights: dict[str, torch.Tensor],
    loss: Callable[[Any], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Last stage first, each stage run again on its saved inputs at `weights` (its
    buffers' updates on copies: the forward made them), from its later stages' input
    gradients (the last stage from the loss, unscaled): every parameter's gradient (zero
    where unused)."""
    gm, modules = stages
    into: dict[str, torch.Tensor] = {}  # value -> the gradient its consumers sent back
    grads: dict[str, torch.Tensor] = {}
    for i, (module, io) in sorted(modules.items(), reverse=True):
        w = {n: weights[n].detach().requires_grad_() for n, _ in module.named_parameters()}
        args = [
            v.detach().requires_grad_() if n in io.received and v.is_floating_point() else v
            for n, v in zip(io.inputs, saved[i], strict=True)
        ]
        kept = {n: b.clone() for n, b in module.named_buffers()}  # updated by the forward
        out = torch.func.functional_call(module, {**w, **kept}, tuple(args))
        roots = [out[n] for n in io.sent if n in into]
        seeds = [into[n] for n in io.sent if n in into]
        if io.has_output:
            roots.append(loss(model_output(gm, out[OUTPUT])))
            seeds.append(torch.ones(()))
        torch.autograd.backward(roots, seeds)
        for n, a in zip(io.inputs, args, strict=True):
            if isinstance(a, torch.Tensor) and a.grad is not None:
                into[n] = into[n] + a.grad if n in into else a.grad
        grads |= {n: torch.zeros_like(t) if t.grad is None else t.grad for n, t in w.items()}
    return grads


def _rates(
    opt: torch.optim.Optimizer, rates: list[float], warm: list[int], j: int, fixes: PolicyOptions
) -> None:
    """Each stage's group at its rate times 1 / tau^(1 - min(j/K, 1)), tau = max(w_i, 1),
    when rescheduled (else at its rate)."""
    done = min(j / fixes.warmup_updates, 1.0) if fixes.lr_reschedule else 1.0
    for group, rate, w in zip(opt.param_groups, rates, warm, strict=True):
        group["lr"] = rate / max(w, 1) ** (1.0 - done)


def _pipemare_reference(
    run: str, schedule: str, the_plan: Plan, where: dict[str, int], warm: dict[int, int]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, PipeMare's rule: micro-batch j (counted over the steps) runs forward with
    no graph, stage i at the weights after max(0, j - w_i) updates; its backward runs each
    stage again on the input that forward gave it, at the live weights (j updates) less
    w_i * delta_i under the correction, delta_i the moving average of stage i's steps. Every
    micro-batch is an update (its loss unscaled; `_rates`). A step's loss weights its
    micro-batches' forward losses by their rows. The stages at a micro-batch's shapes: the
    model traced at them, cut by the plan."""
    case_name, batches = RUNS[run]
    case, fixes = MODELS[case_name], PIPEMARE[schedule]
    model = case.build()
    order = sorted(warm)  # one parameter group per stage, each at its own rate
    opt = optimizer(
        [{"params": [p for n, p in model.named_parameters() if where[n] == i]} for i in order]
    )
    rates = [group["lr"] for group in opt.param_groups]
    history, losses = [_snapshot(model)], []
    delta = {n: torch.zeros_like(w) for n, w in history[0].items()}
    correct = {n: warm[where[n]] if fixes.correction else 0 for n in delta}
    made: dict[tuple[Any, ...], Stages] = {}
    for batch in batches()[1:]:
        total = 0.0
        for inputs, target, share in _micro_batches(batch):
            j, live = len(history) - 1, history[-1]
            shapes = tuple((k, v.shape) for k, v in inputs.items())
            if shapes not in made:
                made[shapes] = _stages_at(model, case, the_plan, inputs)
            old = {n: history[max(0, j - warm[where[n]])][n] for n in live}
            out, saved = _delayed_forward(made[shapes], inputs, old)
            total += case.loss(out, target).item() * share
            corrected = {n: live[n] - correct[n] * delta[n] for n in live}
            grads = _recomputed_backward(
                made[shapes], saved, corrected, functools.partial(case.loss, target=target)
            )
            _rates(opt, rates, [warm[i] for i in order], j, fixes)
            _step(model, opt, grads)
            history.append(_snapshot(model))
            delta = {
                n: fixes.ema * d + (1 - fixes.ema) * (history[-1][n] - live[n])
                for n, d in delta.items()
            }
        losses.append(total)
    return losses, model.state_dict()


CASES_2 = [
    *[(run, s) for run in ("gpt2", "cnn") for s in ("1f1b", "zb", "graph_interleaved")],
    ("llama", "1f1b"),
    ("blocks", "interleaved"),
    ("cnn", "2bw"),
    ("gpt2_untied", "2bw"),
    ("gpt2_untied", "stash"),
    ("gpt2_untied", "pipemare"),
    ("cnn", "pipemare_plain"),
]
CASES_3 = [("bert", "1f1b"), ("cnn", "1f1b")]


LARGEST = (12, 3, 12, 12)  # the CNN's max_shapes: images of 12 pixels, the example's are 8


def _bounded() -> dict[str, Any]:
    """The CNN compiled at its example with max_shapes: its plan's activation bytes, a first
    step at images of 10 pixels (beyond the example, within the bound), one refused at 14."""
    case = CASES["inception"]
    (example, _), (inputs, target) = _image_batches((12, 8), (8, 10))
    pm = gp_compile(
        case.build(), example["image"], loss_fn=case.loss, optimizer=optimizer,
        micro_batches=M, schedule="1f1b", replication=False,
        runtime=RuntimeConfig(timeout=120), max_shapes={"image": LARGEST},
    )  # fmt: skip
    loss = pm.step(inputs["image"], target=target)
    try:
        pm.step(torch.randn(8, 3, 14, 10), target=target)
        refused = ""
    except ConfigError as err:
        refused = str(err)
    activations = sum(s.activation_bytes for s in pm.plan.stages)
    return {"activations": activations, "loss": loss, "refused": refused}


def _worker(cases: list[tuple[str, str]], refusal: bool) -> dict[Any, Any]:
    out: dict[Any, Any] = {(run, schedule): _pipelined(run, schedule) for run, schedule in cases}
    if refusal:  # last: the refused compile leaves a failure posted
        out["bounded"] = _bounded()
        out["value_shaped"] = _value_shaped()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[Any, Any]]:
    return launch(_worker, 2, args=(CASES_2, True), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[Any, Any]]:
    return launch(_worker, 3, args=(CASES_3, False), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], tuple[list[float], dict[str, torch.Tensor]]]:
    flushed = {run for run, s in CASES_2 + CASES_3 if s not in POLICIES}
    delayed = {run for run, s in CASES_2 if s == "2bw"}
    return {(run, 0): _reference(run) for run in flushed} | {
        (run, 1): _reference(run, 1) for run in delayed
    }


def _assert_equal(result: dict[str, Any], reference: tuple[list[float], Any]) -> None:
    losses, expected = reference
    torch.testing.assert_close(result["losses"], losses, rtol=1e-5, atol=1e-7)
    state = result["state"]
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


FLUSHED_2 = [c for c in CASES_2 if c[1] not in ("stash", *PIPEMARE)]


@pytest.mark.parametrize(("run", "schedule"), FLUSHED_2, ids=[f"{r}-{s}" for r, s in FLUSHED_2])
def test_new_shapes_train_as_one_process_at_2_ranks(
    two_ranks: list[dict[Any, Any]],
    references: dict[tuple[str, int], Any],
    run: str,
    schedule: str,
) -> None:
    delay = 1 if schedule == "2bw" else 0
    _assert_equal(two_ranks[0][(run, schedule)], references[(run, delay)])


def test_stash_at_new_shapes_follows_pipedreams_rule(two_ranks: list[dict[Any, Any]]) -> None:
    """An exported model under stash: each micro-batch's forward and backward on the
    version of its stage's weights PipeDream's rule gives, micro-batches in flight across
    steps of other shapes."""
    runs = [rank[("gpt2_untied", "stash")] for rank in two_ranks]
    where = {n: i for run in runs for n, i in run["where"].items()}
    reference = _stash_reference("gpt2_untied", where, runs[0]["warmups"])
    _assert_equal(runs[0], reference)


PIPEMARE_2 = [c for c in CASES_2 if c[1] in PIPEMARE]


@pytest.mark.parametrize(("run", "schedule"), PIPEMARE_2, ids=[f"{r}-{s}" for r, s in PIPEMARE_2])
def test_pipemare_at_new_shapes_follows_its_rule(
    two_ranks: list[dict[Any, Any]], run: str, schedule: str
) -> None:
    """PipeMare on an exported model with its fixes, on an fx-traced one with BatchNorm
    without: each micro-batch's forward on its stages' weights of w_i updates before, its
    backward recomputed at its shapes with the live (corrected) weights, micro-batches in
    flight across steps; BatchNorm's statistics updated once per micro-batch."""
    runs = [rank[(run, schedule)] for rank in two_ranks]
    where = {n: i for r in runs for n, i in r["where"].items()}
    first = runs[0]
    reference = _pipemare_reference(run, schedule, first["plan"], where, first["warmups"])
    _assert_equal(first, reference)


@pytest.mark.parametrize(("run", "schedule"), CASES_3, ids=[f"{r}-{s}" for r, s in CASES_3])
def test_new_shapes_train_as_one_process_at_3_ranks(
    three_ranks: list[dict[Any, Any]],
    references: dict[tuple[str, int], Any],
    run: str,
    schedule: str,
) -> None:
    _assert_equal(three_ranks[0][(run, schedule)], references[(run, 0)])


def test_each_shape_is_made_once_and_the_cut_is_kept(two_ranks: list[dict[Any, Any]]) -> None:
    runs = two_ranks[0]
    # GPT-2: the example's 3 rows at 32; 2 rows at 16, 24, 32 and 20 (the 10-row batch's
    # 3-row micro-batches at 32 are the example's). The CNN: 3 rows at 8; 2 and 3 rows at 6,
    # 2 rows at 8 (its last batch repeats the one before)
    assert runs[("gpt2", "1f1b")]["signatures"] == 5
    assert runs[("cnn", "1f1b")]["signatures"] == 4
    for key, run in runs.items():
        if isinstance(key, tuple):  # every rank made the same ones
            assert two_ranks[1][key]["signatures"] == run["signatures"], key
    assert runs[("gpt2", "graph_interleaved")]["stages"] > 2  # several stages per rank
    blocks = runs[("blocks", "interleaved")]  # Megatron's: 2 stages per rank, exported
    assert (blocks["stages"], blocks["method"]) == (4, "export")


def test_steps_beyond_the_example_or_below_m_rows_are_refused_by_name(
    two_ranks: list[dict[Any, Any]],
) -> None:
    for rank in two_ranks:  # every rank alike; the steps after them equal one process
        beyond, few, dtype = rank[("cnn", "1f1b")]["refused"]
        assert "input image is [8, 3, 10, 10]: dim 2 is beyond the compiled example's" in beyond
        assert "the batch has 3 rows, fewer than the 4 micro-batches" in few
        assert "input image is torch.float64[8, 3, 8, 8]" in dtype


def test_max_shapes_plans_memory_at_them_and_bounds_the_steps(
    two_ranks: list[dict[Any, Any]],
) -> None:
    """The plan's activations are those of 12-pixel images (2.25 times the example's
    8-pixel ones, but for the few pooled values); a 10-pixel step trains as one process's
    first step; a 14-pixel one is refused on every rank, naming the input and the bound."""
    at_example = two_ranks[0][("cnn", "1f1b")]["activations"]
    case = CASES["inception"]
    model = case.build()
    _, (inputs, target) = _image_batches((12, 8), (8, 10))
    expected = sum(
        case.loss(model(part["image"]), piece).item() * share
        for part, piece, share in _micro_batches((inputs, target))
    )
    for rank in two_ranks:
        bounded = rank["bounded"]
        assert bounded["activations"] > 2 * at_example
        assert bounded["loss"] == pytest.approx(expected, rel=1e-5)
        assert (
            "input image is [8, 3, 14, 10]: dim 2 is beyond max_shapes' [12, 3, 12, 12]"
            in (bounded["refused"])
        )


def test_a_shape_that_depends_on_values_is_refused_at_compile(
    two_ranks: list[dict[Any, Any]],
) -> None:
    text = two_ranks[0]["value_shaped"]
    assert "op aten.nonzero.default (node getitem_1" in text
    assert "depends on the values of its input" in text


def test_eval_at_a_new_shape_equals_the_trained_model(
    two_ranks: list[dict[Any, Any]],
    references: dict[tuple[str, int], Any],
) -> None:
    _, state = references[("gpt2", 0)]
    model = CASES["gpt2"].build()
    model.load_state_dict(state)
    model.eval()
    inputs, target = _lm_batches((10,), (12,))[0]
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    loss, logits = two_ranks[0][("gpt2", "1f1b")]["evaluated"]
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    assert loss == pytest.approx(CASES["gpt2"].loss(out, target).item(), rel=1e-5)


class Windowed(nn.Module):
    """Python control flow on a shape (torch.fx cannot trace it; torch.export can), two
    positional inputs, and a reshape that torch.export writes as literals."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x)) * scale  # (B, L, 8) * (B, L, 1)
        if h.shape[1] > 1:
            h = h + h.roll(1, dims=1)
        h = self.mix(h.reshape(-1, 8)).reshape(x.shape[0], x.shape[1], 8)
        return self.out(h).mean(1)


def test_an_exported_stage_runs_at_a_new_shape_on_the_live_parameters() -> None:
    """One process: the stages torch.export made at length 6 are made again at length 4 for
    the same cut, read the live parameters, and compute what the model computes."""
    model = Windowed()
    inputs = (torch.randn(8, 6, 4), torch.rand(8, 6, 1))
    gm = trace(model, inputs, micro_batch_size=2)
    assert trace_info(gm).method == "export"
    the_plan = plan(model, inputs, devices=2, micro_batches=M, pins={"embed": 0, "out": 1})
    stages = {i: build_stage(gm, the_plan, i) for i in range(2)}
    compiled = signature_of(inputs, 2)
    specs = micro_shapes(gm, inputs, 2)
    shapes = Shapes(
        gm, the_plan, {i: m for i, (m, _) in stages.items()}, compiled, specs,
        torch.device("cpu"), torch.device("cpu"), lambda d: d, model,
    )  # fmt: skip
    x, scale = torch.randn(2, 4, 4), torch.rand(2, 4, 1)
    lowered = shapes.lowered(signature_of((x, scale), 2))
    assert shapes.lowered(signature_of((x, scale), 2)) is lowered  # cached
    values = {"x": x, "scale": scale}
    for i in range(2):
        module, io = lowered.modules[i], stages[i][1]
        out = module(*[values[n] for n in io.inputs])
        for name in io.sent:
            assert (tuple(out[name].shape), out[name].dtype) == lowered.specs[name]
        values.update(out)
    torch.testing.assert_close(model_output(gm, values[OUTPUT]), model(x, scale))
    live = dict(stages[1][0].named_parameters())
    assert all(p is live[n] for n, p in lowered.modules[1].named_parameters())
    with pytest.raises(ConfigError, match="torch.export traces another graph"):
        shapes.lowered(signature_of((x[:, :1], scale[:, :1]), 2))  # length 1: no roll


def test_max_shapes_must_name_inputs_at_least_as_large_as_the_example() -> None:
    """Checked at compile, every problem at once: the form before the trace, the names,
    dimensions and sizes after it."""
    with pytest.raises(ConfigError, match=r"max_shapes must be a dict of input name -> shape"):
        RunSpec.build(
            torch.randn(8, 4), loss_fn=F.mse_loss, optimizer=optimizer, max_shapes={"x": (8, -1)}
        )
    inputs = (torch.randn(8, 6, 4), torch.rand(8, 6, 1))
    gm = trace(Windowed(), inputs, micro_batch_size=2)
    check_max_shapes(gm, inputs, {"x": (8, 9, 4)})  # larger: fine
    with pytest.raises(ConfigError) as refused:
        check_max_shapes(gm, inputs, {"mask": (8, 6), "scale": (8, 4, 1)})
    assert "max_shapes names 'mask', which is not an input (the inputs: ['x', 'scale'])" in str(
        refused.value
    )
    assert "max_shapes['scale'] is [8, 4, 1], the example's scale is [8, 6, 1]" in str(
        refused.value
    )


def test_the_dry_run_covers_a_step_at_other_shapes() -> None:
    """check_run runs each schedule over calls at shapes differing call to call; a schedule
    whose rank first meets an older call's micro-batch in a later call is refused: it could
    size that message only from the new call's shapes, its peer from the old ones."""
    the_plan = plan(Blocks(), (torch.randn(8, 6, 4),), devices=3, micro_batches=M, pins={
        "embed": 0, "blocks.0": 1, "blocks.1": 2, "out": 2,
    })  # fmt: skip
    for name in ("1f1b", "zb", "async", "2bw"):
        check_run(the_plan, name, calls=3)
    calls = [  # two ranks, 2 micro-batches a call: rank 1 first acts on micro-batch 1 in call 1
        ["0F0 0SF0>1 0F1 0SF1>1", "1RF0<0 1F0"],
        ["0F2 0SF2>1 0F3 0SF3>1", "1RF1<0 1F1 1RF2<0 1F2 1RF3<0 1F3"],
    ]
    parts = [Schedule("async", 2, parse_ranks(ranks)) for ranks in calls]
    with pytest.raises(ScheduleError) as refused:
        check_shapes(parts, [range(0, 2), range(2, 4)])
    text = str(refused.value)
    assert "rank 1 runs 1RF1<0 in call 1 without the shapes of micro-batch 1" in text
    assert "1RF2<0" not in text  # brought by call 1: known
