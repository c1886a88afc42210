"""The "engine, feature by feature" tab's logic: each experiment run through the Playground's measurement on a
tiny model, kept across restarts, the shipped results shown until this machine has its own, and `bundle`."""
from __future__ import annotations

import json
import threading

import pytest

from engine import LLM, measure
from playground import Playground
from playground.features import NAMES, FeatureExperiments, concurrency_lesson
from playground.results import (
    EXPERIMENTS,
    Measured,
    bundle,
    load_local,
    load_shipped,
    main,
    parse_rows,
    save_local,
)
from playground.tables import concurrency_table, cumulative_table, memory_table, quality_table
from viz.figures import to_figure

TINY_WORKLOAD = """
name = "tiny-features"
seed = 3
arrival = "burst"

[config]
num_kv_blocks = 64
max_model_len = 128

[[groups]]
name = "chat"
count = 4
shared_prefix_tokens = 16
prompt_tokens = [4, 12]
output_tokens = [3, 6]
"""
LEVELS, POOLS = (1, 2), (8, 24)  # contiguous KV reserves max_model_len (8 blocks of 16): 1 request fits in 8


@pytest.fixture(scope="module")
def pg(tiny_models, tmp_path_factory):
    playground = Playground(LLM(tiny_models["llama"][0], max_model_len=512, num_kv_blocks=64),
                            store=tmp_path_factory.mktemp("store") / "ablation.json")
    yield playground
    playground.service.shutdown()


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("workloads") / "tiny-features.toml"
    path.write_text(TINY_WORKLOAD)
    return str(path)


@pytest.fixture(scope="module")
def measured(pg, workload, tmp_path_factory):
    """All three experiments, run once through the page's path; (experiments, rows per kind, progress seen)."""
    experiments = FeatureExperiments(pg, shipped=tmp_path_factory.mktemp("none") / "absent.json")
    rows, progress = {}, {}
    for kind in EXPERIMENTS:
        seen = progress[kind] = []
        rows[kind] = experiments.run(kind, workload, quick=False, levels=LEVELS, pool_sizes=POOLS,
                                     progress=lambda f, d, seen=seen: seen.append((f, d)))
    return experiments, rows, progress


@pytest.mark.slow
def test_each_experiment_runs_through_the_measurement_and_is_kept(pg, workload, measured, tmp_path):
    experiments, rows, progress = measured
    assert [r.feature for r in rows["cumulative"]] == [measure.NAIVE_LOOP] + [f"+ {f.name}" for f in measure.FEATURES]
    base = rows["cumulative"][0].precision
    assert all(r.same_output_as_full for r in rows["cumulative"] if r.precision == base)
    per_level = len(measure.FEATURES) + 1
    assert [r.concurrency for r in rows["concurrency"]] == [lv for lv in LEVELS for _ in range(per_level)]
    by = {(r.num_kv_blocks, r.paged): r for r in rows["memory"]}
    assert by[(24, True)].peak_running > by[(24, False)].peak_running == 24 // 8
    for kind, seen in progress.items():  # the bar moves, says what runs, and ends full
        assert seen[0][1].startswith(f"{NAMES[kind]}: 0/") and seen[-1][0] == 1.0, (kind, seen)
        assert "configurations" in seen[0][1] and "running:" in seen[0][1]
    assert not pg.service.paused and pg.measurement is None  # the live engine resumed

    # a restart: a new page reads the same store
    again = FeatureExperiments(pg, shipped=tmp_path / "absent.json").results()
    assert set(again) == set(EXPERIMENTS) and not any(m.shipped for m in again.values())
    assert again["cumulative"].rows == rows["cumulative"] and again["memory"].rows == rows["memory"]
    assert again["memory"].kv_bytes_per_token == pg.llm.engine.model.kv_bytes_per_token()
    assert again["concurrency"].command == f"python -m engine.bench ablate --concurrency 1,2 --workload {workload}"
    assert "core" in again["cumulative"].measured_on and again["cumulative"].date[:2] == "20"


@pytest.mark.slow
def test_each_section_shows_where_its_numbers_come_from(measured):
    experiments, rows, _ = measured
    for kind in EXPERIMENTS:
        view = experiments.view(kind)
        to_figure(view.figure)  # a valid plotly figure
        assert view.source.startswith("*measured on this machine (") and "`python -m engine.bench" in view.source
        assert view.table["data"]
    assert "From concurrency 1 to 2: KV cache" in experiments.view("concurrency").source
    one = to_figure(experiments.view("concurrency", level=2).figure)
    assert [t.name for t in one.data] == ["concurrency 2"]
    note = experiments.kv_note()
    per_token = experiments.pg.llm.engine.model.kv_bytes_per_token()
    assert f"KV cache per token:** {per_token / 1024:.1f} KB" in note and "× 4 bytes" in note


def test_a_measurement_from_the_tab_can_be_cancelled_and_keeps_nothing(pg, workload, tmp_path):
    experiments = FeatureExperiments(pg, store=tmp_path / "store.json", shipped=tmp_path / "absent.json")
    started, outcome = threading.Event(), {}

    def run():
        try:
            experiments.run("concurrency", workload, quick=False, levels=LEVELS, progress=lambda f, d: started.set())
        except measure.Cancelled as exc:
            outcome["cancelled"] = exc
    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(60)
    total = len(LEVELS) * (len(measure.FEATURES) + 1)
    measuring = pg.measurement
    assert pg.service.paused and (measuring.name, measuring.done, measuring.total) == ("concurrency sweep", 0, total)
    with pytest.raises(ValueError, match="another measurement is running"):
        experiments.run("memory", workload, pool_sizes=POOLS)
    assert pg.cancel_measurement().startswith("Cancelling the concurrency sweep")
    worker.join(60)
    assert "cancelled" in outcome and not pg.service.paused and load_local(experiments.store) == {}


def cli_json(rows: list) -> list:
    """What `python -m engine.bench ... --json PATH` writes: the report's rows as plain JSON."""
    return json.loads(json.dumps(measure.to_jsonable(rows), indent=2))


@pytest.mark.slow
def test_bundle_takes_the_cli_row_files_and_the_page_shows_them_as_shipped(measured, tmp_path):
    experiments, rows, _ = measured
    paths = {}
    for kind in EXPERIMENTS:
        paths[kind] = tmp_path / f"{kind}.json"
        paths[kind].write_text(json.dumps(cli_json(rows[kind])))
    data = bundle(paths["cumulative"], paths["concurrency"], paths["memory"], "2-core Xeon VM, no GPU", "2026-12-01")
    assert list(data) == ["measured_on", "date", "command", *EXPERIMENTS]
    assert data["cumulative"] == cli_json(rows["cumulative"])
    shipped = tmp_path / "feature-by-feature.json"
    shipped.write_text(json.dumps(data))

    page = FeatureExperiments(experiments.pg, store=tmp_path / "nothing-here.json", shipped=shipped)
    assert page.shipped()[1] == ("Shipped results: **measured on 2-core Xeon VM, no GPU, 2026-12-01** — press Run "
                                 "to measure yours.")
    assert all(m.shipped for m in page.results().values())
    assert page.results()["memory"].rows == rows["memory"]
    assert page.view("cumulative").source.startswith(
        "*measured on 2-core Xeon VM, no GPU, 2026-12-01 (shipped with the repository) — press Run to measure yours*")
    # once this machine measured one experiment, that one is its own; the others stay shipped
    save_local(page.store, "memory", Measured(rows["memory"], "here", "2026-12-02", "cmd"))
    assert {k: m.shipped for k, m in page.results().items()} == {"cumulative": True, "concurrency": True,
                                                                  "memory": False}


@pytest.mark.slow
def test_bundle_refuses_files_given_for_the_wrong_experiment(measured, tmp_path):
    _, rows, _ = measured
    cumulative, concurrency, memory = (cli_json(rows[k]) for k in ("cumulative", "concurrency", "memory"))
    with pytest.raises(ValueError, match="cumulative: expected `ablate --cumulative` rows"):
        bundle(concurrency, cumulative, memory, "m", "d")
    with pytest.raises(ValueError, match="concurrency: expected"):
        bundle(cumulative, cumulative, memory, "m", "d")
    with pytest.raises(ValueError, match="memory row 0"):
        bundle(cumulative, concurrency, cumulative, "m", "d")
    with pytest.raises(ValueError, match="where and when"):
        bundle(cumulative, concurrency, memory, "", "d")
    with pytest.raises(ValueError, match="a list of row objects"):
        parse_rows("memory", {"rows": memory})


@pytest.mark.slow
def test_the_bundle_command_writes_the_shipped_file(measured, tmp_path, capsys):
    _, rows, _ = measured
    args = []
    for kind in EXPERIMENTS:
        (tmp_path / f"{kind}.json").write_text(json.dumps(cli_json(rows[kind])))
        args += [f"--{kind}", str(tmp_path / f"{kind}.json")]
    out = tmp_path / "results" / "feature-by-feature.json"
    assert main([*args, "--measured-on", "a laptop", "--date", "2026-12-03", "--out", str(out)]) == 0
    assert "8 cumulative rows" in capsys.readouterr().out
    loaded = load_shipped(out)
    assert loaded["concurrency"].rows == rows["concurrency"] and loaded["memory"].date == "2026-12-03"
    assert main([*args[:2], "--memory", args[1], "--measured-on", "x", "--out", str(out)]) == 2  # wrong file


def test_no_shipped_results_says_so_and_a_broken_file_says_why(pg, tmp_path):
    page = FeatureExperiments(pg, store=tmp_path / "store.json", shipped=tmp_path / "absent.json")
    assert page.shipped()[1].startswith("**No shipped results yet**") and page.results() == {}
    for kind in EXPERIMENTS:
        view = page.view(kind)
        assert view.source.startswith("No results yet") and not view.table["data"]
        assert "press Run" in to_figure(view.figure).layout.annotations[0].text
    broken = tmp_path / "broken.json"
    broken.write_text('{"date": "2026"}')
    assert "could not be read" in FeatureExperiments(pg, shipped=broken).shipped()[1]


def test_rows_from_newer_or_older_versions_still_load():
    """A field this version does not know is dropped, a missing one defaults; kv_cache_dtype is kept."""
    row = {"num_kv_blocks": 32, "paged": True, "kv_cache_mb": 1.5, "peak_running": 3, "kv_cache_dtype": "int8",
           "a_field_from_the_future": 1}
    (parsed,) = parse_rows("memory", [row])
    assert parsed.kv_cache_dtype == "int8" and parsed.preemptions is None


def test_kv_dtype_hook_in_the_memory_table():
    plain = [measure.MemoryRow(32, True, 1.5, 3, 0, 40.0, 0.2, 0.9), measure.MemoryRow(32, False, 0.0, error="no room")]
    table = memory_table(plain)
    assert "KV dtype" not in table["headers"] and table["data"][1][-1] == "no room" and table["data"][0][-2] == "90%"
    quantized = plain + [measure.MemoryRow(32, True, 0.4, 9, 0, 41.0, kv_cache_dtype="int8")]
    table = memory_table(quantized)
    column = table["headers"].index("KV dtype")
    assert [r[column] for r in table["data"]] == ["model's dtype", "model's dtype", "int8"]


def test_cumulative_and_concurrency_tables_and_the_lesson():
    rows = [measure.AblationRow(measure.NAIVE_LOOP, None, 5.0, 1.0),
            measure.AblationRow("+ KV cache", "kv_cache", 50.0, 10.0, step_ratio=10.0)]
    assert [r[:4] for r in cumulative_table(rows)["data"]] == [[measure.NAIVE_LOOP, "5.00", "-", "1.00"],
                                                              ["+ KV cache", "50.00", "10.00", "10.00"]]
    conc = [measure.AblationRow("full engine", None, 40.0, 1.0, concurrency=1),
            measure.AblationRow("no speculative decoding", "speculative_decoding", 20.0, 0.5, concurrency=1),
            measure.AblationRow("full engine", None, 80.0, 1.0, concurrency=32),
            measure.AblationRow("no speculative decoding", "speculative_decoding", 80.0, 1.0, concurrency=32)]
    table = concurrency_table(conc)
    assert table["headers"] == ["configuration", "tok/s @ 1", "feature worth @ 1", "tok/s @ 32", "feature worth @ 32"]
    assert table["data"] == [["full engine", "40.00", "reference", "80.00", "reference"],
                             ["no speculative decoding", "20.00", "2.00", "80.00", "1.00"]]
    assert concurrency_lesson(conc) == "From concurrency 1 to 32: speculative decoding 2.00x → 1.00x"


# ---- quality: what each precision costs, beside the speed --------------------------------------------------------
@pytest.mark.slow
def test_quality_runs_from_the_page_one_row_per_precision(pg, measured):
    experiments, rows, progress = measured
    quality = rows["quality"]
    assert [r.spec for r in quality] == list(measure.QUALITY_SPECS)
    for r in quality:
        assert 0 <= r.top1_agreement <= 1 and r.perplexity > 1 and r.reference_perplexity > 1, r
        assert r.positions > 100 and r.mean_abs_logprob_diff >= 0
    assert len({r.reference_perplexity for r in quality}) == 1  # one fp32 reference for every precision
    # what the page ran is what engine.bench.quality gives for that precision on this model (deterministic)
    window = pg.llm.engine.model.max_len - 1
    (direct,) = measure.quality(pg.llm, [quality[0].spec], window=window)
    assert (direct.top1_agreement, direct.perplexity) == (quality[0].top1_agreement, quality[0].perplexity)
    assert [d for _, d in progress["quality"]][1].endswith("running: quantization=int8")
    view = experiments.view("quality")
    assert [line[0] for line in view.table["data"]] == [r.precision for r in quality]
    assert view.table["data"][0][0] == "float32, int8 weights" and len(view.table["data"]) == len(quality)
    goals = {r.spec: line[-1] for r, line in zip(quality, view.table["data"], strict=True)}
    assert goals["quantization=int8"].startswith("top-1 ≥ 97%, ppl ≤ +2%: ")
    assert goals["kv_cache_dtype=int8"].startswith("top-1 ≥ 98%: ")
    assert goals["int8"] == goals["int4"] == "-"  # the presets: weights with an int8 KV cache, no goal of their own
    assert f"python -m engine.bench quality --spec {measure.QUALITY_SPECS[0]}" in view.source
    assert f"--window {window}" in view.source and f"{quality[0].positions} positions" in view.source
    fig = to_figure(view.figure)
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 2 and list(bars[0].x) == pytest.approx([100 * r.top1_agreement for r in quality])
    assert bars[0].orientation == "h" and len(set(bars[0].y)) == len(quality)  # one named row per precision
    assert list(bars[1].x) == pytest.approx([100 * r.perplexity_change for r in quality])
    assert [t.name for t in fig.data if t.type == "scatter"] == ["goal"] * 2


def test_quality_from_the_tab_can_be_cancelled_and_keeps_nothing(pg, tmp_path):
    experiments = FeatureExperiments(pg, store=tmp_path / "store.json", shipped=tmp_path / "absent.json")
    started, outcome = threading.Event(), {}

    def run():
        try:
            experiments.run("quality", specs=["quantization=int8", "quantization=int4"],
                            progress=lambda f, d: started.set())
        except measure.Cancelled as exc:
            outcome["cancelled"] = exc
    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(60)
    measuring = pg.measurement
    assert pg.service.paused and (measuring.name, measuring.done, measuring.total) == ("quality against fp32", 0, 3)
    assert pg.cancel_measurement().startswith("Cancelling the quality against fp32")
    worker.join(60)
    assert "cancelled" in outcome and "quantization=int8" in str(outcome["cancelled"])
    assert not pg.service.paused and load_local(experiments.store) == {}
    with pytest.raises(ValueError, match="at least one precision"):
        experiments.run("quality", specs=[])
    with pytest.raises(ValueError, match="unknown config field"):
        experiments.run("quality", specs=["quantisation=int8"])
    assert pg.measurement is None and not pg.service.paused


@pytest.mark.slow
def test_bundle_takes_the_quality_json_the_cli_writes(tiny_models, measured, tmp_path):
    from engine.bench.cli import main as bench_main
    experiments, rows, _ = measured
    quality = tmp_path / "quality.json"
    assert bench_main(["quality", "--model", tiny_models["llama"][0], "--spec", "quantization=int8", "--window",
                       "256", "--json", str(quality)]) == 0
    written = json.loads(quality.read_text())
    assert [r["spec"] for r in written] == ["quantization=int8"]
    data = bundle(None, None, None, "a laptop", "2026-12-04", quality_json=quality)
    assert data["command"] == "python -m engine.bench quality --json quality.json"
    assert [r["spec"] for r in data["quality"]] == ["quantization=int8"] and data["memory"] == []
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps(data))
    page = FeatureExperiments(experiments.pg, store=tmp_path / "store.json", shipped=shipped)
    assert set(page.results()) == {"quality"} and page.results()["quality"].shipped
    assert page.view("quality").source.startswith("*measured on a laptop, 2026-12-04 (shipped with the repository)")
    assert page.view("quality").table["data"][0][0] == "float32, int8 weights"
    # this machine's quality run takes over from the shipped one, as for the other experiments
    save_local(page.store, "quality", Measured(rows["quality"], "here", "2026-12-05", "cmd"))
    assert not page.results()["quality"].shipped and len(page.view("quality").table["data"]) == len(rows["quality"])
    # a wrong file is refused, naming the experiment
    with pytest.raises(ValueError, match="quality row 0"):
        bundle(None, None, None, "m", "d", quality_json=cli_json(rows["memory"]))
    with pytest.raises(ValueError, match="memory row 0"):
        bundle(None, None, quality, "m", "d")
    with pytest.raises(ValueError, match=r"quality row 0 \('quantization=int8'\): expected a top-1 agreement in"):
        bundle(None, None, None, "m", "d", quality_json=[{**written[0], "top1_agreement": 97.5}])
    out = tmp_path / "bundled.json"
    assert main(["--quality", str(quality), "--measured-on", "x", "--out", str(out)]) == 0
    assert load_shipped(out)["quality"].rows[0].spec == "quantization=int8"


def test_a_shipped_bundle_without_quality_shows_the_others_and_says_press_run(pg, tmp_path):
    """As the repository's file is until quality is measured on the reference machine."""
    from playground.results import SHIPPED_RESULTS
    data = {k: v for k, v in json.loads(SHIPPED_RESULTS.read_text()).items() if k != "quality"}
    (tmp_path / "shipped.json").write_text(json.dumps(data))
    shipped = FeatureExperiments(pg, store=tmp_path / "store.json", shipped=tmp_path / "shipped.json")
    assert set(shipped.results()) == {"cumulative", "concurrency", "memory"}
    view = shipped.view("quality")
    assert view.source.startswith("No results yet") and not view.table["data"]
    assert to_figure(view.figure).layout.annotations[0].text.startswith("No results yet: press Run to score")


def test_quality_goals_and_table():
    from playground.quality import KV_GOAL, WEIGHT_GOALS, goal_for
    assert goal_for("quantization=int8") is WEIGHT_GOALS["int8"]
    assert goal_for("quantization=int4,quantization_group_size=64,quantize_lm_head=false") is WEIGHT_GOALS["int4"]
    assert goal_for("kv_cache_dtype=int8") is KV_GOAL
    assert goal_for("quantization=int8,kv_cache_dtype=int8") is None and goal_for("dtype=bfloat16") is None
    assert goal_for("no_such_preset") is None
    row = measure.QualityRow("quantization=w8a8", "float32, w8a8 weights", 100, 0.9, 0.2, 1.0, 15.9, 15.2, 1.0,
                           "w8a8 weights · fbgemm kernel", "0.61x fp32 at 16 rows (slower than fp32 here)")
    table = quality_table([row])
    assert table["data"][0] == ["float32, w8a8 weights", "90.0%", "0.200", "15.90", "+4.61%",
                                "w8a8 weights · fbgemm kernel", "0.61x fp32 at 16 rows (slower than fp32 here)",
                                "top-1 ≥ 95%, ppl ≤ +4%: top-1 and ppl short"]
    met = measure.QualityRow("kv_cache_dtype=int8", "float32, int8 KV", 100, 0.99, 0.02, 0.1, 15.2, 15.2, 1.0)
    assert quality_table([met])["data"][0][-1] == "top-1 ≥ 98%: met"


def test_each_table_has_a_width_for_every_column():
    """A column added to a table without its width squeezed the last ones out of a 1,400 px page."""
    from playground.features_tab import COLUMN_WIDTHS
    from playground.tables import CUMULATIVE_HEADERS, QUALITY_HEADERS
    for kind, headers in (("quality", QUALITY_HEADERS), ("cumulative", CUMULATIVE_HEADERS)):
        widths = COLUMN_WIDTHS[kind]
        assert len(widths) == len(headers), kind
        assert sum(float(w.rstrip("%")) for w in widths) == 100, kind
