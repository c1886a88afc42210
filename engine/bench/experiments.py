"""Experiments: each returns dataclasses a UI can use; only the CLI prints.

table (the reference table, with HF generate), compare (one workload, two configurations), hf-static
(HF in static batches vs the engine), sched-cost (the scheduler's own cost), ablate (each switch off in turn).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import EngineConfig
from ..engine import LLMEngine
from ..llm import LLM
from ..sampler import SamplingParams
from ..workloads import Workload
from .hf import hf_generate, hf_pad_id, hf_static_batches, hf_warm_up, load_hf_model
from .runs import (
    GIB,
    RunResult,
    StepBreakdown,
    StepTracker,
    StopCheck,
    build_engine,
    config_fields,
    engine_config,
    fixed_workload,
    kv_bytes_per_block,
    random_prompts,
    run_config,
    run_workload,
    summarize_steps,
    warm_up,
    weight_bytes,
)
from .specs import resolve_spec


# ---- `table`: the reference table ----------------------------------------------------------------------
@dataclass
class TableRow:
    batch: int
    time_s: float
    ttft_s: float | None
    tpot_s: float | None
    memory_gb: float
    tps: float
    generated_tokens: int
    peak_kv_blocks: int
    steps: StepBreakdown
    hf_time_s: float | None = None
    hf_tps: float | None = None
    ratio: float | None = None  # engine TPS / HF TPS


def table_prompts(batch: int, input_len: int, seed: int) -> list[list[int]]:
    """Seeded per batch size, so one batch's prompts never share a prefix with another's."""
    return random_prompts(batch, input_len, seed * 100_003 + batch)


def engine_memory_gb(engine: LLMEngine, peak_blocks: int) -> float:
    """CUDA: allocator peak. CPU: the peak KV blocks in use plus the weights."""
    device = engine.model.device
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return (peak_blocks * kv_bytes_per_block(engine) + weight_bytes(engine.model)) / GIB


def run_table_row(llm: LLM, batch: int, input_len: int, output_len: int, settings: dict[str, Any],
                  seed: int = 0) -> TableRow:
    workload = fixed_workload(table_prompts(batch, input_len, seed), output_len)
    engine = build_engine(llm, settings)
    warm_up(engine)
    if engine.model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.model.device)
    run = run_workload(engine, workload)
    return TableRow(batch, run.wall_s, run.mean_ttft_s, run.mean_tpot_s, engine_memory_gb(engine, run.peak_kv_blocks),
                    run.throughput, run.generated_tokens, run.peak_kv_blocks, run.steps)


def add_hf_to_rows(llm: LLM, rows: list[TableRow], input_len: int, output_len: int, seed: int = 0) -> None:
    """Time transformers' generate on each row's prompts (loaded after the engine runs, so CUDA peaks stay apart)."""
    hf = load_hf_model(llm)
    pad = hf_pad_id(hf, llm.tokenizer)
    hf_warm_up(hf, pad)
    for row in rows:
        row.hf_time_s = hf_generate(hf, table_prompts(row.batch, input_len, seed), output_len, pad)
        row.hf_tps = row.batch * output_len / row.hf_time_s
        row.ratio = row.tps / row.hf_tps
    del hf


def run_table(llm: LLM, batch_sizes: Sequence[int], input_len: int = 128, output_len: int = 128,
              settings: dict[str, Any] | None = None, hf: bool = True, seed: int = 0) -> list[TableRow]:
    rows = [run_table_row(llm, b, input_len, output_len, settings or {}, seed) for b in batch_sizes]
    if hf:
        add_hf_to_rows(llm, rows, input_len, output_len, seed)
    return rows


# ---- `compare`: one workload, two configurations -------------------------------------------------------
@dataclass
class CompareResult:
    workload: str
    labels: tuple[str, str]
    results: tuple[RunResult, RunResult]
    ratio: float  # throughput b / a
    same_outputs: bool  # every request's output token ids equal (expected for greedy workloads)


def compare(llm: LLM, workload: Workload, spec_a: str, spec_b: str, settings: dict[str, Any] | None = None,
            progress: Callable[[int, int, str], None] | None = None,
            should_stop: StopCheck | None = None) -> CompareResult:
    fields = [config_fields(workload, settings or {}, resolve_spec(s)) for s in (spec_a, spec_b)]
    for f in fields:  # every spec is checked before anything runs
        engine_config(llm, f)
    runs = []
    for i, (spec, f) in enumerate(zip((spec_a, spec_b), fields, strict=True)):
        if progress is not None:
            progress(i, len(fields), spec)
        runs.append(run_config(llm, workload, f, should_stop))
    if progress is not None:
        progress(len(fields), len(fields), "done")
    a, b = runs
    ratio = b.throughput / a.throughput if a.throughput else float("inf")
    return CompareResult(workload.name, (spec_a, spec_b), (a, b), ratio, a.output_token_ids == b.output_token_ids)


# ---- `hf-static`: transformers in static batches vs the engine -----------------------------------------
@dataclass
class HFStaticResult:
    workload: str
    batch_size: int
    num_batches: int
    hf_wall_s: float
    hf_generated_tokens: int  # every row runs to its batch's longest output
    hf_useful_tokens: int  # each request's own max_tokens
    hf_throughput: float  # useful tokens per second
    engine: RunResult
    ratio: float  # engine throughput / HF throughput


def hf_static(llm: LLM, workload: Workload, batch_size: int = 8,
              settings: dict[str, Any] | None = None) -> HFStaticResult:
    engine_run = run_config(llm, workload, config_fields(workload, settings or {}, {}))
    hf = load_hf_model(llm)
    pad = hf_pad_id(hf, llm.tokenizer)
    hf_warm_up(hf, pad)
    seconds, generated, useful = hf_static_batches(hf, workload, batch_size, pad)
    del hf
    hf_tps = useful / seconds if seconds > 0 else 0.0
    return HFStaticResult(workload.name, batch_size, -(-len(workload.requests) // batch_size), seconds, generated,
                          useful, hf_tps, engine_run, engine_run.throughput / hf_tps if hf_tps else float("inf"))


# ---- `sched-cost`: the scheduler's own cost per step ---------------------------------------------------
@dataclass
class SchedCostResult:
    running: int
    prompt_len: int
    decode_steps: int
    decode: StepBreakdown  # steps that only decode (all admitted requests running)
    all_steps: StepBreakdown
    wall_s: float


def sched_cost(llm: LLM, running: int = 64, prompt_len: int = 16, decode_steps: int = 32,
               settings: dict[str, Any] | None = None, seed: int = 0) -> SchedCostResult:
    settings = dict(settings or {})
    settings["max_num_seqs"] = max(running, settings.get("max_num_seqs", EngineConfig.max_num_seqs))
    engine = build_engine(llm, settings)
    warm_up(engine)
    tracker = StepTracker(engine)
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    for prompt in random_prompts(running, prompt_len, seed):
        engine.add_request(prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        tracker.step()
    wall = time.perf_counter() - start
    decodes = [r for r in tracker.records if r.decodes and not r.prefills]
    return SchedCostResult(running, prompt_len, decode_steps, summarize_steps(decodes),
                           summarize_steps(tracker.records), wall)


# ---- `ablate`: the full engine, then each switch off in turn -------------------------------------------
FULL_ENGINE = "full engine"
# (label, the EngineConfig switch turned off); the full engine has every built switch on
ABLATIONS: tuple[tuple[str, str], ...] = (
    ("no KV cache (naive loop)", "kv_cache"),
    ("contiguous KV (no paging)", "paged_kv"),
    ("static batching", "continuous_batching"),
    ("no prefix caching", "prefix_caching"),
)


@dataclass
class AblationRow:
    feature: str  # what the row shows, for people
    switch: str | None  # the EngineConfig field that was turned off; None for the full engine
    throughput_tok_s: float | None = None
    ratio: float | None = None  # throughput / the full engine's
    mean_ttft_s: float | None = None
    mean_tpot_s: float | None = None
    peak_kv_blocks: int | None = None
    preemptions: int | None = None
    prefix_hits: int | None = None
    same_output_as_full: bool | None = None
    error: str | None = None  # why this configuration could not run on the workload


def ablate(llm: LLM, workload: Workload, settings: dict[str, Any] | None = None,
           progress: Callable[[int, int, str], None] | None = None,
           should_stop: StopCheck | None = None) -> list[AblationRow]:
    """One row per configuration: the full engine, then each switch off; throughput, its ratio to the full
    engine, latency, and whether its greedy outputs equal the full engine's. A configuration that cannot run
    on this workload (e.g. contiguous KV in a pool too small for max_model_len) gets a row with `error`."""
    plan: list[tuple[str, str | None]] = [(FULL_ENGINE, None), *ABLATIONS]
    rows: list[AblationRow] = []
    full: RunResult | None = None
    for i, (feature, switch) in enumerate(plan):
        if progress is not None:
            progress(i, len(plan), feature)
        row = AblationRow(feature, switch)
        rows.append(row)
        try:
            r = run_config(llm, workload, config_fields(workload, settings or {}, {switch: False} if switch else {}),
                           should_stop)
        except ValueError as exc:
            row.error = str(exc)
            continue
        full = full or r
        row.throughput_tok_s, row.ratio = r.throughput, r.throughput / full.throughput
        row.mean_ttft_s, row.mean_tpot_s, row.peak_kv_blocks = r.mean_ttft_s, r.mean_tpot_s, r.peak_kv_blocks
        row.preemptions, row.prefix_hits = r.preemptions, r.prefix_hits
        row.same_output_as_full = r.output_token_ids == full.output_token_ids
    if progress is not None:
        progress(len(plan), len(plan), "done")
    return rows
