"""Frozen parts are a cost: a stage that takes no gradient runs forward only.

A vision encoder whose parameters take no gradient (`requires_grad_(False)`), a projector
and a decoder whose first layer is frozen too but reads a value that takes a gradient (a
LoRA base layer). The trace marks which values take a gradient (`gp_grad`); the profile
gives the encoder no backward and the frozen decoder layer half of one (its input's
gradient only); the plan's encoder stage runs forward only (no B, I or W, no gradient
message on its edge) and holds its weights once (no gradient, no optimizer state); every
flushed schedule of it passes the dry run under NCCL's and gloo's semantics, and the
simulator charges it no backward. (Training such a stage as one process does, under 1f1b,
zb and pp 2 x dp 2: tests/test_multimodal.py's frozen LLaVA.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphpipe.ir import ActionKind
from graphpipe.planning.partition import plan
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.scheduling.dryrun import check_program, check_schedule
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.program import lower
from graphpipe.scheduling.simulate import simulate
from graphpipe.tracing.tracer import trace

PINS = {"encoder": 0, "project": 1, "decoder": 1, "head": 1}
FLOPS = ProfileConfig(mode="flops")


class FrozenEncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32))
        self.project = nn.Linear(32, 16)
        self.decoder = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)
        self.encoder.requires_grad_(False)
        self.decoder[0].requires_grad_(False)  # frozen, but its input takes a gradient

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(self.project(self.encoder(image))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return FrozenEncoderLM()


def _plan(m: int = 4):  # type: ignore[no-untyped-def]
    return plan(_model(), torch.randn(8, 8), devices=2, micro_batches=m, pins=PINS, profile=FLOPS)


def test_the_trace_marks_what_takes_a_gradient() -> None:
    gm = trace(_model(), torch.randn(8, 8))
    grad = {n.name: n.meta["gp_grad"] for n in gm.graph.nodes if n.op == "call_module"}
    assert grad == {
        "encoder_0": False,
        "encoder_1": False,
        "encoder_2": False,
        "project": True,
        "decoder_0": True,  # frozen weight, but its input takes a gradient
        "decoder_1": True,
        "decoder_2": True,
        "head": True,
    }
    assert gm.meta["graphpipe"].frozen == {
        "encoder.0.weight",
        "encoder.0.bias",
        "encoder.2.weight",
        "encoder.2.bias",
        "decoder.0.weight",
        "decoder.0.bias",
    }


def test_the_profile_gives_frozen_work_no_backward_and_frozen_weights_half_of_one() -> None:
    gm = trace(_model(), torch.randn(8, 8))
    times = profile(gm, (), 8, ProfileConfig(mode="flops", node_overhead=0.0)).times
    assert times["encoder_0"].backward == 0.0 and times["encoder_0"].forward > 0
    # decoder.0 and decoder.2 are the same 16 x 16 layer: one gradient against two
    assert times["decoder_0"].forward == pytest.approx(times["decoder_2"].forward)
    assert times["decoder_0"].backward == pytest.approx(times["decoder_2"].backward / 2)


def test_a_frozen_encoder_stage_runs_forward_only_and_holds_its_weights_once() -> None:
    p = _plan()
    encoder, rest = p.stages
    assert (encoder.backward, rest.backward) == (False, True)
    assert encoder.backward_time == 0.0
    assert encoder.activation_bytes == 2 * 32 * 4  # only the value it sends (2 rows)
    weights = sum(x.numel() * 4 for x in _model().encoder.parameters())
    assert encoder.frozen_bytes == encoder.param_bytes == weights
    # one copy: no gradient and no optimizer state (Adam's two slots) for frozen weights
    held = encoder.activation_bytes * encoder.in_flight
    assert encoder.memory_bytes == weights + held
    (edge,) = p.edges
    assert edge.grads == () and not edge.backward_message


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb", "zb2"])
def test_every_flushed_schedule_of_it_has_no_backward_there_and_passes_the_dry_runs(
    name: str,
) -> None:
    p = _plan()
    sched = make_schedule(p, name)
    first, second = sched.ranks
    assert [a.kind for a in first if a.is_compute] == [ActionKind.F] * 4
    assert not any(a.kind in (ActionKind.RB, ActionKind.SB) for a in (*first, *second))
    check_schedule(p, sched)
    program = lower(p, sched)
    check_program(p, program, "rendezvous")
    check_program(p, program, "buffered")
    step = simulate(p, sched).iteration_time
    rest = p.stages[1]
    # stage 1 alone bounds the step: its M forwards and backwards after the first forward
    assert step >= 4 * (rest.forward_time + rest.backward_time)
