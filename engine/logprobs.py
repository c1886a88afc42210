"""Log probabilities as a request reports them (vLLM's raw logprobs): from the model's own logits, before
temperature or any filter, for a generated token or a given prompt token, with the most likely tokens beside it."""
from __future__ import annotations

import torch


class TokenLogprobs(dict):
    """One position's log probabilities in vLLM's form, a dict {token_id: logprob} holding the chosen (or given)
    token and the most likely ones; also .token_id, .logprob and .top (most likely first), for an OpenAI response."""

    def __init__(self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...]) -> None:
        super().__init__(((token_id, logprob), *top))
        self.token_id, self.logprob, self.top = token_id, logprob, top


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


def record_prompt_logprobs(req, logits: torch.Tensor, positions: range) -> None:
    """The prompt's tokens at `positions`, each from the row of the position before, appended to the request's."""
    given = req.token_ids[positions.start:positions.stop]
    req.prompt_logprobs.extend(token_logprobs(logits, given, [req.params.prompt_logprobs] * len(given)))
