"""Experiments: each returns dataclasses a UI can use; only the CLI prints.

table (the reference table, with HF generate), compare (one workload, two configurations), hf-static
(HF in static batches vs the engine), sched-cost (the scheduler's own cost), sampling-cost, ablate (each switch off
in turn), memory. What each precision costs (kernels, decode, quality) is precision.py.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import BUILT_SWITCHES, EngineConfig
from ..engine import LLMEngine
from ..llm import LLM
from ..quant.speed import model_speeds
from ..sampler import SamplingParams
from ..workloads import Workload
from .hf import hf_generate, hf_pad_id, hf_static_batches, hf_warm_up, load_hf_model
from .runs import (
    GIB,
    Progress,
    RunResult,
    StepBreakdown,
    StepTracker,
    StopCheck,
    config_fields,
    fixed_workload,
    kv_bytes_per_block,
    random_prompts,
    run_config,
    run_workload,
    summarize_steps,
    weight_bytes,
)
from .specs import load_feature_preset, resolve_spec


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
    engine = llm.build_engine(settings)
    engine.warm_up()
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
    results: tuple[RunResult, RunResult]  # the first repetition's
    ratio: float  # throughput b / a, the median over repetitions
    same_outputs: bool  # every request's output token ids equal (expected for greedy workloads)
    ratios: list[float] = field(default_factory=list)  # throughput b / a in each repetition
    gap_ratios: list[float] = field(default_factory=list)  # max token gap a / b in each repetition


def compare(llm: LLM, workload: Workload, spec_a: str, spec_b: str, settings: dict[str, Any] | None = None,
            repeat: int = 1, progress: Progress = None, should_stop: StopCheck | None = None) -> CompareResult:
    """The same workload through two configurations, a then b, `repeat` times side by side (the spread of the
    ratios says how much to trust it on a noisy machine)."""
    fields = [config_fields(workload, settings or {}, resolve_spec(s)) for s in (spec_a, spec_b)]
    for f in fields:  # every spec is checked before anything runs
        llm.config_for(f)
    plan = [(spec, f) for _ in range(max(1, repeat)) for spec, f in zip((spec_a, spec_b), fields, strict=True)]
    runs = []
    for i, (spec, f) in enumerate(plan):
        if progress is not None:
            progress(i, len(plan), spec)
        runs.append(run_config(llm, workload, f, should_stop))
    if progress is not None:
        progress(len(plan), len(plan), "done")
    pairs = list(zip(runs[::2], runs[1::2], strict=True))
    ratios = [b.throughput / a.throughput if a.throughput else float("inf") for a, b in pairs]
    gap_ratios = [a.max_token_gap_s / b.max_token_gap_s for a, b in pairs if a.max_token_gap_s and b.max_token_gap_s]
    return CompareResult(workload.name, (spec_a, spec_b), pairs[0], statistics.median(ratios),
                         all(x.output_token_ids == y.output_token_ids for x, y in pairs), ratios, gap_ratios)


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
    engine = llm.build_engine(settings)
    engine.warm_up()
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


# ---- `sampling-cost`: what sampling adds to a decode step, over greedy -------------------------------------
# (label, SamplingParams fields): greedy first, the reference of every ratio
SAMPLING_MODES = (("greedy", {"temperature": 0.0}), ("temperature 1", {"temperature": 1.0}),
                  ("temperature 0.7, top-p 0.95", {"temperature": 0.7, "top_p": 0.95}),
                  ("temperature 0.8, top-k 50", {"temperature": 0.8, "top_k": 50}),
                  ("temperature 1, min-p 0.05", {"temperature": 1.0, "min_p": 0.05}))


@dataclass
class SamplingCostRow:
    mode: str
    tok_s: list[float]  # one per round
    sample_ms: list[float]  # the sampler's own mean time per step, one per round
    vs_greedy: list[float]  # tok/s over greedy's in the same round


def sampling_cost(llm: LLM, batch: int = 8, prompt_len: int = 128, tokens: int = 64, rounds: int = 3,
                  settings: dict[str, Any] | None = None, seed: int = 0) -> list[SamplingCostRow]:
    """`batch` requests decoding together in each sampling mode, the modes alternating within each round on one
    engine, fresh prompts every run: tokens/s and the sampler's own time per step."""
    engine = llm.build_engine(dict(settings or {}))
    engine.warm_up()
    rows = [SamplingCostRow(label, [], [], []) for label, _ in SAMPLING_MODES]
    draw = seed
    for _ in range(rounds):
        for row, (_, fields) in zip(rows, SAMPLING_MODES, strict=True):
            draw += 1
            tracker = StepTracker(engine)
            for prompt in random_prompts(batch, prompt_len, draw):
                engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=draw, **fields))
            start = time.perf_counter()
            while engine.has_unfinished():
                tracker.step()
            row.tok_s.append(batch * tokens / (time.perf_counter() - start))
            row.sample_ms.append(summarize_steps(tracker.records).mean_ms["sample_ms"])
        for row in rows:
            row.vs_greedy.append(row.tok_s[-1] / rows[0].tok_s[-1])
    return rows


@dataclass
class PrefillCostRow:
    budget: int  # max_num_batched_tokens
    ms_per_token: list[float]  # the wave's prefill time over its prompt tokens, one per round
    steps: list[int]  # steps the wave took
    forward_share: list[float]  # of the wave's time, the model's forward (the rest: scheduling, preparing, sampling)


def prefill_cost(llm: LLM, budgets: list[int], batch: int = 32, prompt_len: int = 128, rounds: int = 3,
                 settings: dict[str, Any] | None = None, seed: int = 0) -> list[PrefillCostRow]:
    """A wave of `batch` fresh prompts arriving together into an idle engine, each asking for one token (so the wave
    is all prefill), at each step budget, the budgets alternating within each round: time per prompt token. What a
    burst of requests waits for its first token; vLLM's offline `LLM.generate` times the same (docs/measurements.md).
    Prefix caching is off: fresh random prompts share nothing anyway, and a cached run would time nothing."""
    engines = [llm.build_engine({**(settings or {}), "prefix_caching": False, "max_num_batched_tokens": b})
               for b in budgets]
    for engine in engines:
        engine.warm_up()
    rows = [PrefillCostRow(b, [], [], []) for b in budgets]
    draw = seed
    for _ in range(rounds):
        for row, engine in zip(rows, engines, strict=True):
            draw += 1
            tracker = StepTracker(engine)
            for prompt in random_prompts(batch, prompt_len, draw):
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            start = time.perf_counter()
            while engine.has_unfinished():
                tracker.step()
            took = time.perf_counter() - start
            row.ms_per_token.append(took * 1e3 / (batch * prompt_len))
            row.steps.append(len(tracker.records))
            row.forward_share.append(sum(r.forward_ms for r in tracker.records) / (took * 1e3))
    return rows


# ---- `ablate`: the full engine, then each switch off in turn; --cumulative; --concurrency ---------------
@dataclass(frozen=True)
class Feature:
    switch: str  # the EngineConfig field: a True/False switch, or a setting such as quantization
    name: str  # "+ name" in the cumulative chart
    off_label: str  # the ablation row of the engine without it
    on_fields: dict[str, Any] | None = None  # what turning it on sets, when more than switch=True
    off_fields: dict[str, Any] | None = None

    def fields(self, on: bool) -> dict[str, Any]:
        given = self.on_fields if on else self.off_fields
        return dict(given) if given is not None else {self.switch: on}


# The course's fifth feature, "INT4 weights + INT8 KV": fewer bytes per weight and per KV slot. Its output is not
# expected to equal the unquantized engine's token for token (AblationRow.precision says which rows compare).
QUANTIZED = load_feature_preset("int4")  # one place: the preset says what the course's int4 + int8 KV is
# In the course's order: the cumulative ablation adds them back one by one in this order.
FEATURES = (
    Feature("kv_cache", "KV cache", "no KV cache (naive loop)"),
    Feature("paged_kv", "paged KV", "contiguous KV (no paging)"),
    Feature("continuous_batching", "continuous batching", "static batching"),
    Feature("prefix_caching", "prefix caching", "no prefix caching"),
    Feature("quantization", "int4 weights + int8 KV", "no quantization", QUANTIZED,
            {"quantization": None, "kv_cache_dtype": "auto", "quantize_lm_head": True,
             "quantization_smoothing": False, "quantization_gptq": False, "kv_cache_smoothing": False}),
    Feature("chunked_prefill", "chunked prefill", "no chunked prefill"),
    Feature("speculative_decoding", "speculative decoding", "no speculative decoding"),
)
assert {f.switch for f in FEATURES} == {*BUILT_SWITCHES, "quantization"}, "every built switch has its row"
FULL_ENGINE = "full engine"
NAIVE_LOOP = "naive loop (everything off)"
ABLATIONS: tuple[tuple[str, str], ...] = tuple((f.off_label, f.switch) for f in FEATURES)


def features_fields(on: Callable[[Feature], bool]) -> dict[str, Any]:
    """The config fields with each feature on or off as `on` says."""
    return {k: v for f in FEATURES for k, v in f.fields(on(f)).items()}


FULL_FIELDS = features_fields(lambda f: True)  # every built feature on (speculation is off by default)


@dataclass
class AblationRow:
    feature: str  # what the row shows, for people
    switch: str | None  # the EngineConfig field that was turned off (added, cumulatively); None for the baseline
    throughput_tok_s: float | None = None
    ratio: float | None = None  # throughput / the baseline's (the full engine; the naive loop when cumulative)
    mean_ttft_s: float | None = None
    mean_tpot_s: float | None = None
    peak_kv_blocks: int | None = None
    preemptions: int | None = None
    prefix_hits: int | None = None
    same_output_as_full: bool | None = None  # greedy outputs equal the baseline's (expected only in its precision)
    precision: str | None = None  # what the row computed with (EngineConfig.precision): rows compare within one
    error: str | None = None  # why this configuration could not run on the workload
    concurrency: int | None = None  # requests at a time (max_num_seqs), when swept
    step_ratio: float | None = None  # cumulative: throughput / the previous row's (what this feature added)
    acceptance_rate: float | None = None  # speculative decoding's accepted / drafted tokens
    kernel: str | None = None  # what ran its projections here ("int4 weights · C++ AVX-512 kernel")
    speed_vs_fp32: str | None = None  # a quantized row's scheme against fp32 on this CPU (quant/speed.py)


def _run_plan(llm: LLM, workload: Workload, settings: dict[str, Any], plan: list[tuple[str, str | None, dict]],
              progress: Progress, concurrency: int | None = None,
              should_stop: StopCheck | None = None) -> list[AblationRow]:
    """Each (label, switch, fields) in turn; ratios against the first row that ran."""
    rows: list[AblationRow] = []
    base: RunResult | None = None
    previous: RunResult | None = None
    for i, (feature, switch, fields) in enumerate(plan):
        if progress is not None:
            progress(i, len(plan), feature)
        row = AblationRow(feature, switch, concurrency=concurrency)
        rows.append(row)
        try:
            r = run_config(llm, workload, config_fields(workload, settings, fields), should_stop)
        except ValueError as exc:
            row.error = str(exc)
            continue
        base = base or r
        row.throughput_tok_s, row.ratio = r.throughput, r.throughput / base.throughput
        row.step_ratio = r.throughput / previous.throughput if previous else None
        row.mean_ttft_s, row.mean_tpot_s, row.peak_kv_blocks = r.mean_ttft_s, r.mean_tpot_s, r.peak_kv_blocks
        row.preemptions, row.prefix_hits, row.acceptance_rate = r.preemptions, r.prefix_hits, r.acceptance_rate
        row.same_output_as_full = r.output_token_ids == base.output_token_ids
        row.precision = EngineConfig(**r.config).precision
        row.kernel = r.kernels.get("weights")
        speed = model_speeds(llm.engine.model).get(r.config["quantization"]) if r.config["quantization"] else None
        row.speed_vs_fp32 = speed.describe() if speed is not None else None
        previous = r
    if progress is not None:
        progress(len(plan), len(plan), "done")
    return rows


def ablate(llm: LLM, workload: Workload, settings: dict[str, Any] | None = None, progress: Progress = None,
           concurrency: int | None = None, should_stop: StopCheck | None = None) -> list[AblationRow]:
    """The full engine (every built switch on), then each switch off in turn: throughput, its ratio to the full
    engine, latency, and whether greedy outputs equal the full engine's. A configuration that cannot run on
    this workload (e.g. contiguous KV in a pool too small for max_model_len) gets a row with `error`.
    concurrency: requests at a time (max_num_seqs), instead of the workload's own."""
    settings = {**(settings or {}), **({"max_num_seqs": concurrency} if concurrency else {})}
    plan = [(FULL_ENGINE, None, FULL_FIELDS)]
    plan += [(f.off_label, f.switch, {**FULL_FIELDS, **f.fields(False)}) for f in FEATURES]
    return _run_plan(llm, workload, settings, plan, progress, concurrency, should_stop)


def ablate_cumulative(llm: LLM, workload: Workload, settings: dict[str, Any] | None = None,
                      progress: Progress = None, should_stop: StopCheck | None = None) -> list[AblationRow]:
    """The course's "engine, feature by feature", measured: everything off (the naive loop), then the features
    added back one at a time in the course's order. ratio: against the naive loop; step_ratio: what each added."""
    plan = [(NAIVE_LOOP, None, features_fields(lambda f: False))]
    for i, f in enumerate(FEATURES):
        plan.append((f"+ {f.name}", f.switch, features_fields(lambda g, i=i: FEATURES.index(g) <= i)))
    return _run_plan(llm, workload, settings or {}, plan, progress, should_stop=should_stop)


def ablate_concurrency(llm: LLM, workload: Workload, levels: Sequence[int], settings: dict[str, Any] | None = None,
                       progress: Progress = None, should_stop: StopCheck | None = None) -> list[AblationRow]:
    """Each feature's multiplier at each concurrency: speculation matters at 1 and fades under load."""
    rows: list[AblationRow] = []
    steps = len(levels) * (len(FEATURES) + 1)
    for i, level in enumerate(levels):
        report = None if progress is None else (
            lambda j, n, name, i=i, level=level: progress(i * (len(FEATURES) + 1) + j, steps, f"{name} @ {level}"))
        rows += ablate(llm, workload, settings, report, concurrency=level, should_stop=should_stop)
    if progress is not None:
        progress(steps, steps, "done")
    return rows


# ---- `memory`: where requests stop fitting ------------------------------------------------------------
@dataclass
class MemoryRow:
    num_kv_blocks: int
    paged: bool
    kv_cache_mb: float  # the pool's size
    peak_running: int | None = None  # most requests in the batch at once
    preemptions: int | None = None
    throughput_tok_s: float | None = None
    mean_ttft_s: float | None = None
    memory_efficiency: float | None = None  # KV slots holding live tokens / slots reserved, mean over steps
    error: str | None = None
    kv_cache_dtype: str | None = None  # the KV cache's element type when swept (e.g. "int8"); None: the model's


# The memory sweep's KV dtypes: the model's own and int8, at the same memory per pool
KV_CACHE_DTYPES_SWEPT = ("auto", "int8")


def memory_sweep(llm: LLM, workload: Workload, pool_sizes: Sequence[int], settings: dict[str, Any] | None = None,
                 progress: Progress = None, should_stop: StopCheck | None = None,
                 kv_cache_dtypes: Sequence[str] = KV_CACHE_DTYPES_SWEPT) -> list[MemoryRow]:
    """Each pool size, paged and contiguous, for each KV dtype: how many requests fit at once, what it costs when
    they do not. pool_sizes are in blocks of the model's own dtype; another KV dtype gets the blocks that fit in
    the same bytes (an int8 pool of the same memory holds ~4x the blocks of fp32), so rows line up by memory."""
    plan = [(blocks, paged, kv) for blocks in pool_sizes for kv in kv_cache_dtypes for paged in (True, False)]
    rows: list[MemoryRow] = []
    for i, (blocks, paged, kv) in enumerate(plan):
        if progress is not None:
            progress(i, len(plan), f"{blocks} blocks' memory, {'paged' if paged else 'contiguous'}"
                                   + ("" if kv == "auto" else f", KV {kv}"))
        fields = config_fields(workload, settings or {}, {"paged_kv": paged, "kv_cache_dtype": kv})
        row = MemoryRow(blocks, paged, 0.0)
        rows.append(row)
        try:
            config = llm.config_for(fields)
            model = llm.weights_for(config)
            if len(kv_cache_dtypes) > 1:  # name each dtype (the model's own too) when they sit side by side
                row.kv_cache_dtype = str(model.kv_dtype(kv)).removeprefix("torch.")
            pool_bytes = blocks * model.kv_bytes_per_token() * config.block_size
            row.num_kv_blocks = pool_bytes // (model.kv_bytes_per_token(kv) * config.block_size)
            engine = llm.build_engine({**fields, "num_kv_blocks": row.num_kv_blocks})
            row.kv_cache_mb = row.num_kv_blocks * kv_bytes_per_block(engine) / 2**20
            engine.warm_up()
            r = run_workload(engine, workload, should_stop, track_efficiency=True)
        except ValueError as exc:
            row.error = str(exc)
            continue
        row.peak_running, row.preemptions, row.throughput_tok_s = r.peak_running, r.preemptions, r.throughput
        row.mean_ttft_s, row.memory_efficiency = r.mean_ttft_s, r.memory_efficiency
    if progress is not None:
        progress(len(plan), len(plan), "done")
    return rows
