"""What each feature is worth: ablate (the full engine, then each switch off in turn; --cumulative;
--concurrency) and memory (where requests stop fitting)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import FEATURE_SWITCHES, EngineConfig
from ..llm import LLM, warm_up
from ..quant.speed import model_speeds
from ..workloads import Workload
from .runs import (
    Progress,
    RunResult,
    StopCheck,
    config_fields,
    kv_bytes_per_block,
    run_config,
    run_workload,
    tell,
)
from .specs import load_feature_preset


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


# the course's "INT4 weights + INT8 KV": not expected to equal the unquantized output token for token
QUANTIZED = load_feature_preset("int4")
# in the course's order, which the cumulative ablation adds them back in
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
assert {f.switch for f in FEATURES} == {*FEATURE_SWITCHES, "quantization"}, "every built switch has its row"
FULL_ENGINE = "full engine"
NAIVE_LOOP = "naive loop (everything off)"
ABLATIONS: tuple[tuple[str, str], ...] = tuple((f.off_label, f.switch) for f in FEATURES)


def features_fields(on: Callable[[Feature], bool]) -> dict[str, Any]:
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
        tell(progress, i, len(plan), feature)
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
    tell(progress, len(plan), len(plan), "done")
    return rows


def ablate(llm: LLM, workload: Workload, settings: dict[str, Any] | None = None, progress: Progress = None,
           concurrency: int | None = None, should_stop: StopCheck | None = None) -> list[AblationRow]:
    """The full engine, then each switch off in turn; a configuration that cannot run on this workload (contiguous
    KV in a pool too small for max_model_len) gets a row with `error`."""
    settings = {**(settings or {}), **({"max_num_seqs": concurrency} if concurrency else {})}
    plan = [(FULL_ENGINE, None, FULL_FIELDS)]
    plan += [(f.off_label, f.switch, {**FULL_FIELDS, **f.fields(False)}) for f in FEATURES]
    return _run_plan(llm, workload, settings, plan, progress, concurrency, should_stop)


def ablate_cumulative(llm: LLM, workload: Workload, settings: dict[str, Any] | None = None,
                      progress: Progress = None, should_stop: StopCheck | None = None) -> list[AblationRow]:
    """The course's "engine, feature by feature": the naive loop, then the features added back one at a time."""
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
    tell(progress, steps, steps, "done")
    return rows


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


KV_CACHE_DTYPES_SWEPT = ("auto", "int8")


def memory_sweep(llm: LLM, workload: Workload, pool_sizes: Sequence[int], settings: dict[str, Any] | None = None,
                 progress: Progress = None, should_stop: StopCheck | None = None,
                 kv_cache_dtypes: Sequence[str] = KV_CACHE_DTYPES_SWEPT) -> list[MemoryRow]:
    """Each pool size, paged and contiguous, for each KV dtype: how many requests fit at once. pool_sizes are in
    blocks of the model's own dtype; another KV dtype gets the blocks that fit in the same bytes, so rows line up."""
    plan = [(blocks, paged, kv) for blocks in pool_sizes for kv in kv_cache_dtypes for paged in (True, False)]
    rows: list[MemoryRow] = []
    for i, (blocks, paged, kv) in enumerate(plan):
        tell(progress, i, len(plan), f"{blocks} blocks' memory, {'paged' if paged else 'contiguous'}"
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
            warm_up(engine)
            r = run_workload(engine, workload, should_stop, track_efficiency=True)
        except ValueError as exc:
            row.error = str(exc)
            continue
        row.peak_running, row.preemptions, row.throughput_tok_s = r.peak_running, r.preemptions, r.throughput
        row.mean_ttft_s, row.memory_efficiency = r.mean_ttft_s, r.memory_efficiency
    tell(progress, len(plan), len(plan), "done")
    return rows
