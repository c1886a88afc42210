"""Pure functions: an engine snapshot (or a history of samples) -> a plotly figure, as a plain dict.

Nothing here touches the engine: inputs are the plain data objects the engine publishes
(`EngineSnapshot`, `HistorySample`, ablation rows), read by attribute name only. Figures are plotly's JSON
form ({"data": [...], "layout": {...}}) rather than `go.Figure` objects: building those validates every
property and took ~150 ms per refresh, time the engine thread needs the GIL for. `to_figure` (and the
tests) check that every spec is a valid plotly figure.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Sequence

import plotly.graph_objects as go

FREE, CACHED_FREE = "#e8e8e8", "#9ecae1"
PALETTE = ["#e6550d", "#31a354", "#756bb1", "#d6616b", "#8c6d31", "#e7ba52", "#637939", "#7b4173",
           "#843c39", "#3182bd", "#636363", "#ce6dbd"]
LAYOUT = dict(margin=dict(l=40, r=10, t=40, b=30), height=300, plot_bgcolor="white",
              legend=dict(orientation="h", y=-0.2), xaxis=dict(gridcolor="#eee"), yaxis=dict(gridcolor="#eee"))


def to_figure(spec: dict) -> go.Figure:
    """The spec as a validated plotly figure (raises on anything plotly would not accept)."""
    return go.Figure(spec)


def to_json(spec: dict) -> str:
    return json.dumps(spec, separators=(",", ":"))


def scatter(**kw) -> dict:
    return {"type": "scatter", **kw}


def figure(data: list[dict], **layout) -> dict:
    merged = {**LAYOUT, **layout}
    for axis in ("xaxis", "yaxis"):
        merged[axis] = {**LAYOUT[axis], **layout.get(axis, {})}
    if isinstance(merged.get("title"), str):
        merged["title"] = {"text": merged["title"]}
    return {"data": data, "layout": merged}


def owner_colour(request_id: str) -> str:
    """Stable across refreshes: the same request keeps its colour."""
    return PALETTE[zlib.crc32(request_id.encode()) % len(PALETTE)]


def block_cells(snap, cols: int = 32) -> list[dict]:
    """One dict per physical block: its grid position, state, owner(s), logical index, ref count and hash."""
    where: dict[int, list[tuple[str, int]]] = {}
    for rid, table in snap.block_tables.items():
        for logical, block in enumerate(table):
            where.setdefault(block, []).append((rid, logical))
    cells = []
    for block, ref in enumerate(snap.block_ref_counts):
        h = snap.block_hashes[block]
        owners = where.get(block, [])
        state = "used" if ref > 0 else ("cached-free" if h is not None else "free")
        cells.append({"block": block, "row": block // cols, "col": block % cols, "state": state, "ref_count": ref,
                      "owners": owners, "hash": h, "shared": ref > 1})
    return cells


def block_table_figure(snap, cols: int = 32) -> dict:
    cells = block_cells(snap, cols)
    groups: dict[str, list[dict]] = {}
    for c in cells:
        key = c["owners"][0][0] if c["owners"] else c["state"]
        groups.setdefault(key, []).append(c)
    data = []
    for key, group in groups.items():
        colour = FREE if key == "free" else CACHED_FREE if key == "cached-free" else owner_colour(key)
        name = key if key in ("free", "cached-free") else f"request {key}"
        data.append(scatter(
            x=[c["col"] for c in group], y=[c["row"] for c in group], mode="markers+text", name=name,
            marker=dict(symbol="square", size=14, color=colour,
                        line=dict(width=[2 if c["shared"] else 0 for c in group], color="black")),
            text=[str(c["ref_count"]) if c["shared"] else "" for c in group], textfont=dict(size=8),
            hovertext=[_cell_hover(c) for c in group], hoverinfo="text", showlegend=len(groups) <= 14))
    rows = max(1, -(-len(cells) // cols))
    return figure(data, height=max(220, 22 * rows + 90),
                  title=f"KV pool: {snap.kv_blocks_used}/{snap.kv_blocks_total} blocks used, "
                        f"{snap.kv_blocks_cached_free} cached-free (block = {snap.block_size} tokens)",
                  xaxis=dict(visible=False, range=[-1, cols]), yaxis=dict(visible=False, autorange="reversed"))


def _cell_hover(c: dict) -> str:
    lines = [f"block {c['block']} · {c['state']} · ref count {c['ref_count']}"]
    lines += [f"request {rid}, logical block {logical}" for rid, logical in c["owners"]]
    if c["hash"] is not None:
        lines.append(f"prefix hash {c['hash'] & 0xFFFFFFFF:08x}")
    return "<br>".join(lines)


def _times(history: Sequence) -> list[float]:
    t0 = history[0].time if history else 0.0
    return [h.time - t0 for h in history]


def _windowed_ratio(history: Sequence, window: int, num, den, scale: float = 1.0) -> list[float | None]:
    """scale * d(num) / d(den) over the last `window` samples at each point (None where den did not move)."""
    out = []
    for i, h in enumerate(history):
        old = history[max(0, i - window)]
        d = den(h) - den(old)
        out.append(scale * (num(h) - num(old)) / d if d > 0 else None)
    return out


def queues_figure(history: Sequence) -> dict:
    t = _times(history)
    pre = [(x, h.num_running) for x, h, prev in zip(t[1:], history[1:], history)
           if h.num_preemptions > prev.num_preemptions]
    return figure([
        scatter(x=t, y=[h.num_running for h in history], name="running", mode="lines"),
        scatter(x=t, y=[h.num_waiting for h in history], name="waiting", mode="lines"),
        scatter(x=[p[0] for p in pre], y=[p[1] for p in pre], name="preemption", mode="markers",
                marker=dict(symbol="x", size=10, color="red")),
    ], title="Scheduler queues", xaxis=dict(title={"text": "seconds"}), yaxis=dict(title={"text": "requests"}))


def prefix_cache_figure(history: Sequence, window: int = 20) -> dict:
    t = _times(history)
    rate = _windowed_ratio(history, window, lambda h: h.prefix_cache_hits, lambda h: h.prefix_cache_queries, 100)
    return figure([
        scatter(x=t, y=rate, name="hit rate, recent (%)", mode="lines", connectgaps=True),
        scatter(x=t, y=[h.prefix_cache_hits for h in history], name="cumulative hit tokens", mode="lines",
                yaxis="y2"),
    ], title="Prefix cache", xaxis=dict(title={"text": "seconds"}),
        yaxis=dict(title={"text": "hit rate %"}, range=[0, 100]),
        yaxis2=dict(title={"text": "tokens"}, overlaying="y", side="right", rangemode="tozero"))


def throughput_figure(history: Sequence, window: int = 10) -> dict:
    t = _times(history)
    tps = _windowed_ratio(history, window, lambda h: h.generation_tokens_total, lambda h: h.time)
    return figure([
        scatter(x=t, y=tps, name="tokens/s", mode="lines"),
        scatter(x=t, y=[h.ttft_s * 1e3 if h.ttft_s else None for h in history], name="TTFT (ms)", mode="markers",
                yaxis="y2"),
        scatter(x=t, y=[h.tpot_s * 1e3 if h.tpot_s else None for h in history], name="TPOT (ms)", mode="markers",
                yaxis="y2"),
    ], title="Throughput and latency", xaxis=dict(title={"text": "seconds"}),
        yaxis=dict(title={"text": "tokens/s"}, rangemode="tozero"),
        yaxis2=dict(title={"text": "ms"}, overlaying="y", side="right", rangemode="tozero"))


def memory_figure(snap, system: dict) -> dict:
    """KV pool use, and the device's memory: GPU (via pynvml) when present, else this process's RSS."""
    names = ["KV pool (blocks)"]
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
                                showarrow=False))
    return figure([{"type": "bar", "x": pct, "y": names, "orientation": "h", "textposition": "auto",
                    "text": [f"{u:.3g} / {t:.3g}" for u, t in zip(used, total)]}],
                  height=200, title="Memory", xaxis=dict(range=[0, 100], title={"text": "% used"}),
                  annotations=annotations)


def compare_figure(result) -> dict:
    """Two configurations side by side (a CompareResult): throughput, mean TTFT and mean TPOT, a panel each."""
    metrics = [("throughput", "tokens/s", 1.0), ("mean_ttft_s", "TTFT (ms)", 1e3), ("mean_tpot_s", "TPOT (ms)", 1e3)]
    labels = list(result.labels)
    data = []
    for i, (attr, label, scale) in enumerate(metrics):
        axis = "" if i == 0 else str(i + 1)
        values = [getattr(r, attr) for r in result.results]
        data.append({"type": "bar", "x": labels, "y": [None if v is None else v * scale for v in values],
                     "name": label, "xaxis": f"x{axis}", "yaxis": f"y{axis}",
                     "marker": {"color": ["#9ecae1", "#31a354"]}, "showlegend": False})
    layout = {"grid": {"rows": 1, "columns": 3, "pattern": "independent"},
              "annotations": [{"text": label, "showarrow": False, "xref": f"x{'' if i == 0 else i + 1} domain",
                               "yref": f"y{'' if i == 0 else i + 1} domain", "x": 0.5, "y": 1.12}
                              for i, (_, label, _) in enumerate(metrics)]}
    return figure(data, title="A vs B on the same workload", **layout)


def ablation_figure(rows: Sequence) -> dict:
    """Bar per configuration (AblationRow) that ran: tokens/s, labelled with the multiplier against the full engine."""
    rows = [r for r in rows if r.throughput_tok_s]
    return figure([{"type": "bar", "x": [r.feature for r in rows], "y": [r.throughput_tok_s for r in rows],
                    "text": [f"{r.ratio:.2f}x" for r in rows], "textposition": "outside",
                    "marker": {"color": ["#31a354" if r.switch is None else "#9ecae1" for r in rows]}}],
                  title="What each feature is worth (measured here)", yaxis=dict(title={"text": "tokens/s"}))
