"""The sampler's per-row arithmetic: temperature and the top-k / top-p / min-p filters, argmax, and the draw's
exponentials and inverted cumulative sum. Each runs in the engine's C++ CPU kernels where they are built and take
the tensor, else in torch calls that keep the same tokens (ties at a boundary aside)."""
from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """Scale by temperature and mask (to -inf) what top-k / top-p / min-p exclude. Rows: requests.

    top_k <= 0 (or >= the vocabulary), top_p = 1 and min_p = 0 disable a filter for that row. Each filter judges
    the tempered distribution; a token stays when every filter keeps it. No filter, no sort. A tie at a boundary
    goes to the lower token id in C++, by topk's order in torch. `in_place`: `logits` is the caller's own copy,
    scaled and masked where it is (one allocation of the logits' size fewer per step).
    """
    if bool((temperature != 1).any()):
        logits = logits.div_(temperature.unsqueeze(1)) if in_place else logits / temperature.unsqueeze(1)
    elif not in_place:
        logits = logits.clone()  # the filters below mask in place: never the caller's tensor
    n, vocab = logits.shape
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1
    use_m = min_p > 0
    if not bool((use_k | use_p | use_m).any()):
        return logits
    if (ext := _native(logits)) is not None:  # the C++ rows: one or two passes a row, no sort of the vocabulary
        return ext.filter_rows(logits, top_k.to(torch.long).contiguous(), top_p.float().contiguous(),
                               min_p.float().contiguous())
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if bool(use_k.any()):
        rows = use_k.nonzero().flatten()
        k = top_k[rows].unsqueeze(1)
        top_idx = _take(logits, rows).topk(int(k.max()), dim=1).indices  # most likely first
        ranks = torch.arange(top_idx.shape[1], device=logits.device).unsqueeze(0)
        _or_rows(drop, rows, torch.ones((len(rows), vocab), dtype=torch.bool, device=logits.device)
                 .scatter_(1, top_idx, ranks >= k))
    if bool((use_p | use_m).any()):
        rows = (use_p | use_m).nonzero().flatten()
        probs = _take(logits, rows).softmax(dim=1)
        if bool(use_m[rows].any()):  # min_p = 0 drops nothing: no probability is below 0
            _or_rows(drop, rows, probs < min_p[rows].unsqueeze(1) * probs.max(dim=1, keepdim=True).values)
        if bool(use_p[rows].any()):
            sel = use_p[rows].nonzero().flatten()
            _or_rows(drop, _take(rows, sel), _top_p_drop(_take(probs, sel), top_p[rows[sel]].unsqueeze(1)))
    return logits.masked_fill_(drop, float("-inf"))


def _native(logits: torch.Tensor):
    """The engine's C++ module where it takes these logits (float32 rows on a CPU, contiguous) and is built, else
    None (torch's calls)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    from engine import cpu_kernels
    ext = cpu_kernels.compiled()
    return ext if ext is not None and hasattr(ext, "filter_rows") else None


def _take(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t's rows (ascending indices); t itself, not a copy, when they are all of them (the common case)."""
    return t if len(rows) == t.shape[0] else t[rows]


def _or_rows(mask: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> None:
    if len(rows) == mask.shape[0]:
        mask |= part
    else:
        mask[rows] |= part


TOP_P_CANDIDATES = (256, 4096)  # top-p looks among this many most likely tokens, then this many, then all


def _top_p_drop(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """What top-p drops: all but the smallest prefix of the most likely tokens whose mass reaches p (the token
    that crosses p stays). Sorting the vocabulary is the costly part and a nucleus is most often small
    (docs/measurements.md), so a row whose TOP_P_CANDIDATES already hold mass p is settled there, exactly."""
    n, vocab = probs.shape
    drop = torch.ones_like(probs, dtype=torch.bool)
    pending = torch.arange(n, device=probs.device)
    for k in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        top, top_idx = _take(probs, pending).topk(k, dim=1)  # most likely first: a sort when k is the vocabulary
        before = top.cumsum(dim=1) - top
        keep = before < _take(p, pending)
        keep[:, 0] = True
        settled = (before[:, -1] + top[:, -1] >= _take(p, pending)[:, 0]) | (k == vocab)
        if bool(settled.all()):
            if len(pending) == n:
                return drop.scatter_(1, top_idx, ~keep)  # past the candidates: dropped
            drop[pending] = drop[pending].scatter_(1, top_idx, ~keep)
            break
        done = pending[settled]
        drop[done] = drop[done].scatter_(1, top_idx[settled], ~keep[settled])
        pending = pending[~settled]
    return drop


CDF_CHUNK = 256  # vocabulary entries per chunk of the two-level cumulative sum in invert_cdf


def exp_and_invert(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """shifted_exp then invert_cdf, in one C++ call where it is built (the same tokens to an ulp of a chunk's sum),
    else the two in torch, whose many small calls' dispatch made a sampled row cost several greedy ones
    (docs/measurements.md, "A sampled row's draw, in one C++ call")."""
    if (ext := _native(probs)) is not None:  # a build is keyed by its source: this one has draw_rows
        return ext.draw_rows(probs, uniform)
    return invert_cdf(shifted_exp(probs), uniform)


EXP_FLOOR = -87.0  # float32's exp underflows below about this; torch's exp_ takes a slow path there


def shifted_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x - each row's max) in place, exactly 0 where x is -inf (a token a filter dropped: never drawn); what
    lies below EXP_FLOOR is taken at the floor (docs/measurements.md)."""
    if (ext := _native(x)) is not None:
        return ext.exp_shifted_rows(x)
    dropped = x == float("-inf")
    return x.sub_(x.amax(dim=1, keepdim=True)).clamp_(min=EXP_FLOOR).exp_().masked_fill_(dropped, 0.0)


def most_likely(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first of equal maxima (the first NaN) as argmax gives it: in C++ where it is built
    (float32 on a CPU), else by max(dim=1), which is faster than argmax on a CPU (docs/measurements.md, "The sampler,
    again: fresh 6 MB tensors")."""
    if logits.shape[0] and (ext := _native(logits)) is not None:
        return ext.argmax_rows(logits)
    return logits.max(dim=1).indices


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u x the row's total: token i with
    probability p_i. A token of probability 0 (a filter removed it) adds no width, so no u lands on it.

    Two levels, for speed and for precision: a float32 running sum over 49k probabilities would misplace the
    tail's boundaries by up to ~1e-3 of mass, and a cumulative sum over every entry is the slow part. So the
    chunks' masses are accumulated in float64 to pick a chunk, and only that chunk gets a running sum."""
    n, vocab = probs.shape
    chunks = -(-vocab // CDF_CHUNK)
    if vocab % CDF_CHUNK:
        probs = torch.nn.functional.pad(probs, (0, chunks * CDF_CHUNK - vocab))
    blocks = probs.view(n, chunks, CDF_CHUNK)
    mass = blocks.sum(dim=2).double()  # float32 sums of CDF_CHUNK (pairwise: exact to a few ulps)
    outer = mass.cumsum(dim=1)
    target = uniform * outer[:, -1:]
    chunk = torch.searchsorted(outer, target, right=True).clamp_(max=chunks - 1)
    rows = torch.arange(n, device=probs.device)
    inner = blocks[rows, chunk.flatten()].cumsum(dim=1)  # (n, CDF_CHUNK), float32
    before = torch.where(chunk > 0, outer.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(target))
    chunk_mass = mass[rows, chunk.flatten()].unsqueeze(1)
    # where u falls inside the chunk, on the scale of the chunk's own running sum
    rest = ((target - before) / chunk_mass * inner[:, -1:].double()).float()
    token = torch.searchsorted(inner, rest.contiguous(), right=True)
    # a rest rounded up to the chunk's whole mass falls past its last token; the last one with mass is meant
    token = torch.minimum(token, torch.searchsorted(inner, inner[:, -1:].contiguous(), right=False))
    return (chunk * CDF_CHUNK + token).flatten()
