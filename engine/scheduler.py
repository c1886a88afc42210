"""Who runs this step and with how many tokens.

The scheduler thinks in {request: num_new_tokens}: a prefill is many new tokens, a decode is one, so
both share one token budget. Running requests go first (FCFS); when the pool runs dry the newest running
request is preempted by recompute (blocks freed, requeued at the front). Waiting requests are admitted
while seats (max_num_seqs), budget and blocks last; static batching admits only into an empty batch.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .blocks import KVCacheManager
from .config import EngineConfig
from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    num_new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens computed this step
    requests: list[Request] = field(default_factory=list)  # scheduled, in batch order
    preempted: list[str] = field(default_factory=list)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)  # newly admitted -> cached prompt tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens.values())


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager | None) -> None:
        self.config = config
        self.kv = kv  # None when kv_cache is off: the naive loop keeps no cache at all
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
            n = self._num_new_tokens(req)
            if n > budget:
                i += 1
                continue
            if not self._allocate_or_preempt(req, n, out):
                break  # req itself was preempted: it was the newest, nothing after it runs
            out.num_new_tokens[req.request_id] = n
            out.requests.append(req)
            budget -= n
            i += 1
        if self.kv is not None:  # no more preemptions this step: the scheduled blocks will be computed
            for req in out.requests:
                self.kv.cache_full_blocks(req, req.num_computed_tokens + out.num_new_tokens[req.request_id])

        admit = self.config.continuous_batching or batch_was_empty
        while admit and not out.preempted and self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req) if self.kv else []
            num_hit = len(cached) * self.kv.block_size if cached else 0
            n = req.num_tokens - num_hit
            if n > budget:
                break
            if self.kv is not None and not self.kv.allocate_slots(req, n, cached):
                break
            self.waiting.popleft()
            if req.metrics.first_scheduled_time is None:  # a re-admission after preemption is not a new query
                req.metrics.first_scheduled_time = time.perf_counter()
                req.metrics.num_cached_tokens = num_hit
                out.prefix_hit_tokens[req.request_id] = num_hit
                if self.kv is not None:
                    self.kv.count_query(req, num_hit)
            req.num_computed_tokens = num_hit
            if self.kv is not None:
                self.kv.cache_full_blocks(req, req.num_tokens)  # later admissions may share them at once
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.num_new_tokens[req.request_id] = n
            out.requests.append(req)
            budget -= n
        return out

    def _num_new_tokens(self, req: Request) -> int:
        if self.kv is None:  # no cache: every step recomputes the whole sequence
            return req.num_tokens
        return req.num_tokens - req.num_computed_tokens

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        if self.kv is None:
            return True
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
        if self.kv is not None:
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
        if self.kv is not None:
            self.kv.free(req)
        req.status = RequestStatus.FINISHED
