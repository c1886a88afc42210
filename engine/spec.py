"""Speculative decoding with n-gram prompt lookup: propose, then verify inside the normal step.

Proposing is free, and right whenever the answer copies from the prompt; the request's 1 + k rows in the step's
forward pass verify the drafts. Greedy keeps the longest draft prefix equal to the argmax; sampling keeps a draft d
with probability p(d), else draws from p without d (rejection sampling), so the output is distributed exactly as p.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampler import processed_logits
from .sampler_ops import most_likely
from .sampling_params import SamplingParams


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens (longest n first)."""
    length = len(token_ids)
    if k < 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = token_ids[length - n:]
        first = pattern[0]
        for i in range(length - n - 1, -1, -1):  # most recent first; an occurrence must end before the last token
            if token_ids[i] == first and token_ids[i:i + n] == pattern:
                return token_ids[i + n:i + n + k]
    return []


def adaptive_k(k: int, num_decoding: int, token_budget: int) -> int:
    """Drafts per request this step: aggressive when few requests decode, none when the batch is full. Speculation
    pays while verifying 1 + k rows costs about what one row does (a small batch is bound by reading the weights);
    once the batch's rows fill the speculative token budget, extra rows cost real compute."""
    if num_decoding < 1:
        return k
    return max(0, min(k, token_budget // num_decoding - 1))


@dataclass
class SpecDecodeStats:
    """Counters with vLLM's meanings (spec_decode_num_drafts, ..._draft_tokens, ..._accepted_tokens, per position)."""
    num_drafts: int = 0  # verify passes that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits: [1 + len(drafts), vocab], row i predicting the token after draft i - 1. Returns the accepted
    drafts followed by one token from the target model (a correction, or the bonus after a full accept)."""
    logits = logits.float()
    if params.greedy:
        target = most_likely(logits).tolist()
        out = []
        for i, d in enumerate(drafts):
            if d != target[i]:
                break
            out.append(d)
        out.append(target[len(out)])
        return out
    probs = processed_logits(logits, [params] * logits.shape[0]).softmax(dim=1)
    out = []
    for i, d in enumerate(drafts):
        u = torch.rand((), device=logits.device, generator=generator)
        if u < probs[i, d]:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0  # p with the rejected draft removed, renormalised by multinomial
        out.append(int(torch.multinomial(residual, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator).item()))
    return out
