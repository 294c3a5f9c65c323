"""A small SVG line chart (no plotting library): one polyline per series."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from html import escape

COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1")


def line_chart(
    series: dict[str, Sequence[tuple[float, float]]],
    title: str,
    x_label: str,
    y_label: str,
    width: int = 560,
    height: int = 320,
    log_y: bool = True,
) -> str:
    """An SVG chart of `series` (name -> (x, y) points), with a legend."""
    left, right, top, bottom = 60, 150, 30, 40
    points = [p for s in series.values() for p in s]
    xs = [x for x, _ in points] or [0.0, 1.0]
    ys = [math.log10(y) if log_y else y for _, y in points if y > 0 or not log_y] or [0.0, 1.0]
    x0, x1 = min(xs), max(xs) or 1.0
    y0, y1 = min(ys), max(ys)
    y1 = y1 if y1 > y0 else y0 + 1

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * (width - left - right)

    def py(y: float) -> float:
        v = math.log10(y) if log_y else y
        return top + (y1 - v) / (y1 - y0) * (height - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="Helvetica,Arial,sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{left}" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}"'
        ' stroke="#333"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#333"/>',
        f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">'
        f"{escape(x_label)}</text>",
        f'<text x="14" y="{(top + height - bottom) / 2}" transform="rotate(-90 14 '
        f'{(top + height - bottom) / 2})" text-anchor="middle">{escape(y_label)}</text>',
    ]
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        label = f"{10**v:.3g}" if log_y else f"{v:.3g}"
        y = top + (y1 - v) / (y1 - y0) * (height - top - bottom)
        out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        x = x0 + (x1 - x0) * i / 4
        out.append(
            f'<text x="{px(x):.1f}" y="{height - bottom + 14}" text-anchor="middle">{x:.3g}</text>'
        )
    for k, (name, pts) in enumerate(series.items()):
        colour = COLOURS[k % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts if y > 0 or not log_y)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        ly = top + 14 * k + 6
        out.append(
            f'<line x1="{width - right + 10}" y1="{ly}" x2="{width - right + 28}" '
            f'y2="{ly}" stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<text x="{width - right + 32}" y="{ly + 4}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def stacked(charts: Sequence[str]) -> str:
    """Several charts from `line_chart`, one below the other, in one SVG document."""
    parts, y, width = [], 0, 0
    for chart in charts:
        w = int(re.search(r'width="(\d+)"', chart).group(1))  # type: ignore[union-attr]
        h = int(re.search(r'height="(\d+)"', chart).group(1))  # type: ignore[union-attr]
        body = chart.split(">", 1)[1].rsplit("</svg>", 1)[0]
        parts.append(f'<g transform="translate(0,{y})">{body}</g>')
        y, width = y + h, max(width, w)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" '
        f'font-family="Helvetica,Arial,sans-serif" font-size="11">' + "".join(parts) + "</svg>"
    )
