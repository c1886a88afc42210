"""What the engine shows of itself: a step's record, a live request's view, and the snapshot every viewer reads
(the Dashboard, /metrics, the benchmarks, the lessons). Plain data: no tensors, no engine objects. The functions at
the end build them from an LLMEngine (its snapshot(), counters() and kernels() call them)."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from .config import EngineConfig
from .factory import kv_bytes_per_block
from .scheduler import Phase


@dataclass(frozen=True)
class FeatureState:
    """One feature as asked for and as it runs: they differ where another switch rules it out (prefix caching
    asked for with paged KV off shares no blocks), and `why` then says which."""
    requested: bool
    active: bool
    why: str = ""  # "" when they agree


def feature_states(c: EngineConfig) -> dict[str, FeatureState]:
    """The snapshot's `features`, so that no reader derives them again from the requested fields."""
    no_cache = "needs a KV cache (kv_cache is off)"
    rules = {
        "kv_cache": (c.kv_cache, ""),
        "paged_kv": (c.paged_kv and c.kv_cache, no_cache),
        "continuous_batching": (c.continuous_batching, ""),
        "prefix_caching": (c.prefix_caching_active, no_cache if not c.kv_cache else
                           "needs a paged KV cache to share blocks (paged_kv is off)"),
        "chunked_prefill": (c.chunked_prefill_active, no_cache),
        "speculative_decoding": (c.speculative_decoding_active, no_cache),
        "cuda_graphs": (c.cuda_graphs, ""),
        "kv_cache_smoothing": (c.key_smoothing_active, f"rescales an int8 KV cache only (kv_cache_dtype is "
                                                       f"{c.kv_cache_dtype!r})"),
    }
    return {name: FeatureState(bool(getattr(c, name)), bool(active), why if bool(getattr(c, name)) != bool(active)
                               else "") for name, (active, why) in rules.items()}


@dataclass
class StepEntry:
    """One scheduled request in one step: its phase and what it computed."""
    request_id: str
    phase: str  # "prefill", "decode" or "verify"
    num_tokens: int  # positions computed (a prefill chunk, 1 for a decode, 1 + drafts for a verify)
    prefix_hit_tokens: int  # tokens taken from the prefix cache in this step instead of being computed
    num_computed_after: int  # the request's tokens with K/V in the cache after the step
    num_prompt_tokens: int
    num_new_tokens: int = 0  # tokens generated (0 for a prefill chunk that stops short of the prompt's end)
    num_drafts: int = 0  # draft tokens verified (speculative decoding)
    num_accepted: int = 0  # of those, accepted


@dataclass
class StepRecord:
    """What the scheduler decided in one step, and what it cost."""
    step: int
    time: float
    entries: list[StepEntry] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, str]] = field(default_factory=list)  # (request, finish reason)
    num_batched_tokens: int = 0
    num_seqs: int = 0  # requests in this step's batch
    num_running: int = 0  # after retiring
    num_waiting: int = 0
    schedule_ms: float = 0.0
    prepare_ms: float = 0.0
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    retire_ms: float = 0.0

    @property
    def prefills(self) -> list[StepEntry]:
        return [e for e in self.entries if e.phase == Phase.PREFILL.value]

    @property
    def decodes(self) -> list[StepEntry]:
        return [e for e in self.entries if e.phase == Phase.DECODE.value]

    @property
    def verifies(self) -> list[StepEntry]:
        return [e for e in self.entries if e.phase == Phase.VERIFY.value]


@dataclass(frozen=True)
class RequestView:
    """One live request as the snapshot shows it."""
    status: str  # RequestStatus's value: "waiting", "running", ...
    num_prompt_tokens: int
    num_output_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache
    num_preemptions: int = 0
    recent_token_ids: tuple[int, ...] = ()  # a few, not all: enough for a viewer to show the latest tokens as text

    @property
    def prefilling(self) -> bool:
        return self.status == "running" and self.num_computed_tokens < self.num_prompt_tokens


@dataclass(slots=True)
class StepCounters:
    """The engine's counters after a step, as its time series keeps them (service.HistorySample adds the rest)."""
    step: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    generation_tokens_total: int


@dataclass(slots=True)
class EngineCounters(StepCounters):
    """The engine's counters now, without the snapshot's per-block and per-request lists: cheap enough to read after
    every step, where the whole snapshot is taken less often (service.py's SNAPSHOT_INTERVAL_S says why)."""
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int


@dataclass
class EngineSnapshot:
    step: int
    time: float
    config: dict
    num_running: int
    num_waiting: int
    num_preemptions: int
    running: list[str]
    waiting: list[str]
    block_size: int
    block_tables: dict[str, list[int]]
    block_ref_counts: list[int]
    block_hashes: list[int | None]
    # KVCacheStats, field by field
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    prefill_tokens_total: int  # tokens computed by prefills (first ones, re-prefills, the naive loop's recompute)
    generation_tokens_total: int
    requests: dict[str, RequestView]  # the live (running and waiting) requests
    steps: list[StepRecord]
    last_reconfig: dict | None
    speculation: dict  # active, k (drafts per request now), the adaptive rule, and SpecDecodeStats' counters
    # one block's K and V in every layer (and an int8 cache's scales): the pool is kv_blocks_total of these
    kv_bytes_per_block: int = 0
    gpu_memory: dict | None = None  # CUDA: the KV pool's sizing (gpu.GpuMemoryPlan: formula and its numbers)
    precision: str = ""  # EngineConfig.precision: what the engine computes with, in words
    # what runs it here, in words: {"weights": "int4 weights · C++ AVX-512 kernel", "weights_why", "lm_head",
    # "layer_ops", "attention"} (quant/kernels.py's choice, the model's and the runner's)
    kernels: dict = field(default_factory=dict)
    # every switch as asked for and as it runs, and why they differ (feature_states)
    features: dict[str, FeatureState] = field(default_factory=dict)


def snapshot_of(engine, num_steps: int = 64) -> EngineSnapshot:
    s, kv, config = engine.scheduler, engine.kv, engine.config
    live = list(s.running) + list(s.waiting)
    ref_counts, hashes = kv.block_states()
    return EngineSnapshot(
        step=engine.step_count, time=time.time(), config=config.to_dict(),
        num_running=len(s.running), num_waiting=len(s.waiting), num_preemptions=s.num_preemptions,
        running=[r.request_id for r in s.running], waiting=[r.request_id for r in s.waiting],
        block_size=config.block_size,
        block_tables={r.request_id: list(kv.block_ids(r)) for r in s.running},
        block_ref_counts=ref_counts, block_hashes=hashes, **dataclasses.asdict(kv.stats()),
        prefill_tokens_total=engine.prefill_tokens_total, generation_tokens_total=engine.generation_tokens_total,
        requests={r.request_id: RequestView(r.status.value, r.num_prompt_tokens, r.num_output_tokens,
                                            r.num_computed_tokens, r.metrics.num_cached_tokens,
                                            r.metrics.num_preemptions, tuple(r.token_ids[-8:])) for r in live},
        steps=list(itertools.islice(reversed(engine.steps), num_steps))[::-1],
        last_reconfig=engine.last_reconfig, speculation=speculation_of(engine),
        kv_bytes_per_block=kv_bytes_per_block(config, engine.model),
        gpu_memory=None if engine.gpu_memory is None else engine.gpu_memory.to_dict(),
        precision=config.precision, kernels=kernels_of(engine), features=feature_states(config),
    )


def counters_of(engine) -> EngineCounters:
    """The snapshot's counters alone (see EngineCounters)."""
    s, kv, spec = engine.scheduler, engine.kv, engine.spec_stats
    return EngineCounters(engine.step_count, len(s.running), len(s.waiting), s.num_preemptions, kv.num_used,
                          kv.prefix_cache_queries, kv.prefix_cache_hits, engine.generation_tokens_total,
                          spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)


def kernels_of(engine) -> dict[str, str]:
    """What runs the engine's steps here, in words (the snapshot's `kernels`)."""
    attention = (engine.runner.attention_kernel if engine.config.kv_cache
                 else "torch SDPA (no KV cache: the whole sequence each step)")
    return {**engine.model.kernels(), "attention": attention, "threads": engine.cores.describe()}


def speculation_of(engine) -> dict:
    c, stats = engine.config, engine.spec_stats
    k, budget = c.num_speculative_tokens, c.speculative_token_budget
    return {"active": c.speculative_decoding_active, "k": engine.scheduler.spec_k,
            "rule": f"k = min({k}, {budget} // decoding requests - 1): {k} drafts up to "
                    f"{budget // (k + 1)} decoding requests, none above {budget // 2}",
            **dataclasses.asdict(stats), "acceptance_rate": stats.acceptance_rate}
