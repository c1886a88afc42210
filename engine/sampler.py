"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Each seeded request owns a torch.Generator that draws exactly one sample per step, so its
output does not depend on what else is in the batch. Logprobs are those of the distribution the token
was drawn from: the logits after temperature and the top-k / top-p / min-p filters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # most likely tokens reported per generated token, at most (OpenAI's top_logprobs limit)
SAMPLING_EPS = 1e-5  # temperatures below this are greedy: dividing by them would overflow the logits


class InvalidSamplingParam(ValueError):
    """A field of SamplingParams out of range or of the wrong type; `param` names it, so an HTTP error can too."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class TokenLogprobs(dict):
    """One position's log probabilities in vLLM's form, a dict {token_id: logprob} holding the chosen (or given)
    token and the most likely ones; also .token_id, .logprob and .top (the most likely, most likely first), which
    an OpenAI response lists in order. From the model's own logits, before temperature or any filter."""

    def __init__(self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...]) -> None:
        super().__init__(((token_id, logprob), *top))
        self.token_id, self.logprob, self.top = token_id, logprob, top

    def as_dict(self) -> dict[int, float]:
        return dict(self)


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
    # None: no logprobs; N: the chosen token's and the N most likely tokens' log probabilities, from the model's
    # own logits before temperature or any filter (vLLM's raw logprobs): a sampled token a filter allowed keeps
    # the probability the model gave it
    logprobs: int | None = None
    # None: none; N: at each prompt position after the first, the given token's and the N most likely tokens'
    # log probabilities, from the model's own logits (vLLM's meaning). A request asking for them is not served
    # from the prefix cache: every prompt position must be computed to have its logits.
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


def _real(x) -> bool:
    """A finite int or float, not a bool (True is an int to Python, but never a temperature)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Scale by temperature and mask (to -inf) what top-k / top-p / min-p exclude. Rows: requests.

    top_k <= 0 disables top-k for that row; top_p = 1 and min_p = 0 disable the others.
    """
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.softmax(dim=1)
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p stays).
    # top_p = 1 is off: the float cumsum reaches 1.0 before the tail, which must not drop the tail's tokens.
    mass_before = probs.cumsum(dim=1) - probs
    drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def processed_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The rows as the sampler draws from them (float32): greedy rows as they are, the others scaled by their
    temperature and filtered. Both the draw and the logprobs read these, so a logprob is that of the draw."""
    logits = logits.float()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return logits
    dev = logits.device
    logits = logits.clone()  # the caller's tensor stays as it was
    logits[rows] = filter_logits(
        logits[rows],
        torch.tensor([params[i].temperature for i in rows], device=dev, dtype=torch.float32),
        torch.tensor([params[i].top_k for i in rows], device=dev),
        torch.tensor([params[i].top_p for i in rows], device=dev, dtype=torch.float32),
        torch.tensor([params[i].min_p for i in rows], device=dev, dtype=torch.float32),
    )
    return logits


def draw(processed: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of processed logits. Greedy rows take the argmax; the rest draw from their distribution."""
    out = processed.argmax(dim=1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    probs = processed[rows].softmax(dim=1)
    for j, i in enumerate(rows):
        out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row. Greedy rows take the argmax; the rest draw from their filtered distribution."""
    return draw(processed_logits(logits, params), params, generators)


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row of the model's logits: the log probability of its token and the num_top most likely tokens; None
    where num_top is None."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, n in enumerate(num_top) if n is not None]
    if not rows:
        return out
    logprobs = logits[rows].float().log_softmax(dim=1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logprobs.device)).flatten().tolist()
    k = max(num_top[i] for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = num_top[i]
        out[i] = TokenLogprobs(tokens[i], chosen[j], tuple(zip(top_ids[j][:n], top_values[j][:n])))
    return out
