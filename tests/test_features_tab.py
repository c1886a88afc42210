"""The "engine, feature by feature" tab's logic: each experiment run through the Playground's measurement on a
tiny model, kept across restarts, the shipped results shown until this machine has its own, and `bundle`."""
from __future__ import annotations

import json
import threading

import pytest

from engine import LLM, bench
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
from playground.tables import concurrency_table, cumulative_table, memory_table
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


def test_each_experiment_runs_through_the_measurement_and_is_kept(pg, workload, measured, tmp_path):
    experiments, rows, progress = measured
    assert [r.feature for r in rows["cumulative"]] == [bench.NAIVE_LOOP] + [f"+ {f.name}" for f in bench.FEATURES]
    base = rows["cumulative"][0].precision
    assert all(r.same_output_as_full for r in rows["cumulative"] if r.precision == base)
    assert [r.concurrency for r in rows["concurrency"]] == [lv for lv in LEVELS for _ in range(len(bench.FEATURES) + 1)]
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
        except bench.Cancelled as exc:
            outcome["cancelled"] = exc
    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(60)
    total = len(LEVELS) * (len(bench.FEATURES) + 1)
    assert f"paused for a measurement (concurrency sweep: 0/{total} configurations" in pg.status()
    with pytest.raises(ValueError, match="another measurement is running"):
        experiments.run("memory", workload, pool_sizes=POOLS)
    assert pg.cancel_measurement().startswith("Cancelling the concurrency sweep")
    worker.join(60)
    assert "cancelled" in outcome and not pg.service.paused and load_local(experiments.store) == {}


def cli_json(rows: list) -> list:
    """What `python -m engine.bench ... --json PATH` writes: the report's rows as plain JSON."""
    return json.loads(json.dumps(bench.to_jsonable(rows), indent=2))


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


def test_bundle_refuses_files_given_for_the_wrong_experiment(measured, tmp_path):
    _, rows, _ = measured
    cumulative, concurrency, memory = (cli_json(rows[k]) for k in EXPERIMENTS)
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
    plain = [bench.MemoryRow(32, True, 1.5, 3, 0, 40.0, 0.2, 0.9), bench.MemoryRow(32, False, 0.0, error="no room")]
    table = memory_table(plain)
    assert "KV dtype" not in table["headers"] and table["data"][1][-1] == "no room" and table["data"][0][-2] == "90%"
    quantized = plain + [bench.MemoryRow(32, True, 0.4, 9, 0, 41.0, kv_cache_dtype="int8")]
    table = memory_table(quantized)
    column = table["headers"].index("KV dtype")
    assert [r[column] for r in table["data"]] == ["model's dtype", "model's dtype", "int8"]


def test_cumulative_and_concurrency_tables_and_the_lesson():
    rows = [bench.AblationRow(bench.NAIVE_LOOP, None, 5.0, 1.0),
            bench.AblationRow("+ KV cache", "kv_cache", 50.0, 10.0, step_ratio=10.0)]
    assert [r[:4] for r in cumulative_table(rows)["data"]] == [[bench.NAIVE_LOOP, "5.00", "-", "1.00"],
                                                              ["+ KV cache", "50.00", "10.00", "10.00"]]
    conc = [bench.AblationRow("full engine", None, 40.0, 1.0, concurrency=1),
            bench.AblationRow("no speculative decoding", "speculative_decoding", 20.0, 0.5, concurrency=1),
            bench.AblationRow("full engine", None, 80.0, 1.0, concurrency=32),
            bench.AblationRow("no speculative decoding", "speculative_decoding", 80.0, 1.0, concurrency=32)]
    table = concurrency_table(conc)
    assert table["headers"] == ["configuration", "tok/s @ 1", "feature worth @ 1", "tok/s @ 32", "feature worth @ 32"]
    assert table["data"] == [["full engine", "40.00", "reference", "80.00", "reference"],
                             ["no speculative decoding", "20.00", "2.00", "80.00", "1.00"]]
    assert concurrency_lesson(conc) == "From concurrency 1 to 32: speculative decoding 2.00x → 1.00x"
