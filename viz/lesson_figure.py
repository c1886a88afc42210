"""A lesson's chart, for a room: its number before and after the switch as two lines, the table's two numbers as
level lines, a marker at the flip. The points are the table's numbers bin by bin (playground/lesson_numbers.py's
`series`), so the chart and the table never disagree."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .figures import figure, placeholder_figure, scatter, shorten

BEFORE, AFTER, FLIP = "#8c8c8c", "#3182bd", "#d62728"


@dataclass(frozen=True)
class LessonChart:
    title: str  # the lesson's title
    label: str  # the number, in words ("prefix-cache hit rate")
    unit: str  # "", "s", "ms", "tok/s", ...
    percent: bool  # a share from 0 to 1, drawn in %
    switch: str  # what flips, in words ("prefix_caching → on")
    points: Sequence[tuple[float, float]]  # (seconds since the before phase began, the number over that bin)
    flip_at_s: float | None  # where the after phase began (None: not yet)
    now_s: float  # how far the lesson is (the x axis reaches at least this far)
    before: float | None = None  # the table's numbers, once measured
    after: float | None = None


def lesson_figure(chart: LessonChart) -> dict:
    # the axes and the flip's marker once the switch has flipped, points or not: a number with nothing to say yet
    # (prefix caching off looks nothing up) must not hold back the marker the room is watching for
    if not chart.points and chart.flip_at_s is None:
        return placeholder_figure(f"{chart.title}: the numbers appear here once the lesson's users are running")
    flip = chart.flip_at_s
    before = [p for p in chart.points if flip is None or p[0] < flip]
    after = [p for p in chart.points if flip is not None and p[0] >= flip]
    scale = 100.0 if chart.percent else 1.0
    unit = "%" if chart.percent else chart.unit

    def line(points, name: str, colour: str) -> dict:
        return scatter(x=[round(x, 2) for x, _ in points], y=[y * scale for _, y in points], name=name,
                       mode="lines+markers", line=dict(color=colour, width=3), marker=dict(size=6, color=colour),
                       hovertemplate=f"%{{x:.0f}} s: %{{y:.3g}} {unit}<extra>{name}</extra>")

    data = [line(before, "before the switch", BEFORE)]
    if after:
        data.append(line(after, f"after: {shorten(chart.switch, 28)}", AFTER))
    end = max(chart.now_s, chart.points[-1][0] if chart.points else 0.0, chart.flip_at_s or 0.0, 1.0)
    for value, name, colour, x0, x1 in ((chart.before, "before", BEFORE, 0.0, flip or end),
                                        (chart.after, "after", AFTER, flip or 0.0, end)):
        if value is not None:
            shown = f"{value * scale:.3g} {unit}".strip()
            data.append(scatter(x=[x0, x1], y=[value * scale] * 2, mode="lines", name=f"{name}: {shown}",
                                line=dict(color=colour, width=1.5, dash="dash"), hoverinfo="skip"))
    shapes, annotations = [], []
    if flip is not None:
        shapes.append(dict(type="line", xref="x", yref="paper", x0=flip, x1=flip, y0=0, y1=1,
                           line=dict(color=FLIP, width=2, dash="dot")))
        annotations.append(dict(x=flip, xref="x", y=1, yref="paper", yanchor="bottom", text="flip", showarrow=False,
                                font=dict(size=13, color=FLIP), hovertext=f"{chart.switch} at {flip:.0f} s"))
    y_title = chart.label + (f" ({unit})" if unit else "")
    return figure(data, title=shorten(f"{chart.title}: {chart.label}", 60), height=340,
                  xaxis=dict(title={"text": "seconds since the lesson's before phase began"}, range=[0, end * 1.02]),
                  yaxis=dict(title={"text": shorten(y_title, 40)}, rangemode="tozero",
                             **({"range": [0, 105]} if chart.percent else {})),
                  legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=13)),
                  margin=dict(l=60, r=20, t=90, b=50), shapes=shapes, annotations=annotations)
