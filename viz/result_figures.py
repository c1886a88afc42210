"""Pure functions: a measurement's results (a comparison, an ablation, the feature-by-feature sweeps, quantized
quality) -> a plotly figure, as a plain dict, with viz/figures.py's primitives."""
from __future__ import annotations

import math
from collections.abc import Sequence

from .figures import AXIS, PALETTE, amount, figure, note, scatter, whole_ticks


def _axis(i: int) -> str:
    """Plotly's name for the i-th panel's axes: "" (x, y), then "2" (x2, y2), ..."""
    return "" if i == 0 else str(i + 1)


def _panels(titles: Sequence[str], xgap: float) -> dict:
    """Layout keys for one row of independent panels, each titled above, each panel's axes styled as the first's."""
    return {"grid": {"rows": 1, "columns": len(titles), "pattern": "independent", "xgap": xgap},
            **{f"{xy}axis{_axis(i)}": dict(AXIS) for i in range(1, len(titles)) for xy in "xy"},
            "annotations": [{"text": title, "showarrow": False, "xref": f"x{_axis(i)} domain",
                             "yref": f"y{_axis(i)} domain", "x": 0.5, "y": 1.0, "yanchor": "bottom"}
                            for i, title in enumerate(titles)]}


def compare_figure(result) -> dict:
    """Two configurations side by side (a CompareResult): throughput, mean TTFT and mean TPOT, a panel each, the
    better of the two green."""
    metrics = [("throughput", "tokens/s", 1.0, True), ("mean_ttft_s", "TTFT (ms)", 1e3, False),
               ("mean_tpot_s", "TPOT (ms)", 1e3, False)]
    labels = list(result.labels)
    data = []
    for i, (attr, label, scale, higher) in enumerate(metrics):
        axis = _axis(i)
        values = [None if (v := getattr(r, attr)) is None else v * scale for r in result.results]
        data.append({"type": "bar", "x": labels, "y": values, "name": label, "xaxis": f"x{axis}",
                     "yaxis": f"y{axis}", "text": ["" if v is None else amount(v) for v in values],
                     "textposition": "auto", "marker": {"color": _better_green(values, higher)},
                     "showlegend": False})
    return figure(data, title="A vs B on the same workload", margin=dict(l=50, r=20, t=80, b=40),
                  **_panels([label for _, label, _, _ in metrics], 0.15))


def ablation_figure(rows: Sequence) -> dict:
    """Bar per configuration (AblationRow) that ran: tokens/s, labelled with the multiplier against the full engine."""
    rows = [r for r in rows if r.throughput_tok_s]
    top = max((r.throughput_tok_s for r in rows), default=1.0)
    return figure([{"type": "bar", "x": [r.feature for r in rows], "y": [r.throughput_tok_s for r in rows],
                    "text": [f"{r.ratio:.2f}x" for r in rows], "textposition": "outside", "cliponaxis": False,
                    "hovertemplate": "%{x}: %{y:.1f} tokens/s (%{text})<extra></extra>",
                    "marker": {"color": ["#31a354" if r.switch is None else "#9ecae1" for r in rows]}}],
                  title="What each feature is worth (measured here)",
                  # headroom above the tallest bar for its "1.00x" label
                  yaxis=dict(title={"text": "tokens/s"}, range=[0, top * 1.18]))


GAIN, LOSS, EVEN, BASELINE = "#31a354", "#d6616b", "#9ecae1", "#636363"
NOISE = 0.05  # within 5% of 1x is the noise of a shared machine (docs/measurements.md: 5-10%), not a gain or a loss
LEVEL_COLOURS = ["#fd8d3c", "#6baed6", "#08519c"]  # concurrency 1, 8, 32: warm for one request, dark for many


def _times_x(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x"


def _gain_colour(ratio: float | None) -> str:
    if ratio is None:
        return BASELINE
    return GAIN if ratio >= 1 + NOISE else LOSS if ratio <= 1 - NOISE else EVEN


def _two_lines(label: str) -> str:
    """'naive loop (everything off)' over two lines, so seven bars' labels fit side by side."""
    return label.replace(" (", "<br>(")


def cumulative_figure(rows: Sequence) -> dict:
    """measure.ablate_cumulative's rows, a bar each: what its feature added (step_ratio, bold) and the total against
    the naive loop (ratio); a configuration that could not run keeps its place, marked."""
    cats = [_two_lines(r.feature) for r in rows]
    ran = [r for r in rows if r.throughput_tok_s]
    text = ["" if not r.throughput_tok_s else
            "<b>baseline</b>" if r.step_ratio is None else
            f"<b>{_times_x(r.step_ratio)}</b><br>total {_times_x(r.ratio)}" for r in rows]
    top = max((r.throughput_tok_s for r in ran), default=1.0)
    bar = {"type": "bar", "x": cats, "y": [r.throughput_tok_s or None for r in rows], "text": text,
           "textposition": "outside", "cliponaxis": False, "textfont": {"size": 13},
           "marker": {"color": [_gain_colour(r.step_ratio) for r in rows]},
           "hovertemplate": "%{x}: %{y:.1f} tokens/s<extra></extra>"}
    failed = [dict(x=c, y=0, yanchor="bottom", showarrow=False, text="could not run<br>(see the table)",
                   font=dict(color=LOSS)) for c, r in zip(cats, rows) if not r.throughput_tok_s]
    return figure([bar], height=460, margin=dict(l=60, r=20, t=80, b=60), showlegend=False,
                  title="The engine, feature by feature: tokens/s as each feature is added back (measured)<br>"
                        "<sup>bold: what that feature added · total: against the naive loop · green = a gain, "
                        "red = a loss, blue = within 5% (noise)</sup>",
                  annotations=failed if ran else [note("no configuration ran")],
                  # headroom above the tallest bar for its two-line label
                  yaxis=dict(title={"text": "tokens/s"}, range=[0, top * 1.3]), xaxis=dict(tickangle=0))


def concurrency_figure(rows: Sequence, level: int | None = None, names: dict[str, str] | None = None) -> dict:
    """Each feature's worth at each concurrency: the full engine's tokens/s over the engine's without it, drawn
    from 1x on a log axis so a 10x and a 1.1x both read. level: only that concurrency. names: switch -> name."""
    names = names or {}
    label = {r.switch: names.get(r.switch, r.feature) for r in rows if r.switch}
    levels = sorted({r.concurrency for r in rows if r.concurrency is not None})
    shown = [lv for lv in levels if level is None or lv == level]
    by = {(r.switch, r.concurrency): r for r in rows}
    data, worths = [], []
    for lv in shown:
        worth = [1 / r.ratio if (r := by.get((s, lv))) and r.ratio else None for s in label]
        worths += [w for w in worth if w]
        data.append({"type": "bar", "name": f"concurrency {lv}", "x": [_two_lines(n) for n in label.values()],
                     "base": 1, "y": [None if w is None else w - 1 for w in worth],
                     "text": [_times_x(w) if w else "" for w in worth], "textposition": "outside",
                     "cliponaxis": False, "customdata": worth,
                     "marker": {"color": LEVEL_COLOURS[levels.index(lv) % len(LEVEL_COLOURS)]},
                     "hovertemplate": f"%{{x}} at concurrency {lv}: %{{customdata:.2f}}x<extra></extra>"})
    where = "at each concurrency" if level is None else f"at concurrency {level}"
    lo, hi = min(worths + [1.0]) / 1.6, max(worths + [1.0]) * 1.8  # room for the labels above and below
    return figure(data, height=440, barmode="group", margin=dict(l=60, r=20, t=90, b=60),
                  title=f"What each feature is worth {where} (full engine ÷ engine without it)",
                  shapes=[dict(type="line", xref="paper", x0=0, x1=1, y0=1, y1=1, line=dict(color="#555", dash="dot"))],
                  annotations=[] if worths else [note("no feature ran at this concurrency")],
                  yaxis=dict(type="log", range=[math.log10(lo), math.log10(hi)], title={"text": "x tokens/s (log)"}),
                  xaxis=dict(tickangle=0))


MEMORY_PANELS = (("peak_running", "requests running at once (peak)"), ("preemptions", "preemptions"),
                 ("throughput_tok_s", "tokens/s"))


def memory_sweep_figure(rows: Sequence) -> dict:
    """The memory sweep (MemoryRows), each layout and KV dtype over the pool's size in MB (so dtypes line up by
    memory); a layout that could not run in a pool is drawn as 0 requests, with an x."""
    mb = {}  # a pool that could not be built has no size of its own: take its sibling's
    for r in rows:
        key = (r.num_kv_blocks, getattr(r, "kv_cache_dtype", None))
        mb[key] = max(mb.get(key, 0.0), r.kv_cache_mb or 0.0)
    series: dict[tuple[bool, str | None], list] = {}
    for r in rows:
        series.setdefault((r.paged, getattr(r, "kv_cache_dtype", None)), []).append(r)
    dtypes = list(dict.fromkeys(dtype for _, dtype in series))
    data = []
    for (paged, dtype), members in series.items():
        members = sorted((r for r in members if mb[(r.num_kv_blocks, dtype)] > 0), key=lambda r: r.num_kv_blocks)
        name = ("paged" if paged else "contiguous") + (f", KV {dtype}" if dtype else "")
        x = [mb[(r.num_kv_blocks, dtype)] for r in members]
        style = dict(color=GAIN if paged else PALETTE[0], dash=["solid", "dash", "dot"][dtypes.index(dtype) % 3])
        for i, (attr, _) in enumerate(MEMORY_PANELS):
            axis = _axis(i)
            y = [getattr(r, attr) if not r.error else (0 if i == 0 else None) for r in members]
            labelled = i == 0  # the number of requests that fit, written by each point
            data.append(scatter(
                x=x, y=y, name=name, legendgroup=name, showlegend=i == 0,
                mode="lines+markers+text" if labelled else "lines+markers", xaxis=f"x{axis}", yaxis=f"y{axis}",
                line=style, textposition="top center", cliponaxis=False,
                text=[str(v) if v is not None else "" for v in y] if labelled else None,
                marker=dict(color=style["color"], size=8, symbol=["x" if r.error else "circle" for r in members]),
                customdata=[f"{r.num_kv_blocks} blocks" + (f": {r.error}" if r.error else "") for r in members],
                hovertemplate=f"{name}, %{{x:.3~g}} MB, %{{customdata}}: %{{y}}<extra></extra>"))
    # one tick label for pools within 5% of each other (an int8 pool sized to a float32 one's memory lands within a
    # percent of it): two labels there overprinted each other
    ticks: list[float] = []
    for v in sorted(set(v for v in mb.values() if v > 0)):
        if not ticks or v > ticks[-1] * 1.05:
            ticks.append(v)
    layout = {**_panels([label for _, label in MEMORY_PANELS], 0.12),
              "legend": dict(orientation="v", x=1.01, xanchor="left", y=1.0, yanchor="top")}
    if not ticks:
        layout["annotations"] = [note("no pool size ran")]
    x_axis = dict(AXIS, type="log", tickvals=ticks, ticktext=[f"{amount(t)} MB" for t in ticks],
                  title={"text": "KV pool"})
    for i, (attr, _) in enumerate(MEMORY_PANELS):
        axis = _axis(i)
        layout[f"xaxis{axis}"] = x_axis
        layout[f"yaxis{axis}"] = dict(AXIS, rangemode="tozero")
        if attr != "throughput_tok_s":  # counts: no half a request, no 1.5 preemptions
            layout[f"yaxis{axis}"].update(whole_ticks(max((getattr(r, attr) or 0 for r in rows), default=0)))
    return figure(data, height=380, title="Memory is still the constraint: what fits in each KV pool (measured)",
                  margin=dict(l=50, r=20, t=80, b=60), **layout)


QUALITY_PANELS = ("top-1 agreement with fp32 (%)", "perplexity change vs fp32 (%)")


def _precision_label(precision: str) -> str:
    """'float32, int4 weights (groups of 32), int8 KV' as 'int4 weights (groups of 32), int8 KV': the reference
    is fp32, so a row in fp32 says only what it changes."""
    parts = precision.split(", ")
    if len(parts) > 1 and parts[0] == "float32":
        parts = parts[1:]
    return ", ".join(parts)


def _signed(percent: float) -> str:
    """+3.4%, -0.3%; a change that rounds to nothing is 0.0%, not -0.0%."""
    text = f"{percent:+.1f}%"
    return "0.0%" if text in ("+0.0%", "-0.0%") else text


def _better_green(values: list, higher_is_better: bool) -> list[str]:
    """Each bar's colour: GAIN for the strictly better value, EVEN for the rest."""
    known = [v for v in values if v is not None]
    if len(known) < 2 or max(known) == min(known):
        return [EVEN] * len(values)
    best = max(known) if higher_is_better else min(known)
    return [GAIN if v == best else EVEN for v in values]


def _percent(value: float, goal: float | None) -> str:
    """97.97% rather than 98.0% beside a 98% goal it falls short of: one decimal, two within 0.1 of the goal."""
    return f"{value:.2f}%" if goal is not None and abs(value - goal) < 0.1 else f"{value:.1f}%"


def _against_goal(value: float, goal: float | None, higher_is_better: bool) -> str:
    if goal is None:
        return EVEN
    return GAIN if (value >= goal if higher_is_better else value <= goal) else LOSS


def quality_figure(rows: Sequence, goals: Sequence[tuple[float, float | None] | None] | None = None) -> dict:
    """What each precision costs in quality (QualityRows): how often its most likely next token is fp32's, and how far
    its perplexity moves, a row per precision across two panels. goals: per row, (least top-1 agreement, most
    perplexity change or None) or None: a black dash, the bar green when it meets it, red when short, else blue."""
    goals = list(goals) if goals is not None else [None] * len(rows)
    cats = [_precision_label(r.precision) for r in rows]
    top1 = [100 * r.top1_agreement for r in rows]
    ppl = [100 * r.perplexity_change for r in rows]
    top1_goal = [None if g is None else 100 * g[0] for g in goals]
    ppl_goal = [None if g is None or g[1] is None else 100 * g[1] for g in goals]
    data = []
    for axis, values, wanted, higher, labels in (("", top1, top1_goal, True,
                                                  [_percent(v, g) for v, g in zip(top1, top1_goal, strict=True)]),
                                                 ("2", ppl, ppl_goal, False, [_signed(v) for v in ppl])):
        data.append({"type": "bar", "orientation": "h", "y": cats, "x": values, "xaxis": f"x{axis}",
                     "yaxis": f"y{axis}", "text": labels, "textposition": "outside", "cliponaxis": False,
                     "width": min(0.7, 0.175 * len(rows)),  # one or two precisions: not a bar as tall as the panel
                     "marker": {"color": [_against_goal(v, g, higher) for v, g in zip(values, wanted, strict=True)]},
                     "showlegend": False, "hovertemplate": "%{y}: %{x:.2f}%<extra></extra>"})
        marked = [(c, g) for c, g in zip(cats, wanted, strict=True) if g is not None]
        if marked:
            data.append(scatter(y=[c for c, _ in marked], x=[g for _, g in marked], xaxis=f"x{axis}",
                                yaxis=f"y{axis}", mode="markers", name="goal",
                                legendgroup="goal", showlegend=axis == "",
                                marker=dict(symbol="line-ns-open", size=22, color="#222", line=dict(width=3)),
                                hovertemplate=f"%{{y}}: goal {'≥' if higher else '≤'} %{{x:.0f}}%<extra></extra>"))
    low = min(top1 + [g for g in top1_goal if g is not None] + [100.0])
    floor = max(0.0, 5 * math.floor((low - 6) / 5))  # a bar's difference from 100% stays visible
    spread = ppl + [g for g in ppl_goal if g is not None] + [0.0]
    pad = max(1.0, 0.2 * (max(spread) - min(spread)))  # room on both sides for the labels
    order = dict(categoryorder="array", categoryarray=cats[::-1])  # the first row on top
    panels = _panels(QUALITY_PANELS, 0.12)
    layout = {**panels, "annotations": panels["annotations"] + ([] if rows else [note("no precision ran")]),
              "xaxis": dict(range=[floor, 104], ticksuffix="%"),
              "xaxis2": dict(AXIS, range=[min(spread) - pad, max(spread) + pad], ticksuffix="%", zeroline=True,
                             zerolinecolor="#888"),
              "yaxis": dict(order, automargin=True),
              "yaxis2": dict(order, matches="y", showticklabels=False),
              "legend": dict(orientation="h", x=1.0, xanchor="right", y=1.0, yanchor="bottom")}
    return figure(data, height=150 + 34 * max(len(rows), 2), margin=dict(l=20, r=30, t=100, b=40),
                  title="What each precision costs in quality: against the fp32 engine on the same text (measured)"
                        "<br><sup>green: meets the project's goal (black dash) · red: short · blue: "
                        "no goal for that combination</sup>", **layout)
