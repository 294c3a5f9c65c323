"""BENCHMARKS.md: regenerating the figures keeps the notes written under them."""

from __future__ import annotations

from pathlib import Path

from benchmarks.__main__ import NOTES, kept_notes, unlisted, with_notes

OLD = f"""# Benchmarks

## Runtime

| model | ms |
|-------|----|
| chain | 150 |

{NOTES}

Measured on day 1: the target is not met.

## Planner

| config | ratio |
|--------|-------|
| mmt | 1.1x |
"""


def test_regenerated_sections_keep_their_notes_and_sections_without_notes_stay_bare() -> None:
    notes = kept_notes(OLD)
    assert notes == {"## Runtime": "Measured on day 1: the target is not met."}
    runtime = "## Runtime\n\n| model | ms |\n|-------|----|\n| chain | 140 |\n"
    planner = "## Planner\n\n| config | ratio |\n|--------|-------|\n| mmt | 1.2x |\n"
    new = with_notes(runtime, notes)
    assert "| chain | 140 |" in new and new.endswith(
        f"{NOTES}\n\nMeasured on day 1: the target is not met.\n"
    )
    assert with_notes(planner, notes) == planner


def test_the_checked_in_document_round_trips() -> None:
    text = (Path(__file__).resolve().parent.parent / "BENCHMARKS.md").read_text()
    notes = kept_notes(text)
    assert notes  # the hand-written notes are marked
    for part in text.split("\n## ")[1:]:
        section = "## " + part
        generated = section.split(NOTES)[0]
        assert with_notes(generated, notes).strip() == section.strip()


def test_sections_no_benchmark_generates_are_kept_as_they_are() -> None:
    runtime = "## Runtime\n\n| model | ms |\n|-------|----|\n| chain | 140 |\n"
    assert unlisted(OLD, [runtime]) == [
        "## Planner\n\n| config | ratio |\n|--------|-------|\n| mmt | 1.1x |\n"
    ]
    assert unlisted(OLD, [runtime, "## Planner\n\nnew figures\n"]) == []
