"""viz/: figure builders on hand-made snapshots (no engine, no server)."""
from __future__ import annotations

from types import SimpleNamespace

from engine.bench import AblationRow
from viz import figures


def snapshot(**kw):
    base = dict(step=3, block_size=4, kv_blocks_total=8, kv_blocks_used=5, kv_blocks_cached_free=1,
                block_tables={"a": [0, 1, 2], "b": [0, 1, 3, 4]},
                block_ref_counts=[2, 2, 1, 1, 1, 0, 0, 0], block_hashes=[11, 22, None, None, None, 33, None, None])
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
    assert set(by_name) == {"request a", "request b", "cached-free", "free"}
    assert len(by_name["request a"].x) == 3 and len(by_name["request b"].x) == 2  # shared blocks drawn under a
    assert list(by_name["request a"].text) == ["2", "2", ""]  # ref counts shown on shared blocks
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
    assert list(rate.y) == [None, 25.0, 100.0] and list(cumulative.y) == [0, 25, 125]
    tps, ttft, _ = figures.to_figure(figures.throughput_figure(hist, window=1)).data
    assert list(tps.y) == [None, 10.0, 20.0] and list(ttft.y) == [None, None, 200.0]


def test_memory_and_ablation_figures():
    system = {"rss_gb": 1.0, "ram_total_gb": 4.0, "gpu_used_gb": None}
    fig = figures.to_figure(figures.memory_figure(snapshot(), system))
    assert list(fig.data[0].y) == ["KV pool (blocks)", "process RSS (GB)"]
    assert list(fig.data[0].x) == [62.5, 25.0]
    rows = [AblationRow("full engine", None, throughput_tok_s=100.0, ratio=1.0),
            AblationRow("no KV cache (naive loop)", "kv_cache", throughput_tok_s=10.0, ratio=0.1),
            AblationRow("contiguous KV (no paging)", "paged_kv", error="does not fit")]
    bar = figures.to_figure(figures.ablation_figure(rows)).data[0]
    assert list(bar.y) == [100.0, 10.0] and list(bar.text) == ["1.00x", "0.10x"]


def test_compare_figure_puts_both_configurations_in_each_panel():
    run = SimpleNamespace
    result = SimpleNamespace(labels=("naive", "full"),
                             results=(run(throughput=6.0, mean_ttft_s=0.7, mean_tpot_s=0.78),
                                      run(throughput=58.0, mean_ttft_s=0.7, mean_tpot_s=None)))
    fig = figures.to_figure(figures.compare_figure(result))
    assert [list(t.x) for t in fig.data] == [["naive", "full"]] * 3
    assert list(fig.data[0].y) == [6.0, 58.0] and list(fig.data[1].y) == [700.0, 700.0]
    assert list(fig.data[2].y) == [780.0, None]
