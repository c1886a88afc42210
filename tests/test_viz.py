"""viz/: figure builders on hand-made snapshots (no engine, no server)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.measure import AblationRow, MemoryRow
from engine.service import ConfigChange
from engine.snapshot import FeatureState, RequestView, feature_states
from viz import figures, result_figures
from viz.dashboard import FigureCache
from viz.result_figures import BASELINE, EVEN, GAIN, LOSS


def snapshot(**kw):
    base = dict(step=3, block_size=4, kv_blocks_total=8, kv_blocks_used=5, kv_blocks_cached_free=1,
                block_tables={"a": [0, 1, 2], "b": [0, 1, 3, 4]},
                block_ref_counts=[2, 2, 1, 1, 1, 0, 0, 0], block_hashes=[11, 22, None, None, None, 33, None, None],
                requests={"a": RequestView("running", 9, num_output_tokens=2, num_computed_tokens=11),
                          "b": RequestView("running", 14, num_output_tokens=5, num_computed_tokens=14)},
                config={"prefix_caching": True, "kv_cache": True, "paged_kv": True}, num_running=2, num_waiting=0,
                features={"prefix_caching": FeatureState(True, True)})
    base.update(kw)
    return SimpleNamespace(**base)


def sample(t, **kw):
    base = dict(time=t, step=int(t), num_running=2, num_waiting=1, num_preemptions=0, kv_blocks_used=3,
                prefix_cache_queries=0, prefix_cache_hits=0, generation_tokens_total=0, step_ms=10.0,
                ttft_s=None, tpot_s=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_block_cells_states_owners_and_sharing():
    cells = figures.block_cells(snapshot(), cols=4)
    assert [c["state"] for c in cells] == ["used"] * 5 + ["cached-free", "free", "free"]
    assert [c["shared"] for c in cells] == [True, True] + [False] * 6
    assert cells[0]["owners"] == [("a", 0), ("b", 0)] and cells[4]["owners"] == [("b", 3)]
    assert (cells[5]["row"], cells[5]["col"]) == (1, 1)


def test_block_table_figure_colours_each_request_and_marks_shared_blocks():
    fig = figures.to_figure(figures.block_table_figure(snapshot(), cols=4))
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"request a", "request b", "cached-free", "free", "shared (number = ref count)"}
    assert len(by_name["request a"].x) == 3 and len(by_name["request b"].x) == 2  # shared blocks drawn under a
    assert list(by_name["request a"].text) == ["2", "2", ""]  # ref counts shown on shared blocks
    # the ref count contrasts with its cell: it was dark text on dark cells
    assert by_name["request a"].textfont.color == figures.text_colour(figures.owner_colour("a"))
    assert figures.text_colour("#31a354") == "white" and figures.text_colour("#e7ba52") == "#222"
    assert {figures.text_colour(c) for c in figures.PALETTE} == {"white", "#222"}
    assert by_name["free"].marker.color == figures.FREE and by_name["cached-free"].marker.color == figures.CACHED_FREE
    assert by_name["request a"].marker.color == figures.owner_colour("a")
    assert "5/8 blocks used" in fig.layout.title.text
    assert "ref count 2" in by_name["request a"].hovertext[0] and "request b, logical block 0" in \
        by_name["request a"].hovertext[0]


def test_queue_figure_marks_preemptions():
    hist = [sample(0), sample(1, num_preemptions=1, num_running=1), sample(2, num_preemptions=1)]
    fig = figures.to_figure(figures.queues_figure(hist))
    running, waiting, pre = fig.data
    assert list(running.y) == [2, 1, 2] and list(waiting.y) == [1, 1, 1]
    assert list(pre.x) == [1.0] and list(pre.y) == [1]


def test_prefix_and_throughput_series():
    hist = [sample(0), sample(1, prefix_cache_queries=100, prefix_cache_hits=25, generation_tokens_total=10),
            sample(2, prefix_cache_queries=200, prefix_cache_hits=125, generation_tokens_total=30, ttft_s=0.2)]
    rate, cumulative = figures.to_figure(figures.prefix_cache_figure(hist, window=1)).data
    # a point without new prompt tokens has no hit rate: left out, so the line joins its neighbours
    assert list(rate.x) == [1, 2] and list(rate.y) == [25.0, 100.0] and list(cumulative.y) == [0, 25, 125]
    tps, ttft, _ = figures.to_figure(figures.throughput_figure(hist, window=1)).data
    assert list(tps.y) == [10.0, 20.0] and list(ttft.y) == [None, None, 200.0]


def test_memory_figure_splits_the_gpu_as_the_engine_sized_its_pool():
    """On CUDA the snapshot says how the pool was sized: the chart shows weights, activations, KV pool and free
    as one stacked bar of the card (NVML's total); without that plan (CPU), no such bar."""
    gib = 2 ** 30
    plan = {"used_before_bytes": 2 * gib, "activation_peak_bytes": gib, "kv_budget_bytes": 4 * gib}
    snap = snapshot(kv_blocks_total=1024, kv_bytes_per_block=4 * gib // 1024, gpu_memory=plan)
    system = {"gpu_used_gb": 7.5, "gpu_total_gb": 10.0, "gpu_util": 40}
    assert figures.gpu_memory_split(snap, system) == [("weights + context", 2.0), ("activations (peak)", 1.0),
                                                      ("KV pool", 4.0), ("free", 3.0)]
    fig = figures.to_figure(figures.memory_figure(snap, system))
    bars = [t for t in fig.data if list(t.y) == [figures.GPU_SPLIT_ROW]]
    assert [b.name for b in bars] == ["weights + context", "activations (peak)", "KV pool", "free"]
    assert [b.x[0] for b in bars] == [20.0, 10.0, 40.0, 30.0] and fig.layout.barmode == "stack"
    assert figures.gpu_memory_split(snapshot(), {"rss_gb": 1.0, "ram_total_gb": 4.0}) == []
    cpu = figures.to_figure(figures.memory_figure(snapshot(), {"rss_gb": 1.0, "ram_total_gb": 4.0}))
    assert len(cpu.data) == 1


def test_memory_and_ablation_figures():
    system = {"rss_gb": 1.0, "ram_total_gb": 4.0, "gpu_used_gb": None}
    fig = figures.to_figure(figures.memory_figure(snapshot(), system))
    assert list(fig.data[0].y) == ["KV pool (blocks)", "process RSS (GB)"]
    assert list(fig.data[0].x) == [62.5, 25.0]
    assert list(fig.data[0].text) == ["5 / 8", "1 / 4"]  # not "2.05e+03" for a pool of 2048 blocks
    rows = [AblationRow("full engine", None, throughput_tok_s=100.0, ratio=1.0),
            AblationRow("no KV cache (naive loop)", "kv_cache", throughput_tok_s=10.0, ratio=0.1),
            AblationRow("contiguous KV (no paging)", "paged_kv", error="does not fit")]
    bar = figures.to_figure(result_figures.ablation_figure(rows)).data[0]
    assert list(bar.y) == [100.0, 10.0] and list(bar.text) == ["1.00x", "0.10x"]


def test_compare_figure_puts_both_configurations_in_each_panel():
    run = SimpleNamespace
    result = SimpleNamespace(labels=("naive", "full"),
                             results=(run(throughput=6.0, mean_ttft_s=0.7, mean_tpot_s=0.78),
                                      run(throughput=58.0, mean_ttft_s=0.7, mean_tpot_s=None)))
    fig = figures.to_figure(result_figures.compare_figure(result))
    assert [list(t.x) for t in fig.data] == [["naive", "full"]] * 3
    assert list(fig.data[0].y) == [6.0, 58.0] and list(fig.data[1].y) == [700.0, 700.0]
    assert list(fig.data[2].y) == [780.0, None]
    # the better one is green in each panel (here A's TTFT ties, B has no TPOT), numbers as numbers
    assert list(fig.data[0].marker.color) == [EVEN, GAIN]
    assert list(fig.data[1].marker.color) == [EVEN] * 2 and list(fig.data[2].marker.color) == [EVEN] * 2
    worse = SimpleNamespace(labels=("a", "b"), results=(run(throughput=2270.0, mean_ttft_s=0.05, mean_tpot_s=0.01),
                                                         run(throughput=1500.0, mean_ttft_s=0.09, mean_tpot_s=0.02)))
    fig = figures.to_figure(result_figures.compare_figure(worse))
    assert list(fig.data[0].text) == ["2270", "1500"] and list(fig.data[0].marker.color) == [GAIN, EVEN]
    assert list(fig.data[1].marker.color) == [GAIN, EVEN]  # B is worse: not green


def test_a_value_just_short_of_its_goal_does_not_read_as_the_goal():
    assert result_figures._percent(97.97, 98.0) == "97.97%" and result_figures._percent(97.3, 98.0) == "97.3%"
    assert result_figures._percent(97.97, None) == "98.0%"


def test_block_table_legend_and_grid_stay_put_with_many_requests():
    """Above a dozen requests the legend used to vanish and the grid to change shape with it."""
    def pool(num_requests: int):
        tables = {str(i): [2 * i, 2 * i + 1] for i in range(num_requests)}
        refs = [1] * (2 * num_requests) + [0] * (64 - 2 * num_requests)
        return snapshot(kv_blocks_total=64, kv_blocks_used=2 * num_requests, block_tables=tables,
                        block_ref_counts=refs, block_hashes=[None] * 64)
    few, many = figures.block_table_figure(pool(2)), figures.block_table_figure(pool(20))
    for spec in (few, many):
        names = [t["name"] for t in spec["data"] if t.get("showlegend", True)]
        assert len(names) <= figures.LEGEND_OWNERS + 4
        assert {"free", "cached-free", "shared (number = ref count)"} <= set(names)  # always explained
        assert all(t["x"] for t in spec["data"])  # plotly leaves a trace without points out of the legend
    assert "14 other requests" in [t["name"] for t in many["data"]]
    assert sum(len(t["x"]) for t in many["data"] if t["x"] != [None]) == 64  # every block still drawn
    for key in ("height", "margin", "xaxis", "yaxis"):
        assert few["layout"][key] == many["layout"][key]  # same pool, same grid


def test_a_big_pool_gets_smaller_cells_not_a_taller_chart():
    assert [figures.grid_columns(n) for n in (8, 728, 768, 2048, 8192)] == [32, 32, 32, 64, 128]
    heights = []
    for n in (768, 2048, 8192):
        spec = figures.block_table_figure(snapshot(kv_blocks_total=n, block_tables={}, block_ref_counts=[0] * n,
                                                   block_hashes=[None] * n))
        heights.append(spec["layout"]["height"])
    assert max(heights) <= 700, heights


def test_time_series_break_across_idle_periods():
    """Fifty seconds of nothing used to draw a slope from the last busy value to the next one."""
    counters = [(0.0, 0, 0, 0), (0.1, 100, 80, 10), (0.2, 200, 160, 20),  # busy: 80% hits
                (50.0, 300, 160, 25), (50.1, 400, 160, 30)]  # 50 s later, busy again: 0% hits
    hist = [sample(t, step_ms=100.0, prefix_cache_queries=q, prefix_cache_hits=h, generation_tokens_total=g)
            for t, q, h, g in counters]
    for spec in (figures.queues_figure(hist), figures.prefix_cache_figure(hist, window=1),
                 figures.throughput_figure(hist, window=1)):
        line = figures.to_figure(spec).data[0]
        assert "connectgaps" not in spec["data"][0]
        xs, ys = list(line.x), list(line.y)
        gap = [i for i, y in enumerate(ys) if y is None]
        assert gap and all(0.2 < xs[i] < 50.0 for i in gap), (xs, ys)  # a hole between the two busy periods
    # a lone point (one step in step mode) is drawn as a marker, since a one-point line shows nothing
    lone = figures.queues_figure([sample(0.0), sample(10.0), sample(20.0)])["data"][0]
    assert lone["marker"]["size"] == [6, 0, 6, 0, 6]
    # a busy period's line has no markers at all: the page would draw one per point (size 0 or not) every second
    busy = figures.queues_figure([sample(t / 10) for t in range(50)])["data"][0]
    assert busy["mode"] == "lines" and "marker" not in busy and len(busy["x"]) == 50


def test_prefix_chart_says_when_prefix_caching_is_off():
    hist = [sample(0), sample(1)]
    assert figures.prefix_cache_figure(hist)["layout"]["annotations"] == []
    off = figures.to_figure(figures.prefix_cache_figure(hist, active=False))
    assert [a.text for a in off.layout.annotations] == ["prefix caching is off"]


def test_each_feature_as_asked_and_as_it_runs():
    """One answer to "is it on?": the snapshot's features, with the reason where what runs differs from the ask."""
    on = feature_states(EngineConfig(prefix_caching=True, kv_cache=True, paged_kv=True))
    assert on["prefix_caching"] == FeatureState(True, True)
    for off in ("kv_cache", "paged_kv"):
        state = feature_states(EngineConfig(prefix_caching=True, kv_cache=True, paged_kv=True).replace(
            **{off: False}))["prefix_caching"]
        assert state.requested and not state.active and f"{off} is off" in state.why
    assert not feature_states(EngineConfig(prefix_caching=False))["prefix_caching"].active
    smoothing = feature_states(EngineConfig(kv_cache_smoothing=True))["kv_cache_smoothing"]
    assert smoothing.requested and not smoothing.active and "int8" in smoothing.why
    assert feature_states(EngineConfig(kv_cache_smoothing=True, kv_cache_dtype="int8"))["kv_cache_smoothing"].active


def test_hit_rate_stops_at_the_switch_instead_of_drawing_old_hits_on():
    """Caching switched off at t=10: no prompt is looked up after it, so the recent hit rate has no value there.
    The window used to reach back across the change, drawing 90% on for 20 steps, and the line then joined the
    hits before the change to those after caching came back on, as if caching had never been off."""
    hist = [sample(t, prefix_cache_queries=10 * min(t, 10) + 10 * max(0, t - 20),
                   prefix_cache_hits=9 * min(t, 10) + 9 * max(0, t - 20)) for t in range(31)]
    changes = [change(9.5, prefix_caching=False), change(19.5, prefix_caching=True)]
    spec = figures.prefix_cache_figure(hist, changes=changes)
    xs, ys = spec["data"][0]["x"], spec["data"][0]["y"]
    drawn = [x for x, y in zip(xs, ys) if y is not None]
    assert not [x for x in drawn if 10 <= x < 21], drawn  # nothing while it was off
    assert [y for x, y in zip(xs, ys) if x >= 21 and y is not None] == [90.0] * 10  # its own window after
    assert None in ys  # the line is broken across the off period, not joined through it
    off = figures.prefix_cache_figure(hist, active=False, changes=changes)["layout"]["annotations"][0]
    assert off["text"] == "prefix caching is off" and off["x"] > 0.9  # in a corner, clear of the lines


def test_axes_make_room_for_their_labels():
    """Right-hand ticks ("4(") and the memory chart's labels ("SS (GB)") were cut by fixed margins."""
    hist = [sample(0), sample(1)]
    system = {"rss_gb": 1.0, "ram_total_gb": 4.0}
    for spec in (figures.prefix_cache_figure(hist), figures.throughput_figure(hist), figures.queues_figure(hist),
                 figures.memory_figure(snapshot(), system)):
        layout = spec["layout"]
        for axis in [k for k in layout if k.startswith(("xaxis", "yaxis"))]:
            assert layout[axis]["automargin"] is True, axis
    assert figures.prefix_cache_figure(hist)["layout"]["yaxis2"]["side"] == "right"


def test_ablation_bars_leave_room_for_their_labels():
    rows = [AblationRow("full engine", None, throughput_tok_s=100.0, ratio=1.0),
            AblationRow("static batching", "continuous_batching", throughput_tok_s=90.0, ratio=0.9)]
    spec = result_figures.ablation_figure(rows)
    assert spec["layout"]["yaxis"]["range"][1] >= 115.0 and spec["data"][0]["cliponaxis"] is False


def test_empty_charts_say_why():
    for spec in (figures.queues_figure([]), figures.prefix_cache_figure([]), figures.throughput_figure([])):
        assert [a["text"] for a in figures.to_figure(spec).to_dict()["layout"]["annotations"]] == ["no steps yet"]
    spec = figures.to_figure(figures.placeholder_figure("Press Compare"))
    assert [a.text for a in spec.layout.annotations] == ["Press Compare"] and not spec.data
    long = figures.placeholder_figure("Your request in the KV pool: not available when attached to a remote server")
    lines = long["layout"]["annotations"][0]["text"].split("<br>")
    assert len(lines) == 2 and all(len(line) <= figures.PLACEHOLDER_CHARS for line in lines)


def test_block_table_shows_a_partly_prefilled_request():
    snap = snapshot(requests={"a": RequestView("running", 40, num_computed_tokens=8),
                              "b": RequestView("running", 14, num_computed_tokens=14)})
    fig = figures.to_figure(figures.block_table_figure(snap))
    names = [t.name for t in fig.data]
    assert "request a (prefill 8/40)" in names and "request b" in names
    a = fig.data[names.index("request a (prefill 8/40)")]
    assert list(a.marker.opacity) == [figures.PREFILLING_OPACITY] * 3 and "still prefilling" in a.hovertext[0]
    b = fig.data[names.index("request b")]
    assert set(b.marker.opacity) == {1.0}


def test_cumulative_figure_labels_each_bar_with_what_its_feature_added_and_the_total():
    rows = [AblationRow("naive loop (everything off)", None, throughput_tok_s=5.0, ratio=1.0),
            AblationRow("+ KV cache", "kv_cache", throughput_tok_s=50.0, ratio=10.0, step_ratio=10.0),
            AblationRow("+ paged KV", "paged_kv", error="pool too small"),
            AblationRow("+ continuous batching", "continuous_batching", throughput_tok_s=49.0, ratio=9.8,
                        step_ratio=0.98),
            AblationRow("+ speculative decoding", "speculative_decoding", throughput_tok_s=40.0, ratio=8.0,
                        step_ratio=0.8)]
    spec = result_figures.cumulative_figure(rows)
    bar = figures.to_figure(spec).data[0]
    # every configuration keeps its place in the course's order, the naive loop's label on two lines
    assert list(bar.x) == ["naive loop<br>(everything off)", "+ KV cache", "+ paged KV", "+ continuous batching",
                           "+ speculative decoding"]
    assert list(bar.y) == [5.0, 50.0, None, 49.0, 40.0]
    assert list(bar.text) == ["<b>baseline</b>", "<b>10.0x</b><br>total 10.0x", "", "<b>0.98x</b><br>total 9.80x",
                              "<b>0.80x</b><br>total 8.00x"]
    # a gain green, noise blue, a loss red; the configuration that could not run says so where its bar would be
    assert list(bar.marker.color) == [BASELINE, GAIN, BASELINE, EVEN, LOSS]
    assert [a["x"] for a in spec["layout"]["annotations"]] == ["+ paged KV"]
    assert spec["layout"]["yaxis"]["range"][1] >= 50.0 * 1.25 and bar.cliponaxis is False  # room for two lines
    empty = result_figures.cumulative_figure([AblationRow("naive loop (everything off)", None, error="x")])
    assert [a["text"] for a in empty["layout"]["annotations"]] == ["no configuration ran"]


def test_concurrency_figure_draws_each_features_worth_up_from_one():
    rows = []
    for level, spec_ratio in ((1, 0.5), (8, 0.8), (32, 1.0)):
        rows += [AblationRow("full engine", None, throughput_tok_s=40.0, ratio=1.0, concurrency=level),
                 AblationRow("no KV cache (naive loop)", "kv_cache", throughput_tok_s=4.0, ratio=0.1,
                             concurrency=level),
                 AblationRow("no speculative decoding", "speculative_decoding", throughput_tok_s=20.0,
                             ratio=spec_ratio, concurrency=level)]
    names = {"kv_cache": "KV cache", "speculative_decoding": "speculative decoding"}
    spec = result_figures.concurrency_figure(rows, names=names)
    fig = figures.to_figure(spec)
    assert [t.name for t in fig.data] == ["concurrency 1", "concurrency 8", "concurrency 32"]
    assert list(fig.data[0].x) == ["KV cache", "speculative decoding"]  # the full engine is the reference
    # worth = full / without: the bar goes from 1x to it (a log axis, so 10x and 1.25x both read)
    assert [list(t.customdata) for t in fig.data] == [[10.0, 2.0], [10.0, 1.25], [10.0, 1.0]]
    assert list(fig.data[1].text) == ["10.0x", "1.25x"] and fig.data[0].base == 1
    assert fig.layout.yaxis.type == "log" and fig.layout.shapes[0].y0 == 1
    low, high = spec["layout"]["yaxis"]["range"]
    assert 10 ** low < 1 < 10.0 * 1.5 < 10 ** high
    only = figures.to_figure(result_figures.concurrency_figure(rows, level=32, names=names))
    assert [t.name for t in only.data] == ["concurrency 32"]
    assert only.layout.title.text.startswith("What each feature is worth at concurrency 32")
    missing = result_figures.concurrency_figure(rows, level=4)
    assert [a["text"] for a in missing["layout"]["annotations"]] == ["no feature ran at this concurrency"]


def test_memory_sweep_figure_paged_vs_contiguous_and_a_series_per_kv_dtype():
    rows = [MemoryRow(32, True, 7.5, peak_running=4, preemptions=6, throughput_tok_s=30.0),
            MemoryRow(32, False, 0.0, error="a request's max_model_len needs 48 blocks"),
            MemoryRow(64, True, 15.0, peak_running=9, preemptions=0, throughput_tok_s=45.0),
            MemoryRow(64, False, 15.0, peak_running=1, preemptions=0, throughput_tok_s=12.0)]
    fig = figures.to_figure(result_figures.memory_sweep_figure(rows))
    assert [(t.name, t.xaxis, t.showlegend) for t in fig.data] == [
        ("paged", "x", True), ("paged", "x2", False), ("paged", "x3", False),
        ("contiguous", "x", True), ("contiguous", "x2", False), ("contiguous", "x3", False)]
    paged, contiguous = fig.data[0], fig.data[3]
    assert list(paged.x) == [7.5, 15.0] and list(paged.y) == [4, 9] and list(fig.data[1].y) == [6, 0]
    # the pool that cannot hold one contiguous reservation: 0 requests fit, marked with an x, at its pool's size
    assert list(contiguous.x) == [7.5, 15.0] and list(contiguous.y) == [0, 1]
    assert list(contiguous.marker.symbol) == ["x", "circle"] and list(fig.data[5].y) == [None, 12.0]
    assert list(fig.layout.xaxis.ticktext) == ["7.5 MB", "15 MB"]
    assert (fig.layout.yaxis.dtick, fig.layout.yaxis2.dtick) == (2, 2)  # counts tick at whole numbers
    # the fp32 vs int8 hook: rows that carry a KV dtype get a series each, told apart by their dash
    quantized = rows + [MemoryRow(32, True, 1.9, peak_running=9, preemptions=0, throughput_tok_s=44.0,
                                  kv_cache_dtype="int8")]
    fig = figures.to_figure(result_figures.memory_sweep_figure(quantized))
    legend = [(t.name, t.line.dash) for t in fig.data if t.showlegend]
    assert legend == [("paged", "solid"), ("contiguous", "solid"), ("paged, KV int8", "dash")]
    # an int8 pool sized to a float32 pool's memory lands within a percent of it: one tick label, not two overprinted
    near = rows + [MemoryRow(120, True, 7.47, peak_running=9, preemptions=0, throughput_tok_s=44.0,
                             kv_cache_dtype="int8")]
    assert list(figures.to_figure(result_figures.memory_sweep_figure(near)).layout.xaxis.ticktext) == [
        "7.47 MB", "15 MB"]
    # rows from before the field existed still draw
    old = [SimpleNamespace(**{k: v for k, v in vars(r).items() if k != "kv_cache_dtype"}) for r in rows]
    names = [t.name for t in figures.to_figure(result_figures.memory_sweep_figure(old)).data]
    assert names[::3] == ["paged", "contiguous"]


def test_a_chats_view_brightens_its_own_request_and_dims_the_others():
    spec = figures.highlighted_block_figure(snapshot(), "b", live=True)
    fig = figures.to_figure(spec)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"your request b", "other requests", "free", "cached-free"}
    mine = by_name["your request b"]
    # every block it holds, the two it shares with a as well, in its own colour, outlined, drawn on top
    assert sorted(zip(mine.x, mine.y)) == [(0, 0), (1, 0), (3, 0), (4, 0)] and fig.data[-1] is mine
    assert mine.marker.color == figures.owner_colour("b") and mine.marker.line.color == "black"
    assert mine.marker.line.width > 0 and set(mine.marker.opacity) == {1.0}
    others = by_name["other requests"]
    assert list(others.x) == [2] and list(others.marker.opacity) == [figures.DIMMED_OPACITY]
    assert mine.marker.size > others.marker.size  # it stands out in a big pool's small cells too
    assert fig.layout.title.text == "Your request b: 4 of 8 blocks, decoding, 5 tokens out"
    # no request of this tab's in the pool: nothing is dimmed, the title says why
    plain = {t.name: t for t in figures.to_figure(figures.highlighted_block_figure(snapshot(), None)).data}
    assert "your request b" not in plain and set(plain["other requests"].marker.opacity) == {1.0}
    titles = {figures.highlighted_block_figure(snapshot(), rid, live)["layout"]["title"]["text"]
              for rid, live in (("z", True), ("z", False), (None, False))}
    assert titles == {"Your request z: sent, not scheduled yet", "Your request z: finished, blocks freed",
                      "KV pool: 5/8 blocks used"}
    waiting = snapshot(requests={"c": RequestView("waiting", 9)})
    assert figures.highlighted_block_figure(waiting, "c")["layout"]["title"]["text"] == \
        "Your request c waits for a seat or blocks"
    prefilling = snapshot(requests={"b": RequestView("running", 40, num_computed_tokens=8)})
    assert "prefill 8/40" in figures.highlighted_block_figure(prefilling, "b")["layout"]["title"]["text"]


def change(t, step=1, error=None, **changes):
    return ConfigChange(t, step, changes, "applied in place", error)


def test_configuration_changes_are_marked_on_every_time_series():
    hist = [sample(100.0 + i) for i in range(11)]
    changes = [change(95.0, prefix_caching=True),  # before the first sample shown: left out
               change(105.0, step=5, prefix_caching=False),
               change(108.0, step=8, error="MemoryError: no room", num_kv_blocks=9999),
               change(112.0, step=11, max_num_seqs=4)]  # applied by an idle engine after the last step
    for build in (figures.queues_figure, figures.prefix_cache_figure, figures.throughput_figure):
        spec = build(hist, changes=changes)
        fig = figures.to_figure(spec)  # valid plotly
        lines = [s for s in spec["layout"]["shapes"]]
        assert [s["x0"] for s in lines] == [5.0, 8.0, 12.0] and all(s["yref"] == "paper" for s in lines)
        labels = [a for a in spec["layout"]["annotations"] if a.get("textangle") == -90]
        assert [a["text"] for a in labels] == ["prefix_caching off", "✗ num_kv_blocks=9999", "max_num_seqs=4"]
        assert all(a["y"] == 1 and a["yref"] == "paper" and a["yanchor"] == "top" for a in labels)  # inside the plot
        assert "step 5: prefix_caching=False (applied in place)" in labels[0]["hovertext"]
        assert "not applied: MemoryError" in labels[1]["hovertext"]
        assert lines[1]["line"]["color"] != lines[0]["line"]["color"]  # a change that did not apply is drawn grey
        assert len(fig.layout.shapes) == 3
    assert figures.queues_figure(hist)["layout"]["shapes"] == []
    assert figures.queues_figure([], changes=changes)["layout"]["shapes"] == []  # no time axis yet


def test_changes_close_in_time_share_one_marker_and_labels_stay_short():
    hist = [sample(0.0), sample(100.0)]
    close = [change(50.0, prefix_caching=False), change(51.0, continuous_batching=False, max_num_seqs=4)]
    shapes, annotations = figures.change_markers(hist, close)
    assert len(shapes) == len(annotations) == 1
    text = annotations[0]["text"]
    assert text == "2 changes"  # one short label a marker, readable from the back of a room
    assert "prefix_caching=False" in annotations[0]["hovertext"] and "max_num_seqs=4" in annotations[0]["hovertext"]
    far = [change(10.0, prefix_caching=False), change(60.0, prefix_caching=True)]
    assert len(figures.change_markers(hist, far)[0]) == 2


def test_recent_tokens_per_second():
    hist = [sample(t, generation_tokens_total=10 * t) for t in range(20)]
    assert figures.recent_tokens_per_s(hist) == 10.0
    assert figures.recent_tokens_per_s(hist[:1]) == 0.0 and figures.recent_tokens_per_s([]) == 0.0
    idle_then_one = hist + [sample(60.0, generation_tokens_total=500)]  # first step after an idle minute
    assert figures.recent_tokens_per_s(idle_then_one) == 0.0


def test_rates_never_reach_back_across_an_engine_restart():
    """A restarted engine's steps and counters start again from 0, in the same history as the old one's: no rate
    reaches back across the restart (it would be negative), and the lines break there."""
    old = [sample(t / 10, step=t, generation_tokens_total=100 * t, prefix_cache_queries=100 * t,
                  prefix_cache_hits=50 * t) for t in range(1, 6)]
    new = [sample(0.6 + t / 10, step=t, generation_tokens_total=100 * t, prefix_cache_queries=100 * t,
                  prefix_cache_hits=90 * t) for t in range(0, 5)]
    hist = old + new
    tps = figures.to_figure(figures.throughput_figure(hist, window=3)).data[0]
    rate = figures.to_figure(figures.prefix_cache_figure(hist, window=3)).data[0]
    assert min(y for y in tps.y if y is not None) == pytest.approx(1000.0)  # 100 tokens a step, a step each 0.1 s
    assert None in tps.y  # the line is broken at the restart
    assert sorted({round(y) for y in rate.y if y is not None}) == [50, 90]  # each engine's own rate
    assert figures.recent_tokens_per_s(hist, window=3) == pytest.approx(1000.0)
    assert figures.recent_tokens_per_s(hist[:6], window=3) == 0.0  # the new engine has stepped once


def test_chat_views_come_from_the_shared_cache():
    """30 tabs polling each second must not rebuild figures: once per snapshot, plus once per highlighted request."""
    cache = FigureCache(min_interval_s=0.0)
    snap, hist = snapshot(), [sample(0), sample(1, generation_tokens_total=8)]
    views = [cache.chat_view(snap, hist, rid, True) for _ in range(30) for rid in ("a", "b", None)]
    assert cache.builds == 1 and cache.view_builds == 3
    assert views[0] is views[3] and views[0].blocks is views[3].blocks  # the same spec: serialised once
    assert cache._cells and cache._cells[0]["hover"].startswith("block 0")  # cells (and hovers) built once for all
    assert cache.get(snap, hist) is cache.get(snap, hist) and cache.builds == 1
    assert "running **2**" in views[0].summary and "**8.0** tokens/s" in views[0].summary
    assert cache.chat_view(snap, hist, "a", False) is not views[0] and cache.view_builds == 4  # a finished view
    # a new snapshot (a step, or a change an idle engine applied) rebuilds everything once
    later = snapshot(step=4)
    cache.chat_view(later, hist, "a", True, changes=[change(0.5, prefix_caching=False)])
    assert cache.builds == 2 and cache.view_builds == 5
    assert cache.get(later, hist).queues["layout"]["shapes"]  # the marker is drawn
    idle_change = snapshot(step=4)  # same step, new snapshot object: the service published a reconfiguration
    cache.get(idle_change, hist)
    assert cache.builds == 3
    throttled = FigureCache(min_interval_s=60.0)
    first = throttled.chat_view(snap, hist, "a", True)
    assert throttled.chat_view(later, hist, "a", True) is first and throttled.builds == 1  # at most once a minute
    rebuilt = throttled.chat_view(snapshot(step=1), list(hist), "a", True, replaced_at=time.time() - 3)
    assert rebuilt is not first and throttled.builds == 2  # a new engine (its own history) is drawn at once
    assert "step **1** since the rebuild 3 s ago" in rebuilt.summary


def test_the_time_series_cover_minutes_whatever_the_step_rate():
    """300 steps of a fast engine were 3 s: a configuration change left the charts before its effect showed."""
    fast = [sample(i * 0.01, generation_tokens_total=i) for i in range(30_000)]  # 300 s at 100 steps/s
    recent = figures.recent_samples(fast, span_s=120.0, max_points=300)
    assert 295 <= len(recent) <= 301 and recent[-1] is fast[-1]
    assert 119.0 <= recent[-1].time - recent[0].time <= 120.0
    gaps = [b.time - a.time for a, b in zip(recent, recent[1:])]
    assert max(gaps) < figures.IDLE_GAP_S  # thinning never looks like an idle engine
    assert figures.throughput_figure(recent, window=1)["data"][0]["y"][-1] == pytest.approx(100.0)
    slow = [sample(float(i)) for i in range(50)]  # one step a second: every sample kept
    assert figures.recent_samples(slow, 120.0, 300) == slow and figures.recent_samples([], 120.0, 300) == []
    short = fast[:1000]  # 10 s of history: thinned over those 10 s, not over the whole span
    kept = figures.recent_samples(short, 120.0, 300)
    assert 295 <= len(kept) <= 301 and kept[0].time < 0.05


def test_the_block_table_and_every_chat_view_share_one_snapshot_s_cells(monkeypatch):
    """Each chatting tab's view is the block table again: the cells (owners, states, hover text) of a snapshot are
    worked out once per build, not once per figure (they were most of the figures' GIL time with 8 chats)."""
    calls = []
    real = figures.block_cells
    monkeypatch.setattr(figures, "block_cells", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cache = FigureCache(min_interval_s=0.0)
    snap, hist = snapshot(), [sample(0), sample(1, generation_tokens_total=8)]
    for rid in ("a", "b", None):
        cache.chat_view(snap, hist, rid, True)
    assert len(calls) == 1 and cache.view_builds == 3
    alone = figures.highlighted_block_figure(snap, "b", True)
    assert cache.chat_view(snap, hist, "b", True).blocks == alone  # the same figure as built on its own
    assert cache.get(snap, hist).blocks == figures.block_table_figure(snap)


def test_a_lessons_chart_names_its_lines_axes_and_one_flip():
    from viz.lesson_figure import LessonChart, lesson_figure
    chart = LessonChart("Prefix caching", "prefix-cache hit rate", "", True, "prefix_caching → on",
                        [(1.0, 0.0), (3.0, 0.0), (5.0, 0.6), (7.0, 0.9)], flip_at_s=4.0, now_s=8.0, before=0.0,
                        after=0.88)
    spec = lesson_figure(chart)
    figures.to_figure(spec)  # a valid plotly figure
    names = [t["name"] for t in spec["data"]]
    assert names == ["before the switch", "after: prefix_caching → on", "before: 0 %", "after: 88 %"]
    assert spec["data"][0]["x"] == [1.0, 3.0] and spec["data"][1]["y"] == [60.0, 90.0]  # percent drawn in %
    layout = spec["layout"]
    assert layout["xaxis"]["title"]["text"] == "seconds since the lesson's before phase began"
    assert layout["yaxis"]["title"]["text"] == "prefix-cache hit rate (%)"
    assert layout["xaxis"]["range"][0] == 0 and len(layout["shapes"]) == 1  # this lesson's window, one marker
    assert [a["text"] for a in layout["annotations"]] == ["flip"]
    assert "prefix_caching → on at 4 s" in layout["annotations"][0]["hovertext"]
    waiting = lesson_figure(LessonChart("Paged KV", "requests running", "", False, "paged_kv → on", [], None, 0.0))
    assert "appear here once" in json.dumps(waiting)
    # flipped, with no number yet (prefix caching off looked nothing up before): the marker shows at once
    flipped = lesson_figure(LessonChart("Prefix caching", "prefix-cache hit rate", "", True, "prefix_caching → on",
                                        [], flip_at_s=30.0, now_s=30.5))
    figures.to_figure(flipped)
    assert [a["text"] for a in flipped["layout"]["annotations"]] == ["flip"]
    assert flipped["layout"]["xaxis"]["range"][1] >= 30.0


def test_a_markers_label_is_short_and_hover_has_the_rest():
    from engine.service import ConfigChange
    one = ConfigChange(1.0, 5, {"num_kv_blocks": 96, "max_model_len": 384}, "rebuilt the KV pool")
    assert figures.marker_label([one]) == "num_kv_blocks=96 +1"
    long = ConfigChange(1.0, 5, {"quantization_smoothing_calibration_text": "x" * 80}, "rebuilt")
    assert len(figures.marker_label([long])) <= figures.MARKER_LABEL_CHARS
    assert figures.marker_label([ConfigChange(1.0, 5, {}, "restarted")]) == "engine restarted"
