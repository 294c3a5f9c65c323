"""The command line: `graphpipe plan` prints tables and writes files; errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.tools.cli import main, parse_options


def test_plan_prints_both_plans_and_writes_every_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {
        k: tmp_path / f"{k}.{ext}"
        for k, ext in (
            ("plan", "json"),
            ("stages", "svg"),
            ("ops", "svg"),
            ("tl", "svg"),
            ("tr", "json"),
        )
    }
    code = main(
        [
            "plan",
            "models.mmt",
            "--preset",
            "tiny",
            "--devices",
            "3",
            "--micro-batches",
            "2",
            "--json",
            str(files["plan"]),
            "--render",
            str(files["stages"]),
            "--render-ops",
            str(files["ops"]),
            "--timeline",
            str(files["tl"]),
            "--trace",
            str(files["tr"]),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "graph plan:" in out and "sequential plan:" in out and "graph vs sequential" in out
    assert "predicted bottleneck" in out and "samples/s" in out and "peak memory" in out
    plan = Plan.from_json(files["plan"].read_text())
    assert plan.num_devices == 3 and plan.micro_batches == 2
    for name in ("stages", "ops"):
        assert "<svg" in files[name].read_text()
    # the graph plan's timeline and trace where asked, the sequential plan's beside them
    for tl, tr in (("tl", "tr"), ("tl-sequential", "tr-sequential")):
        assert "<svg" in (tmp_path / f"{tl}.svg").read_text()
        events = json.loads((tmp_path / f"{tr}.json").read_text())["traceEvents"]
        assert any(e["ph"] == "X" for e in events)
    assert not (tmp_path / "tl-graph.svg").exists()


def test_a_model_in_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "mine.py"
    source.write_text(
        "from models import candle_uno\n"
        "def make(preset, **options):\n"
        "    return candle_uno.workload('tiny', **options)\n"
    )
    assert main(["plan", f"{source}:make", "--devices", "2", "--partitioner", "graph"]) == 0
    assert "graph plan:" in capsys.readouterr().out


LLAMA_FILE = """
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from graphpipe.tools.workload import Workload

def make(preset, use_cache=True):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_cache=use_cache)
    ids = torch.randint(0, 64, (8, 6))
    loss = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    return Workload("llama", LlamaForCausalLM(config), (ids,), loss, lambda: ((ids,), ids),
                    micro_batches=4)
"""


def test_plan_profiles_an_exported_model_at_the_size_it_traced_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Hugging Face model is exported: its graph runs at its traced shapes only, so the
    measured profile runs it at the micro-batch it was traced at (it was traced at the
    batch and profiled at the micro-batch: a raw reshape error from planning/measure.py)."""
    source = tmp_path / "llama_wl.py"
    source.write_text(LLAMA_FILE)
    argv = ["plan", f"{source}:make", "--devices", "2", "-o", "use_cache=False"]
    assert main(argv) == 0
    assert "graph plan:" in capsys.readouterr().out


MLP_FILE = """
import torch
from torch import nn
from graphpipe.tools.workload import Workload

def make(preset, **options):
    blocks = [nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(4)]
    x = torch.randn(8, 32)
    return Workload(
        "mlp", nn.Sequential(*blocks), (x,), lambda out, y: out.pow(2).mean(),
        lambda: ((torch.randn(8, 32),), None), micro_batches=2,
    )
"""


def test_plan_with_tensor_parallelism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--tp 2 with a plan of Megatron's MLP split: a tp mesh in the summary and the plan, the
    split layers' parameter bytes halved."""
    source = tmp_path / "mlp.py"
    source.write_text(MLP_FILE)
    argv = ["plan", f"{source}:make", "--devices", "2", "--partitioner", "graph"]
    assert main([*argv, "--json", str(tmp_path / "tp1.json")]) == 0
    split = '{"*.0": "colwise", "*.2": "rowwise"}'
    argv = [*argv[:3], "4", *argv[4:], "--tp", "2", "--tp-plan", split]
    assert main([*argv, "--json", str(tmp_path / "tp2.json")]) == 0
    assert "tp 2, dp and tp uniform over the stages" in capsys.readouterr().out
    whole, halved = (Plan.from_json((tmp_path / f).read_text()) for f in ("tp1.json", "tp2.json"))
    assert halved.cost_model.dims.tp == 2 and whole.cost_model.dims.tp == 1
    bias = 32 * 4 * 4  # the row-wise layers' biases stay whole
    params = sum(s.param_bytes for s in whole.stages)
    assert sum(s.param_bytes for s in halved.stages) == pytest.approx((params - bias) / 2 + bias)


TP_MMT = ["plan", "models.mmt", "--preset", "tiny", "--devices", "4", "--tp", "2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "models.nothing", "--devices", "2"], "cannot import 'models.nothing'"),
        (["run", "no.such.module", "--devices", "2"], "cannot import 'no.such.module'"),
        (
            ["run", "models.mmt", "--devices", "4", "--dp", "3"],
            "dp=3 x tp=1 does not divide devices=4",
        ),
        (
            ["run", "models.mmt", "--preset", "tiny", "--devices", "8", "--dp", "8"],
            "dp=8 does not divide a micro-batch of 4 rows",
        ),
        (["plan", "models.mmt", "--preset", "huge", "--devices", "2"], "'huge'"),
        (
            TP_MMT,
            "MultiModalTransformer has no base_model_tp_plan",
        ),
        (
            [*TP_MMT, "--tp-plan", '{"head.nope": "colwise"}'],
            "tp_plan entries ['head.nope'] match no module",
        ),
        (
            ["plan", "models.mmt", "--preset", "tiny", "--devices", "2", "-m", "3"],
            "batch of 8 does not split into 3",
        ),
        (["plan", "models.mmt", "--preset", "tiny", "--devices", "99"], "99 devices"),
        (
            ["plan", "models.mmt", "--preset", "tiny", "--devices", "2", "--memory-budget", "1000"],
            "memory budget",
        ),
    ],
)
def test_errors_are_one_clear_line_and_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "graphpipe: error:" in err and message in err
    said = [line for line in err.splitlines() if not line.startswith("[graphpipe]")]  # progress
    assert "Traceback" not in err and said == [said[0]] and said[0].startswith("graphpipe: error")


def test_model_options() -> None:
    assert parse_options(["branches=3", "name=x", "sizes=(1, 2)"]) == {
        "branches": 3,
        "name": "x",
        "sizes": (1, 2),
    }
    with pytest.raises(ConfigError, match="'branches'"):
        parse_options(["branches"])


def test_zero_bubble_timeline_shows_its_weight_gradient_passes(tmp_path: Path) -> None:
    out = tmp_path / "t.svg"
    assert (
        main(
            [
                "plan",
                "models.dlrm",
                "--preset",
                "tiny",
                "--devices",
                "2",
                "--partitioner",
                "sequential",
                "--no-replication",
                "--schedule",
                "zb",
                "--timeline",
                str(out),
            ]
        )
        == 0
    )
    svg = out.read_text()
    assert "<title>0I0" in svg and "<title>0W0" in svg and "<title>1W0" in svg


def test_plan_interleave_folds_the_mmt_preset_and_schedules_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mmt (paper preset) on 8 devices: the interleaved plan holds 9 stages on 8 devices."""
    out = tmp_path / "plan.json"
    argv = ["plan", "models.mmt", "--preset", "paper", "--devices", "8", "--no-replication"]
    assert main([*argv, "--interleave", "--partitioner", "graph", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "schedule graph_interleaved" in text
    folded = Plan.from_json(out.read_text())
    assert len(folded.stages) > 8 and folded.info["placement"].startswith("graph:")
    assert (
        folded.info["interleave"]["interleaved_step"] < folded.info["interleave"]["unfolded_step"]
    )


def test_run_trains_pp_x_dp_on_local_processes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "models.mmt", "--preset", "tiny", "--devices", "4", "--dp", "2"]
    argv += ["--steps", "3", "--profile", "flops", "--out", str(tmp_path)]
    assert main(argv) == 0
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.num_devices == 2 and plan.cost_model.dims.dp == 2  # pp 2 x dp 2
    said = capfd.readouterr().out  # rank 0's lines, from its process
    assert "dp 2 (sharded)" in said and said.count("step    3/3") == 1  # one rank says it


def test_run_takes_a_dp_degree_not_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "models.mmt", "--devices", "4", "--dp", "auto"]) == 2
    assert "`graphpipe plan --dp auto`" in capsys.readouterr().err
