"""benchmarks.actions: one stage's actions timed on the host and on the device (issue 37,
item 5's command; on the CPU here, where the device is the host)."""

from __future__ import annotations

import pytest

from benchmarks.actions import kind, report


def test_an_action_kind_is_read_from_its_text_and_other_text_is_refused() -> None:
    assert [kind(a) for a in ("0F3", "12W0", "0U", "3I11")] == ["F", "W", "U", "I"]
    with pytest.raises(ValueError, match="'F3'"):
        kind("F3")


def test_the_section_has_every_action_kind_of_each_schedule_with_its_count_per_step() -> None:
    text = report("cpu", width=16, layers=2, batch=8, m=4, steps=2)
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    table = {(r[0].strip(), r[1].strip()): [c.strip() for c in r[2:]] for r in rows[1:]}
    counts = {key: int(cells[0]) for key, cells in table.items()}
    assert counts == {
        ("1f1b", "F"): 4, ("1f1b", "B"): 4, ("1f1b", "U"): 1,
        ("zb", "F"): 4, ("zb", "I"): 4, ("zb", "W"): 4, ("zb", "U"): 1,
    }  # fmt: skip
    assert all(int(cells[1]) > 0 and int(cells[2]) > 0 for cells in table.values()), table
    assert "- 1f1b: step " in text and "- zb: step " in text
