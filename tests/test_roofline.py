"""engine/measure/roofline.py (`python -m engine.bench roofline`): the machine's read bandwidth and GEMM peaks, and
each precision's decode against them, on the tiny model at sizes smaller than --quick's. Structure and arithmetic:
the bytes from the loaded buffers, the floors from the bytes, flops and measured limits; never a timing."""
from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest
import torch

from engine import measure
from engine.bench import cli
from engine.measure import roofline as rf
from engine.measure.specs import resolve_spec

TINY = dataclasses.replace(rf.QUICK, read_bytes=16 * 2**20, gemm_n=128, repeats=2, batch=4, prompt_len=6, tokens=3)


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    folder, _ = tiny_models["llama"]
    return measure.load_llm({"model": folder})


@pytest.fixture(scope="module")
def result(tiny_llm):
    return rf.roofline(tiny_llm, sizes=TINY)


def test_the_machine_is_measured_on_the_engines_threads(result):
    m = result.machine
    assert m.threads == torch.get_num_threads() and m.cores >= 1 and m.cpu
    assert set(m.read_gb_s) - {"fp32 sum", "bf16 sum", "fp32 matrix-vector"} == {
        f"fp32 matrix-vector by the engine's {rf.Linear(torch.ones(2, 2)).choice.kernel}"} and len(m.read_gb_s) == 4
    assert all(len(runs) == TINY.repeats and min(runs) > 0 for runs in m.read_gb_s.values())
    assert m.bandwidth == max(max(runs) for runs in m.read_gb_s.values()) * 1e9 > 0
    assert m.read_bytes == TINY.read_bytes  # a whole number of the matrix-vector read's rows
    # each precision by torch.mm and by the engine's own kernel; the peak is the better of the two
    assert len(m.gemm_gflops) == 4 and all(len(r) == TINY.repeats and min(r) > 0 for r in m.gemm_gflops.values())
    for p in ("fp32", "bf16"):
        runs = [r for name, r in m.gemm_gflops.items() if name.startswith(p)]
        assert len(runs) == 2 and m.peak_flops(p) == max(max(runs[0]), max(runs[1])) * 1e9


def test_the_read_buffer_outgrows_the_cache():
    """At least 1 GiB and READ_OVER_LLC times the last-level cache, unless that is more than a quarter of the free
    memory."""
    llc = rf.llc_bytes()
    assert llc is None or llc > 0
    plenty = 64 * rf.GIB
    assert rf.default_read_bytes(None, plenty) == rf.default_read_bytes(64 * 2**20, plenty) == rf.MIN_READ_BYTES
    assert rf.default_read_bytes(2 * rf.GIB, plenty) == rf.READ_OVER_LLC * 2 * rf.GIB
    assert rf.default_read_bytes(2 * rf.GIB, 4 * rf.GIB) == rf.GIB  # a quarter of what is free
    assert 0 < rf.default_read_bytes(llc) <= max(rf.MIN_READ_BYTES, rf.READ_OVER_LLC * (llc or 0))


def test_each_precision_reads_fewer_bytes_than_the_one_before(result):
    assert [r.spec for r in result.rows] == list(rf.SPECS)
    fp32, bf16, int8, int4 = (r.weight_bytes for r in result.rows)
    assert int4 < int8 < bf16 < fp32
    params = result.rows[0].matmul_params
    assert fp32 >= 4 * params and bf16 >= 2 * params and params <= int8 < 2 * params and params / 2 <= int4 < params


def _buffers(model) -> int:
    """The test's own count: every tensor the projections stream, the layers' norms, the final norm."""
    streamed = sum(t.numel() * t.element_size() for t in model.streamed_tensors())
    norms = sum(w.numel() * w.element_size() for layer in model.layers for w in (layer.input_norm, layer.post_norm))
    return streamed + norms + model.norm.numel() * model.norm.element_size()


def test_the_bytes_are_the_loaded_buffers(tiny_llm, result):
    for row in result.rows:
        model = tiny_llm.load_weights(tiny_llm.config_for(resolve_spec(row.spec)))
        assert row.weight_bytes == rf.weight_bytes_per_step(model) == _buffers(model)
        context = TINY.prompt_len + TINY.tokens // 2
        assert row.row_bytes == (model.embed.shape[1] * model.embed.element_size()
                                 + context * model.kv_bytes_per_token())


def test_a_presets_own_kv_cache_is_counted(tiny_llm):
    """The int4 preset keeps K and V in int8: its engine has that cache, and its rows read those bytes."""
    sizes = dataclasses.replace(TINY, batch=2, tokens=2, read_bytes=4 * 2**20, gemm_n=64, repeats=1)
    (row,) = rf.roofline(tiny_llm, ["int4"], sizes).rows
    model = tiny_llm.load_weights(tiny_llm.config_for(resolve_spec("int4")))
    context = sizes.prompt_len + sizes.tokens // 2
    assert model.kv_bytes_per_token("int8") < model.kv_bytes_per_token()
    assert row.row_bytes == model.embed.shape[1] * model.embed.element_size() + context * model.kv_bytes_per_token(
        "int8")
    assert row.weight_bytes == rf.weight_bytes_per_step(model) and "int4" in row.precision


def test_the_matmul_params_are_the_models_shape(tiny_llm, result):
    s = tiny_llm.engine.model.shape
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_layer = s.hidden_size * (q + 2 * kv) + q * s.hidden_size + 3 * s.hidden_size * s.intermediate_size
    assert {r.matmul_params for r in result.rows} == {s.num_layers * per_layer + s.vocab_size * s.hidden_size}


def test_the_floors_are_bytes_over_bandwidth_and_flops_over_peak(result):
    m, b = result.machine, TINY.batch
    for r in result.rows:
        assert len(r.batch1_ms) == len(r.batch_ms) == TINY.rounds and min(r.batch1_ms + r.batch_ms) > 0
        assert r.bytes_per_step == r.weight_bytes + r.row_bytes
        assert math.isclose(r.bandwidth_floor_ms, r.bytes_per_step / m.bandwidth * 1e3)
        assert math.isclose(r.batch1_ratio, statistics.median(r.batch1_ms) / r.bandwidth_floor_ms)
        # each round also against a read taken just before it: the same bytes over that read's rate
        assert len(r.batch1_read_gb_s) == TINY.rounds and min(r.batch1_read_gb_s) > 0
        for ratio, ms, gb_s in zip(r.batch1_beside_ratios, r.batch1_ms, r.batch1_read_gb_s, strict=True):
            assert math.isclose(ratio, ms / (r.bytes_per_step / (gb_s * 1e9) * 1e3))
        assert r.peak == {"dtype=float32": "fp32", "dtype=bfloat16": "bf16"}.get(r.spec, r.peak) in ("fp32", "bf16")
        assert math.isclose(r.compute_floor_ms, 2 * r.matmul_params * b / m.peak_flops(r.peak) * 1e3)
        assert math.isclose(r.batch_bandwidth_floor_ms, (r.weight_bytes + b * r.row_bytes) / m.bandwidth * 1e3)
        assert math.isclose(r.batch_ratio, statistics.median(r.batch_ms) / r.compute_floor_ms)
        assert "threads" in r.threads and r.kernel


def test_the_report_has_the_machine_and_both_floors(result):
    report = rf.roofline_report(result)
    machine, one, many = report.tables.values()
    # four reads, then two GEMMs (torch.mm and the engine's own kernel) in each of fp32 and bf16
    assert len(machine) == 8 and all("GB/s" in row["best"] for row in machine[:4])
    assert all("GFLOP/s" in row["best"] and "GEMM" in row["measure"] for row in machine[4:])
    assert [row["spec"] for row in one] == [row["spec"] for row in many] == list(rf.SPECS)
    assert {"weights MB a step", "floor ms", "measured / floor", "each round / the read just before it"} <= set(one[0])
    assert {"compute floor ms", "peak", "measured / compute floor"} <= set(many[0])
    assert f"batch {TINY.batch}" in list(report.tables)[2]
    assert "1 is the machine's limit" in "\n".join(report.notes)
    assert "roofline" in measure.report.render_report(report)


def test_the_command_line_runs_quick_and_writes_json(tiny_models, tmp_path, capsys):
    folder, _ = tiny_models["llama"]
    out = tmp_path / "roofline.json"
    assert cli.main(["roofline", "--model", folder, "--quick", "--spec", "dtype=float32", "--spec",
                     "quantization=int4", "--batch", "2", "--tokens", "2", "--prompt-len", "4", "--read-mb", "8",
                     "--gemm", "64", "--json", str(out)]) == 0
    assert "against the bandwidth floor" in capsys.readouterr().out
    (data,) = json.loads(out.read_text())
    assert data["machine"]["read_bytes"] == 8 * 2**20 and data["sizes"]["batch"] == 2
    assert [r["spec"] for r in data["rows"]] == ["dtype=float32", "quantization=int4"]
    assert data["rows"][0]["weight_bytes"] > data["rows"][1]["weight_bytes"] > 0


def test_quick_sizes_give_way_to_each_option_given():
    sizes = cli.roofline_sizes(cli.parse_args(["roofline", "--quick", "--batch", "8"]))
    assert sizes == dataclasses.replace(rf.QUICK, batch=8)
    assert cli.roofline_sizes(cli.parse_args(["roofline"])) == rf.Sizes()
    assert cli.roofline_sizes(cli.parse_args(["roofline", "--read-mb", "3"])).read_bytes == 3 * 2**20
