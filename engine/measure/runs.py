"""Running workloads: the weights loaded once (`load_llm`), an engine per configuration, every step recorded."""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import factory
from ..config import LOAD_TIME_FIELDS
from ..engine import LLMEngine
from ..llm import LLM, warm_up
from ..models import LlamaFamilyModel
from ..quant.linear import PROJECTION_TYPES, Projection
from ..request import RequestOutput
from ..sampling_params import SamplingParams
from ..snapshot import StepRecord
from ..workloads import TOKEN_RANGE, Workload, WorkloadRequest
from .specs import check_fields

PHASES = ("schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "retire_ms")
GIB = 2**30  # "GB" in the tables means GiB, like EngineConfig.kv_cache_memory_gb
REQUEST_PREFIX = "bench-"
MAX_IDLE_STEPS = 1000  # consecutive steps that compute nothing before run_workload gives up
StopCheck = Callable[[], bool]  # polled between steps: True cancels the run


# what an experiment reports as it goes: (done, total, what now), or None
Progress = Callable[[int, int, str], None] | None


def tell(progress: Progress, done: int, total: int, what: str) -> None:
    if progress is not None:
        progress(done, total, what)


class Cancelled(Exception):
    """A run stopped by its should_stop check (not a ValueError: an experiment must not record it as a row)."""


def load_llm(settings: dict[str, Any] | None = None) -> LLM:
    """The weights, loaded once; its own engine keeps no KV pool: benchmarks build theirs with LLM.build_engine."""
    settings = settings or {}
    check_fields(settings, "settings")
    load = {k: settings[k] for k in (*LOAD_TIME_FIELDS, "max_model_len") if k in settings and k != "model"}
    return LLM(settings.get("model"), kv_cache=False, **load)


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(n)]


def decode_ms(engine, rows: int, prompt_len: int, tokens: int, seed: int) -> float:
    """Mean ms of a decode step with all `rows` requests in each timed step: prefills untimed, and max_tokens past
    the window (each aborted after it), since with it just past `tokens` the first to start ended inside it."""
    params = SamplingParams(temperature=0, max_tokens=tokens + rows + 8, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in random_prompts(rows, prompt_len, seed=seed)]
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    start = time.perf_counter()
    for _ in range(tokens):
        engine.step()
    elapsed = time.perf_counter() - start
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return elapsed * 1e3 / tokens


def run_to_end(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """Each prompt's final output, in order: all added at once."""
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def fixed_workload(prompts: list[list[int]], output_len: int) -> Workload:
    """Greedy requests that each generate exactly output_len tokens, all arriving at time 0."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    requests = [WorkloadRequest(p, dataclasses.replace(params), 0.0, "batch") for p in prompts]
    return Workload(f"batch-{len(prompts)}", f"{len(prompts)} prompts, {output_len} new tokens each", requests, {})


def weight_bytes(model: Any) -> int:
    """Bytes of the model's weights (a tied lm_head counted once; tables derived from them excluded)."""
    sizes: dict[int, int] = {}
    for name, value in vars(model).items():
        if name not in LlamaFamilyModel.DERIVED:
            for w in _weights(value):
                key = id(w) if isinstance(w, PROJECTION_TYPES) else w.data_ptr()
                sizes[key] = w.nbytes if isinstance(w, PROJECTION_TYPES) else w.numel() * w.element_size()
    return sum(sizes.values())


def _weights(value: Any) -> Iterator[torch.Tensor | Projection]:
    if isinstance(value, (torch.Tensor, *PROJECTION_TYPES)):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _weights(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _weights(getattr(value, f.name))


def kv_bytes_per_block(engine: LLMEngine) -> int:
    return factory.kv_bytes_per_block(engine.config, engine.model)


@dataclass
class StepBreakdown:
    """Per-step costs over the steps that computed something."""
    num_steps: int
    mean_ms: dict[str, float]  # phase (schedule_ms, prepare_ms, ...) -> mean over steps
    mean_running: float  # requests computed per step


def summarize_steps(records: Sequence[StepRecord]) -> StepBreakdown:
    active = [r for r in records if r.num_batched_tokens > 0]
    if not active:
        return StepBreakdown(0, dict.fromkeys(PHASES, 0.0), 0.0)
    n = len(active)
    return StepBreakdown(
        num_steps=n,
        mean_ms={p: sum(getattr(r, p) for r in active) / n for p in PHASES},
        mean_running=sum(len(r.entries) for r in active) / n,
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
    peak_running: int = 0  # most requests in the batch at once
    max_token_gap_s: float | None = None  # longest wait between two tokens of one request (after the first)
    p95_token_gap_s: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted
    num_accepted_tokens: int = 0
    memory_efficiency: float | None = None  # mean over steps of KV slots holding live tokens / slots reserved
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)  # what ran it here (LLMEngine.kernels)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class StepTracker:
    """Steps the engine, keeping every StepRecord (engine.steps is a bounded deque), the peak KV use and batch,
    when each request's tokens arrived, and (if asked) how much of the reserved KV memory holds live tokens."""

    def __init__(self, engine: LLMEngine, track_efficiency: bool = False) -> None:
        self.engine = engine
        self.records: list[StepRecord] = []
        self.peak_blocks = _kv_used(engine)
        self.peak_running = 0
        self.idle = 0
        self.token_times: dict[str, list[float]] = {}  # request -> time of each output that brought tokens
        self.track_efficiency = track_efficiency
        self.efficiency: list[float] = []

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        now = time.perf_counter()
        for o in outputs:
            if o.finish_reason != "abort":
                self.token_times.setdefault(o.request_id, []).append(now)
        record = self.engine.steps[-1]
        self.records.append(record)
        self.peak_blocks = max(self.peak_blocks, _kv_used(self.engine))
        self.peak_running = max(self.peak_running, record.num_seqs)
        if self.track_efficiency:
            self._sample_efficiency()
        self.idle = 0 if record.num_batched_tokens else self.idle + 1
        if self.idle > MAX_IDLE_STEPS:
            raise RuntimeError(f"the engine computed nothing for {MAX_IDLE_STEPS} steps with requests waiting: "
                               f"{self.engine.snapshot(num_steps=0).waiting}")
        return outputs

    def _sample_efficiency(self) -> None:
        """Slots holding live tokens / slots in blocks held: a shared block's slots count once."""
        bs = self.engine.config.block_size
        filled: dict[int, int] = {}
        for req in self.engine.scheduler.running:
            for i, block in enumerate(self.engine.kv.block_ids(req)):
                filled[block] = max(filled.get(block, 0), min(bs, max(0, req.num_computed_tokens - i * bs)))
        if filled:
            self.efficiency.append(sum(filled.values()) / (len(filled) * bs))

    def token_gaps(self) -> list[float]:
        return [b - a for times in self.token_times.values() for a, b in itertools.pairwise(times)]


def _kv_used(engine: LLMEngine) -> int:
    return engine.kv.stats().kv_blocks_used


def _counters(engine: LLMEngine) -> tuple[int, int, int, int, int]:
    kv, spec = engine.kv.stats(), engine.spec_stats
    return (engine.scheduler.num_preemptions, kv.prefix_cache_queries, kv.prefix_cache_hits,
            spec.num_draft_tokens, spec.num_accepted_tokens)


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


def run_workload(engine: LLMEngine, workload: Workload, should_stop: StopCheck | None = None,
                 track_efficiency: bool = False) -> RunResult:
    """Drive the engine through the workload, honouring arrival offsets; the engine should be idle."""
    workload = workload.tokenized(engine.tokenizer)
    pending = deque(sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s))
    before = _counters(engine)
    tracker = StepTracker(engine, track_efficiency)
    done: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        if should_stop is not None and should_stop():
            raise Cancelled(f"cancelled after {time.perf_counter() - start:.1f} s of '{workload.name}'")
        _submit_arrived(engine, workload, pending, start)
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + workload.requests[pending[0]].arrival_s - time.perf_counter()))
            continue
        done.update((o.request_id, o) for o in tracker.step() if o.finished)
    wall = time.perf_counter() - start
    outputs = [done[f"{REQUEST_PREFIX}{i}"] for i in range(len(workload.requests))]
    return _run_result(engine, workload, outputs, tracker, before, wall)


def _run_result(engine: LLMEngine, workload: Workload, outputs: list[RequestOutput], tracker: StepTracker,
                before: tuple[int, ...], wall: float) -> RunResult:
    preemptions, queries, hits, drafted, accepted = (
        after - b for after, b in zip(_counters(engine), before, strict=True))
    generated = sum(len(o.token_ids) for o in outputs)
    gaps = sorted(tracker.token_gaps())
    return RunResult(
        config=engine.config.to_dict(), num_requests=len(outputs), prompt_tokens=workload.num_prompt_tokens,
        generated_tokens=generated, wall_s=wall, throughput=generated / wall if wall > 0 else 0.0,
        mean_ttft_s=_mean([o.metrics.ttft for o in outputs]), mean_tpot_s=_mean([o.metrics.tpot for o in outputs]),
        peak_kv_blocks=tracker.peak_blocks, preemptions=preemptions, prefix_queries=queries, prefix_hits=hits,
        hit_rate=hits / queries if queries else 0.0, steps=summarize_steps(tracker.records),
        output_token_ids=[list(o.token_ids) for o in outputs], peak_running=tracker.peak_running,
        max_token_gap_s=gaps[-1] if gaps else None, p95_token_gap_s=gaps[int(0.95 * (len(gaps) - 1))] if gaps else None,
        num_draft_tokens=drafted, num_accepted_tokens=accepted,
        memory_efficiency=_mean(tracker.efficiency) if tracker.track_efficiency else None,
        kernels=engine.kernels(),
    )


def run_config(llm: LLM, workload: Workload, fields: dict[str, Any], should_stop: StopCheck | None = None) -> RunResult:
    engine = llm.build_engine(fields)
    warm_up(engine)
    return run_workload(engine, workload, should_stop)


def config_fields(workload: Workload, settings: dict[str, Any], spec_fields: dict[str, Any]) -> dict[str, Any]:
    """The workload's own config first, then the common --set settings, then the spec."""
    return {**workload.config, **settings, **spec_fields}

