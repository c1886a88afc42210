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

    def plain(self, vocab: int) -> bool:
        """Sampling from the model's own distribution: temperature 1 and no filter on (filter_logits' rule for
        which settings turn a filter off)."""
        return self.temperature == 1 and not 0 < self.top_k < vocab and self.top_p >= 1 and self.min_p <= 0


def _real(x) -> bool:
    """A finite int or float, not a bool (True is an int to Python, but never a temperature)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """Scale by temperature and mask (to -inf) what top-k / top-p / min-p exclude. Rows: requests.

    top_k <= 0 (or >= the vocabulary) disables top-k for that row; top_p = 1 and min_p = 0 disable the others.
    Each filter judges the tempered distribution as it is, and a token stays when every filter keeps it (an
    intersection). Only what a row asks for is computed: no filter, no sort. On a CPU with the engine's C++ module
    built, each row in C++ (cpu_kernels.cpp, filter_rows: the likely candidates gathered in one pass and only they
    sorted; a tie at a boundary goes to the lower token id). Otherwise torch's calls: top-k by `topk` (exactly k
    kept, a tie at the boundary broken by topk's order); top-p first among the few most likely (_top_p_drop);
    min-p needs the softmax and its maximum only. `in_place`: `logits` is the caller's own copy, scaled and masked where
    it is (an allocation of 6 MB less per step at 32 rows); rows at temperature 1 are not divided at all.
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
    None (torch's calls: the same tokens kept, ties at a boundary aside)."""
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
    that crosses p stays). Sorting 49k entries is the costly part, and a nucleus is most often small (SmolLM2
    chatting at temperature 1: the 256 most likely hold 0.9 of the mass in 92% of steps, the 4,096 most likely
    in all). So the most likely TOP_P_CANDIDATES come first (`topk`); a row whose candidates already hold mass p
    is settled by them exactly as a full sort would settle it (every token past them has at least that mass
    before it), and only the rows still short look further, the last ones at the whole sorted row."""
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


def processed_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The rows as the sampler draws from them (float32 once any row samples): greedy rows as they are, the others
    scaled by their temperature and filtered. Both the draw and the logprobs read these, so a logprob is that of
    the draw."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return logits  # argmax reads them as they are: float32 changes no comparison
    source, logits = logits, logits.float()
    every = len(rows) == len(params)
    if all(params[i].plain(logits.shape[1]) for i in rows):  # nothing to scale or mask, only a copy to give
        return logits.clone() if logits.data_ptr() == source.data_ptr() else logits  # (the draw writes in it)
    dev = logits.device
    filtered = filter_logits(
        logits if every else logits[rows],
        torch.tensor([params[i].temperature for i in rows], device=dev, dtype=torch.float32),
        torch.tensor([params[i].top_k for i in rows], device=dev),
        torch.tensor([params[i].top_p for i in rows], device=dev, dtype=torch.float32),
        torch.tensor([params[i].min_p for i in rows], device=dev, dtype=torch.float32),
        # a copy of the rows, or the float32 copy of bf16 logits: scaled where it is; the caller's float32 logits
        # (its logprobs read them) never
        in_place=not every or logits.data_ptr() != source.data_ptr(),
    )
    if every:
        return filtered
    out = logits.clone() if logits.data_ptr() == source.data_ptr() else logits  # the caller's stays as it was
    out[rows] = filtered
    return out


CDF_CHUNK = 256  # vocabulary entries per chunk of the two-level cumulative sum in draw()


def draw(processed: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of processed logits. Greedy rows take the argmax; the rest draw from their distribution,
    all at once, by inverting its cumulative sum at one uniform number per row (binary searches, no loop over the
    vocabulary in Python). `processed` is the caller's to give away (processed_logits' output): a sampled batch
    overwrites it. Each generator draws the numbers of its own rows only, one per row per step, so a
    seeded request's tokens do not depend on what else is in the batch."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return most_likely(processed).tolist()
    out = [0] * len(params)
    if greedy := [i for i, p in enumerate(params) if p.greedy]:
        for i, token in zip(greedy, most_likely(processed[greedy]).tolist()):
            out[i] = token
    # each sampled row's probabilities up to a scale of its own, which is all the inversion needs: exp(x - max) in
    # place, without softmax's division or its new tensor, whose fresh 6 MB's page faults cost most of softmax's
    # time at 32 rows (docs/measurements.md, "The sampler, again: fresh 6 MB tensors")
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
    for i, token in zip(rows, _exp_and_invert(probs, uniform).tolist()):
        out[i] = token
    return out


def _exp_and_invert(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """shifted_exp then invert_cdf, in one C++ call where it is built (cpu_kernels.cpp, draw_rows: a row a task, the
    same tokens to an ulp of a chunk's sum), else the two in torch. The torch way is ~15 calls on small tensors,
    whose dispatch, not their arithmetic, made a sampled row at batch 1 several times greedy's cost; the one call
    pays at one row and at a few, and is even at 32 (docs/measurements.md, "A sampled row's draw, in one C++
    call")."""
    if (ext := _native(probs)) is not None:  # a build is keyed by its source: this one has draw_rows
        return ext.draw_rows(probs, uniform)
    return invert_cdf(shifted_exp(probs), uniform)


EXP_FLOOR = -87.0  # float32's exp underflows below about this; torch's exp_ takes a slow path there


def shifted_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x - each row's max) in place, exactly 0 where x is -inf (a token a filter dropped: never drawn). torch's
    exp_ takes a slow path below ~-87 (a filtered row's -inf; a low temperature's far tail; docs/measurements.md, "A
    decode step's own work, then the sampler's rows in C++"), so what lies below is taken at the floor, ~1e-38 of the
    top token's mass, where the float would underflow anyway."""
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
    tail's boundaries by up to ~1e-3 of mass, and a cumulative sum over every entry is the slow part. So the row
    is cut into chunks of CDF_CHUNK; the chunks' masses (a vectorized sum) are accumulated in float64 to pick the
    chunk, and only the picked chunk gets a running sum, each boundary in it off by at most an ulp of its mass."""
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
