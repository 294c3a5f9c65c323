"""A check on values inside forward is not a shape (graphpipe.tracing.checks).

LLaVA's "image tokens and image features agree" is `torch._check_tensor_all_with` on a
tensor, which torch.export writes as a read-back (`item`) and scalar asserts. Such a region
is kept as a device-side assert on the condition tensor (it still fails on bad values), a
check on a number is dropped with a warning, and a read-back that makes a shape is left for
the stage builder to refuse.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.runtime.stage import micro_shapes
from graphpipe.tracing.checks import drop_value_checks
from graphpipe.tracing.tracer import trace


class TokensMatch(nn.Module):
    """LLaVA's check, written as Hugging Face writes it: the count of image tokens times the
    width must equal the features' size; shapes differ in branches fx cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (b, l, 4)
        mask = (ids == 9).unsqueeze(-1).expand_as(x)
        torch._check_tensor_all_with(
            ValueError, mask.sum() == feats.numel(), lambda: "image tokens and features differ"
        )
        if x.shape[1] > 1:  # shape control flow: fx fails, export traces it
            x = x.masked_scatter(mask, self.proj(feats))
        return x.sum(-1)


def _ids(rows: int) -> torch.Tensor:
    ids = torch.ones(rows, 5, dtype=torch.long)
    ids[:, 1:3] = 9  # two image tokens per row
    return ids


def test_a_tensor_check_is_kept_on_the_device_and_still_fails_on_bad_values() -> None:
    model = TokensMatch()
    feats = torch.randn(4, 2, 4)
    gm = trace(model, (_ids(4), feats), micro_batch_size=2)
    checks = gm.meta["gp_value_checks"]
    assert [c.fate for c in checks] == ["kept"]
    targets = [str(n.target) for n in gm.graph.nodes]
    assert "aten._assert_async.msg" in targets
    assert not any(t in ("aten.item.default", "aten._local_scalar_dense.default") for t in targets)
    # no data-dependent shape left: the stage builder's fake run sizes every value
    specs = micro_shapes(gm, [_ids(4), feats], 2)
    (out,) = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert specs[out.name] == ((2, 5), torch.float32)
    good = torch.fx.Interpreter(gm).run(_ids(2), feats[:2])
    torch.testing.assert_close(good, model(_ids(2), feats[:2]))
    bad = _ids(2)
    bad[:, 3] = 9  # three image tokens per row, features for two
    with pytest.raises(RuntimeError, match="a check of the model's forward failed"):
        torch.fx.Interpreter(gm).run(bad, feats[:2])


class PositiveCount(nn.Module):
    """`torch._check` on a number read back: a check, but not on a boolean tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        torch._check(n.sum().item() > 0)
        y = self.a(x)
        return y * 2 if y.shape[0] > 1 else y


def test_a_check_on_a_number_is_dropped_with_a_warning_naming_it() -> None:
    x, n = torch.randn(4, 4), torch.ones(4, dtype=torch.long)
    with pytest.warns(UserWarning, match=r"dropped a check on a tensor's value \(node item"):
        gm = trace(PositiveCount(), (x, n), micro_batch_size=2)
    assert [c.fate for c in gm.meta["gp_value_checks"]] == ["dropped"]
    assert "aten.item.default" not in [str(t.target) for t in gm.graph.nodes]


class CountedZeros(nn.Module):
    """A value read back that makes a shape: no check, a data-dependent size."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.max().item()
        torch._check_is_size(k)  # an assert on the value too, but not all its uses are
        pad = torch.zeros(k, 4)
        return x + pad.sum(0, keepdim=True)


def test_a_value_that_makes_a_shape_is_not_a_check_and_is_refused_by_name() -> None:
    gm = torch.export.export(
        CountedZeros(), (torch.randn(2, 4), torch.ones(2, dtype=torch.long)), strict=False
    ).module()
    assert drop_value_checks(gm) == []
    assert "aten.item.default" in [str(t.target) for t in gm.graph.nodes]
    inputs = [torch.randn(4, 4), torch.ones(4, dtype=torch.long)]
    with pytest.raises(ConfigError, match=r"aten._local_scalar_dense.* makes a shape"):
        micro_shapes(trace(CountedZeros(), tuple(inputs)), inputs, 2)
