"""Writes tests/data/schedules.json.gz: the plans of the schedule tests' zoo and, for each
schedule that runs on them, its actions, its lowered programs and its simulated step.

    PYTHONPATH=$PWD python tests/golden_schedules.py     # only to re-pin on purpose

`tests/test_golden.py` checks that the generators, the lowering and the simulator still
produce exactly these.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from plans import folded_plans, placed_plans, zoo_plans

from graphpipe.errors import ScheduleError
from graphpipe.ir import Plan
from graphpipe.scheduling.program import lower
from graphpipe.scheduling.simulate import simulate, steady_run

PATH = Path(__file__).parent / "data" / "schedules.json.gz"
NAMES = ("gpipe", "1f1b", "zb", "zb2", "async", "2bw", "forward", "graph_interleaved")
CALLS = 2  # step() calls of an asynchronous run, before its drain


def outcome(plan: Plan, name: str) -> dict[str, Any]:
    """What `name` makes of `plan`: its text forms and simulated step, or the error."""
    try:
        schedule = steady_run(plan, name, CALLS)
    except ScheduleError as exc:
        return {"error": str(exc).splitlines()[0]}
    return {
        "schedule": [" ".join(map(str, actions)) for actions in schedule.ranks],
        "program": str(lower(plan, schedule)),
        "prefetch": str(lower(plan, schedule, prefetch=True)),
        "step": repr(simulate(plan, schedule).iteration_time),
    }


def cases() -> list[dict[str, Any]]:
    """Every zoo plan (as JSON) with the outcome of every schedule that may run on it."""
    plans = [(label, p, NAMES) for label, p in zoo_plans()]
    plans += [(label, p, ("zbv", "dualpipev")) for label, p in placed_plans("zbv")]
    loop = ("interleaved", "interleaved_zb")
    plans += [(label, p, loop) for label, p in placed_plans("interleaved")]
    plans += [(label, p, ("graph_interleaved",)) for label, p in folded_plans()]
    out = []
    for label, plan, names in plans:
        text = plan.to_json()
        again = Plan.from_json(text)
        out.append(
            {
                "label": label,
                "plan": json.loads(text),
                "outcomes": {name: outcome(again, name) for name in names},
            }
        )
    return out


if __name__ == "__main__":
    with gzip.open(PATH, "wt") as f:
        json.dump(cases(), f, separators=(",", ":"))
    print(f"wrote {PATH} ({PATH.stat().st_size} bytes)")
