"""Timeline pictures: an SVG Gantt chart and a Chrome/Perfetto trace, simulated or measured.

    svg = timeline_svg(simulate(plan, sched).timeline)       # devices x time
    trace = chrome_trace(timeline)                            # open in ui.perfetto.dev

Rows are ranks, time runs left to right. Forward passes are blue, backward passes green (the
input-gradient half light green, the weight-gradient half teal), updates grey; each box shows
its micro-batch. Empty space is the bubble; each row ends with its idle share. Both functions
return data (SVG text, a JSON-able dict); writing files is the caller's choice.
"""

from __future__ import annotations

from html import escape
from typing import Any

from graphpipe._units import format_time
from graphpipe.ir import Action, ActionKind, Span, Timeline

__all__ = ["COLOURS", "chrome_trace", "timeline_svg"]

COLOURS = {"F": "#4e79a7", "B": "#59a14f", "I": "#8cd17d", "W": "#499894", "U": "#9d9d9d"}
NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad", "U": "update"}
LEFT, RIGHT, TOP, ROW, GAP = 110, 70, 46, 26, 6


def _kind(span: Span) -> ActionKind:
    return Action.parse(span.action).kind


def timeline_svg(timeline: Timeline, width: int = 1100) -> str:
    """The Gantt chart of `timeline` as SVG text.

    Args:
        timeline: From `simulate(...).timeline` or the runtime's measured timeline.
        width: Picture width in pixels.

    Returns:
        A standalone SVG document.
    """
    t0 = min((s.start for s in timeline.spans), default=0.0)
    span = timeline.makespan or 1.0
    plot = width - LEFT - RIGHT
    height = TOP + timeline.num_ranks * (ROW + GAP) + 40

    def x(t: float) -> float:
        return LEFT + (t - t0) / span * plot

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="Helvetica,Arial,sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{LEFT}" y="18" font-size="13" font-weight="bold">'
        f"{escape(timeline.title or 'timeline')} ({timeline.source}): "
        f"{format_time(span)}</text>",
        *_legend(LEFT, 34),
    ]
    busy = [0.0] * timeline.num_ranks
    for s in timeline.spans:
        if _kind(s) != ActionKind.U:
            busy[s.rank] += s.end - s.start
    for r in range(timeline.num_ranks):
        y = TOP + r * (ROW + GAP)
        parts.append(f'<rect x="{LEFT}" y="{y}" width="{plot}" height="{ROW}" fill="#f3f3f3"/>')
        parts.append(
            f'<text x="{LEFT - 8}" y="{y + ROW / 2 + 4}" text-anchor="end">rank {r}</text>'
        )
        idle = 1 - busy[r] / span if span else 0.0
        parts.append(f'<text x="{LEFT + plot + 6}" y="{y + ROW / 2 + 4}">{idle:.0%} idle</text>')
    for s in timeline.spans:
        parts += _box(s, x(s.start), x(s.end), TOP + s.rank * (ROW + GAP))
    parts += _axis(t0, span, x, TOP + timeline.num_ranks * (ROW + GAP))
    parts.append("</svg>")
    return "\n".join(parts)


def _box(s: Span, x0: float, x1: float, y: float) -> list[str]:
    kind = _kind(s)
    a = Action.parse(s.action)
    w = max(x1 - x0, 0.5)
    out = [
        f'<rect x="{x0:.2f}" y="{y}" width="{w:.2f}" height="{ROW}" fill="{COLOURS[kind]}" '
        f'stroke="white" stroke-width="0.5"><title>{escape(s.action)} '
        f"{format_time(s.end - s.start)}</title></rect>"
    ]
    label = "" if a.mb is None else str(a.mb)
    if label and w > 7 * len(label) + 2:
        out.append(
            f'<text x="{x0 + w / 2:.2f}" y="{y + ROW / 2 + 4}" text-anchor="middle" '
            f'fill="white">{label}</text>'
        )
    return out


def _legend(x: float, y: float) -> list[str]:
    out = []
    for kind, colour in COLOURS.items():
        out.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{x + 14}" y="{y}">{NAMES[kind]}</text>')
        x += 24 + 7 * len(NAMES[kind])
    return out


def _axis(t0: float, span: float, x: Any, y: float) -> list[str]:
    out = [f'<line x1="{x(t0)}" y1="{y}" x2="{x(t0 + span)}" y2="{y}" stroke="#333"/>']
    for i in range(6):
        t = t0 + span * i / 5
        out.append(f'<line x1="{x(t):.2f}" y1="{y}" x2="{x(t):.2f}" y2="{y + 4}" stroke="#333"/>')
        out.append(
            f'<text x="{x(t):.2f}" y="{y + 16}" text-anchor="middle">{format_time(t - t0)}</text>'
        )
    return out


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline in the Chrome trace event format (chrome://tracing, ui.perfetto.dev).

    One process per rank, one complete event ("X") per action, times in microseconds.
    """
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}}
        for r in range(timeline.num_ranks)
    ]
    for s in timeline.spans:
        kind = _kind(s)
        events.append(
            {
                "ph": "X",
                "name": s.action,
                "cat": NAMES[kind],
                "pid": s.rank,
                "tid": 0,
                "ts": s.start * 1e6,
                "dur": (s.end - s.start) * 1e6,
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": timeline.source, "title": timeline.title},
    }
