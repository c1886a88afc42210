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

import torch

from .blocks import KVCache, NoKVCache
from .config import EngineConfig
from .factory import Resolved
from .gpu import GpuMemoryPlan
from .logprobs import TokenLogprobs, token_logprobs
from .output import OutputProcessor, eos_token_ids
from .quant.format import WeightFormat
from .reconfigure import Reconfiguration
from .request import Request, RequestOutput, RequestStatus
from .runner import Batch, ModelRunner
from .sampler import draw, processed_logits
from .sampling_params import SamplingParams
from .scheduler import Phase, ScheduledRequest, Scheduler
from .snapshot import EngineCounters, EngineSnapshot, RequestView, StepEntry, StepRecord
from .spec import SpecDecodeStats, verify
from .threads import CoreShare
from .utils import TOKEN_RANGE, cdiv


class ContextLengthError(ValueError):
    """A request that can never fit: its prompt reaches max_model_len, or it needs more KV blocks than the pool has."""


class LLMEngine:
    def __init__(self, config: EngineConfig, model, tokenizer, hf_config=None,
                 requested: EngineConfig | None = None) -> None:
        """`config`: what to run, its dtype decided (engine/factory.py; its sizes may be left None, the factory
        fills them through reconfigure.py). `requested`: as asked, kept to report (dtype "auto" there); it may
        differ from config in nothing else. LLM builds engines so (llm.py's engine_for)."""
        _check_resolved(config, config if requested is None else requested)
        _check_weights(config, model)
        self.model = model
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        # sizes filled in and checked (reconfigure.py); a GPU's memory profile counts the pool this engine holds
        self.reconfig = Reconfiguration(model, tokenizer, config if requested is None else requested,
                                        lambda: self.runner.kv_cache_bytes if hasattr(self, "runner") else 0)
        self.config = self.reconfig.current
        _check_weights(self.config, model)  # a requested "auto" decided otherwise than config's dtype
        self.kv: KVCache = NoKVCache(self.config.block_size)
        self.scheduler = Scheduler(self.config, self.kv)
        self.use(self.config, *self.reconfig.build(self.config))
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._ids = itertools.count()
        self.step_count = 0
        self.prefill_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_stats = SpecDecodeStats()
        self.steps: deque[StepRecord] = deque(maxlen=256)
        # on a CPU the compute threads follow the cores other processes leave free; a GPU's host thread is one
        self.cores = CoreShare() if model.device.type == "cpu" else CoreShare(most=1)
        self.generator = torch.Generator(device=model.device).manual_seed(self.config.seed)
        # each new token's text and whether it ends its request (engine/output.py)
        self.output = OutputProcessor(tokenizer, eos_token_ids(tokenizer, hf_config))

    @property
    def eos_token_ids(self) -> set[int]:
        return self.output.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.output.eos_token_ids = set(ids)

    # ---- configuration (engine/reconfigure.py does the work) -------------------------------------------
    def use(self, config: EngineConfig, kv: KVCache, runner: ModelRunner) -> None:
        """Run `config` from the next step on, over this pool and runner (reconfigure.py built and checked them)."""
        if kv is not self.kv:
            kv.adopt_counters(self.kv)
        self.config, self.kv, self.runner = config, kv, runner
        self.scheduler.use(config, kv)
        # what the snapshot says runs: fixed until the next configuration, so not derived again at every step
        self._kernels: dict[str, str] | None = None
        self._features = config.feature_states()

    @property
    def requested_config(self) -> EngineConfig:
        return self.reconfig.requested

    @property
    def resolved(self) -> Resolved:
        """What was asked and what runs (engine/factory.py): resolved.chosen() says what each "auto" came to."""
        return Resolved(self.reconfig.requested, self.config)

    @property
    def last_reconfig(self) -> dict | None:
        return self.reconfig.last

    @property
    def gpu_memory(self) -> GpuMemoryPlan | None:
        return self.reconfig.gpu_memory

    def automatic_sizes(self, config: EngineConfig) -> dict[str, int]:
        """What each size left empty (None) comes to, given config's other fields."""
        return self.reconfig.automatic_sizes(config)

    def kv_bytes_per_block(self, config: EngineConfig) -> int:
        return self.reconfig.kv_bytes_per_block(config)

    def update_config(self, **changes) -> None:
        """Validate now (ValueError leaves everything as it was); apply at the next step boundary."""
        def fits(resolved: EngineConfig) -> None:  # every request in flight must fit what comes
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.check_fits(req.num_prompt_tokens, req.params, resolved)
        self.reconfig.update(changes, fits)

    def pending_config(self) -> tuple[EngineConfig, EngineConfig]:
        """(requested, resolved): what the engine runs once the pending changes apply (what it runs now if none
        wait)."""
        return self.reconfig.pending_view()

    def apply_pending(self) -> dict | None:
        """Apply waiting changes now; only between steps (the service calls it when the engine is idle, so a
        change does not wait for a step that may never come). Returns the reconfiguration record, if any."""
        change = self.reconfig.take()
        if change is None:
            return None
        moved = []
        if change.built is not None:
            # Re-prefill: free every running request's blocks in the old pool and requeue them, oldest first.
            for req in reversed(list(self.scheduler.running)):
                self.scheduler.preempt(req, count=False)
                moved.append(req.request_id)
            self.use(change.config, *change.built)
        elif change.config is not None:
            self.use(change.config, self.kv, self.runner)
            self.kv.set_prefix_caching(change.config.prefix_caching_active)
        return self.reconfig.record(change, self.step_count, moved[::-1])

    def warm_up(self) -> None:
        """One tiny greedy request run to the end, so what follows does not pay first-call costs (and a
        configuration that builds but cannot run a step fails here, not on someone's request)."""
        rng = random.Random(-1)
        self.add_request([rng.randrange(*TOKEN_RANGE) for _ in range(8)],
                         SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while self.has_unfinished():
            self.step()

    # ---- requests ------------------------------------------------------------------------------------
    def check_fits(self, num_prompt: int, params: SamplingParams, config: EngineConfig) -> None:
        if num_prompt >= config.max_model_len:
            raise ContextLengthError(f"prompt has {num_prompt} tokens but max_model_len is {config.max_model_len} "
                                     f"(room is needed for at least one generated token)")
        if config.kv_cache and config.paged_kv:
            need = cdiv(min(num_prompt + params.max_tokens, config.max_model_len), config.block_size)
            if need > config.num_kv_blocks:
                raise ContextLengthError(f"this request needs {need} KV blocks but the pool has only "
                                         f"{config.num_kv_blocks}")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, priority: int = 0) -> str:
        """`priority`: lower goes first under the priority policy (vLLM's), equal ones first come, first served."""
        params = params or SamplingParams()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
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
        self.check_fits(len(token_ids), params, self.config)
        if self.reconfig.pending:  # it must also fit the configuration about to apply
            self.check_fits(len(token_ids), params, self.reconfig.pending_config)
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
        self.apply_pending()
        self.cores.adjust()  # the compute threads follow the cores nobody else wants (engine/threads.py)
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
        """A finished or aborted request's last output; the engine and the output processor let it go."""
        self.requests.pop(req.request_id, None)
        return req.to_output(self.output.pop(req.request_id))

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
            block_tables={r.request_id: list(self.kv.block_ids(r)) for r in s.running},
            block_ref_counts=ref_counts, block_hashes=hashes, **dataclasses.asdict(self.kv.stats()),
            prefill_tokens_total=self.prefill_tokens_total, generation_tokens_total=self.generation_tokens_total,
            requests={r.request_id: RequestView(r.status.value, r.num_prompt_tokens, r.num_output_tokens,
                                                r.num_computed_tokens, r.metrics.num_cached_tokens,
                                                r.metrics.num_preemptions, tuple(r.token_ids[-8:])) for r in live},
            steps=list(itertools.islice(reversed(self.steps), num_steps))[::-1],
            last_reconfig=self.last_reconfig, speculation=self._speculation(),
            kv_bytes_per_block=self.kv_bytes_per_block(self.config),
            gpu_memory=None if self.gpu_memory is None else self.gpu_memory.to_dict(),
            precision=self.config.precision, kernels=self.kernels(), features=self._features,
        )

    def counters(self) -> EngineCounters:
        """The snapshot's counters alone (see EngineCounters)."""
        s, kv, spec = self.scheduler, self.kv, self.spec_stats
        return EngineCounters(self.step_count, len(s.running), len(s.waiting), s.num_preemptions, kv.num_used,
                              kv.prefix_cache_queries, kv.prefix_cache_hits, self.generation_tokens_total,
                              spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)

    def kernels(self) -> dict[str, str]:
        """What runs this engine's steps here, in words (the snapshot's `kernels`), worked out once per
        configuration."""
        if self._kernels is None:
            self._kernels = {**self.model.kernels(), "attention": self.runner.attention_kernel if self.config.kv_cache
                             else "torch SDPA (no KV cache: the whole sequence each step)"}
        return {**self._kernels, "threads": self.cores.describe()}

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


def _check_resolved(config: EngineConfig, requested: EngineConfig) -> None:
    """An engine runs one resolved configuration: the dtype is decided before it is built (the weights are loaded
    in it), by engine/factory.py, never here."""
    if config.dtype == "auto":
        raise ValueError("LLMEngine was given dtype='auto': the dtype is decided by engine/factory.py before an "
                         "engine is built (resolve_weights(config, model.device), or llm.py's engine_for, does it)")
    if differ := [k for k, v in requested.to_dict().items()
                  if getattr(config, k) != v and not (k == "dtype" and v == "auto")]:
        raise ValueError(f"the requested configuration may differ from the one given only in its dtype ('auto'), "
                         f"not in {', '.join(differ)}")


def _check_weights(config: EngineConfig, model) -> None:
    """An engine runs the weights it is given: they must be stored as config says (dtype, quantization)."""
    have, want = stored_as(model), (config.dtype, WeightFormat.of(config))
    if have != want:
        raise ValueError(f"the model's weights are {have[0]}, {have[1].describe()}, but the config asks for "
                         f"{want[0]}, {want[1].describe()}: load the model with them (LLM(..., dtype=, quantization=))")


__all__ = ["ContextLengthError", "LLMEngine", "RequestStatus"]
