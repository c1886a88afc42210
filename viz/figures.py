"""Pure functions: an engine snapshot (or a history of samples) -> a plotly figure, as a plain dict.

Inputs are the plain data objects the engine publishes, read by attribute name only. Figures are plotly's JSON form
rather than `go.Figure` objects, whose validation of every property took a long time per refresh, time the engine
thread needs the GIL for (docs/measurements.md, "Does the page stay responsive?"); the tests check each is valid.
"""
from __future__ import annotations

import bisect
import json
import textwrap
import zlib
from collections.abc import Sequence

import plotly.graph_objects as go

FREE, CACHED_FREE = "#e8e8e8", "#9ecae1"
PALETTE = ["#e6550d", "#31a354", "#756bb1", "#d6616b", "#8c6d31", "#e7ba52", "#637939", "#7b4173",
           "#843c39", "#3182bd", "#636363", "#ce6dbd"]
# automargin on every axis: plotly grows a margin to fit its tick labels and title instead of cutting them
AXIS = dict(gridcolor="#eee", automargin=True)
# the legend sits between the title and the plot: below it, it collided with the x axis' title
LAYOUT = dict(margin=dict(l=50, r=20, t=75, b=40), height=300, plot_bgcolor="white", title=dict(font=dict(size=15)),
              legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom"), xaxis=AXIS, yaxis=AXIS)
IDLE_GAP_S = 2.0  # an engine idle longer than this between two steps breaks the time series' lines
LEGEND_OWNERS = 6  # the block table's legend names the requests holding most blocks, then "N other requests"
CELL_PX = 22  # a block table row at 32 columns, in pixels: the grid's height depends on the pool size only
CHAT_CELL_PX = 15  # the same in a chat's live view, which shares its row with the conversation (~450-600 px wide)
PREFILLING_OPACITY = 0.45  # a request whose prompt is still being prefilled in chunks: its blocks drawn faint
DIMMED_OPACITY = 0.25  # a chat's own view of the pool: everyone else's blocks drawn faint beside its own
# A change's label is drawn upright from the top of the plot down: longer ones would run past its bottom. Markers
# closer than MARKER_MERGE of the time span share one line, so their labels never pile on each other.
MARKER_LABEL_CHARS = 24
MARKER_MERGE = 0.04


def to_figure(spec: dict) -> go.Figure:
    """The spec as a validated plotly figure (raises on anything plotly would not accept)."""
    return go.Figure(spec)


def to_json(spec: dict) -> str:
    return json.dumps(spec, separators=(",", ":"))


def scatter(**kw) -> dict:
    return {"type": "scatter", **kw}


def figure(data: list[dict], **layout) -> dict:
    merged = {**LAYOUT, **layout}
    for axis in ("xaxis", "yaxis", "yaxis2"):
        if axis in LAYOUT or axis in layout:
            merged[axis] = {**AXIS, **layout.get(axis, {})}
    if isinstance(merged.get("title"), str):
        merged["title"] = {**LAYOUT["title"], "text": merged["title"]}
    return {"data": data, "layout": merged}


def note(text: str) -> dict:
    """A message in the middle of a chart, for when its lines would say nothing."""
    return dict(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font=dict(size=16, color="#555"),
                bgcolor="rgba(255,255,255,0.85)")


def corner_note(text: str) -> dict:
    """A message in a chart's lower right corner, clear of the lines drawn before it applied."""
    return {**note(text), "x": 0.98, "y": 0.04, "xanchor": "right", "yanchor": "bottom"}


PLACEHOLDER_CHARS = 44  # a line of a placeholder's text: it fits the chat's narrow live view at 1600 px


def placeholder_figure(text: str, height: int = 250) -> dict:
    """An empty chart that says why it is empty (gradio's own empty plot is a blank box), its text wrapped so a
    long reason stays inside a narrow chart."""
    wrapped = "<br>".join(textwrap.wrap(text, PLACEHOLDER_CHARS)) or text
    return figure([], height=height, margin=dict(l=10, r=10, t=10, b=10), annotations=[note(wrapped)],
                  xaxis=dict(visible=False), yaxis=dict(visible=False))


def _empty_note(history: Sequence) -> list[dict]:
    return [] if history else [note("no steps yet")]


def owner_colour(request_id: str) -> str:
    """Stable across refreshes: the same request keeps its colour."""
    return PALETTE[zlib.crc32(request_id.encode()) % len(PALETTE)]


def text_colour(background: str) -> str:
    """White on dark cells, near-black on light ones (by the colour's luma), so a ref count stays readable."""
    r, g, b = (int(background[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#222" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.6 else "white"


def block_cells(snap, cols: int = 32) -> list[dict]:
    """One dict per physical block: its grid position, state, owner(s), logical index, ref count and hash."""
    where: dict[int, list[tuple[str, int]]] = {}
    for rid, table in snap.block_tables.items():
        for logical, block in enumerate(table):
            where.setdefault(block, []).append((rid, logical))
    progress = prefill_progress(snap)
    cells = []
    for block, ref in enumerate(snap.block_ref_counts):
        h = snap.block_hashes[block]
        owners = where.get(block, [])
        state = "used" if ref > 0 else ("cached-free" if h is not None else "free")
        cell = {"block": block, "row": block // cols, "col": block % cols, "state": state, "ref_count": ref,
                "owners": owners, "hash": h, "shared": ref > 1, "prefilling": bool(owners) and owners[0][0] in progress}
        cell["hover"] = _cell_hover(cell)
        cells.append(cell)
    return cells


def prefill_progress(snap) -> dict[str, tuple[int, int]]:
    """Running requests whose prompt is still being prefilled (in chunks): id -> (computed, prompt tokens)."""
    return {rid: (r.num_computed_tokens, r.num_prompt_tokens) for rid, r in snap.requests.items() if r.prefilling}


def grid_columns(num_blocks: int) -> int:
    """32 columns, doubled while the grid would be more than 3/4 as tall as it is wide: a big pool gets
    smaller cells rather than a chart taller than the page."""
    cols = 32
    while num_blocks > cols * cols * 3 // 4:
        cols *= 2
    return cols


def block_table_figure(snap, cols: int | None = None, cells: list[dict] | None = None) -> dict:
    """Every block a square. The grid's shape depends only on the pool size, and the legend has at most
    LEGEND_OWNERS + 4 entries however many requests run, so neither jumps as requests come and go.
    `cells`: the snapshot's block_cells at `cols` columns (default grid_columns), when the caller has them."""
    cols = cols or grid_columns(len(snap.block_ref_counts))
    pitch = CELL_PX * min(1.0, 32 / cols)  # pixels per row (and, at the usual chart width, per column)
    cells = block_cells(snap, cols) if cells is None else cells
    by_owner: dict[str, list[dict]] = {}
    for c in cells:
        if c["owners"]:  # a shared block is drawn in its first owner's colour
            by_owner.setdefault(c["owners"][0][0], []).append(c)
    ranked = sorted(by_owner, key=lambda rid: (-len(by_owner[rid]), rid))
    named, others = ranked[:LEGEND_OWNERS], ranked[LEGEND_OWNERS:]
    progress = prefill_progress(snap)
    data = [_cells_trace(by_owner[rid], f"request {rid}" + (" (prefill {}/{})".format(*progress[rid])
                                                              if rid in progress else ""), owner_colour(rid), pitch)
            for rid in named]
    if others:
        rest = [c for rid in others for c in by_owner[rid]]
        colours = [owner_colour(c["owners"][0][0]) for c in rest]  # each still in its own colour
        data.append(_cells_trace(rest, f"{len(others)} other requests", colours, pitch))
    data += _free_traces(cells, pitch)
    data.append(scatter(x=[None], y=[None], mode="markers", name="shared (number = ref count)", hoverinfo="skip",
                        marker=dict(symbol="square", color="white", line=dict(width=2, color="black"))))
    # below the grid, the legend: 3-4 lines of fixed-width entries at most (LEGEND_OWNERS)
    return _grid_figure(data, len(cells), cols, pitch, 90, 170,
                        f"KV pool: {snap.kv_blocks_used}/{snap.kv_blocks_total} blocks used, "
                        f"{snap.kv_blocks_cached_free} cached-free (block = {snap.block_size} tokens)")


def highlighted_block_figure(snap, request_id: str | None, live: bool = False, cells: list[dict] | None = None) -> dict:
    """The block table as one chat sees it: its own request's blocks outlined, every other request's dimmed.
    `live`: the request is still streaming, though perhaps not in this snapshot yet."""
    cols = grid_columns(len(snap.block_ref_counts))
    pitch = CHAT_CELL_PX * min(1.0, 32 / cols)
    cells = block_cells(snap, cols) if cells is None else cells
    mine = [c for c in cells if request_id is not None and any(rid == request_id for rid, _ in c["owners"])]
    mine_ids = {c["block"] for c in mine}
    others = [c for c in cells if c["owners"] and c["block"] not in mine_ids]
    data = []
    if others:
        trace = _cells_trace(others, "other requests", [owner_colour(c["owners"][0][0]) for c in others], pitch)
        dim = DIMMED_OPACITY if mine else 1.0
        trace["marker"]["opacity"] = [o * dim for o in trace["marker"]["opacity"]]
        data.append(trace)
    data += _free_traces(cells, pitch)
    if request_id is not None:  # drawn last: on top of the others, with a thick outline
        trace = _cells_trace(mine, f"your request {request_id}", owner_colour(request_id), pitch)
        trace["marker"]["line"] = dict(width=2.5 if pitch >= 12 else 1.5, color="black")
        trace["marker"]["size"] = max(5, round(pitch * 0.9))  # a little larger than the others: it stands out
        data.append(trace)
    return _grid_figure(data, len(cells), cols, pitch, 60, 140, _highlight_title(snap, request_id, live, len(mine)))


def _free_traces(cells: list[dict], pitch: float) -> list[dict]:
    """The free and cached-free blocks: always in the legend, even when there are none."""
    return [_cells_trace([c for c in cells if c["state"] == state], state, colour, pitch)
            for state, colour in (("free", FREE), ("cached-free", CACHED_FREE))]


def _grid_figure(data: list[dict], num_blocks: int, cols: int, pitch: float, legend_px: int, entry_px: int,
                 title: str) -> dict:
    """A block grid `pitch` pixels a row, its title above it and `legend_px` of legend below it."""
    rows, top = max(1, -(-num_blocks // cols)), 50
    return figure(data, height=round(pitch * rows) + top + legend_px, margin=dict(l=10, r=10, t=top, b=legend_px),
                  legend=dict(orientation="h", x=0, y=0, yanchor="top", entrywidth=entry_px, itemsizing="constant"),
                  title=title, xaxis=dict(visible=False, range=[-0.6, cols - 0.4], fixedrange=True),
                  yaxis=dict(visible=False, range=[rows - 0.5, -0.5], fixedrange=True))


def _highlight_title(snap, request_id: str | None, live: bool, num_blocks: int) -> str:
    if request_id is None:
        return f"KV pool: {snap.kv_blocks_used}/{snap.kv_blocks_total} blocks used"
    req = snap.requests.get(request_id)
    if req is None:
        return f"Your request {request_id}: " + ("sent, not scheduled yet" if live else "finished, blocks freed")
    if req.status != "running":
        return f"Your request {request_id} waits for a seat or blocks"
    done, prompt = req.num_computed_tokens, req.num_prompt_tokens
    doing = f"prefill {done}/{prompt}" if done < prompt else f"decoding, {req.num_output_tokens} tokens out"
    return f"Your request {request_id}: {num_blocks} of {snap.kv_blocks_total} blocks, {doing}"


def _cells_trace(cells: list[dict], name: str, colour: str | list[str], pitch: float = CELL_PX) -> dict:
    text = text_colour(colour) if isinstance(colour, str) else [text_colour(c) for c in colour]
    roomy = pitch >= 16  # small cells: no room for a number (hover shows the ref count), a thinner outline
    if not cells:  # plotly leaves a trace without points out of the legend; one empty point keeps it there
        return scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                       marker=dict(symbol="square", color=colour))
    return scatter(
        x=[c["col"] for c in cells], y=[c["row"] for c in cells], mode="markers+text" if roomy else "markers",
        name=name, marker=dict(symbol="square", size=max(3, round(pitch * 0.64)), color=colour,
                               opacity=[PREFILLING_OPACITY if c["prefilling"] else 1.0 for c in cells],
                               line=dict(width=[(2 if roomy else 1) if c["shared"] else 0 for c in cells],
                                         color="black")),
        text=[str(c["ref_count"]) if c["shared"] else "" for c in cells], textfont=dict(size=9, color=text),
        hovertext=[c["hover"] for c in cells], hoverinfo="text")


def _cell_hover(c: dict) -> str:
    lines = [f"block {c['block']} · {c['state']} · ref count {c['ref_count']}"
             + (" · its request is still prefilling (chunked)" if c["prefilling"] else "")]
    lines += [f"request {rid}, logical block {logical}" for rid, logical in c["owners"]]
    if c["hash"] is not None:
        lines.append(f"prefix hash {c['hash'] & 0xFFFFFFFF:08x}")
    return "<br>".join(lines)


def recent_samples(history: Sequence, span_s: float, max_points: int) -> list:
    """The samples of the last span_s seconds, thinned to about max_points (the last of each equal slice of time),
    so a chart covers the same minutes at any step rate and a configuration change stays on screen beside what came
    before it. Counters are cumulative, so rates over thinned samples stay right."""
    if not history:
        return []
    end = history[-1].time
    start = max(end - span_s, history[0].time)  # a short history keeps its full resolution
    width = max(end - start, 1e-9) / max(1, max_points)
    kept: dict[int, object] = {}
    for h in history:
        if h.time >= start:
            kept[int((h.time - start) / width)] = h  # a later sample in the same slice replaces the earlier
    return list(kept.values())


def _times(history: Sequence) -> list[float]:
    t0 = history[0].time if history else 0.0
    return [h.time - t0 for h in history]


def _busy_starts(history: Sequence, idle_gap_s: float) -> list[bool]:
    """True where a sample starts a busy period: the engine sat idle longer than idle_gap_s before its step (the
    gap less the step's own time), or it is a new engine's first (its counters start again from 0: a rate reaching
    back across it would come out negative)."""
    return [i > 0 and (h.time - prev.time - h.step_ms / 1e3 > idle_gap_s or _counters_fell(h, prev))
            for i, (h, prev) in enumerate(zip(history, [None, *history[:-1]]))]


def _counters_fell(h, prev) -> bool:
    return (h.step < prev.step or h.generation_tokens_total < prev.generation_tokens_total
            or h.prefix_cache_queries < prev.prefix_cache_queries)


def _windowed_ratio(history: Sequence, window: int, num, den, scale: float = 1.0,
                    starts: Sequence[bool] | None = None) -> list[float | None]:
    """scale * d(num) / d(den) over the last `window` samples at each point (None where den did not move).
    With `starts`, a window never reaches back across an idle period (for rates over time)."""
    out, first = [], 0
    for i, h in enumerate(history):
        if starts is not None and starts[i]:
            first = i
        old = history[max(first, i - window)]
        d = den(h) - den(old)
        out.append(scale * (num(h) - num(old)) / d if d > 0 else None)
    return out


def _line(t: Sequence[float], y: Sequence, starts: Sequence[bool], drop_missing: bool = False, **kw) -> dict:
    """A line broken at idle periods (no slope drawn through time when nothing ran). A point with no neighbour
    (a lone step, as in step mode) gets a marker, since a line of one point draws nothing; a line with none has no
    markers at all (even of size 0 the page draws one per point, every second: docs/measurements.md, "What the
    Dashboard costs the browser"). With drop_missing, points without a value are left out, so the line joins its
    neighbours within a busy period."""
    xs: list[float | None] = []
    ys: list = []
    broken = False
    for x, v, start in zip(t, y, starts):
        broken = broken or start
        if v is None and drop_missing:
            continue
        if broken and xs:
            xs.append((xs[-1] + x) / 2)
            ys.append(None)
        broken = False
        xs.append(x)
        ys.append(v)
    lone = [v is not None and (i == 0 or ys[i - 1] is None) and (i == len(ys) - 1 or ys[i + 1] is None)
            for i, v in enumerate(ys)]
    if not any(lone):
        return scatter(x=xs, y=ys, mode="lines", **kw)
    return scatter(x=xs, y=ys, mode="lines+markers", marker=dict(size=[6 if a else 0 for a in lone]), **kw)


def change_label(change) -> str:
    """'prefix_caching=False', or '✗ num_kv_blocks=9999' for a change the engine could not build (drawn grey; its
    hover says "not applied" and why); 'engine restarted' for a change that replaced the engine itself."""
    if not change.changes:
        return f"engine {change.action}"
    text = ", ".join(f"{k}={v}" for k, v in change.changes.items())
    return f"✗ {text}" if change.error else text


def marker_label(group: Sequence) -> str:
    """A marker's label, short enough to read whole from the back of a room: one field ('prefix_caching off'),
    the first of several ('num_kv_blocks=96 +1'), or how many changes share the marker; hover has them all."""
    if len(group) > 1:
        return f"{len(group)} changes"
    change = group[0]
    if not change.changes:
        return f"engine {change.action}"
    (name, value), more = next(iter(change.changes.items())), len(change.changes) - 1
    word = "on" if value is True else "off" if value is False else "auto" if value is None else value
    text = f"{name} {word}" if isinstance(value, bool) else f"{name}={word}"
    return ("✗ " if change.error else "") + shorten(text, MARKER_LABEL_CHARS - 4) + (f" +{more}" if more else "")


def change_markers(history: Sequence, changes: Sequence) -> tuple[list[dict], list[dict]]:
    """(shapes, annotations): a dotted vertical line and an upright label for each configuration change (the
    service's ConfigChange records) since the first sample, on the same time axis as the samples."""
    if not history or not changes:
        return [], []
    t0 = history[0].time
    points = sorted(((c.time - t0, c) for c in changes if c.time >= t0), key=lambda p: p[0])
    if not points:
        return [], []
    span = max(history[-1].time - t0, points[-1][0], 1.0)
    groups: list[tuple[float, list]] = []
    for x, change in points:
        if groups and x - groups[-1][0] < MARKER_MERGE * span:
            groups[-1][1].append(change)
        else:
            groups.append((x, [change]))
    shapes, annotations = [], []
    for x, group in groups:
        label = marker_label(group)
        colour = "#999" if all(c.error for c in group) else "#333"
        hover = "<br>".join(f"step {c.step}: {change_label(c)} "
                            + (f"(not applied: {c.error})" if c.error else f"({c.action})") for c in group)
        shapes.append(dict(type="line", xref="x", yref="paper", x0=x, x1=x, y0=0, y1=1,
                           line=dict(color=colour, width=1.5, dash="dot")))
        annotations.append(dict(x=x, xref="x", y=1, yref="paper", xanchor="right", yanchor="top", textangle=-90,
                                text=shorten(label, MARKER_LABEL_CHARS), hovertext=hover, showarrow=False,
                                font=dict(size=11, color=colour), bgcolor="rgba(255,255,255,0.75)"))
    return shapes, annotations


def shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _marked(layout_annotations: list[dict], history: Sequence, changes: Sequence) -> dict:
    """Layout keys for a time-series chart: its own notes plus the configuration changes' markers."""
    shapes, annotations = change_markers(history, changes)
    return dict(shapes=shapes, annotations=layout_annotations + annotations)


def queues_figure(history: Sequence, idle_gap_s: float = IDLE_GAP_S, changes: Sequence = ()) -> dict:
    t, starts = _times(history), _busy_starts(history, idle_gap_s)
    pre = [(x, h.num_running) for x, h, prev in zip(t[1:], history[1:], history)
           if h.num_preemptions > prev.num_preemptions]
    return figure([
        _line(t, [h.num_running for h in history], starts, name="running"),
        _line(t, [h.num_waiting for h in history], starts, name="waiting"),
        scatter(x=[p[0] for p in pre], y=[p[1] for p in pre], name="preemption", mode="markers",
                marker=dict(symbol="x", size=10, color="red")),
    ], title="Scheduler queues", xaxis=dict(title={"text": "seconds"}),
        **_marked(_empty_note(history), history, changes),
        yaxis=dict(title={"text": "requests"}, rangemode="tozero", **whole_ticks(
            max((max(h.num_running, h.num_waiting) for h in history), default=0))))


def whole_ticks(top: int) -> dict:
    """Ticks at whole numbers: there is no half a request."""
    return dict(tick0=0, dtick=max(1, -(-top // 5)))


def _after_changes(history: Sequence, changes: Sequence, starts: Sequence[bool]) -> list[bool]:
    """`starts`, plus the first sample after each configuration change the engine applied."""
    times = [h.time for h in history]
    out = list(starts)
    for change in changes:
        i = bisect.bisect_left(times, change.time)
        if not change.error and 0 < i < len(out):
            out[i] = True
    return out


def prefix_cache_figure(history: Sequence, window: int = 20, active: bool = True,
                        idle_gap_s: float = IDLE_GAP_S, changes: Sequence = ()) -> dict:
    """`active`: whether prefix caching is on now (the snapshot's features); when off, the chart says so."""
    t, starts = _times(history), _busy_starts(history, idle_gap_s)
    # The recent rate never reaches back across a configuration change: with caching switched off no prompt is looked
    # up, so the line stops at the change instead of being drawn on from the hits before it.
    breaks = _after_changes(history, changes, starts)
    rate = _windowed_ratio(history, window, lambda h: h.prefix_cache_hits, lambda h: h.prefix_cache_queries, 100,
                           starts=breaks)
    return figure([
        _line(t, rate, breaks, drop_missing=True, name="hit rate, recent (%)"),
        _line(t, [h.prefix_cache_hits for h in history], starts, name="cumulative hit tokens", yaxis="y2"),
    ], title="Prefix cache", xaxis=dict(title={"text": "seconds"}),
        yaxis=dict(title={"text": "hit rate %"}, range=[0, 105]),
        yaxis2=dict(title={"text": "tokens"}, overlaying="y", side="right", rangemode="tozero", showgrid=False),
        **_marked(_empty_note(history) if active else [corner_note("prefix caching is off")], history, changes))


def throughput_figure(history: Sequence, window: int = 10, idle_gap_s: float = IDLE_GAP_S,
                      changes: Sequence = ()) -> dict:
    t, starts = _times(history), _busy_starts(history, idle_gap_s)
    tps = _windowed_ratio(history, window, lambda h: h.generation_tokens_total, lambda h: h.time, starts=starts)
    return figure([
        _line(t, tps, starts, drop_missing=True, name="tokens/s"),
        scatter(x=t, y=[h.ttft_s * 1e3 if h.ttft_s else None for h in history], name="TTFT (ms)", mode="markers",
                yaxis="y2"),
        scatter(x=t, y=[h.tpot_s * 1e3 if h.tpot_s else None for h in history], name="TPOT (ms)", mode="markers",
                yaxis="y2"),
    ], title="Throughput and latency", xaxis=dict(title={"text": "seconds"}),
        **_marked(_empty_note(history), history, changes),
        yaxis=dict(title={"text": "tokens/s"}, rangemode="tozero"),
        yaxis2=dict(title={"text": "ms"}, overlaying="y", side="right", rangemode="tozero", showgrid=False))


def recent_tokens_per_s(history: Sequence, window: int = 10, idle_gap_s: float = IDLE_GAP_S) -> float:
    """Tokens generated per second over the last `window` steps (as the throughput chart's last point), 0 when
    the engine has not stepped twice since it was last idle."""
    recent = list(history)[-(window + 1):]
    rates = _windowed_ratio(recent, window, lambda h: h.generation_tokens_total, lambda h: h.time,
                            starts=_busy_starts(recent, idle_gap_s))
    return (rates[-1] or 0.0) if rates else 0.0


def memory_figure(snap, system: dict, kv_label: str = "KV pool (blocks)") -> dict:
    """KV pool use, and the device's memory: GPU (via pynvml) when present, else this process's RSS.
    `kv_label`: what the pool's numbers count (a remote server may report only a percentage)."""
    names = [kv_label]
    used, total = [snap.kv_blocks_used], [max(snap.kv_blocks_total, 1)]
    for key, label in (("gpu_used_gb", "GPU memory (GB)"), ("rss_gb", "process RSS (GB)")):
        if system.get(key) is not None:
            names.append(label)
            used.append(system[key])
            total.append(system.get(key.replace("used", "total").replace("rss", "ram_total"), system[key]))
    pct = [100 * u / t for u, t in zip(used, total)]
    annotations = []
    if system.get("gpu_util") is not None:
        annotations.append(dict(text=f"GPU utilisation {system['gpu_util']}%", x=100, y=len(names) - 1,
                                xanchor="right", showarrow=False))
    # labels beside their bars (an empty pool's bar has no inside), in a right margin wide enough for them
    data = [{"type": "bar", "x": pct, "y": names, "orientation": "h", "textposition": "outside", "showlegend": False,
             "cliponaxis": False, "text": [f"{amount(u)} / {amount(t)}" for u, t in zip(used, total)]}]
    split = gpu_memory_split(snap, system)
    if split:  # one more bar: what holds the card's memory, as the engine sized its pool
        data += [{"type": "bar", "x": [100 * gb / system["gpu_total_gb"]], "y": [GPU_SPLIT_ROW], "name": part,
                  "orientation": "h", "marker": {"color": colour}, "text": [f"{part} {amount(round(gb, 2))} GB"],
                  "textposition": "inside", "insidetextanchor": "middle", "hoverinfo": "text"}
                 for (part, gb), colour in zip(split, GPU_SPLIT_COLOURS)]
    return figure(data, height=240 if split else 200, title="Memory", margin=dict(l=50, r=110, t=50, b=40),
                  xaxis=dict(range=[0, 100], title={"text": "% used"}), barmode="stack", annotations=annotations,
                  legend=dict(orientation="h", y=-0.35))


GPU_SPLIT_ROW = "GPU: what holds it"
GPU_SPLIT_COLOURS = ("#6baed6", "#fd8d3c", "#31a354", "#d9d9d9")


def gpu_memory_split(snap, system: dict) -> list[tuple[str, float]]:
    """The card's memory in GB as the engine sized its KV pool (snapshot.gpu_memory) and NVML sees it; empty
    without both (CPU, a pool given in GB or blocks, no NVML)."""
    plan, total = getattr(snap, "gpu_memory", None), system.get("gpu_total_gb")
    if not plan or not total:
        return []
    gib = 2 ** 30
    pool = snap.kv_blocks_total * getattr(snap, "kv_bytes_per_block", 0) / gib
    parts = [("weights + context", plan["used_before_bytes"] / gib),
             ("activations (peak)", plan["activation_peak_bytes"] / gib), ("KV pool", pool)]
    return parts + [("free", max(0.0, total - sum(gb for _, gb in parts)))]


def amount(x: float) -> str:
    """2048 rather than 2.05e+03; 0.654 rather than 0.6543212."""
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
