"""engine.bench: each subcommand's core function on the tiny model; structure and invariants, never timings."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from engine import cpu_kernels, huge_pages, measure
from engine.bench import cli
from engine.config import EngineConfig
from engine.workloads import build_workload

SMALL_POOL = {"num_kv_blocks": 256}  # the tiny model's default pool would be 0.5 GB of zeros per engine
# Blocks enter the prefix cache once computed, so requests admitted in the same step cannot share them:
# two seats make the shared group's later requests arrive after its first one computed the prefix.
FEW_SEATS = {**SMALL_POOL, "max_num_seqs": 2}


def tiny_workload(**overrides):
    spec = {"name": "tiny", "seed": 3, "groups": [
        {"name": "chat", "count": 5, "prompt_tokens": [6, 30], "output_tokens": [3, 9]},
        {"name": "shared", "count": 3, "shared_prefix_tokens": 32, "prompt_tokens": [2, 6], "output_tokens": 4},
    ]}
    spec.update(overrides)
    return build_workload(spec)


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    folder, _ = tiny_models["llama"]
    return measure.load_llm({"model": folder})


# ---- specs -------------------------------------------------------------------------------------------
def test_parse_value():
    assert measure.parse_value("true") is True and measure.parse_value("False") is False
    assert measure.parse_value("none") is None and measure.parse_value("null") is None
    assert measure.parse_value("8") == 8 and isinstance(measure.parse_value("8"), int)
    assert measure.parse_value("0.25") == 0.25
    assert measure.parse_value(" bfloat16 ") == "bfloat16"


def test_flag_specs():
    assert measure.resolve_spec("prefix_caching=false,max_num_seqs=8") == {"prefix_caching": False, "max_num_seqs": 8}
    assert measure.parse_assignments(["block_size=32", "num_kv_blocks=none"]) == {"block_size": 32,
                                                                              "num_kv_blocks": None}
    with pytest.raises(ValueError, match="bogus_field"):
        measure.resolve_spec("bogus_field=1")
    with pytest.raises(ValueError, match="key=value"):
        measure.parse_assignments("block_size=32,oops")


def test_feature_presets():
    names = measure.list_feature_presets()
    for expected in ("naive", "full", "no-prefix-cache", "contiguous-kv", "static-batching"):
        assert expected in names
    assert measure.resolve_spec("naive") == {"kv_cache": False}
    assert measure.resolve_spec("full") == {}
    assert measure.resolve_spec("no-prefix-cache") == {"prefix_caching": False}
    assert measure.resolve_spec("contiguous-kv") == {"paged_kv": False}
    assert measure.resolve_spec("static-batching") == {"continuous_batching": False}
    for name in names:
        EngineConfig.from_kwargs(**measure.resolve_spec(name))


def test_bad_preset_name_names_it():
    with pytest.raises(ValueError, match="no-such-preset"):
        measure.resolve_spec("no-such-preset")


def test_spec_cannot_change_the_checkpoint_or_device(tiny_llm):
    with pytest.raises(ValueError, match="device='cuda' differs from the loaded model's"):
        measure.compare(tiny_llm, tiny_workload(), "full", "device=cuda", SMALL_POOL)
    with pytest.raises(ValueError, match="model='other' differs"):
        measure.compare(tiny_llm, tiny_workload(), "full", "model=other", SMALL_POOL)


def test_spec_can_change_the_weights_precision(tiny_llm):
    """dtype and quantization are loaded once more from the same checkpoint (and kept for the next run)."""
    result = measure.compare(tiny_llm, tiny_workload(), "full", "int8", SMALL_POOL)
    int8 = result.results[1].config
    assert (int8["quantization"], int8["kv_cache_dtype"]) == ("int8", "int8")
    assert tiny_llm.weights_for(tiny_llm.config_for({"quantization": "int8"})).lm_head.scheme == "int8"
    assert tiny_llm.weights_for(tiny_llm.config_for({})) is tiny_llm.engine.model


def test_config_order_workload_then_settings_then_spec():
    wl = tiny_workload(config={"num_kv_blocks": 48, "block_size": 8})
    fields = measure.config_fields(wl, {"block_size": 16, "max_num_seqs": 4}, {"max_num_seqs": 2})
    assert fields == {"num_kv_blocks": 48, "block_size": 16, "max_num_seqs": 2}


# ---- run_workload and compare ------------------------------------------------------------------------
def test_run_workload_counts_and_structure(tiny_llm):
    wl = tiny_workload()
    result = measure.run_config(tiny_llm, wl, FEW_SEATS)
    assert result.num_requests == len(wl.requests)
    assert result.generated_tokens == wl.num_output_tokens
    assert result.prompt_tokens == wl.num_prompt_tokens
    assert [len(ids) for ids in result.output_token_ids] == [r.params.max_tokens for r in wl.requests]
    assert 0 < result.peak_kv_blocks <= 256
    assert result.prefix_queries == wl.num_prompt_tokens  # warm-up queries are not counted
    assert result.prefix_hits > 0 and 0 < result.hit_rate <= 1  # the shared group hits
    assert result.mean_ttft_s is not None and result.mean_tpot_s is not None
    assert result.steps.num_steps > 0 and set(result.steps.mean_ms) == set(measure.PHASES)
    assert result.steps.mean_running >= 1
    assert result.config["num_kv_blocks"] == 256


def test_run_workload_more_steps_than_the_engine_keeps(tiny_llm):
    wl = build_workload({"name": "long", "groups": [{"count": 1, "prompt_tokens": 4, "output_tokens": 300}]})
    result = measure.run_config(tiny_llm, wl, SMALL_POOL)
    assert result.steps.num_steps == 300  # every step counted, though engine.steps keeps only 256
    assert result.generated_tokens == 300


def test_run_workload_honours_arrivals(tiny_llm):
    wl = tiny_workload(arrival="poisson", rate=200.0)
    assert wl.requests[-1].arrival_s > 0
    result = measure.run_config(tiny_llm, wl, SMALL_POOL)
    assert result.generated_tokens == wl.num_output_tokens


def test_compare_naive_vs_full_same_greedy_outputs(tiny_llm):
    wl = tiny_workload()
    result = measure.compare(tiny_llm, wl, "naive", "full", FEW_SEATS)
    naive, full = result.results
    assert result.labels == ("naive", "full")
    assert result.same_outputs and naive.output_token_ids == full.output_token_ids
    assert naive.generated_tokens == full.generated_tokens == wl.num_output_tokens
    assert naive.peak_kv_blocks == 0 and naive.prefix_hits == 0 and naive.config["kv_cache"] is False
    assert full.peak_kv_blocks > 0 and full.prefix_hits > 0
    assert result.ratio > 0
    report = measure.compare_report(result)
    rows = report.tables["configurations"]
    assert [r["config"] for r in rows] == ["naive", "full"]
    assert list(rows[0]) == ["config", "throughput tok/s", "mean TTFT (s)", "mean TPOT (s)", "peak KV blocks",
                             "preemptions", "prefix hits (tokens)", "hit rate", "wall time (s)", "max token gap (s)",
                             "p95 token gap (s)", "draft acceptance"]


@pytest.mark.parametrize("spec", ["contiguous-kv", "static-batching", "no-prefix-cache",
                                  "num_kv_blocks=12,block_size=4"])
def test_compare_features_keep_greedy_outputs(tiny_llm, spec):
    wl = tiny_workload()
    result = measure.compare(tiny_llm, wl, "full", spec, {"num_kv_blocks": 256, "max_model_len": 128})
    assert result.same_outputs
    assert result.results[1].generated_tokens == wl.num_output_tokens


def test_compare_preempts_with_a_small_pool(tiny_llm):
    wl = tiny_workload(config={"block_size": 4, "num_kv_blocks": 16})
    result = measure.compare(tiny_llm, wl, "full", "full")
    assert result.results[0].config["num_kv_blocks"] == 16  # the workload's own config applies
    assert result.results[0].preemptions > 0
    assert result.results[0].peak_kv_blocks <= 16
    assert result.same_outputs


# ---- table, hf-static --------------------------------------------------------------------------------
def test_table_rows(tiny_llm):
    rows = measure.run_table(tiny_llm, [1, 3], input_len=8, output_len=5, settings=SMALL_POOL, hf=True)
    assert [r.batch for r in rows] == [1, 3]
    for r in rows:
        assert r.generated_tokens == r.batch * 5
        assert r.peak_kv_blocks == r.batch  # 13 tokens per request in blocks of 16
        assert r.memory_gb * measure.GIB == pytest.approx(
            r.peak_kv_blocks * 16 * tiny_llm.engine.model.kv_bytes_per_token()
            + measure.weight_bytes(tiny_llm.engine.model))
        assert r.hf_tps > 0 and r.ratio == pytest.approx(r.tps / r.hf_tps)
        assert r.steps.num_steps == 5 and r.steps.mean_running == r.batch
    report = measure.table_report(rows, 8, 5)
    assert list(report.tables["reference"][0]) == ["Batch", "Time (s)", "TTFT (s)", "TPOT (s)", "Memory (GB)", "TPS"]
    assert "engine / HF" in report.tables["vs transformers generate"][0]


def test_table_without_hf(tiny_llm):
    rows = measure.run_table(tiny_llm, [2], input_len=8, output_len=3, settings=SMALL_POOL, hf=False)
    assert rows[0].hf_tps is None
    assert "vs transformers generate" not in measure.table_report(rows, 8, 3).tables


def test_weight_bytes_matches_hf_parameters(tiny_models, tiny_llm):
    _, hf_model = tiny_models["llama"]  # tied embeddings: HF holds one tensor, we add a transposed head copy
    hf_bytes = sum(p.numel() * 4 for p in hf_model.parameters())
    head_copy = hf_model.lm_head.weight.numel() * 4
    assert measure.weight_bytes(tiny_llm.engine.model) == hf_bytes + head_copy


def test_hf_static(tiny_llm):
    wl = tiny_workload()
    result = measure.hf_static(tiny_llm, wl, batch_size=3, settings=SMALL_POOL)
    assert result.num_batches == 3
    assert result.hf_useful_tokens == wl.num_output_tokens == result.engine.generated_tokens
    longest = [max(r.params.max_tokens for r in wl.requests[i:i + 3]) * len(wl.requests[i:i + 3])
               for i in range(0, len(wl.requests), 3)]
    assert result.hf_generated_tokens == sum(longest) >= result.hf_useful_tokens
    assert result.hf_throughput > 0 and result.ratio > 0
    assert len(measure.hf_static_report(result).tables["throughput"]) == 2


# ---- rendering and the command line ------------------------------------------------------------------
def test_markdown_table():
    text = measure.markdown_table([{"a": 1, "b": 0.5, "c": None, "d": 1234.5}, {"a": 2, "b": 2.0, "c": True, "d": 0.0}])
    assert text.splitlines() == ["| a | b | c | d |", "|---|---|---|---|", "| 1 | 0.5000 | - | 1234.5 |",
                                 "| 2 | 2.00 | True | 0.0000 |"]


def test_default_subcommand_is_table():
    args = cli.parse_args(["--batch-sizes", "1,2", "--no-hf"])
    assert args.command == "table" and args.batch_sizes == [1, 2] and args.input_len == 128
    assert cli.parse_args([]).command == "table"
    args = cli.parse_args(["compare", "--workload", "mixed-lengths", "--set", "block_size=32", "--set", "seed=1"])
    assert cli.settings_from_args(args) == {"block_size": 32, "seed": 1}
    assert (args.a, args.b) == ("naive", "full")


def test_cli_table_json(tiny_models, tmp_path, capsys):
    folder, _ = tiny_models["llama"]
    out = tmp_path / "rows.json"
    assert cli.main(["--model", folder, "--set", "num_kv_blocks=64", "--batch-sizes", "1,2", "--input-len", "8",
                       "--output-len", "3", "--no-hf", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| Batch | Time (s) | TTFT (s) | TPOT (s) | Memory (GB) | TPS |" in printed
    data = json.loads(out.read_text())
    assert [r["Batch"] for r in data["tables"]["reference"]] == [1, 2]


def test_cli_compare_with_workload_file(tiny_models, tmp_path, capsys):
    folder, _ = tiny_models["llama"]
    path = tmp_path / "wl.toml"
    path.write_text('name = "file"\n[config]\nnum_kv_blocks = 64\n'
                    '[[groups]]\ncount = 3\nprompt_tokens = [4, 12]\noutput_tokens = 3\n')
    assert cli.main(["compare", "--model", folder, "--workload", str(path), "--a", "naive", "--b",
                       "prefix_caching=false"]) == 0
    printed = capsys.readouterr().out
    assert "| naive |" in printed and "| prefix_caching=false |" in printed and "throughput b/a" in printed


def test_cli_bad_preset_is_an_error(tiny_models, capsys):
    folder, _ = tiny_models["llama"]
    assert cli.main(["compare", "--model", folder, "--workload", "fixed-16", "--b", "nope"]) == 2
    assert "'nope'" in capsys.readouterr().err


def test_cli_ablate_writes_rows_for_the_page(tiny_models, tmp_path, capsys):
    folder, _ = tiny_models["llama"]
    path = tmp_path / "wl.toml"
    path.write_text('name = "file"\n[config]\nnum_kv_blocks = 64\nmax_num_seqs = 2\nmax_model_len = 128\n'
                    '[[groups]]\ncount = 5\nshared_prefix_tokens = 16\nprompt_tokens = [4, 12]\n'
                    'output_tokens = [2, 6]\n')
    out = tmp_path / "ablation.json"
    assert cli.main(["ablate", "--model", folder, "--set", "block_size=4", "--workload", str(path),
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["feature"] for r in rows] == [measure.FULL_ENGINE] + [name for name, _ in measure.ABLATIONS]
    assert [r["switch"] for r in rows] == [None] + [switch for _, switch in measure.ABLATIONS]
    assert rows[0]["ratio"] == 1.0 and all(r["throughput_tok_s"] > 0 for r in rows)
    assert all(r["same_output_as_full"] for r in rows if r["precision"] == rows[0]["precision"])
    assert "x full engine" in capsys.readouterr().out


def test_ablate_reports_a_configuration_that_cannot_run(tiny_llm):
    workload = load_workload_text('name = "x"\n[config]\nnum_kv_blocks = 8\nmax_model_len = 256\n'
                                  '[[groups]]\ncount = 2\nprompt_tokens = 8\noutput_tokens = 2\n')
    rows = {r.switch: r for r in measure.ablate(tiny_llm, workload)}
    contiguous = rows["paged_kv"]
    assert contiguous.throughput_tok_s is None and "contiguous KV reserves" in contiguous.error
    assert rows[None].error is None and rows[None].feature == measure.FULL_ENGINE


def load_workload_text(text: str):
    import tomllib

    from engine.workloads import build_workload
    return build_workload(tomllib.loads(text))


def test_compare_repeats_side_by_side_and_reports_token_gaps(tiny_llm):
    wl = tiny_workload()
    result = measure.compare(tiny_llm, wl, "chunked_prefill=false", "max_num_batched_tokens=16", SMALL_POOL, repeat=2)
    assert len(result.ratios) == 2 and len(result.gap_ratios) == 2 and result.same_outputs
    a, b = result.results
    assert a.max_token_gap_s >= a.p95_token_gap_s > 0 and b.peak_running >= 1
    notes = "\n".join(measure.compare_report(result).notes)
    assert "median of 2" in notes and "longest gap between two tokens" in notes


def test_every_built_switch_has_an_ablation_row(tiny_llm):
    from engine.config import FEATURE_SWITCHES
    rows = measure.ablate(tiny_llm, tiny_workload(), FEW_SEATS)
    assert [r.switch for r in rows] == [None, *[f.switch for f in measure.FEATURES]]
    assert set(FEATURE_SWITCHES) < {r.switch for r in rows}
    # within the full engine's precision (int4 weights, int8 KV) no switch changes greedy output; the unquantized
    # row computes in another precision and is reported as such, never claimed identical
    full, asked = rows[0].precision, tiny_llm.config_for(measure.FULL_FIELDS)
    assert (asked.quantization, asked.kv_cache_dtype) == ("int4", "int8") and full == asked.precision
    assert all(r.error is None and r.same_output_as_full for r in rows if r.precision == full)
    assert [r.switch for r in rows if r.precision != full] == ["quantization"]
    assert rows[0].ratio == 1.0 and rows[0].feature == measure.FULL_ENGINE
    notes = "\n".join(measure.ablate_report(tiny_workload(), rows).notes)
    assert "rows in another precision (float32) are not expected to match it token for token" in notes


def test_cumulative_ablation_adds_features_back_in_the_course_order(tiny_llm):
    rows = measure.ablate_cumulative(tiny_llm, tiny_workload(), FEW_SEATS)
    assert [r.feature for r in rows] == [measure.NAIVE_LOOP] + [f"+ {f.name}" for f in measure.FEATURES]
    assert rows[0].peak_kv_blocks == 0 and rows[0].step_ratio is None and rows[0].ratio == 1.0
    # greedy output never changes as features come back, until quantization changes the precision
    quantized = [f.switch for f in measure.FEATURES].index("quantization") + 1
    assert all(r.same_output_as_full for r in rows[:quantized])
    assert {r.precision for r in rows[quantized:]} == {tiny_llm.config_for(measure.FULL_FIELDS).precision}
    assert rows[1].step_ratio == pytest.approx(rows[1].ratio)
    text = measure.render_report(measure.ablate_report(tiny_workload(), rows, cumulative=True))
    assert "x previous" in text and "+ speculative decoding" in text


def test_ablation_at_each_concurrency(tiny_llm):
    rows = measure.ablate_concurrency(tiny_llm, tiny_workload(), [1, 3], SMALL_POOL)
    assert [r.concurrency for r in rows] == [1] * (len(measure.FEATURES) + 1) + [3] * (len(measure.FEATURES) + 1)
    text = measure.render_report(measure.ablate_report(tiny_workload(), rows))
    assert "x full @ 1" in text and "x full @ 3" in text


def test_memory_sweep_paged_fits_more_than_contiguous(tiny_llm):
    wl = tiny_workload(config={"max_model_len": 64})
    rows = measure.memory_sweep(tiny_llm, wl, [16, 40], {"block_size": 4, "max_num_seqs": 8}, kv_cache_dtypes=["auto"])
    assert [(r.num_kv_blocks, r.paged) for r in rows] == [(16, True), (16, False), (40, True), (40, False)]
    assert all(r.kv_cache_dtype is None for r in rows)  # one dtype: nothing to tell apart
    by = {(r.num_kv_blocks, r.paged): r for r in rows}
    assert by[(40, True)].peak_running > by[(40, False)].peak_running  # contiguous reserves 16 blocks each
    assert by[(40, False)].peak_running == 40 // (64 // 4)
    assert 0 < by[(40, False)].memory_efficiency < by[(40, True)].memory_efficiency <= 1
    assert by[(16, True)].preemptions > 0 or by[(16, True)].error
    assert by[(40, True)].kv_cache_mb > by[(16, True)].kv_cache_mb > 0


def test_memory_sweep_int8_kv_fits_more_requests_in_the_same_memory(tiny_llm):
    wl = tiny_workload(config={"max_model_len": 64})
    # 20 fp32 blocks: one contiguous reservation (max_model_len 64 = 16 blocks) fits, and a few paged requests
    rows = measure.memory_sweep(tiny_llm, wl, [20], {"block_size": 4, "max_num_seqs": 8})
    assert [(r.kv_cache_dtype, r.paged) for r in rows] == [("float32", True), ("float32", False), ("int8", True),
                                                          ("int8", False)]
    fp32, int8 = rows[0], rows[2]
    assert int8.num_kv_blocks == 20 * 4 * 16 // (16 + 4)  # 4 bytes per element become 1, plus a scale per head
    assert int8.kv_cache_mb == pytest.approx(fp32.kv_cache_mb, rel=0.02)  # the same memory
    assert int8.peak_running > fp32.peak_running and int8.preemptions < fp32.preemptions
    assert rows[3].peak_running > rows[1].peak_running  # contiguous too: more reservations fit
    text = measure.render_report(measure.memory_report(wl, rows, 1, 1))
    assert "| KV dtype |" in text and "| int8 |" in text


def test_text_workloads_and_group_arrivals(tiny_llm):
    wl = build_workload({"name": "t", "groups": [
        {"name": "copy", "texts": ["Repeat: a b c", "Repeat: d e f"], "count": 3, "output_tokens": 4},
        {"name": "late", "count": 1, "prompt_tokens": 5, "output_tokens": 2, "arrival_s": 0.2}]})
    assert [r.text for r in wl.requests[:3]] == ["Repeat: a b c", "Repeat: d e f", "Repeat: a b c"]
    assert wl.requests[3].arrival_s == 0.2 and wl.requests[0].params.ignore_eos is False
    tokenized = wl.tokenized(tiny_llm.tokenizer)
    assert tokenized.requests[0].prompt_token_ids == tiny_llm.apply_chat_template(
        [{"role": "user", "content": "Repeat: a b c"}])
    result = measure.run_config(tiny_llm, wl, SMALL_POOL)
    assert result.num_requests == 4 and result.prompt_tokens == tokenized.num_prompt_tokens
    assert result.wall_s >= 0.2


def test_quality_against_fp32_over_the_same_text(tiny_llm):
    text = measure.QUALITY_TEXT.read_text()[:600]
    rows = measure.quality(tiny_llm, ["dtype=float32", "quantization=int8"], text=text, window=48)
    same, int8 = rows
    windows = measure.text_windows(tiny_llm, text, 48)
    assert same.positions == int8.positions == sum(len(w) - 1 for w in windows) > 100
    # the fp32 engine against itself: every position agrees, nothing differs
    assert (same.top1_agreement, same.max_abs_logprob_diff) == (1.0, 0.0)
    assert same.perplexity == same.reference_perplexity == int8.reference_perplexity
    assert int8.precision == "float32, int8 weights" and int8.max_abs_logprob_diff > 0
    assert 0.9 <= int8.top1_agreement < 1 or int8.mean_abs_logprob_diff > 0
    text = measure.render_report(measure.quality_report(rows, 48))
    assert "| quantization=int8 | float32, int8 weights |" in text


def test_quality_arithmetic():
    windows = [[7, 1, 2]]
    ref = [[None, {1: -0.5, 3: -0.4}, {2: -1.0}]]
    got = [[None, {1: -0.3}, {2: -2.0, 5: -0.1}]]
    m = measure.compare_logprobs(windows, ref, got)
    assert m["positions"] == 2 and m["top1_agreement"] == 0.0  # 3 vs 1, then 2 vs 5
    assert m["mean_abs_logprob_diff"] == pytest.approx(0.6) and m["max_abs_logprob_diff"] == pytest.approx(1.0)
    assert m["perplexity"] == pytest.approx(math.exp(1.15)) and m["reference_perplexity"] == pytest.approx(
        math.exp(0.75))


def test_cli_quality_compares_the_set_precision(tiny_models):
    from engine.bench.cli import parse_args, quality_specs, settings_from_args
    args = parse_args(["quality", "--model", tiny_models["llama"][0], "--set", "quantization=int4",
                       "--set", "quantization_group_size=32"])
    assert quality_specs(args, settings_from_args(args)) == ["quantization=int4"]
    args = parse_args(["quality", "--spec", "kv_cache_dtype=int8"])
    assert quality_specs(args, settings_from_args(args)) == ["kv_cache_dtype=int8"]
    assert quality_specs(parse_args(["quality"]), {}) == list(measure.QUALITY_SPECS)


def test_cli_decode_times_each_precision(tiny_models, tmp_path, capsys):
    """`decode` loads every precision asked for and times each round of each: as many rows as specs,
    the reference first (its ratio 1), a time per round, the precision as the engine states it."""
    from engine.bench import cli
    folder = tiny_models["llama"][0]
    out = tmp_path / "decode.json"
    assert cli.main(["decode", "--model", folder, "--spec", "dtype=float32", "--spec", "quantization=int4",
                     "--rounds", "2", "--tokens", "3", "--prompt-len", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["spec"] for r in rows] == ["dtype=float32", "quantization=int4"] and rows[0]["ratio"] == 1.0
    assert all(len(r["ms_per_token"]) == 2 and min(r["ms_per_token"]) > 0 for r in rows)
    assert "int4 weights" in rows[1]["precision"] and "time per token" in capsys.readouterr().out


@pytest.mark.skipif(cpu_kernels.compiled() is None or not cpu_kernels.compiled().weight_only_available(),
                    reason="the engine's C++ CPU kernels (with AVX-512's weight-only matmuls) are not built here")
def test_kernel_worth_times_each_kernel_off_and_puts_it_back(tiny_models, tmp_path):
    """`kernel-worth`: a row per (precision, kernel, rows) with a time per round on each side; each kernel really
    switched to its torch path while its side runs (seen from inside the step), and back on after."""
    from engine.bench import cli
    from engine.bench import kernel_worth as kw
    seen = []
    real = kw.decode_ms

    def spy(engine, rows, prompt_len, tokens, seed):
        layer = engine.model.layers[0]
        seen.append((engine.runner.attention.decode_attention is not None, engine.model.cpu_ops is not None,
                     getattr(layer.qkv, "_own", None) is not None,
                     getattr(layer.qkv, "_quantize_rows", None) is not cpu_kernels.quantize_rows_python))
        return real(engine, rows, prompt_len, tokens, seed)
    kw.decode_ms = spy
    try:
        out = tmp_path / "worth.json"
        assert cli.main(["kernel-worth", "--model", tiny_models["llama"][0], "--spec", "dtype=float32",
                         "--spec", "quantization=int8",
                         "--spec", "quantization=w8a8", "--rows", "1,2", "--tokens", "2", "--rounds", "1",
                         "--json", str(out)]) == 0
    finally:
        kw.decode_ms = real
    rows = json.loads(out.read_text())
    # the tiny model's LM head (49,152 x 64 floats) is big enough to go into 2 MB pages where the system has them
    pages = ("huge pages",) if huge_pages.thp_mode() in ("always", "madvise") and huge_pages._libc() else ()
    assert [(r["spec"], r["kernel"], r["rows"]) for r in rows] == [
        (spec, k, n) for spec, ks in (("dtype=float32", ("attention", "layer ops", "matmul")),  # dense_matmul
                                      ("quantization=int8", ("attention", "layer ops", "matmul")),
                                      ("quantization=w8a8", ("attention", "layer ops", "w8a8 rows")))
        for k in (*ks, *(pages if spec != "quantization=w8a8" else ())) for n in (1, 2)]  # fbgemm's are opaque
    assert all(len(r["on_ms"]) == len(r["off_ms"]) == 1 and min(r["on_ms"] + r["off_ms"]) > 0 for r in rows)
    index = {"attention": 0, "layer ops": 1, "matmul": 2, "w8a8 rows": 3}
    for i, r in enumerate(rows):  # each row's one round: the kernel on, then off; nothing else differs
        on, off = seen[2 * i], seen[2 * i + 1]
        if r["kernel"] == "huge pages":  # the next test looks inside; here no kernel changes
            assert on == off, (r, on, off)
            continue
        j = index[r["kernel"]]
        assert on[j] and not off[j] and on[:j] + on[j + 1:] == off[:j] + off[j + 1:], (r, on, off)


def test_kernel_worth_takes_a_preset_name_as_decode_does():
    """`--spec int4` is the int4 preset's fields (as `bench decode` reads it), not a malformed key=value."""
    from engine.bench import kernel_worth as kw
    from engine.measure.specs import resolve_spec

    class Stop(Exception):
        pass

    class FakeLLM:
        def build_engine(self, fields):
            raise Stop(fields)
    if cpu_kernels.compiled() is None:
        pytest.skip("the C++ kernels are not built here")
    with pytest.raises(Stop) as stop:
        kw.kernel_worth(FakeLLM(), ["int4"])
    assert resolve_spec("int4").items() <= stop.value.args[0].items()


@pytest.mark.skipif(huge_pages.thp_mode() not in ("always", "madvise") or huge_pages._libc() is None,
                    reason="no transparent huge pages here")
def test_kernel_worth_times_the_weights_out_of_huge_pages_and_puts_them_back(tiny_models, monkeypatch):
    """`kernel-worth`'s huge-pages row: its off side runs over weights each in memory of its own, its on side over
    the one 2 MB-page buffer, and the weights are back in it after (the tiny model's tensors count here)."""
    from engine import LLM
    from engine.bench import kernel_worth as kw
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    llm = LLM(tiny_models["llama"][0], max_model_len=256)
    if not llm.engine.model.huge_page_bytes:
        pytest.skip("this CPU's kernel keeps its weights in oneDNN's opaque layout")
    seen = []
    real = kw.decode_ms

    def spy(engine, rows, prompt_len, tokens, seed):
        seen.append(len({t.untyped_storage().data_ptr() for t in engine.model.streamed_tensors() if not t.is_mkldnn}))
        return real(engine, rows, prompt_len, tokens, seed)
    monkeypatch.setattr(kw, "decode_ms", spy)
    rows = kw.kernel_worth(llm, ["dtype=float32"], rows=(1,), tokens=2, rounds=1)
    worth = [i for i, r in enumerate(rows) if r.kernel == "huge pages"]
    assert [rows[i].kernel for i in worth] == ["huge pages"]
    n = len(llm.build_engine({}).model.streamed_tensors())
    assert n > 1 and seen[2 * worth[0]:2 * worth[0] + 2] == [1, n]  # one buffer; then each its own
    model = llm.build_engine({}).model
    assert model.huge_page_bytes > 0 and len({t.untyped_storage().data_ptr() for t in model.streamed_tensors()}) == 1


def test_cli_decode_times_llama_cpp_in_the_same_rounds_or_says_what_it_needs(tiny_models, tmp_path, capsys,
                                                                             monkeypatch):
    """`decode --llama-cpp GGUF` adds llama.cpp's row, timed in each round with the same prompt and token count (a
    stand-in for the llama-cpp-python package here: it is not a requirement); without the package, a clear error."""
    import types

    from engine.bench import cli
    folder = tiny_models["llama"][0]
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    args = ["decode", "--model", folder, "--spec", "dtype=float32", "--rounds", "2", "--tokens", "3",
            "--prompt-len", "8", "--llama-cpp", str(gguf)]
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    assert cli.main(args) == 2 and "pip install llama-cpp-python" in capsys.readouterr().err
    calls = []

    class Llama:
        def __init__(self, path, **kwargs):
            assert path == str(gguf) and kwargs["n_threads"] == torch.get_num_threads()

        def reset(self):
            calls.append("reset")

        def eval(self, tokens):
            calls.append(len(tokens))

        def sample(self, temp):
            assert temp == 0.0
            return 7

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    out = tmp_path / "decode.json"
    assert cli.main([*args, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["spec"] for r in rows] == ["dtype=float32", "llama.cpp"] and len(rows[1]["ms_per_token"]) == 2
    assert "model.gguf" in rows[1]["precision"]
    # each round: the prompt in one call, then 3 warm-up decodes and 3 timed ones, one token each
    assert calls == 2 * ["reset", 8, *[1] * 6]


@pytest.mark.slow
def test_a_random_model_loads_in_another_precision_for_the_benchmarks():
    """bench decode loads each precision from the model loaded: a random: model too (its seeded weights)."""
    from engine import LLM
    from engine.quant.linear import Int8Linear
    llm = LLM("random:smollm2-135m", max_model_len=64, kv_cache=False)
    model = llm.load_weights(llm.config.replace(quantization="int8"))
    assert isinstance(model.layers[0].qkv, Int8Linear) and model.shape == llm.engine.model.shape


def test_busy_process_runs_only_inside_its_block():
    from engine.measure.experiments import busy_processes
    with busy_processes(1, 1, 1) as (proc,):
        assert proc.poll() is None  # spinning while the block runs
    assert proc.poll() is not None  # killed and reaped after it


def test_beside_busy_wants_two_finite_milliseconds():
    import argparse

    from engine.bench.cli import _busy_pair
    assert _busy_pair("2,3") == (2.0, 3.0)
    for bad in ("2", "2,3,4", "0,3", "nan,3", "2,inf", "-1,3", "x,3", "1e7,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _busy_pair(bad)


def test_closed_loop_keeps_its_requests_in_flight_and_runs_them_all(tiny_llm):
    """Every request runs to its length (tok/s counts them), at most `concurrency` at once (the engine's
    max_num_seqs is set to it), and decode-only and mixed steps are both timed."""
    from engine.measure.experiments import closed_loop
    from engine.measure.report import closed_loop_report
    seen = []
    real = tiny_llm.build_engine

    def build(settings):
        engine = real(settings)
        seen.append(engine.config.max_num_seqs)
        return engine
    tiny_llm.build_engine = build
    try:
        rows = closed_loop(tiny_llm, concurrency=3, requests=5, prompt_len=6, output_len=4, rounds=2,
                           settings=SMALL_POOL)
    finally:
        del tiny_llm.build_engine
    assert seen == [3] and len(rows) == 1 and not rows[0].beside_busy
    assert len(rows[0].tok_s) == 2 and min(rows[0].tok_s) > 0
    assert min(rows[0].decode_step_ms) > 0 and min(rows[0].mixed_step_ms) > 0
    table = closed_loop_report(rows, 3, 5, 6, 4).tables["per condition"]
    assert "beside a busy process" not in table[0] and table[0]["output tok/s (median)"] > 0


def test_fair_share_is_an_equal_slice_of_the_cores_per_thread():
    from engine.measure.experiments import fair_share
    for k in (0, 1, 2, 4, 6):  # two threads on two cores beside k whole-core neighbours: quiet x 2 / (2 + k)
        assert math.isclose(fair_share(k, threads=2, cores=2), 2 / (2 + k))
    assert fair_share(1, threads=1, cores=2) == 1.0  # a core each
    assert math.isclose(fair_share(2, threads=1, cores=2), 2 / 3)
    assert math.isclose(fair_share(1, threads=2, cores=2, duty=0.1), 0.95)  # the neighbour takes its tenth only
    assert math.isclose(fair_share(6, threads=4, cores=4), 0.4)


def test_closed_loop_beside_each_number_of_neighbours(tiny_llm, monkeypatch):
    """Each round runs quiet, then beside each count of busy processes (all of them spinning while it runs, none
    left after); every row has tok/s against the quiet run's and against its fair share."""
    from contextlib import contextmanager

    from engine.measure import experiments
    from engine.measure.report import closed_loop_report
    started, procs = [], []
    real = experiments.busy_processes

    @contextmanager
    def counted(count, busy_ms, idle_ms):
        with real(count, busy_ms, idle_ms) as running:
            assert all(p.poll() is None for p in running)
            started.append((count, busy_ms, idle_ms))
            procs.extend(running)
            yield running
    monkeypatch.setattr(experiments, "busy_processes", counted)
    threads, cores = torch.get_num_threads(), experiments.usable_cores()
    rows = experiments.closed_loop(tiny_llm, concurrency=2, requests=3, prompt_len=6, output_len=3, rounds=2,
                                   settings=SMALL_POOL, neighbours=[1, 2])
    assert torch.get_num_threads() == threads  # left as found, whatever the engine's count did meanwhile
    assert [(c, b) for c, b, _ in started] == [(0, math.inf), (1, math.inf), (2, math.inf)] * 2
    assert len(procs) == 6 and all(p.poll() is not None for p in procs)
    assert [r.neighbours for r in rows] == [0, 1, 2] and [r.beside_busy for r in rows] == [False, True, True]
    for r in rows:
        assert len(r.tok_s) == len(r.vs_quiet) == len(r.threads) == 2 and min(r.tok_s) > 0
        assert r.fair_share == experiments.fair_share(r.neighbours, threads, cores)
        assert r.of_fair_share == [v / r.fair_share for v in r.vs_quiet]
        assert all(1 <= t <= threads for t in r.threads)
    assert rows[0].vs_quiet == [1.0, 1.0] and rows[0].fair_share == 1.0
    assert rows[1].vs_quiet == [a / b for a, b in zip(rows[1].tok_s, rows[0].tok_s)]
    report = closed_loop_report(rows, 2, 3, 6, 3)
    table = report.tables["per condition"]
    assert [t["busy neighbours"] for t in table] == [0, 1, 2]
    assert {"vs quiet (median)", "fair share", "of fair share (median)", "threads (runs)"} <= set(table[2])
    assert "always busy" in report.notes[0]


def test_closed_loop_with_a_duty_cycle_alone_is_one_part_time_neighbour(tiny_llm):
    from engine.measure import experiments
    from engine.measure.report import closed_loop_report
    threads, cores = torch.get_num_threads(), experiments.usable_cores()
    rows = experiments.closed_loop(tiny_llm, concurrency=2, requests=2, prompt_len=6, output_len=2, rounds=1,
                                   settings=SMALL_POOL, busy=(1.0, 3.0), settle=False)
    assert [r.neighbours for r in rows] == [0, 1]
    assert rows[1].fair_share == experiments.fair_share(1, threads, cores, duty=0.25)
    assert "25% of a core" in closed_loop_report(rows, 2, 2, 6, 2, busy=(1.0, 3.0)).notes[0]
    with pytest.raises(ValueError, match="at least 1"):
        experiments.closed_loop(tiny_llm, neighbours=[0])


def test_busy_processes_are_gone_however_the_block_ends():
    from engine.measure.experiments import MAX_NEIGHBOURS, busy_processes
    with pytest.raises(RuntimeError, match="the block failed"), busy_processes(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        raise RuntimeError("the block failed")
    assert all(p.poll() is not None for p in procs)
    with busy_processes(0) as none:
        assert none == []
    for bad in (-1, MAX_NEIGHBOURS + 1):
        with pytest.raises(ValueError, match="busy processes"), busy_processes(bad):
            pass


def test_a_busy_process_ends_when_its_parent_is_killed(tmp_path):
    """A parent killed outright runs no finally: its spinners notice it has gone and end by themselves."""
    import os
    import signal
    import subprocess
    import time
    script = ("from engine.measure.experiments import busy_processes\n"
              "import time\n"
              "with busy_processes(1) as procs:\n"
              "    print(procs[0].pid, flush=True)\n"
              "    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended, not yet reaped by its new parent
                    break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the busy process outlived its parent by 10 s")
    finally:
        parent.kill()
        parent.stdout.close()


def test_closed_loop_beside_busy_takes_neighbour_counts():
    import argparse

    from engine.bench.cli import _neighbour_counts
    args = cli.parse_args(["closed-loop", "--beside-busy", "1,2,4,6"])
    assert args.beside_busy == [1, 2, 4, 6] and args.busy_duty is None
    args = cli.parse_args(["closed-loop", "--beside-busy", "1", "--busy-duty", "0.5,4.5"])
    assert args.beside_busy == [1] and args.busy_duty == (0.5, 4.5)
    with pytest.raises(argparse.ArgumentTypeError, match="--busy-duty 0.5,4.5"):
        _neighbour_counts("0.5,4.5")  # the earlier form says what it is now
    for bad in ("0", "1,0", "65", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _neighbour_counts(bad)


def test_a_stream_of_tokens_without_text_counts_by_its_usage():
    """A random prompt can make a model emit only special tokens, which a server streams without text: with its
    usage saying tokens came, the request succeeded (its tokens counted, no TTFT to time); without usage, it failed.
    (It was counted a failure, and one such request out of 32 stopped a whole `bench versus` cell.)"""
    import asyncio

    import httpx

    from engine.bench.serve import stream_request

    def chunks(*bodies: dict) -> bytes:
        return b"".join(b"data: " + json.dumps(b).encode() + b"\n\n" for b in bodies) + b"data: [DONE]\n\n"

    def run(body: bytes):
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

        async def go():
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await stream_request(client, "/v1/completions", {}, chat=False, run_start=0.0)
        return asyncio.run(go())

    texts = run(chunks({"choices": [{"text": "a"}]}, {"choices": [{"text": "b", "finish_reason": "length"}]},
                       {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}))
    assert texts.ok and texts.ttft_s is not None and texts.output_tokens == 2 and texts.text == "ab"
    silent = run(chunks({"choices": [{"text": ""}]}, {"choices": [{"text": "", "finish_reason": "length"}]},
                        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}))
    assert silent.ok and silent.ttft_s is None and silent.output_tokens == 2 and silent.error is None
    unknown = run(chunks({"choices": [{"text": "", "finish_reason": "length"}]}))
    assert not unknown.ok and unknown.error == "the stream carried no text"
