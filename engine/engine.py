"""LLMEngine: add_request / step / abort / snapshot.

step():  schedule (+ block allocation) -> prepare inputs -> forward -> sample -> retire.
Config changes wait for the next step boundary; a change to the KV pool's structure re-prefills running
requests (their blocks are freed and they are requeued in order), so nothing in flight is lost.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .blocks import KVCacheManager, NoKVCache, kv_cache_for
from .config import LOAD_TIME_FIELDS, STRUCTURAL_FIELDS, EngineConfig, FeatureState
from .cuda_graphs import DecodeGraphs, check_cuda_graphs
from .gpu import GpuMemoryPlan, kv_budget_bytes, profile_gpu_memory, resolve_attention_backend, resolve_dtype
from .memory import check_kv_pool_fits
from .quant.calibrate import key_scales_for
from .quant.format import WeightFormat
from .request import Request, RequestOutput, RequestStatus
from .runner import Batch, ModelRunner
from .sampler import SamplingParams, TokenLogprobs, draw, processed_logits, token_logprobs
from .scheduler import Phase, ScheduledRequest, Scheduler
from .spec import SpecDecodeStats, verify
from .utils import cdiv
from .workloads import TOKEN_RANGE


class ContextLengthError(ValueError):
    """A request that can never fit: its prompt reaches max_model_len, or it needs more KV blocks than the pool has."""


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
    requests: dict[str, dict]
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
    # every switch as asked for and as it runs, and why they differ (EngineConfig.feature_states)
    features: dict[str, FeatureState] = field(default_factory=dict)

    @property
    def block_owners(self) -> dict[int, list[str]]:
        owners: dict[int, list[str]] = {}
        for rid, table in self.block_tables.items():
            for b in table:
                owners.setdefault(b, []).append(rid)
        return owners

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, model, tokenizer, hf_config=None) -> None:
        config = config.replace(dtype=resolve_dtype(config.dtype, model.device))  # "auto": the device decides
        _check_weights(config, model)
        self.model = model
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.gpu_memory: GpuMemoryPlan | None = None  # CUDA: how the pool was sized (gpu.py)
        self.requested_config = config
        self.config = self._resolve(config)
        self.kv: KVCacheManager | NoKVCache = NoKVCache(self.config.block_size)
        self.scheduler = Scheduler(self.config, self.kv)
        self._use_kv(*self._build_kv(self.config))
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._pending: dict = {}  # changes waiting for the next step boundary
        self._pending_config = self.config  # what the engine will run with once they apply
        self._ids = itertools.count()
        self.step_count = 0
        self.prefill_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_stats = SpecDecodeStats()
        self.steps: deque[StepRecord] = deque(maxlen=256)
        self.last_reconfig: dict | None = None
        self.generator = torch.Generator(device=model.device).manual_seed(self.config.seed)
        self.eos_token_ids = _eos_ids(tokenizer, hf_config)

    # ---- configuration -------------------------------------------------------------------------------
    def automatic_sizes(self, config: EngineConfig) -> dict[str, int]:
        """What each size left empty (None) comes to, given config's other fields (the settings form says it)."""
        max_len = config.max_model_len or self.model.max_len
        device = self.model.device
        per_block = self.kv_bytes_per_block(config)
        budget_tokens = config.max_num_batched_tokens or config.default_max_num_batched_tokens(max_len, device.type)
        if (device.type == "cuda" and config.kv_cache_memory_gb is None and config.num_kv_blocks is None
                and config.kv_cache):
            self._plan_gpu_memory(config, max_len, budget_tokens)
        num_blocks = max(1, kv_budget_bytes(config, device, self.gpu_memory) // per_block)
        # never more than every seat filled to max_model_len: beyond that the memory would sit idle
        num_blocks = min(num_blocks, config.max_num_seqs * cdiv(max_len, config.block_size))
        return {"max_model_len": self.model.max_len,
                "max_num_batched_tokens": config.default_max_num_batched_tokens(max_len, device.type),
                "num_kv_blocks": num_blocks, "attention_backend": resolve_attention_backend(config, device)}

    def _plan_gpu_memory(self, config: EngineConfig, max_len: int, budget_tokens: int) -> None:
        """Profile once per (utilization, step size); a settings change that keeps both reuses the plan."""
        plan = self.gpu_memory
        if plan is None or (plan.utilization, plan.profile_tokens) != (config.gpu_memory_utilization, budget_tokens):
            pool = self.runner.kv_cache_bytes if hasattr(self, "runner") else 0
            self.gpu_memory = profile_gpu_memory(self.model, config, max_len, budget_tokens, pool)

    def _resolve(self, config: EngineConfig) -> EngineConfig:
        """Fill the sizes left as None from the model and the memory budget, and check they fit together and
        in the memory free now. Every way in (LLM(...), update_config, the page) passes here."""
        auto = self.automatic_sizes(config)
        max_len = config.max_model_len or auto["max_model_len"]
        if max_len > self.model.max_len:
            raise ValueError(f"max_model_len {max_len} exceeds the loaded model's limit ({self.model.max_len})")
        budget = config.max_num_batched_tokens or auto["max_num_batched_tokens"]
        num_blocks = config.num_kv_blocks or auto["num_kv_blocks"]
        resolved = config.replace(max_model_len=max_len, max_num_batched_tokens=budget, num_kv_blocks=num_blocks,
                                  attention_backend=auto["attention_backend"])
        if resolved.cuda_graphs:
            check_cuda_graphs(self.model.device, resolved.attention_backend, resolved.kv_cache)
        if resolved.kv_cache and not resolved.paged_kv and cdiv(max_len, config.block_size) > num_blocks:
            raise ValueError(
                f"contiguous KV reserves max_model_len={max_len} tokens "
                f"({cdiv(max_len, config.block_size)} blocks) per request, but the pool has only {num_blocks} blocks")
        self._check_memory(config, resolved)
        return resolved

    def _check_memory(self, requested: EngineConfig, resolved: EngineConfig) -> None:
        """A new pool must fit beside the current one (it is built before the old one is let go); keeping the
        current pool needs nothing new, even if free memory has shrunk since."""
        current = getattr(self, "config", None)  # None while __init__ resolves the first config
        rebuild = current is None or any(getattr(current, f) != getattr(resolved, f) for f in STRUCTURAL_FIELDS)
        if not (resolved.kv_cache and rebuild):
            return
        blocks = f"{resolved.num_kv_blocks} blocks"
        what = (f"num_kv_blocks={requested.num_kv_blocks}" if requested.num_kv_blocks is not None else
                f"kv_cache_memory_gb={requested.kv_cache_memory_gb} ({blocks})"
                if requested.kv_cache_memory_gb is not None else f"the automatic pool ({blocks})")
        check_kv_pool_fits(what, resolved.num_kv_blocks, self.kv_bytes_per_block(resolved), self.model.device)

    def kv_bytes_per_block(self, config: EngineConfig) -> int:
        return self.model.kv_bytes_per_token(config.kv_cache_dtype) * config.block_size

    def _build_kv(self, c: EngineConfig) -> tuple[KVCacheManager | NoKVCache, ModelRunner]:
        """A pool and runner for config c. Changes nothing in the engine, so a failure here leaves it serving."""
        kv = kv_cache_for(c.kv_cache, c.paged_kv, c.prefix_caching_active, c.num_kv_blocks, c.block_size,
                          c.max_model_len)
        key_scales = key_scales_for(self.model, self.tokenizer) if c.key_smoothing_active else None
        runner = ModelRunner(self.model, c.block_size, c.num_kv_blocks, c.kv_cache, c.kv_cache_dtype,
                             c.attention_backend, scratch_block=c.cuda_graphs, key_scales=key_scales)
        if c.cuda_graphs:
            runner.graphs = DecodeGraphs(self.model, runner.kv_layers, c.block_size, runner.scratch_block,
                                         c.max_num_seqs, c.max_model_len)
        return kv, runner

    def _use_kv(self, kv: KVCacheManager | NoKVCache, runner: ModelRunner) -> None:
        kv.adopt_counters(self.kv)
        self.kv = kv
        self.scheduler.kv = kv
        self.scheduler.config = self.config
        self.runner = runner

    def update_config(self, **changes) -> None:
        """Validate now (ValueError leaves everything as it was); apply at the next step boundary."""
        if bad := [k for k in changes if k in LOAD_TIME_FIELDS]:
            raise ValueError(f"{', '.join(bad)} cannot change while serving (the weights are loaded with it): "
                             f"create a new LLM")
        requested = self.requested_config.replace(**{**self._pending, **changes})
        resolved = self._resolve(requested)
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._check_fits(req.num_prompt_tokens, req.params, resolved)
        self._pending.update(changes)
        self._pending_config = resolved

    def pending_config(self) -> tuple[EngineConfig, EngineConfig]:
        """(requested, resolved): what the engine runs once the pending changes apply (what it runs now if none
        wait). Requested keeps None for the sizes left automatic; resolved has the numbers they come to."""
        return self.requested_config.replace(**self._pending), self._pending_config

    def apply_pending(self) -> dict | None:
        """Apply waiting changes now; only between steps (the service calls it when the engine is idle, so a
        change does not wait for a step that may never come). Returns the reconfiguration record, if any."""
        if not self._pending:
            return None
        self._apply_pending()
        return self.last_reconfig

    def _apply_pending(self) -> None:
        if not self._pending:
            return
        changes, self._pending = self._pending, {}
        old = self.config
        try:
            requested = self.requested_config.replace(**changes)
            new = self._resolve(requested)  # checked again: free memory may have shrunk since update_config
            structural = any(getattr(old, f) != getattr(new, f) for f in STRUCTURAL_FIELDS)
            # The new pool is built while the old one still serves: if memory runs out, nothing has changed.
            built = self._build_kv(new) if structural else None
        except (ValueError, MemoryError, RuntimeError) as exc:  # torch's out-of-memory is a RuntimeError
            self._pending_config = old
            self.last_reconfig = {"step": self.step_count, "changes": changes,
                                  "action": "not applied: the previous configuration keeps serving",
                                  "requests_re_prefilled": [], "error": f"{type(exc).__name__}: {exc}"}
            return
        self.requested_config, self.config, self._pending_config = requested, new, new
        moved = []
        if built is not None:
            # Re-prefill: free every running request's blocks in the old pool and requeue them, oldest first.
            for req in reversed(list(self.scheduler.running)):
                self.scheduler.preempt(req, count=False)
                moved.append(req.request_id)
            self._use_kv(*built)
        else:
            self.scheduler.config = new
            self.kv.set_prefix_caching(new.prefix_caching_active)
        self.last_reconfig = {"step": self.step_count, "changes": changes,
                              "action": "re-prefill running requests" if structural else "applied in place",
                              "requests_re_prefilled": moved[::-1]}

    def warm_up(self) -> None:
        """One tiny greedy request run to the end, so what follows does not pay first-call costs (and a
        configuration that builds but cannot run a step fails here, not on someone's request)."""
        rng = random.Random(-1)
        self.add_request([rng.randrange(*TOKEN_RANGE) for _ in range(8)],
                         SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while self.has_unfinished():
            self.step()

    # ---- requests ------------------------------------------------------------------------------------
    def _check_fits(self, num_prompt: int, params: SamplingParams, config: EngineConfig) -> None:
        if num_prompt >= config.max_model_len:
            raise ContextLengthError(f"prompt has {num_prompt} tokens but max_model_len is {config.max_model_len} "
                                     f"(room is needed for at least one generated token)")
        if config.kv_cache and config.paged_kv:
            need = cdiv(min(num_prompt + params.max_tokens, config.max_model_len), config.block_size)
            if need > config.num_kv_blocks:
                raise ContextLengthError(f"this request needs {need} KV blocks but the pool has only "
                                         f"{config.num_kv_blocks}")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        text = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            text = prompt
            token_ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
                raise ValueError("prompt token ids must be integers")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("empty prompt")
        vocab = self.model.shape.vocab_size
        if bad := [t for t in token_ids if not 0 <= t < vocab]:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        self._check_fits(len(token_ids), params, self.config)
        if self._pending:  # it must also fit the configuration about to apply
            self._check_fits(len(token_ids), params, self._pending_config)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator(device=self.model.device).manual_seed(params.seed)
        req = Request(request_id, token_ids, params, text, arrival_time, gen)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now; its final output (finish_reason "abort") comes from the next step."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self.scheduler.finish(req)
        req.finish_reason = "abort"
        req.metrics.finished_time = time.perf_counter()
        self._aborted.append(req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._apply_pending()
        outputs = [self._pop(r) for r in self._aborted]
        self._aborted = []
        rec = StepRecord(self.step_count, time.time())
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        rec.preempted = sched.preempted
        if sched.scheduled:
            batch = self.runner.prepare(sched.scheduled)
            t2 = time.perf_counter()
            logits = self.runner.execute(batch)
            t3 = time.perf_counter()
            new_tokens = self._sample(batch, logits)
            t4 = time.perf_counter()
            outputs += self._retire(batch.scheduled, new_tokens, rec)
            t5 = time.perf_counter()
            rec.schedule_ms, rec.prepare_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
            rec.forward_ms, rec.sample_ms, rec.retire_ms = (t3 - t2) * 1e3, (t4 - t3) * 1e3, (t5 - t4) * 1e3
        rec.num_batched_tokens, rec.num_seqs = sched.total_tokens, len(sched.scheduled)
        rec.num_running, rec.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        self.steps.append(rec)
        self.step_count += 1
        return outputs

    def _sample(self, batch: Batch, logits) -> list[list[tuple[int, TokenLogprobs | None]]]:
        """The tokens each scheduled request gains this step, in batch order, each with its logprobs (None unless
        asked for): one for a prefill's end or a decode, the accepted drafts plus one for a verify, none for a
        prefill chunk short of the prompt's end."""
        rows, row = [], 0  # where each request's rows to sample from start (after its prompt-logprob rows)
        for s in batch.scheduled:
            positions = s.prompt_logprob_positions
            if positions:
                self._record_prompt_logprobs(s, logits[row:row + len(positions)], positions)
            rows.append(row + len(positions))
            row += len(positions) + s.num_logits
        single = [i for i, s in enumerate(batch.scheduled) if s.num_logits == 1]
        params = [batch.scheduled[i].request.params for i in single]
        raw = logits[[rows[i] for i in single]]
        sampled = draw(processed_logits(raw, params), params, [batch.scheduled[i].request.generator for i in single])
        logprobs = token_logprobs(raw, sampled, [p.logprobs for p in params])
        out: list[list[tuple[int, TokenLogprobs | None]]] = [[] for _ in batch.scheduled]
        for i, token, lp in zip(single, sampled, logprobs, strict=True):
            out[i] = [(token, lp)]
        for i, s in enumerate(batch.scheduled):
            if s.phase is Phase.VERIFY:
                p, rows_i = s.request.params, logits[rows[i]:rows[i] + s.num_logits]
                tokens = verify(rows_i, s.draft_token_ids, p, s.request.generator)
                lps = [None] * len(tokens)
                if p.logprobs is not None:  # row j predicted the token at j
                    lps = token_logprobs(rows_i[:len(tokens)], tokens, [p.logprobs] * len(tokens))
                out[i] = list(zip(tokens, lps))
        return out

    @staticmethod
    def _record_prompt_logprobs(s: ScheduledRequest, logits: torch.Tensor, positions: range) -> None:
        """Log probabilities of the prompt's tokens at positions, from the model's own logits (before temperature
        or any filter), each row being the position before."""
        req, k = s.request, s.request.params.prompt_logprobs
        given = req.token_ids[positions.start:positions.stop]
        req.prompt_logprobs.extend(token_logprobs(logits, given, [k] * len(given)))

    def _retire(self, scheduled: list[ScheduledRequest], new_tokens: list[list[tuple[int, TokenLogprobs | None]]],
                rec: StepRecord) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = []
        for s, tokens in zip(scheduled, new_tokens, strict=True):
            req = s.request
            if s.phase is Phase.PREFILL:
                self.prefill_tokens_total += s.num_tokens
            num_accepted = max(0, len(tokens) - 1) if s.phase is Phase.VERIFY else 0
            if s.phase is Phase.VERIFY:
                self.spec_stats.record(len(s.draft_token_ids), num_accepted)
            # the accepted drafts' K/V are right (computed over the right tokens); the rejected ones' slots go back
            self.kv.mark_computed(req, s.known_end + num_accepted)
            entry = StepEntry(req.request_id, s.phase.value, s.num_tokens, s.prefix_hit_tokens,
                              req.num_computed_tokens, req.num_prompt_tokens, 0, len(s.draft_token_ids), num_accepted)
            rec.entries.append(entry)
            if not tokens:
                continue
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            reason = None
            for token, logprobs in tokens:  # one by one: a stop inside an accepted run ends it there
                req.token_ids.append(token)
                if req.logprobs is not None:
                    req.logprobs.append(logprobs)
                entry.num_new_tokens += 1
                self._detokenize(req)
                reason = self._stop_reason(req, token)
                if reason:
                    break
            self.generation_tokens_total += entry.num_new_tokens
            m.num_generation_tokens = req.num_output_tokens
            if reason:
                req.finish_reason = reason
                m.finished_time = now
                self.scheduler.finish(req)
                rec.finished.append((req.request_id, reason))
                outputs.append(self._pop(req))
            else:
                outputs.append(req.to_output())
        return outputs

    def _pop(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        return req.to_output()

    def _detokenize(self, req: Request) -> None:
        """Append the new token's text, decoding only a short window of recent tokens."""
        d, ids = req.detok, req.output_token_ids
        prefix = self.tokenizer.decode(ids[d.prefix_offset:d.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[d.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            req.text += full[len(prefix):]
            d.prefix_offset, d.read_offset = d.read_offset, len(ids)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if p.stop:
            start = max(0, req.detok.stop_scan_from - max(len(s) for s in p.stop))
            hits = [i for i in (req.text.find(s, start) for s in p.stop) if i >= 0]
            req.detok.stop_scan_from = len(req.text)
            if hits:
                req.text = req.text[:min(hits)]
                return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    # ---- the view inside -----------------------------------------------------------------------------
    def snapshot(self, num_steps: int = 64) -> EngineSnapshot:
        """A plain-data picture of the engine now; no tensors, cheap enough for every refresh."""
        s = self.scheduler
        live = list(s.running) + list(s.waiting)
        ref_counts, hashes = self.kv.block_states()
        return EngineSnapshot(
            step=self.step_count, time=time.time(), config=self.config.to_dict(),
            num_running=len(s.running), num_waiting=len(s.waiting), num_preemptions=s.num_preemptions,
            running=[r.request_id for r in s.running], waiting=[r.request_id for r in s.waiting],
            block_size=self.config.block_size,
            block_tables={r.request_id: list(r.block_table) for r in s.running},
            block_ref_counts=ref_counts, block_hashes=hashes, **dataclasses.asdict(self.kv.stats()),
            prefill_tokens_total=self.prefill_tokens_total, generation_tokens_total=self.generation_tokens_total,
            requests={r.request_id: {"status": r.status.value, "num_prompt_tokens": r.num_prompt_tokens,
                                     "num_output_tokens": r.num_output_tokens,
                                     "num_computed_tokens": r.num_computed_tokens,
                                     "num_cached_tokens": r.metrics.num_cached_tokens,
                                     "num_preemptions": r.metrics.num_preemptions,
                                     # a few, not all: enough for a viewer to show the latest tokens as text
                                     "recent_token_ids": r.token_ids[-8:]} for r in live},
            steps=list(itertools.islice(reversed(self.steps), num_steps))[::-1],
            last_reconfig=self.last_reconfig, speculation=self._speculation(),
            kv_bytes_per_block=self.kv_bytes_per_block(self.config),
            gpu_memory=None if self.gpu_memory is None else self.gpu_memory.to_dict(),
            precision=self.config.precision, kernels=self.kernels(), features=self.config.feature_states(),
        )

    def kernels(self) -> dict[str, str]:
        """What runs this engine's steps here, in words (the snapshot's `kernels`)."""
        return {**self.model.kernels(), "attention": self.runner.attention_kernel if self.config.kv_cache else
                "torch SDPA (no KV cache: the whole sequence each step)"}

    def _speculation(self) -> dict:
        c, stats = self.config, self.spec_stats
        k, budget = c.num_speculative_tokens, c.speculative_token_budget
        return {"active": c.speculative_decoding_active, "k": self.scheduler.spec_k,
                "rule": f"k = min({k}, {budget} // decoding requests - 1): {k} drafts up to "
                        f"{budget // (k + 1)} decoding requests, none above {budget // 2}",
                **dataclasses.asdict(stats), "acceptance_rate": stats.acceptance_rate}


def stored_as(model) -> tuple[str, WeightFormat]:
    """How a loaded model's weights are stored: its dtype's name and its weight format."""
    return str(model.dtype).removeprefix("torch."), model.weight_format


def _check_weights(config: EngineConfig, model) -> None:
    """An engine runs the weights it is given: they must be stored as config says (dtype, quantization)."""
    have, want = stored_as(model), (config.dtype, WeightFormat.of(config))
    if have != want:
        raise ValueError(f"the model's weights are {have[0]}, {have[1].describe()}, but the config asks for "
                         f"{want[0]}, {want[1].describe()}: load the model with them (LLM(..., dtype=, quantization=))")


def _eos_ids(tokenizer, hf_config) -> set[int]:
    ids = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


__all__ = ["ContextLengthError", "LLMEngine", "EngineSnapshot", "StepEntry", "StepRecord", "RequestStatus"]
