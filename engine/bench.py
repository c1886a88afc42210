"""Benchmarks: the reference table, feature comparisons, the HF static-batching baseline, scheduler cost.

    python -m engine.bench                       # `table`: Batch | Time | TTFT | TPOT | Memory | TPS, and HF
    python -m engine.bench compare --workload mixed-lengths --a naive --b full
    python -m engine.bench hf-static --workload mixed-lengths   # or --fixed: 16 x (48 prompt, 64 new)
    python -m engine.bench sched-cost --running 64
    python -m engine.bench ablate --workload mixed-lengths --quick --json ablation.json

Every function below `main` returns plain dataclasses / dicts, so a UI can call them; only `main` prints.
Weights are loaded once (`load_llm`); each configuration gets its own engine built from them (`build_engine`).
A configuration SPEC is a preset name (presets/features/NAME.toml) or flags such as "prefix_caching=false".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
import tomllib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import LOAD_TIME_FIELDS, EngineConfig
from .engine import LLMEngine, StepRecord
from .llm import DTYPES, LLM
from .request import RequestOutput
from .sampler import SamplingParams
from .workloads import TOKEN_RANGE, Workload, WorkloadRequest, load_workload

FEATURE_DIR = Path(__file__).resolve().parent.parent / "presets" / "features"
PHASES = ("schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "retire_ms")
GIB = 2**30  # "GB" in the tables means GiB, like EngineConfig.kv_cache_memory_gb
REQUEST_PREFIX = "bench-"
ROPE_TABLES = ("cos", "sin")  # model attributes that are precomputed tables, not weights
MAX_IDLE_STEPS = 1000  # consecutive steps that compute nothing before run_workload gives up


# ---- configuration specs -------------------------------------------------------------------------------
def parse_value(text: str) -> bool | int | float | str | None:
    """'true'/'false' -> bool, 'none'/'null' -> None, then int, then float, else the string itself."""
    value = text.strip()
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def check_fields(fields: dict[str, Any], source: str) -> None:
    unknown = sorted(set(fields) - set(EngineConfig.field_names()))
    if unknown:
        raise ValueError(f"{source}: unknown config field(s) {', '.join(unknown)}; "
                         f"known fields: {', '.join(EngineConfig.field_names())}")


def parse_assignments(text: str | Sequence[str]) -> dict[str, Any]:
    """'a=1,b=false' (or a list of such strings) -> {'a': 1, 'b': False}; keys must be EngineConfig fields."""
    parts = [text] if isinstance(text, str) else list(text)
    fields: dict[str, Any] = {}
    for item in (p.strip() for part in parts for p in part.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        fields[key.strip()] = parse_value(value)
    check_fields(fields, f"flags {', '.join(parts)!r}")
    return fields


def list_feature_presets() -> list[str]:
    return sorted(p.stem for p in FEATURE_DIR.glob("*.toml"))


def load_feature_preset(name: str) -> dict[str, Any]:
    path = FEATURE_DIR / f"{name}.toml"
    if not name or not path.is_file():
        raise ValueError(f"unknown feature preset {name!r}; presets: {', '.join(list_feature_presets())} "
                         f"(or give flags such as 'prefix_caching=false,max_num_seqs=8')")
    with open(path, "rb") as f:
        fields = tomllib.load(f)
    check_fields(fields, f"feature preset {name!r} ({path})")
    return fields


def resolve_spec(spec: str) -> dict[str, Any]:
    """A preset name or comma-separated key=value flags -> EngineConfig fields."""
    spec = spec.strip()
    return parse_assignments(spec) if "=" in spec else load_feature_preset(spec)


# ---- models and engines --------------------------------------------------------------------------------
def load_llm(settings: dict[str, Any] | None = None) -> LLM:
    """Load the weights once. Only load-time fields (and max_model_len, which sizes the RoPE tables) are used;
    the returned LLM's own engine keeps no KV pool (kv_cache=False), so it costs no cache memory:
    benchmarks build their engines from it with build_engine."""
    settings = settings or {}
    check_fields(settings, "settings")
    load = {k: settings[k] for k in (*LOAD_TIME_FIELDS, "max_model_len") if k in settings and k != "model"}
    return LLM(settings.get("model"), kv_cache=False, **load)


def engine_config(llm: LLM, fields: dict[str, Any]) -> EngineConfig:
    """EngineConfig for an engine over llm's weights; load-time fields must agree with what was loaded."""
    fields = dict(fields)
    for name in LOAD_TIME_FIELDS:
        loaded = getattr(llm.config, name)
        if name in fields and fields[name] != loaded:
            raise ValueError(f"{name}={fields[name]!r} differs from the loaded model's {name}={loaded!r}: "
                             f"weights are loaded once, so give it with --model / --set for the whole run")
        fields[name] = loaded
    return EngineConfig.from_kwargs(**fields)


def build_engine(llm: LLM, fields: dict[str, Any]) -> LLMEngine:
    return LLMEngine(engine_config(llm, fields), llm.engine.model, llm.tokenizer, llm.engine.hf_config)


def warm_up(engine: LLMEngine) -> None:
    """One tiny request, so the timed run does not pay first-call costs."""
    prompt = random_prompts(1, 8, seed=-1)[0]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(n)]


def fixed_workload(prompts: list[list[int]], output_len: int) -> Workload:
    """Greedy requests that each generate exactly output_len tokens, all arriving at time 0."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    requests = [WorkloadRequest(p, dataclasses.replace(params), 0.0, "batch") for p in prompts]
    return Workload(f"batch-{len(prompts)}", f"{len(prompts)} prompts, {output_len} new tokens each", requests, {})


def weight_bytes(model: Any) -> int:
    """Bytes of the model's weight tensors (a tied lm_head counted once; RoPE tables excluded)."""
    sizes = {t.data_ptr(): t.numel() * t.element_size()
             for name, value in vars(model).items() if name not in ROPE_TABLES for t in _tensors(value)}
    return sum(sizes.values())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name))


def kv_bytes_per_block(engine: LLMEngine) -> int:
    return engine.model.kv_bytes_per_token() * engine.config.block_size


# ---- running a workload --------------------------------------------------------------------------------
@dataclass
class StepBreakdown:
    """Per-step costs over the steps that computed something."""
    num_steps: int
    mean_ms: dict[str, float]  # phase (schedule_ms, prepare_ms, ...) -> mean over steps
    max_ms: dict[str, float]
    mean_running: float  # requests computed per step (prefills + decodes)
    mean_batched_tokens: float


def summarize_steps(records: Sequence[StepRecord]) -> StepBreakdown:
    active = [r for r in records if r.num_batched_tokens > 0]
    if not active:
        zeros = dict.fromkeys(PHASES, 0.0)
        return StepBreakdown(0, zeros, dict(zeros), 0.0, 0.0)
    n = len(active)
    return StepBreakdown(
        num_steps=n,
        mean_ms={p: sum(getattr(r, p) for r in active) / n for p in PHASES},
        max_ms={p: max(getattr(r, p) for r in active) for p in PHASES},
        mean_running=sum(len(r.prefills) + len(r.decodes) for r in active) / n,
        mean_batched_tokens=sum(r.num_batched_tokens for r in active) / n,
    )


@dataclass
class RunResult:
    config: dict[str, Any]  # the engine's resolved EngineConfig
    num_requests: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    throughput: float  # generated tokens per second of wall time
    mean_ttft_s: float | None
    mean_tpot_s: float | None
    peak_kv_blocks: int  # max over steps of blocks held by requests (cached-free blocks not counted)
    preemptions: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens served from it
    hit_rate: float
    steps: StepBreakdown
    output_token_ids: list[list[int]]  # per request, in workload order


class _StepTracker:
    """Steps the engine, keeping every StepRecord (engine.steps is a bounded deque) and the peak KV use."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.records: list[StepRecord] = []
        self.peak_blocks = _kv_used(engine)
        self.idle = 0

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        record = self.engine.steps[-1]
        self.records.append(record)
        self.peak_blocks = max(self.peak_blocks, _kv_used(self.engine))
        self.idle = 0 if record.num_batched_tokens else self.idle + 1
        if self.idle > MAX_IDLE_STEPS:
            raise RuntimeError(f"the engine computed nothing for {MAX_IDLE_STEPS} steps with requests waiting: "
                               f"{self.engine.snapshot(num_steps=0).waiting}")
        return outputs


def _kv_used(engine: LLMEngine) -> int:
    return engine.kv.num_used if engine.kv is not None else 0


def _counters(engine: LLMEngine) -> tuple[int, int, int]:
    kv = engine.kv
    return (engine.scheduler.num_preemptions, kv.prefix_cache_queries if kv else 0,
            kv.prefix_cache_hits if kv else 0)


def _submit_arrived(engine: LLMEngine, workload: Workload, pending: deque[int], start: float) -> None:
    """Add every request whose arrival offset the wall clock has passed; its TTFT counts from that offset."""
    now = time.perf_counter() - start
    while pending and workload.requests[pending[0]].arrival_s <= now:
        i = pending.popleft()
        req = workload.requests[i]
        engine.add_request(list(req.prompt_token_ids), dataclasses.replace(req.params),
                           request_id=f"{REQUEST_PREFIX}{i}", arrival_time=start + req.arrival_s)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def run_workload(engine: LLMEngine, workload: Workload) -> RunResult:
    """Drive the engine through the workload, honouring arrival offsets; the engine should be idle."""
    pending = deque(sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s))
    before = _counters(engine)
    tracker = _StepTracker(engine)
    done: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        _submit_arrived(engine, workload, pending, start)
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + workload.requests[pending[0]].arrival_s - time.perf_counter()))
            continue
        done.update((o.request_id, o) for o in tracker.step() if o.finished)
    wall = time.perf_counter() - start
    outputs = [done[f"{REQUEST_PREFIX}{i}"] for i in range(len(workload.requests))]
    return _run_result(engine, workload, outputs, tracker, before, wall)


def _run_result(engine: LLMEngine, workload: Workload, outputs: list[RequestOutput], tracker: _StepTracker,
                before: tuple[int, int, int], wall: float) -> RunResult:
    preemptions, queries, hits = (after - b for after, b in zip(_counters(engine), before, strict=True))
    generated = sum(len(o.token_ids) for o in outputs)
    return RunResult(
        config=engine.config.to_dict(), num_requests=len(outputs), prompt_tokens=workload.num_prompt_tokens,
        generated_tokens=generated, wall_s=wall, throughput=generated / wall if wall > 0 else 0.0,
        mean_ttft_s=_mean([o.metrics.ttft for o in outputs]), mean_tpot_s=_mean([o.metrics.tpot for o in outputs]),
        peak_kv_blocks=tracker.peak_blocks, preemptions=preemptions, prefix_queries=queries, prefix_hits=hits,
        hit_rate=hits / queries if queries else 0.0, steps=summarize_steps(tracker.records),
        output_token_ids=[list(o.token_ids) for o in outputs],
    )


def run_config(llm: LLM, workload: Workload, fields: dict[str, Any]) -> RunResult:
    """A fresh, warmed-up engine with these fields, run through the workload."""
    engine = build_engine(llm, fields)
    warm_up(engine)
    return run_workload(engine, workload)


# ---- Hugging Face transformers baseline ----------------------------------------------------------------
def load_hf_model(llm: LLM) -> Any:
    """transformers' model over the same weights, in the engine's dtype (float32 by default) and device."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=DTYPES[llm.config.dtype])
    return hf.to(llm.engine.model.device).eval()


def hf_pad_id(hf_model: Any, tokenizer: Any) -> int:
    for candidate in (hf_model.config.pad_token_id, tokenizer.pad_token_id, hf_model.config.eos_token_id):
        if isinstance(candidate, (list, tuple)) and candidate:
            candidate = candidate[0]
        if isinstance(candidate, int):
            return candidate
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(hf_model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> float:
    """Seconds for one left-padded greedy batch in which every row generates exactly max_new_tokens."""
    width = max(len(p) for p in prompts)
    device = hf_model.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, pad_token_id=pad_id,
                                temperature=None, top_p=None, top_k=None)
    _sync(device)
    elapsed = time.perf_counter() - start
    if out.shape[1] - width != max_new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens per row, expected {max_new_tokens}")
    return elapsed


def hf_warm_up(hf_model: Any, pad_id: int) -> None:
    hf_generate(hf_model, random_prompts(1, 8, seed=-1), 2, pad_id)


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


def config_fields(workload: Workload, settings: dict[str, Any], spec_fields: dict[str, Any]) -> dict[str, Any]:
    """The workload's own config first, then the common --set settings, then the spec."""
    return {**workload.config, **settings, **spec_fields}


def compare(llm: LLM, workload: Workload, spec_a: str, spec_b: str,
            settings: dict[str, Any] | None = None) -> CompareResult:
    fields = [config_fields(workload, settings or {}, resolve_spec(s)) for s in (spec_a, spec_b)]
    for f in fields:  # every spec is checked before anything runs
        engine_config(llm, f)
    a, b = (run_config(llm, workload, f) for f in fields)
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


def hf_static_batches(hf_model: Any, workload: Workload, batch_size: int, pad_id: int) -> tuple[float, int, int]:
    """(seconds, generated tokens, useful tokens) for the workload in static batches, in workload order."""
    seconds, generated, useful = 0.0, 0, 0
    for i in range(0, len(workload.requests), batch_size):
        batch = workload.requests[i:i + batch_size]
        longest = max(r.params.max_tokens for r in batch)
        seconds += hf_generate(hf_model, [list(r.prompt_token_ids) for r in batch], longest, pad_id)
        generated += longest * len(batch)
        useful += sum(r.params.max_tokens for r in batch)
    return seconds, generated, useful


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
    tracker = _StepTracker(engine)
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
ABLATIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    (FULL_ENGINE, {}),
    ("no KV cache (naive loop)", {"kv_cache": False}),
    ("contiguous KV (no paging)", {"paged_kv": False}),
    ("static batching", {"continuous_batching": False}),
    ("no prefix caching", {"prefix_caching": False}),
)


def ablate(llm: LLM, workload: Workload, settings: dict[str, Any] | None = None,
           progress: Callable[[int, int, str], None] | None = None) -> list[dict[str, Any]]:
    """One row per configuration: feature, throughput_tok_s, ratio (vs the full engine), latency, and
    whether its greedy outputs equal the full engine's. A configuration that cannot run on this workload
    (e.g. contiguous KV in a pool too small for max_model_len) gets a row with `error` and no throughput."""
    rows: list[dict[str, Any]] = []
    full: RunResult | None = None
    for i, (feature, switch) in enumerate(ABLATIONS):
        if progress is not None:
            progress(i, len(ABLATIONS), feature)
        try:
            r = run_config(llm, workload, config_fields(workload, settings or {}, switch))
        except ValueError as exc:
            rows.append({"feature": feature, "throughput_tok_s": None, "ratio": None, "error": str(exc)})
            continue
        full = full or r
        rows.append({"feature": feature, "throughput_tok_s": r.throughput, "ratio": r.throughput / full.throughput,
                     "mean_ttft_s": r.mean_ttft_s, "mean_tpot_s": r.mean_tpot_s, "peak_kv_blocks": r.peak_kv_blocks,
                     "preemptions": r.preemptions, "prefix_hits": r.prefix_hits,
                     "same_output_as_full": r.output_token_ids == full.output_token_ids, "error": None})
    if progress is not None:
        progress(len(ABLATIONS), len(ABLATIONS), "done")
    return rows


def ablate_report(workload: Workload, rows: list[dict[str, Any]]) -> Report:
    report = Report(f"ablation on workload {workload.name!r} ({len(workload.requests)} requests)")
    report.tables["each feature off in turn"] = [
        {"configuration": r["feature"], "tok/s": r["throughput_tok_s"], "x full engine": r["ratio"],
         "mean TTFT (s)": r.get("mean_ttft_s"), "mean TPOT (s)": r.get("mean_tpot_s"),
         "peak KV blocks": r.get("peak_kv_blocks"), "same output": r.get("same_output_as_full"),
         "error": r["error"] or ""} for r in rows]
    report.rows = rows
    return report


# ---- reports: rows of plain dicts, rendered as markdown ------------------------------------------------
@dataclass
class Report:
    title: str
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # caption -> rows
    notes: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] | None = None  # when set, --json writes these rows instead of the whole report


def breakdown_row(label: str, s: StepBreakdown) -> dict[str, Any]:
    return {"run": label, "steps": s.num_steps, "schedule ms": s.mean_ms["schedule_ms"],
            "prepare inputs ms": s.mean_ms["prepare_ms"], "forward ms": s.mean_ms["forward_ms"],
            "sample ms": s.mean_ms["sample_ms"], "retire ms": s.mean_ms["retire_ms"],
            "mean running": s.mean_running}


def table_report(rows: list[TableRow], input_len: int, output_len: int) -> Report:
    report = Report(f"Engine: prompt {input_len} tokens, {output_len} new tokens, greedy")
    report.tables["reference"] = [
        {"Batch": r.batch, "Time (s)": r.time_s, "TTFT (s)": r.ttft_s, "TPOT (s)": r.tpot_s,
         "Memory (GB)": r.memory_gb, "TPS": r.tps} for r in rows]
    if any(r.hf_tps is not None for r in rows):
        report.tables["vs transformers generate"] = [
            {"Batch": r.batch, "engine TPS": r.tps, "HF time (s)": r.hf_time_s, "HF TPS": r.hf_tps,
             "engine / HF": r.ratio} for r in rows]
    report.tables["per-step breakdown (mean per step)"] = [breakdown_row(f"batch {r.batch}", r.steps) for r in rows]
    return report


def compare_report(result: CompareResult) -> Report:
    report = Report(f"compare on workload {result.workload!r}")
    pairs = list(zip(result.labels, result.results, strict=True))
    report.tables["configurations"] = [_compare_row(label, r) for label, r in pairs]
    report.tables["per-step breakdown (mean per step)"] = [breakdown_row(label, r.steps) for label, r in pairs]
    report.notes.append(f"throughput b/a ({result.labels[1]} / {result.labels[0]}): {result.ratio:.2f}x")
    report.notes.append(f"identical output token ids for every request: {'yes' if result.same_outputs else 'no'}")
    return report


def _compare_row(label: str, r: RunResult) -> dict[str, Any]:
    return {"config": label, "throughput tok/s": r.throughput, "mean TTFT (s)": r.mean_ttft_s,
            "mean TPOT (s)": r.mean_tpot_s, "peak KV blocks": r.peak_kv_blocks, "preemptions": r.preemptions,
            "prefix hits (tokens)": r.prefix_hits, "hit rate": r.hit_rate, "wall time (s)": r.wall_s}


def hf_static_report(result: HFStaticResult) -> Report:
    report = Report(f"HF generate in static batches of {result.batch_size} vs the engine, "
                    f"workload {result.workload!r}")
    e = result.engine
    report.tables["throughput"] = [
        {"system": f"HF generate, {result.num_batches} static batch(es)", "useful tokens": result.hf_useful_tokens,
         "generated tokens": result.hf_generated_tokens, "wall time (s)": result.hf_wall_s,
         "throughput tok/s": result.hf_throughput},
        {"system": "engine", "useful tokens": e.generated_tokens, "generated tokens": e.generated_tokens,
         "wall time (s)": e.wall_s, "throughput tok/s": e.throughput}]
    report.notes.append(f"engine / HF throughput: {result.ratio:.2f}x (useful tokens only)")
    return report


def sched_cost_report(result: SchedCostResult) -> Report:
    report = Report(f"scheduler cost: {result.running} requests, prompts of {result.prompt_len} tokens, "
                    f"{result.decode_steps} decode steps")
    report.tables["cost per step"] = [_sched_row("decode-only steps", result.decode),
                                      _sched_row("all steps", result.all_steps)]
    return report


def _sched_row(label: str, s: StepBreakdown) -> dict[str, Any]:
    per_request = s.mean_ms["schedule_ms"] * 1e3 / s.mean_running if s.mean_running else None
    return {"steps": label, "count": s.num_steps, "mean running": s.mean_running,
            "schedule mean ms": s.mean_ms["schedule_ms"], "schedule max ms": s.max_ms["schedule_ms"],
            "schedule us / request": per_request, "prepare mean ms": s.mean_ms["prepare_ms"],
            "prepare max ms": s.max_ms["prepare_ms"], "forward mean ms": s.mean_ms["forward_ms"]}


def format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.4f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(format_cell(row.get(h)) for h in headers) + " |" for row in rows]
    return "\n".join(lines)


def render_report(report: Report) -> str:
    parts = [f"## {report.title}"]
    for caption, rows in report.tables.items():
        parts += [f"\n{caption}:\n", markdown_table(rows)]
    if report.notes:
        parts.append("\n" + "\n".join(report.notes))
    return "\n".join(parts)


# ---- command line --------------------------------------------------------------------------------------
COMMANDS = ("table", "compare", "hf-static", "sched-cost", "ablate")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _common_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="model folder, GGUF file or hub id (default: embedded)")
    common.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="any EngineConfig field, e.g. --set block_size=32 (repeatable, or comma-separated)")
    common.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_common_parser()]
    table = sub.add_parser("table", parents=common, help="the reference table (default)")
    table.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 16])
    table.add_argument("--input-len", type=int, default=128)
    table.add_argument("--output-len", type=int, default=128)
    table.add_argument("--seed", type=int, default=0)
    table.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    cmp = sub.add_parser("compare", parents=common, help="one workload through two configurations")
    cmp.add_argument("--workload", required=True, help="preset name or TOML path")
    cmp.add_argument("--a", default="naive", help="preset name or flags (default: naive)")
    cmp.add_argument("--b", default="full", help="preset name or flags (default: full)")
    cmp.add_argument("--quick", action="store_true", help="a quarter of each workload group")
    hf = sub.add_parser("hf-static", parents=common, help="HF generate in static batches vs the engine")
    hf.add_argument("--workload", default="mixed-lengths")
    hf.add_argument("--batch-size", type=int, default=8)
    hf.add_argument("--fixed", action="store_true", help="the fixed-16 workload (16 x 48 prompt, 64 new), one batch")
    hf.add_argument("--quick", action="store_true")
    ab = sub.add_parser("ablate", parents=common, help="the full engine, then each feature switch off in turn")
    ab.add_argument("--workload", default="ablation", help="preset name or TOML path")
    ab.add_argument("--quick", action="store_true", help="a quarter of each workload group")
    sc = sub.add_parser("sched-cost", parents=common, help="the scheduler's own cost per step")
    sc.add_argument("--running", type=int, default=64)
    sc.add_argument("--prompt-len", type=int, default=16)
    sc.add_argument("--decode-steps", type=int, default=32)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["table", *argv]  # `table` is the default subcommand
    return build_parser().parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    settings = parse_assignments(args.settings) if args.settings else {}
    if args.model is not None:
        settings["model"] = args.model
    return settings


def run_command(args: argparse.Namespace) -> Report:
    settings = settings_from_args(args)
    llm = load_llm(settings)
    if args.command == "table":
        rows = run_table(llm, args.batch_sizes, args.input_len, args.output_len, settings, not args.no_hf, args.seed)
        return table_report(rows, args.input_len, args.output_len)
    if args.command == "compare":
        workload = load_workload(args.workload, args.quick)
        return compare_report(compare(llm, workload, args.a, args.b, settings))
    if args.command == "hf-static":
        workload = load_workload("fixed-16" if args.fixed else args.workload, args.quick)
        batch = len(workload.requests) if args.fixed else args.batch_size
        return hf_static_report(hf_static(llm, workload, batch, settings))
    if args.command == "ablate":
        workload = load_workload(args.workload, args.quick)
        return ablate_report(workload, ablate(llm, workload, settings))
    return sched_cost_report(sched_cost(llm, args.running, args.prompt_len, args.decode_steps, settings))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run_command(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_report(report))
    if args.json is not None:
        data = report.rows if report.rows is not None else dataclasses.asdict(report)
        args.json.write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"\nrows written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
