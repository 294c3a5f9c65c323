"""The generators, the lowering and the simulator reproduce the pinned outcomes of every zoo
plan (tests/data/schedules.json.gz, written by tests/golden_schedules.py): a refactor of the
scheduling code changes no action, no communication group and no simulated step."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from golden_schedules import outcome

from graphpipe.ir import Plan

CASES: list[dict[str, Any]] = json.loads(
    gzip.decompress((Path(__file__).parent / "data" / "schedules.json.gz").read_bytes())
)


def test_the_pins_cover_every_schedule_and_the_hard_shapes() -> None:
    ran = {name for case in CASES for name, o in case["outcomes"].items() if "error" not in o}
    assert ran == {
        "gpipe",
        "1f1b",
        "zb",
        "zb2",
        "async",
        "2bw",
        "forward",
        "interleaved",
        "interleaved_zb",
        "zbv",
        "dualpipev",
        "graph_interleaved",
    }
    plans = [Plan.from_json(json.dumps(case["plan"])) for case in CASES]
    assert any(s.replicas > 1 for p in plans for s in p.stages)
    assert any(p.shared_devices() for p in plans)


@pytest.mark.parametrize("case", CASES, ids=[case["label"] for case in CASES])
def test_outcomes_are_the_pinned_ones(case: dict[str, Any]) -> None:
    plan = Plan.from_json(json.dumps(case["plan"]))
    for name, pinned in case["outcomes"].items():
        assert outcome(plan, name) == pinned, name
