"""Pure functions: an engine snapshot (or a history of samples) -> a plotly figure.

Nothing here touches the engine: inputs are the plain data objects the engine publishes
(`EngineSnapshot`, `HistorySample`, ablation rows), read by attribute name only.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import plotly.graph_objects as go

FREE, CACHED_FREE = "#e8e8e8", "#9ecae1"
PALETTE = ["#e6550d", "#31a354", "#756bb1", "#d6616b", "#8c6d31", "#e7ba52", "#637939", "#7b4173",
           "#843c39", "#3182bd", "#636363", "#ce6dbd"]
LAYOUT = dict(margin=dict(l=40, r=10, t=40, b=30), height=300, template="plotly_white",
              legend=dict(orientation="h", y=-0.2))


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


def block_table_figure(snap, cols: int = 32) -> go.Figure:
    cells = block_cells(snap, cols)
    fig = go.Figure()
    groups: dict[str, list[dict]] = {}
    for c in cells:
        key = c["owners"][0][0] if c["owners"] else c["state"]
        groups.setdefault(key, []).append(c)
    for key, group in groups.items():
        colour = FREE if key == "free" else CACHED_FREE if key == "cached-free" else owner_colour(key)
        name = key if key in ("free", "cached-free") else f"request {key}"
        fig.add_trace(go.Scatter(
            x=[c["col"] for c in group], y=[c["row"] for c in group], mode="markers+text", name=name,
            marker=dict(symbol="square", size=14, color=colour,
                        line=dict(width=[2 if c["shared"] else 0 for c in group], color="black")),
            text=[str(c["ref_count"]) if c["shared"] else "" for c in group], textfont=dict(size=8),
            hovertext=[_cell_hover(c) for c in group], hoverinfo="text", showlegend=len(groups) <= 14))
    rows = max(1, -(-len(cells) // cols))
    fig.update_layout(**{**LAYOUT, "height": max(220, 22 * rows + 90)},
                      title=f"KV pool: {snap.kv_blocks_used}/{snap.kv_blocks_total} blocks used, "
                            f"{snap.kv_blocks_cached_free} cached-free (block = {snap.block_size} tokens)")
    fig.update_xaxes(visible=False, range=[-1, cols])
    fig.update_yaxes(visible=False, autorange="reversed")
    return fig


def _cell_hover(c: dict) -> str:
    lines = [f"block {c['block']} · {c['state']} · ref count {c['ref_count']}"]
    lines += [f"request {rid}, logical block {logical}" for rid, logical in c["owners"]]
    if c["hash"] is not None:
        lines.append(f"prefix hash {c['hash'] & 0xFFFFFFFF:08x}")
    return "<br>".join(lines)


def _times(history: Sequence) -> list[float]:
    t0 = history[0].time if history else 0.0
    return [h.time - t0 for h in history]


def queues_figure(history: Sequence) -> go.Figure:
    t = _times(history)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=t, y=[h.num_running for h in history], name="running", mode="lines"))
    fig.add_trace(go.Scatter(x=t, y=[h.num_waiting for h in history], name="waiting", mode="lines"))
    pre = [(x, h.num_running) for x, h, prev in zip(t[1:], history[1:], history)
           if h.num_preemptions > prev.num_preemptions]
    fig.add_trace(go.Scatter(x=[p[0] for p in pre], y=[p[1] for p in pre], name="preemption", mode="markers",
                             marker=dict(symbol="x", size=10, color="red")))
    fig.update_layout(**LAYOUT, title="Scheduler queues", xaxis_title="seconds", yaxis_title="requests")
    return fig


def prefix_cache_figure(history: Sequence, window: int = 20) -> go.Figure:
    t = _times(history)
    rate = []
    for i, h in enumerate(history):
        j = max(0, i - window)
        q = h.prefix_cache_queries - history[j].prefix_cache_queries
        rate.append(100 * (h.prefix_cache_hits - history[j].prefix_cache_hits) / q if q else None)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=t, y=rate, name="hit rate, recent (%)", mode="lines", connectgaps=True))
    fig.add_trace(go.Scatter(x=t, y=[h.prefix_cache_hits for h in history], name="cumulative hit tokens",
                             mode="lines", yaxis="y2"))
    fig.update_layout(**LAYOUT, title="Prefix cache", xaxis_title="seconds",
                      yaxis=dict(title="hit rate %", range=[0, 100]),
                      yaxis2=dict(title="tokens", overlaying="y", side="right", rangemode="tozero"))
    return fig


def throughput_figure(history: Sequence, window: int = 10) -> go.Figure:
    t = _times(history)
    tps = []
    for i, h in enumerate(history):
        j = max(0, i - window)
        dt = h.time - history[j].time
        tps.append((h.generation_tokens_total - history[j].generation_tokens_total) / dt if dt > 0 else None)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=t, y=tps, name="tokens/s", mode="lines"))
    fig.add_trace(go.Scatter(x=t, y=[h.ttft_s * 1e3 if h.ttft_s else None for h in history], name="TTFT (ms)",
                             mode="markers", yaxis="y2"))
    fig.add_trace(go.Scatter(x=t, y=[h.tpot_s * 1e3 if h.tpot_s else None for h in history], name="TPOT (ms)",
                             mode="markers", yaxis="y2"))
    fig.update_layout(**LAYOUT, title="Throughput and latency", xaxis_title="seconds",
                      yaxis=dict(title="tokens/s", rangemode="tozero"),
                      yaxis2=dict(title="ms", overlaying="y", side="right", rangemode="tozero"))
    return fig


def memory_figure(snap, system: dict) -> go.Figure:
    """KV pool use, and the device's memory: GPU (via pynvml) when present, else this process's RSS."""
    names = ["KV pool (blocks)"]
    used, total = [snap.kv_blocks_used], [max(snap.kv_blocks_total, 1)]
    for key, label in (("gpu_used_gb", "GPU memory (GB)"), ("rss_gb", "process RSS (GB)")):
        if system.get(key) is not None:
            names.append(label)
            used.append(system[key])
            total.append(system.get(key.replace("used", "total").replace("rss", "ram_total"), system[key]))
    pct = [100 * u / t for u, t in zip(used, total)]
    fig = go.Figure(go.Bar(x=pct, y=names, orientation="h", text=[f"{u:.3g} / {t:.3g}" for u, t in zip(used, total)],
                           textposition="auto"))
    if system.get("gpu_util") is not None:
        fig.add_annotation(text=f"GPU utilisation {system['gpu_util']}%", x=100, y=len(names) - 1, showarrow=False)
    fig.update_layout(**{**LAYOUT, "height": 200}, title="Memory", xaxis=dict(range=[0, 100], title="% used"))
    return fig


def ablation_figure(rows: Sequence[dict]) -> go.Figure:
    """Bar per configuration: tokens/s, labelled with the multiplier against the full engine."""
    fig = go.Figure(go.Bar(x=[r["feature"] for r in rows], y=[r["throughput_tok_s"] for r in rows],
                           text=[f"{r['ratio']:.2f}x" for r in rows], textposition="outside",
                           marker_color=["#31a354" if r["feature"] == "full engine" else "#9ecae1" for r in rows]))
    fig.update_layout(**LAYOUT, title="What each feature is worth (measured here)", yaxis_title="tokens/s")
    return fig
