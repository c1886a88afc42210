"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Each seeded request owns a torch.Generator that draws exactly one sample per step, so its
output does not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row. Greedy rows take the argmax; the rest draw from their filtered distribution."""
    logits = logits.float()
    out = logits.argmax(dim=1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device
    sub = filter_logits(
        logits[rows],
        torch.tensor([params[i].temperature for i in rows], device=dev, dtype=torch.float32),
        torch.tensor([params[i].top_k for i in rows], device=dev),
        torch.tensor([params[i].top_p for i in rows], device=dev, dtype=torch.float32),
        torch.tensor([params[i].min_p for i in rows], device=dev, dtype=torch.float32),
    )
    probs = sub.softmax(dim=1)
    for j, i in enumerate(rows):
        out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return out
