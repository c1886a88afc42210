"""Scheduling policies (EngineConfig.scheduling_policy, as vLLM's --scheduling-policy): which waiting request is
admitted next, which running one gives its blocks back when the pool runs dry, and which requests sit a step out.

- fcfs: first come, first served.
- priority (vLLM's): lower `priority` first, then first come. While a better request reads its prompt the worse
  ones wait a step, so a person's first token does not queue behind simulated users'.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


class FCFS:
    name = "fcfs"

    def next_waiting(self, waiting: Sequence[Request]) -> Request:
        return waiting[0]

    def victim(self, running: Sequence[Request]) -> Request:
        return running[-1]

    def outranks(self, request: Request, running: Sequence[Request]) -> bool:
        """Whether `request` may take a running one's seat and blocks."""
        return False

    def cutoff(self, running: Sequence[Request], waiting: Sequence[Request]) -> int | None:
        """The worst priority that runs this step (None: every running request does)."""
        return None


class Priority(FCFS):
    name = "priority"

    @staticmethod
    def rank(request: Request) -> tuple[int, int]:
        return request.priority, request.arrival_seq

    def next_waiting(self, waiting: Sequence[Request]) -> Request:
        return min(waiting, key=self.rank)

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=self.rank)

    def outranks(self, request: Request, running: Sequence[Request]) -> bool:
        return any(r.priority > request.priority for r in running)

    def cutoff(self, running: Sequence[Request], waiting: Sequence[Request]) -> int | None:
        first = [r.priority for r in running if r.is_prefilling]
        if waiting:
            first.append(self.next_waiting(waiting).priority)
        best = min(first, default=None)
        return best if best is not None and any(r.priority > best for r in running) else None


POLICIES = {policy.name: policy for policy in (FCFS(), Priority())}
