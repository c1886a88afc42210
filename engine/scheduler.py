"""Who runs this step and with how many tokens.

The scheduler thinks in {request: num_new_tokens}: a prefill is many new tokens, a decode is one, so both share
one token budget. Each scheduled request's phase is decided here once; the runner and the step log read it. When
the pool runs dry the policy's victim (engine/policies.py) is preempted by recompute.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from .blocks import NO_PREFIX, CachedPrefix, KVCache
from .config import EngineConfig
from .policies import POLICIES
from .request import Request, RequestStatus
from .spec import adaptive_k, propose_ngram


class Phase(enum.StrEnum):
    PREFILL = "prefill"  # prompt tokens (or a recompute after preemption, or the naive loop's whole sequence)
    DECODE = "decode"  # the one token sampled last step, over a cached context
    VERIFY = "verify"  # that token plus draft tokens, checked in the same pass


@dataclass
class ScheduledRequest:
    request: Request
    phase: Phase
    start: int  # first position computed this step
    num_tokens: int  # positions computed this step: a prefill (chunk), 1 for a decode, 1 + drafts for a verify
    prefix_hit_tokens: int = 0  # tokens this step took from the prefix cache instead of computing them
    draft_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # the request's block table, as the KV manager holds it

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def known_end(self) -> int:
        """End of the positions whose tokens are known (the drafts after them are guesses until verified)."""
        return self.end - len(self.draft_token_ids)

    @property
    def prompt_logprob_positions(self) -> range:
        """Prompt positions whose log probabilities this step computes, each from the row of the position before
        it: only while the prompt is prefilled, for a request asking for them, and never twice."""
        req = self.request
        if req.prompt_logprobs is None or self.phase is not Phase.PREFILL:
            return range(0)
        return range(max(self.start + 1, len(req.prompt_logprobs)), min(self.known_end, req.num_prompt_tokens - 1) + 1)

    @property
    def num_logits(self) -> int:
        """Rows to sample from: none for a prefill chunk that stops short of the sequence's end."""
        if self.known_end < self.request.num_tokens:
            return 0
        return 1 + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in scheduling order
    preempted: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCache) -> None:
        self.use(config, kv)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.num_preemptions = 0
        self._budget = 0  # tokens left in the step being scheduled
        self.spec_k = 0  # drafts per decoding request in the last step (adaptive)

    def use(self, config: EngineConfig, kv: KVCache) -> None:
        """Schedule with this configuration and KV manager from the next step on (a reconfiguration)."""
        self.config, self.kv = config, kv
        self.policy = POLICIES[config.scheduling_policy]

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.config.max_num_batched_tokens
        batch_was_empty = not self.running
        num_decoding = sum(1 for r in self.running if not r.is_prefilling)
        c = self.config
        self.spec_k = (adaptive_k(c.num_speculative_tokens, num_decoding, c.speculative_token_budget)
                       if c.speculative_decoding_active else 0)

        # Running requests: decodes first, so streams never stall behind a long prompt's chunks
        cutoff = self.policy.cutoff(self.running, self.waiting)
        for req in sorted(self.running, key=lambda r: r.is_prefilling):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room for an older request
            if cutoff is not None and req.priority > cutoff:
                continue
            cached = self.kv.find_cached_prefix(req) if req.is_prefilling else NO_PREFIX
            drafts = [] if req.is_prefilling else self._propose(req)
            start = req.num_computed_tokens + cached.num_tokens
            n = self._fit(start, req.num_tokens - start + len(drafts))
            if n == 0:
                continue
            if not self._allocate_or_preempt(req, n, cached, out):
                continue
            self._take(ScheduledRequest(req, Phase.VERIFY if drafts else _phase(req, start), start, n,
                                        cached.num_tokens, drafts), out)
        # no request leaves the batch from here on (admission preempts none in it): its full blocks can be named now
        for s in out.scheduled:
            self.kv.cache_full_blocks(s.request, s.known_end)

        admit = self.config.continuous_batching or batch_was_empty
        while admit and self.waiting:
            req = self.policy.next_waiting(self.waiting)
            if cutoff is not None and req.priority > cutoff:
                break  # a worse newcomer's prompt waits too: it would lengthen the better one's step
            # a request the policy ranks above a running one takes that one's seat and blocks (priority only)
            outranks = self.policy.outranks(req, self.running)
            if out.preempted and not outranks:
                break
            if len(self.running) >= self.config.max_num_seqs:
                if not (outranks and self._give_way(out, admitting=True)):
                    break
                continue
            cached = self.kv.find_cached_prefix(req)
            num_hit = cached.num_tokens
            n = self._fit(num_hit, req.num_tokens - num_hit)
            if n == 0:
                break
            if self.kv.allocate_slots(req, n, cached) is None:
                if not (outranks and self._give_way(out, admitting=True)):
                    break
                continue
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
            self._take(ScheduledRequest(req, Phase.PREFILL, num_hit, n, num_hit), out, admitted=True)
            self.kv.cache_full_blocks(req, num_hit + n)  # later admissions may share them at once
        return out

    def _take(self, s: ScheduledRequest, out: SchedulerOutput, admitted: bool = False) -> None:
        """Into this step's batch, over the request's blocks; its prefix hits are counted, but never a recompute's."""
        req = s.request
        if not req.recomputing:
            self.kv.count_prefix_hits(req.num_prompt_tokens if admitted else 0, s.prefix_hit_tokens)
            req.metrics.num_cached_tokens += s.prefix_hit_tokens
        req.num_computed_tokens, s.block_ids = s.start, self.kv.block_ids(req)
        out.scheduled.append(s)
        self._budget -= s.num_tokens

    def _propose(self, req: Request) -> list[int]:
        """Draft tokens for a decoding request (each bound less 1: the token verified after them always counts)."""
        c = self.config
        room = min(self.spec_k, req.params.max_tokens - req.num_output_tokens - 1,
                   c.max_model_len - req.num_tokens - 1, self._budget - 1)
        return propose_ngram(req.token_ids, room, c.prompt_lookup_min, c.prompt_lookup_max) if room > 0 else []

    def _fit(self, start: int, n: int) -> int:
        """How many of a request's n remaining tokens run this step. A chunk ends on a block boundary where possible,
        so the next chunk can be skipped if its blocks turn up in the prefix cache."""
        if n <= self._budget:
            return n
        if not self.config.chunked_prefill_active or self._budget == 0:
            return 0
        bs = self.kv.block_size
        aligned = (start + self._budget) // bs * bs - start
        return aligned if aligned > 0 else self._budget

    def _allocate_or_preempt(self, req: Request, n: int, cached: CachedPrefix, out: SchedulerOutput) -> bool:
        """Slots for n new tokens, preempting the policy's victims until they fit; False if req itself was one."""
        while self.kv.allocate_slots(req, n, cached) is None:
            if self._give_way(out) is req:
                return False
        return True

    def _give_way(self, out: SchedulerOutput, admitting: bool = False) -> Request | None:
        """Preempt the policy's victim; one scheduled earlier in this step (a decode that went first) leaves the
        batch and gives its tokens back. While admitting, a victim in the batch is left alone (None): its full blocks
        are named in the prefix cache already, and would stay there without K/V (Priority's sit-out avoids that too)."""
        victim = self.policy.victim(self.running)
        if admitting and any(s.request is victim for s in out.scheduled):
            return None
        self.preempt(victim)
        out.preempted.append(victim.request_id)
        for s in out.scheduled:
            if s.request is victim:
                out.scheduled.remove(s)
                self._budget += s.num_tokens
                break
        return victim

    def preempt(self, req: Request, count: bool = True) -> None:
        """Free the request's blocks and requeue it at the front; it will be recomputed from scratch."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.recomputing = True
        req.status = RequestStatus.PREEMPTED
        if count:
            req.metrics.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        (self.running if req in self.running else self.waiting).remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED


def _phase(req: Request, start: int) -> Phase:
    """Decode: only the token sampled last step is new, and everything before it is cached."""
    if req.num_output_tokens > 0 and start == req.num_tokens - 1:
        return Phase.DECODE
    return Phase.PREFILL
