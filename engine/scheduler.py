"""Who runs this step and with how many tokens.

The scheduler thinks in {request: num_new_tokens}: a prefill is many new tokens, a decode is one, so
both share one token budget. It decides each scheduled request's phase once (prefill, decode, verify) and
hands it on in `SchedulerOutput`: the runner and the step log read it, neither guesses it again.
Running requests go first (FCFS); when the pool runs dry the newest running request is preempted by
recompute (blocks freed, requeued at the front). Waiting requests are admitted while seats (max_num_seqs),
budget and blocks last; static batching admits only into an empty batch.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from .blocks import KVCacheManager, NoKVCache
from .config import EngineConfig
from .request import Request, RequestStatus


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

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_logits(self) -> int:
        """Rows to sample from: none for a prefill chunk that stops short of the sequence's end."""
        if self.start + self.num_tokens - len(self.draft_token_ids) < self.request.num_tokens:
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
    def __init__(self, config: EngineConfig, kv: KVCacheManager | NoKVCache) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        batch_was_empty = not self.running

        i = 0
        while i < len(self.running):
            req = self.running[i]
            start = req.num_computed_tokens
            n = req.num_tokens - start
            if n > budget:
                i += 1
                continue
            if not self._allocate_or_preempt(req, n, out):
                break  # req itself was preempted: it was the newest, nothing after it runs
            out.scheduled.append(ScheduledRequest(req, _phase(req, start), start, n))
            budget -= n
            i += 1
        for s in out.scheduled:  # no more preemptions this step: the scheduled blocks will be computed
            self.kv.cache_full_blocks(s.request, s.end)

        admit = self.config.continuous_batching or batch_was_empty
        while admit and not out.preempted and self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            num_hit = len(cached) * self.kv.block_size
            n = req.num_tokens - num_hit
            if n > budget:
                break
            if not self.kv.allocate_slots(req, n, cached):
                break
            self.waiting.popleft()
            if req.metrics.first_scheduled_time is None:  # a re-admission after preemption is not a new query
                req.metrics.first_scheduled_time = time.perf_counter()
                req.metrics.num_cached_tokens = num_hit
                self.kv.count_query(req, num_hit)
            req.num_computed_tokens = num_hit
            self.kv.cache_full_blocks(req, req.num_tokens)  # later admissions may share them at once
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, Phase.PREFILL, num_hit, n, prefix_hit_tokens=num_hit))
            budget -= n
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req, n):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request, count: bool = True) -> None:
        """Free the request's blocks and requeue it at the front; it will be recomputed from scratch."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if count:
            req.metrics.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED


def _phase(req: Request, start: int) -> Phase:
    """Decode: only the token sampled last step is new, and everything before it is cached."""
    if req.num_output_tokens > 0 and start == req.num_tokens - 1:
        return Phase.DECODE
    return Phase.PREFILL
