"""SamplingParams: how one request's tokens are chosen (vLLM's fields and meanings), each field checked where the
params are made, so that a bad value is an InvalidSamplingParam naming it (an HTTP error names it too)."""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most likely tokens reported per generated token, at most (OpenAI's top_logprobs limit)
SAMPLING_EPS = 1e-5  # temperatures below this are greedy: dividing by them would overflow the logits


class InvalidSamplingParam(ValueError):
    """A field of SamplingParams out of range or of the wrong type; `param` names it, so an HTTP error can too."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None: none; N: the chosen token's and the N most likely tokens' log probabilities (logprobs.py: a sampled
    # token a filter allowed keeps the probability the model gave it)
    logprobs: int | None = None
    # None: none; N: at each prompt position after the first, the given token's and the N most likely tokens'. Such
    # a request is not served from the prefix cache: every prompt position must be computed to have its logits.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidSamplingParam("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidSamplingParam("stop_token_ids", f"stop_token_ids must be a list of integers, "
                                                         f"got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not _real(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParam("temperature", f"temperature must be >= 0 (0 is greedy), a finite number, "
                                                      f"got {self.temperature!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidSamplingParam("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise InvalidSamplingParam("top_k", f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not _real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidSamplingParam("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise InvalidSamplingParam("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # a torch.Generator takes any 64-bit seed
        if self.seed is not None and (not _integer(self.seed) or not -2**63 <= self.seed < 2**64):
            raise InvalidSamplingParam("seed", f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSamplingParam("stop", f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not _integer(t) for t in self.stop_token_ids):
            raise InvalidSamplingParam("stop_token_ids", f"stop_token_ids must be integers, "
                                                         f"got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParam("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidSamplingParam(name, f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], "
                                                 f"got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def plain(self, vocab: int) -> bool:
        """Sampling from the model's own distribution: temperature 1 and no filter on (filter_logits' rule for
        which settings turn a filter off)."""
        return self.temperature == 1 and not 0 < self.top_k < vocab and self.top_p >= 1 and self.min_p <= 0


def _real(x) -> bool:
    """A finite int or float, not a bool (True is an int to Python, but never a temperature)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
