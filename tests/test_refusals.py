"""Every refused combination lives in one table (`graphpipe.runtime.refusals`), each error is
built from its row, and the guides quote the table as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zoo import dict_loss

from graphpipe.errors import ConfigError
from graphpipe.runtime.refusals import REFUSALS, refusal, table
from graphpipe.runtime.spec import RunSpec

DOCS = Path(__file__).resolve().parents[1] / "docs"
BEGIN, END = "<!-- refusals: begin -->", "<!-- refusals: end -->"


def test_the_failures_guide_quotes_the_table_as_it_is() -> None:
    text = (DOCS / "failures.md").read_text()
    quoted = text.split(BEGIN)[1].split(END)[0].strip()
    assert quoted == table()


def test_every_row_has_a_distinct_key_and_says_what_to_do() -> None:
    assert len({r.key for r in REFUSALS}) == len(REFUSALS)
    assert all(r.when and r.why and r.instead for r in REFUSALS)


@pytest.mark.parametrize(
    ("kwargs", "key", "subject"),
    [
        ({"weights": "pipemare"}, "mesh-weights", "weights='pipemare'"),
        ({"weights": "2bw", "tp": 2}, "mesh-versions-tp", "weights='2bw' with tp=2"),
        ({"nan_check": True}, "mesh-nan-check", "nan_check=True"),
        ({"compile_stages": True}, "mesh-compile-stages", "compile_stages=True"),
        ({"replication": True}, "mesh-replication", "replication=True"),
    ],
)
def test_a_mesh_refusal_is_its_row_naming_the_value(
    kwargs: dict[str, object], key: str, subject: str
) -> None:
    with pytest.raises(ConfigError) as err:
        RunSpec.build(
            torch.randn(8, 4),
            loss_fn=dict_loss,
            optimizer=torch.optim.SGD,
            micro_batches=2,
            dp=2,
            **kwargs,
        )
    assert refusal(key, subject) in str(err.value)


def test_a_versioned_policy_with_mesh_auto_is_refused_by_its_row() -> None:
    with pytest.raises(ConfigError) as err:
        RunSpec.build(
            torch.randn(8, 4),
            loss_fn=dict_loss,
            optimizer=torch.optim.SGD,
            micro_batches=2,
            mesh="auto",
            weights="stash",
        )
    assert refusal("mesh-versions-tp", "weights='stash' with mesh='auto'") in str(err.value)
