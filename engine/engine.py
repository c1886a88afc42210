"""LLMEngine: add_request / step / abort; step() is schedule -> prepare -> forward -> sample -> retire."""
from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from .blocks import KVCache
from .config import EngineConfig
from .factory import CoreBuilder, check_resolved, check_weights
from .inputs import ContextLengthError, check_fits, checked_inputs
from .logprobs import TokenLogprobs, record_prompt_logprobs, token_logprobs
from .output import OutputProcessor, eos_token_ids
from .request import Request, RequestOutput, RequestStatus
from .runner import Batch, ModelRunner
from .sampler import draw, processed_logits
from .sampling_params import SamplingParams
from .scheduler import Phase, ScheduledRequest, Scheduler
from .snapshot import EngineCounters, EngineSnapshot, StepEntry, StepRecord, counters_of, kernels_of, snapshot_of
from .spec import SpecDecodeStats, verify
from .threads import compute_threads


class LLMEngine:
    def __init__(self, config: EngineConfig, model, tokenizer, hf_config=None,
                 requested: EngineConfig | None = None) -> None:
        """`config`: what to run, its dtype decided (its sizes may be left None: the factory fills them).
        `requested`: as asked, kept to report (dtype "auto" there). llm.py's engine_for builds engines so."""
        requested = config if requested is None else requested
        check_resolved(config, requested)
        check_weights(config, model)
        self.model = model
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        builder = CoreBuilder(model, tokenizer)
        self.config = builder.resolve(requested)
        check_weights(self.config, model)  # a requested "auto" decided otherwise than config's dtype
        self.kv, self.runner = builder.build(self.config)
        self.scheduler = Scheduler(self.config, self.kv)
        # what it was asked, how a GPU's pool was sized, the last change's record: its owner keeps them current
        self.requested, self.gpu_memory = requested, builder.gpu_memory
        self.last_reconfig: dict | None = None
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._ids = itertools.count()
        self.step_count = 0
        self.prefill_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_stats = SpecDecodeStats()
        self.steps: deque[StepRecord] = deque(maxlen=256)
        self.cores = compute_threads(model.device)
        self.generator = torch.Generator(device=model.device).manual_seed(self.config.seed)
        self.output = OutputProcessor(tokenizer, eos_token_ids(tokenizer, hf_config))

    # ---- the next configuration, handed in from outside (engine/reconfigure.py builds and checks it) ---------
    def swap_core(self, config: EngineConfig, kv: KVCache | None = None,
                  runner: ModelRunner | None = None) -> list[str]:
        """Run `config` from the next step on; only between steps. With a new pool (`kv` and its `runner`), every
        running request is freed and requeued, to be re-prefilled (nothing in flight is lost); their ids come back,
        oldest first. Without one, config applies in place (prefix caching switched on the pool kept)."""
        if kv is None:
            moved: list[str] = []
            self.kv.set_prefix_caching(config.prefix_caching_active)
        else:
            moved = [req.request_id for req in self.scheduler.running]  # admission order: the oldest first
            for req in reversed(list(self.scheduler.running)):  # requeued newest first: the oldest heads the queue
                self.scheduler.preempt(req, count=False)
            kv.adopt_counters(self.kv)
            self.kv, self.runner = kv, runner
        self.config = config
        self.scheduler.use(config, self.kv)
        return moved

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, priority: int = 0) -> str:
        text, token_ids, params = checked_inputs(prompt, params, priority, self.tokenizer, self.model.shape.vocab_size)
        check_fits(len(token_ids), params, self.config)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator(device=self.model.device).manual_seed(params.seed)
        req = Request(request_id, token_ids, params, text, arrival_time, gen, priority)
        self.requests[request_id] = req
        self.output.add(request_id)
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
        with self.cores.computing():
            return self._step()

    def _step(self) -> list[RequestOutput]:
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
        """The tokens each scheduled request gains this step, in batch order, with their logprobs (None unless asked
        for): one for a prefill's end or a decode, the accepted drafts plus one for a verify."""
        rows, row = [], 0  # where each request's rows to sample from start (after its prompt-logprob rows)
        for s in batch.scheduled:
            positions = s.prompt_logprob_positions
            if positions:
                record_prompt_logprobs(s.request, logits[row:row + len(positions)], positions)
            rows.append(row + len(positions))
            row += len(positions) + s.num_logits
        single = [i for i, s in enumerate(batch.scheduled) if s.num_logits == 1]
        params = [batch.scheduled[i].request.params for i in single]
        picked = [rows[i] for i in single]
        # most often every row, in order: the logits themselves, not a copy, whose fresh tensor costs page faults
        # (docs/measurements.md, "The sampler, again: fresh 6 MB tensors")
        raw = logits if picked == list(range(logits.shape[0])) else logits[picked]
        sampled = draw(processed_logits(raw, params), params, [batch.scheduled[i].request.generator for i in single])
        logprobs = token_logprobs(raw, sampled, [p.logprobs for p in params])
        out: list[list[tuple[int, TokenLogprobs | None]]] = [[] for _ in batch.scheduled]
        for i, token, lp in zip(single, sampled, logprobs, strict=True):
            out[i] = [(token, lp)]
        for i, s in enumerate(batch.scheduled):
            if s.phase is Phase.VERIFY:
                p, rows_i = s.request.params, logits[rows[i]:rows[i] + s.num_logits]
                tokens = verify(rows_i, s.draft_token_ids, p, s.request.generator)
                # row j predicted the token at j (token_logprobs computes nothing unless they were asked for)
                out[i] = list(zip(tokens, token_logprobs(rows_i[:len(tokens)], tokens, [p.logprobs] * len(tokens))))
        return out

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
                reason = self.output.process(req, token, self.config.max_model_len)
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
                outputs.append(req.to_output(self.output.text(req.request_id)))
        return outputs

    def _pop(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        return req.to_output(self.output.pop(req.request_id))

    # ---- the view inside (engine/snapshot.py builds it) --------------------------------------------------
    def snapshot(self, num_steps: int = 64) -> EngineSnapshot:
        return snapshot_of(self, num_steps)

    def counters(self) -> EngineCounters:
        return counters_of(self)

    def kernels(self) -> dict[str, str]:
        return kernels_of(self)


__all__ = ["ContextLengthError", "LLMEngine", "RequestStatus"]
