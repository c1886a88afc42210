"""The sampler: one token per row of logits, greedy or drawn from the request's filtered distribution. Each seeded
request owns a torch.Generator that draws exactly one number per step, so its output does not depend on what else
is in the batch."""
from __future__ import annotations

import torch

from .sampler_ops import exp_and_invert, filter_logits, most_likely
from .sampling_params import SamplingParams


def processed_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The rows as the sampler draws from them (float32 once any row samples): greedy rows as they are, the others
    scaled by their temperature and filtered."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return logits  # argmax reads them as they are: float32 changes no comparison
    source, logits = logits, logits.float()
    # bf16 logits' float32 copy is ours to write in; the caller's float32 logits (its logprobs read them) never are
    own = logits.data_ptr() != source.data_ptr()
    every = len(rows) == len(params)
    if all(params[i].plain(logits.shape[1]) for i in rows):  # nothing to scale or mask, only a copy to give
        return logits if own else logits.clone()  # (the draw writes in it)
    dev = logits.device
    filtered = filter_logits(
        logits if every else logits[rows],
        torch.tensor([params[i].temperature for i in rows], device=dev, dtype=torch.float32),
        torch.tensor([params[i].top_k for i in rows], device=dev),
        torch.tensor([params[i].top_p for i in rows], device=dev, dtype=torch.float32),
        torch.tensor([params[i].min_p for i in rows], device=dev, dtype=torch.float32),
        in_place=own or not every,  # logits[rows] is a copy too
    )
    if every:
        return filtered
    out = logits if own else logits.clone()
    out[rows] = filtered
    return out


def draw(processed: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of processed logits (the caller's to give away: a sampled batch overwrites it). Greedy rows
    take the argmax; the rest draw at once by inverting their cumulative sum at one uniform number per row."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return most_likely(processed).tolist()
    out = [0] * len(params)
    if greedy := [i for i, p in enumerate(params) if p.greedy]:
        for i, token in zip(greedy, most_likely(processed[greedy]).tolist()):
            out[i] = token
    # each row's probabilities up to a scale of its own (all the inversion needs): exp(x - max) in place, no softmax
    probs = processed if len(rows) == len(params) else processed[rows]
    by_generator: dict[int, list[int]] = {}
    for j, i in enumerate(rows):
        by_generator.setdefault(id(generators[i]), []).append(j)
    if len(by_generator) == 1:  # the common case: one generator (the engine's) for every sampled row
        uniform = torch.rand((len(rows), 1), dtype=torch.float64, device=probs.device, generator=generators[rows[0]])
    else:
        uniform = torch.empty((len(rows), 1), dtype=torch.float64, device=probs.device)
        for js in by_generator.values():  # rows sharing one generator (the engine's, unseeded) draw in batch order
            uniform[js] = torch.rand((len(js), 1), dtype=torch.float64, device=probs.device,
                                     generator=generators[rows[js[0]]])
    for i, token in zip(rows, exp_and_invert(probs, uniform).tolist()):
        out[i] = token
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row. Greedy rows take the argmax; the rest draw from their filtered distribution."""
    return draw(processed_logits(logits, params), params, generators)
