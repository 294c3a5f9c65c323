"""The showcase: every example trains end to end, and the gallery renders."""

from __future__ import annotations

import io
import math
import re
import sys
from pathlib import Path

import pytest

from graphpipe.tools.cli import main
from graphpipe.tools.train import TrainConfig, progress_bar, train
from viz.gallery import KINDS, MODELS, render_gallery

EXAMPLES = ("mmt", "dlrm", "candle_uno", "nbranch", "inception", "vlm")
FILES = ("plan.svg", "ops.svg", "timeline.svg", "timeline.json", "simulated.svg", "plan.json")


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_trains_on_two_processes(name: str, tmp_path: Path) -> None:
    result = train(
        TrainConfig(
            model=f"models.{name}",
            preset="tiny",
            devices=2,
            steps=2,
            profile="flops",
            out=str(tmp_path),
            compile_options={"timeout": 60},
            deadline=240,
        )
    )
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    for file in FILES:
        assert (tmp_path / file).stat().st_size > 0, file
    assert "rank 1" in (tmp_path / "timeline.svg").read_text()


def test_gallery_renders_three_pictures_per_model(tmp_path: Path) -> None:
    written = render_gallery(tmp_path, devices=4)
    assert sorted(p.name for p in written) == sorted(f"{m}-{k}.svg" for m in MODELS for k in KINDS)
    for m in MODELS:
        ops = (tmp_path / f"{m}-ops.svg").read_text()
        assert ops.startswith("<?xml") or ops.startswith("<svg")
        assert len(re.findall(r'class="cluster"', ops)) >= 2  # one frame per stage
        assert "graph plan" in (tmp_path / f"{m}-stages.svg").read_text()
        assert "idle" in (tmp_path / f"{m}-timeline.svg").read_text()


def test_run_flags_reach_the_pipeline(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """graphpipe run with clipping, recomputation and bf16: trains, a line per step (no TTY)."""
    code = main(
        [
            "run",
            "models.mmt",
            "--preset",
            "tiny",
            "--steps",
            "2",
            "--profile",
            "flops",
            "--out",
            str(tmp_path),
            "--max-grad-norm",
            "0.5",
            "--recompute",
            "all",
            "--precision",
            "bf16",
        ]
    )
    assert code == 0
    out = capfd.readouterr().out
    assert re.search(r"step +2/2  loss [0-9.]+ ", out), out


def test_the_progress_bar_is_for_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    bar = progress_bar(True, 3)
    assert bar is not None
    bar.set_postfix(loss="0.5", samples_s="10.0")
    bar.update(1)
    bar.close()
    assert "loss=0.5" in sys.stdout.getvalue() and "1/3" in sys.stdout.getvalue()
    assert progress_bar(False, 3) is None  # other ranks
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert progress_bar(True, 3) is None  # not a terminal: lines instead
