"""runtime/clip.py's local halves: torch's get_total_norm / clip_grads_with_norm_ (torch 2.6+)
and the same two steps graphpipe computes on torch 2.4 and 2.5 give the same gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from graphpipe.runtime import clip


def _params(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 4
    return params


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_the_old_torch_path_equals_torchs_functions(monkeypatch, norm_type):
    torchs, ours = _params(0), _params(0)
    norm = clip._total_norm([p.grad for p in torchs], norm_type)
    clip._clip_with_norm(torchs, 1.0, norm)
    monkeypatch.delattr(nn.utils, "get_total_norm")
    monkeypatch.delattr(nn.utils, "clip_grads_with_norm_")
    own = clip._total_norm([p.grad for p in ours], norm_type)
    clip._clip_with_norm(ours, 1.0, own)
    torch.testing.assert_close(own, norm)
    assert own > 1.0  # the clipping is active
    for a, b in zip(torchs, ours, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
