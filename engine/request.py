"""A request's state machine (waiting -> running -> finished, running -> preempted -> running) and its tokens."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

import torch

from .logprobs import TokenLogprobs
from .sampling_params import SamplingParams

_ARRIVALS = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; it will be recomputed
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # the generated text so far (whole, not a delta)
    token_ids: list[int]  # generated tokens only
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    metrics: RequestMetrics
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when the params asked for them
    # one per prompt position, {token_id: logprob} (the given token and the most likely ones); None at the first
    # position, which nothing predicts. Complete once the prompt is computed (from the first token's output on).
    prompt_logprobs: list[dict[int, float] | None] | None = None


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None,
                 generator: torch.Generator | None = None, priority: int = 0) -> None:
        self.request_id = request_id
        self.priority = priority  # lower first, under the priority policy (engine/policies.py)
        self.arrival_seq = next(_ARRIVALS)  # first come, first served among equal priorities
        self.prompt = prompt
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache, in blocks the KV manager holds for it
        self.recomputing = False  # re-prefilling after a preemption or a pool rebuild: prefix hits are not counted
        self.generator = generator
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        # indexed by prompt position, filled in order as the prompt is computed (a recompute never redoes them)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None if params.prompt_logprobs is None else [None]
        self.metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                                      num_prompt_tokens=self.num_prompt_tokens)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token still lacks its K/V: the prompt (or a recompute) is under way."""
        return self.num_computed_tokens < self.num_tokens - 1 or self.num_output_tokens == 0

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def to_output(self, text: str) -> RequestOutput:
        """`text`: the generated text so far, which the output processor keeps (engine/output.py)."""
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, text,
                             self.output_token_ids, self.finished, self.finish_reason, self.metrics,
                             logprobs=None if self.logprobs is None else list(self.logprobs),
                             prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs))

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")

