"""Sampling: exact support of top-k / top-p / min-p, temperature, greedy rows, and seeded reproducibility.

The crafted vectors have probabilities far from every threshold used, so each expected kept set below is
computed by hand and does not depend on rounding.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, sampler_ops
from engine.sampler import sample
from engine.sampler_ops import filter_logits, invert_cdf
from tests.conftest import assert_all_blocks_free

NEG_INF = float("-inf")

# A: probabilities 0.5, 0.25, 0.15, 0.1 on tokens 2, 0, 3, 1 (not in sorted order, so the scatter back is tested)
A_PROBS = {2: 0.5, 0: 0.25, 3: 0.15, 1: 0.1}
A = [math.log(A_PROBS[i]) for i in range(4)]
# B: logits 0..5, softmax = 0.634, 0.233, 0.0858, 0.0316, 0.0116, 0.0043 on tokens 5, 4, 3, 2, 1, 0
B = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
ALL_A = {0, 1, 2, 3}


def kept(logits: list[float], temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> set[int]:
    out = filter_logits(torch.tensor([logits]), torch.tensor([float(temperature)]), torch.tensor([top_k]),
                        torch.tensor([float(top_p)]), torch.tensor([float(min_p)]))
    return set(torch.isfinite(out[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize("top_k,expected", [(1, {2}), (2, {2, 0}), (3, {2, 0, 3}), (4, ALL_A), (10, ALL_A),
                                            (-1, ALL_A)])
def test_top_k_keeps_the_k_most_likely(top_k, expected):
    assert kept(A, top_k=top_k) == expected


@pytest.mark.parametrize("top_p,expected", [
    (0.01, {2}),  # the most likely token always survives
    (0.4, {2}),  # mass before token 0 is 0.5 >= 0.4
    (0.6, {2, 0}),  # 0.5 < 0.6, then 0.75 >= 0.6: the token that crosses p stays
    (0.8, {2, 0, 3}),  # 0.75 < 0.8 <= 0.9
    (0.95, ALL_A),
    (1.0, ALL_A),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    assert kept(A, top_p=top_p) == expected


@pytest.mark.parametrize("min_p,expected", [
    (1.0, {2}),  # only tokens as likely as the top one
    (0.6, {2}),  # threshold 0.30
    (0.4, {2, 0}),  # threshold 0.20
    (0.25, {2, 0, 3}),  # threshold 0.125
    (0.1, ALL_A),  # threshold 0.05
    (0.0, ALL_A),
])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability(min_p, expected):
    assert kept(A, min_p=min_p) == expected


@pytest.mark.parametrize("params,expected", [
    (dict(top_k=3, top_p=0.6), {2, 0}),
    (dict(top_k=2, min_p=0.1), {2, 0}),
    (dict(top_k=3, top_p=0.95, min_p=0.25), {2, 0, 3}),
    (dict(top_k=1, top_p=1.0, min_p=0.0), {2}),
    (dict(top_p=0.8, min_p=0.4), {2, 0}),
])
def test_filters_combine_as_an_intersection(params, expected):
    assert kept(A, **params) == expected


@pytest.mark.parametrize("temperature,expected", [
    (1.0, {2, 0}),  # mass before token 3: 0.75 >= 0.7
    (0.5, {2}),  # probs ~ p^2: 0.725, 0.181, ...: 0.725 >= 0.7 already
    (2.0, {2, 0, 3}),  # probs ~ sqrt(p): 0.370, 0.262, 0.203, 0.166: mass before token 1 is 0.835
])
def test_top_p_applies_to_the_tempered_distribution(temperature, expected):
    assert kept(A, temperature=temperature, top_p=0.7) == expected


def test_temperature_scales_the_kept_logits():
    logits = torch.tensor([B, B, B])
    temps = torch.tensor([1.0, 0.5, 4.0])
    out = filter_logits(logits, temps, torch.tensor([-1, -1, -1]), torch.ones(3), torch.zeros(3))
    assert torch.allclose(out, logits / temps.unsqueeze(1))
    # the tempered distribution sharpens below 1 and flattens above it
    probs = out.softmax(dim=1)
    assert probs[1, 5] > probs[0, 5] > probs[2, 5]
    assert torch.allclose(probs[2], torch.softmax(torch.tensor(B) / 4, dim=0))


def test_kept_logits_are_unchanged_and_the_rest_are_minus_inf():
    out = filter_logits(torch.tensor([A]), torch.tensor([1.0]), torch.tensor([2]), torch.ones(1), torch.zeros(1))[0]
    for i in range(4):
        assert out[i].item() == (pytest.approx(A[i]) if i in (2, 0) else NEG_INF)


def test_per_row_parameters_in_one_batch():
    pad = [NEG_INF, NEG_INF]  # A has 4 tokens, B has 6: a logit already at -inf stays out
    rows = [  # (logits, temperature, top_k, top_p, min_p, expected kept set)
        (A + pad, 1.0, -1, 1.0, 0.0, ALL_A),
        (A + pad, 1.0, 2, 1.0, 0.0, {2, 0}),
        (B, 1.0, -1, 0.9, 0.0, {5, 4, 3}),  # mass before token 2: 0.953 >= 0.9
        (B, 1.0, -1, 1.0, 0.04, {5, 4, 3, 2}),  # threshold 0.0254
        (A + pad, 0.5, -1, 0.7, 0.0, {2}),
        (A + pad, 2.0, -1, 0.7, 0.0, {2, 0, 3}),
        (B, 1.0, 2, 1.0, 0.0, {5, 4}),
        (B, 1.0, -1, 1.0, 0.0, set(range(6))),
        (B, 1.0, 4, 0.99, 0.1, {5, 4, 3}),  # min_p threshold 0.0634 drops token 2
    ]
    out = filter_logits(torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                        torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]),
                        torch.tensor([r[4] for r in rows]))
    for i, row in enumerate(rows):
        assert set(torch.isfinite(out[i]).nonzero().flatten().tolist()) == row[5], f"row {i}"
        # each row's result is what it would be alone: rows do not leak into each other
        assert torch.equal(out[i], filter_logits(torch.tensor([row[0]]), torch.tensor([row[1]]), torch.tensor([row[2]]),
                                                 torch.tensor([row[3]]), torch.tensor([row[4]]))[0])


def test_top_p_one_and_min_p_zero_keep_every_finite_token():
    """Disabled filters keep the whole support, even tokens whose probability is far below float precision."""
    assert kept([10.0, 0.0, -30.0, -60.0]) == {0, 1, 2, 3}
    torch.manual_seed(0)
    logits = torch.randn(4, 49152) * 3
    out = filter_logits(logits, torch.ones(4), torch.full((4,), -1), torch.ones(4), torch.zeros(4))
    assert torch.isfinite(out).all()
    assert torch.equal(out, logits)


def test_ties_at_the_top_k_boundary_keep_exactly_k():
    assert len(kept([1.0, 3.0, 3.0, 3.0, 0.0], top_k=2)) == 2
    assert kept([1.0, 3.0, 3.0, 3.0, 0.0], top_k=2) <= {1, 2, 3}


# ---- sample() -----------------------------------------------------------------------------------------

def test_greedy_rows_take_the_argmax():
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0, top_k=5, top_p=0.2), SamplingParams(temperature=0.9),
              SamplingParams(temperature=0)]
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    out = sample(logits, params, gens)
    argmax = logits.argmax(dim=1).tolist()
    for i in (0, 1, 2, 4):
        assert out[i] == argmax[i]
    assert 0 <= out[3] < 300
    # an all-greedy batch needs no generator and draws nothing
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    assert sample(logits, [SamplingParams(temperature=0)] * 5, [g] * 5) == argmax
    assert torch.equal(g.get_state(), state)


def test_greedy_takes_the_first_of_equal_maxima_as_argmax_does():
    from engine.sampler_ops import most_likely
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(4, 49152, dtype=dtype)
        logits[0, [7, 300, 40000]] = 5  # ties, far apart (a vectorized reduction splits the row)
        logits[1, 49151] = 1
        logits[2, [0, 1]] = -1  # the maxima are the zeros after them
        logits[3, 12345] = float("nan")  # a NaN wins, as it does for argmax
        assert most_likely(logits).tolist() == logits.argmax(dim=1).tolist() == [7, 49151, 2, 12345]
        assert sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4) == [7, 49151, 2, 12345]


def test_greedy_sample_accepts_half_precision_logits():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]], dtype=torch.float16)
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [None, None]) == [1, 0]


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    torch.manual_seed(2)
    row, others = torch.randn(1, 500), torch.randn(3, 500)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    for k in range(20):
        g = torch.Generator().manual_seed(5)
        alone = sample(row, [p], [g])
        batch = torch.cat([others[:2], row, others[2:]])
        mixed = sample(batch, [SamplingParams(temperature=1.0), SamplingParams(temperature=0), p,
                               SamplingParams(temperature=0.5, top_k=3)],
                       [torch.Generator().manual_seed(100 + k), None, torch.Generator().manual_seed(5),
                        torch.Generator().manual_seed(200 + k)])
        assert mixed[2] == alone[0]


def _support_and_probs(logits: list[float], **params) -> tuple[set[int], dict[int, float]]:
    p = SamplingParams(**params)
    out = filter_logits(torch.tensor([logits]), torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                        torch.tensor([p.top_p]), torch.tensor([p.min_p]))[0]
    probs = out.softmax(dim=0)
    support = set(torch.isfinite(out).nonzero().flatten().tolist())
    return support, {i: probs[i].item() for i in support}


@pytest.mark.parametrize("params,expected_support", [
    (dict(temperature=1.0, top_k=3), {5, 4, 3}),
    (dict(temperature=1.0, top_p=0.9), {5, 4, 3}),
    (dict(temperature=1.5, min_p=0.2), {5, 4, 3}),  # tempered: 0.50, 0.26, 0.13, 0.07 ... threshold 0.10
    (dict(temperature=3.0, top_k=5, top_p=0.8), {5, 4, 3, 2}),  # 0.33, 0.23, 0.17, 0.12: 0.85 before token 1
])
def test_draws_never_leave_the_support_and_follow_its_distribution(params, expected_support):
    support, probs = _support_and_probs(B, **params)
    assert support == expected_support
    n = 2000
    g = torch.Generator().manual_seed(1234)
    draws = sample(torch.tensor([B] * n), [SamplingParams(**params)] * n, [g] * n)
    counts = Counter(draws)
    assert set(counts) == support, "a token outside the support was drawn, or one inside never was"
    for tok, p in probs.items():  # seeded, so deterministic; 5 sigma of slack
        assert abs(counts[tok] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3, (tok, counts[tok] / n, p)


def test_draws_stay_in_a_large_vocabulary_support():
    torch.manual_seed(3)
    logits = torch.randn(1, 5000) * 2
    p = SamplingParams(temperature=0.7, top_k=200, top_p=0.5, min_p=0.05)
    out = filter_logits(logits, torch.tensor([0.7]), torch.tensor([200]), torch.tensor([0.5]), torch.tensor([0.05]))
    support = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    assert 1 < len(support) <= 200
    assert support <= set(logits[0].topk(200).indices.tolist())
    g = torch.Generator().manual_seed(9)
    draws = sample(logits.expand(2000, -1), [p] * 2000, [g] * 2000)
    assert set(draws) <= support and len(set(draws)) > 1


# ---- the sampler's fast paths: the same answers as the plain way, without its work ---------------------

def reference_filter(logits, temperature, top_k, top_p, min_p):
    """The plain way, one full sort per row: what every fast path must agree with."""
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).unsqueeze(1)
    probs = sorted_logits.softmax(dim=1)
    drop |= ((probs.cumsum(dim=1) - probs) >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits.masked_fill(drop, NEG_INF))


def use_native(monkeypatch, native: bool) -> None:
    """The C++ rows (asserted built: make install builds them), or torch's calls as without them."""
    if native:
        assert sampler_ops._native(torch.zeros(1, 2)) is not None, "the engine's C++ CPU kernels did not build"
    else:
        monkeypatch.setattr(sampler_ops, "_native", lambda logits: None)


@pytest.mark.parametrize("native,candidates", [(True, (256, 4096)), (False, (256, 4096)), (False, (4, 16)),
                                               (False, (1,)), (False, ())])
@pytest.mark.usefixtures("two_threads")
def test_fast_filters_agree_with_one_full_sort_per_row(monkeypatch, native, candidates):
    """Random batches of random settings, peaked and flat rows: with few candidates most rows look further, some
    to the whole sorted row, so every tier of top-p and every row mix (all rows, some rows) is crossed; in C++,
    both the candidates' path and the exponent buckets' (flat rows, k past the candidates, p near 1)."""
    use_native(monkeypatch, native)
    monkeypatch.setattr(sampler_ops, "TOP_P_CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(11)
    for trial in range(48):
        n, vocab = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(2, 700, (1,), generator=gen))
        if trial >= 40:  # the model's vocabulary
            n, vocab = 4, 49152
        sharpness = torch.rand(n, 1, generator=gen) * 8
        logits = torch.randn(n, vocab, generator=gen) * sharpness
        temperature = torch.rand(n, generator=gen) * 1.5 + 0.1
        top_k = torch.where(torch.rand(n, generator=gen) < 0.5, torch.randint(1, vocab + 2, (n,), generator=gen), -1)
        top_p = torch.where(torch.rand(n, generator=gen) < 0.5, torch.rand(n, generator=gen), torch.ones(n))
        min_p = torch.where(torch.rand(n, generator=gen) < 0.3, torch.rand(n, generator=gen) * 0.5, torch.zeros(n))
        top_p = top_p.clamp(min=1e-3)
        got = filter_logits(logits, temperature, top_k, top_p, min_p)
        want = reference_filter(logits, temperature, top_k, top_p, min_p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"trial {trial}"
        assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_cpp_filters_break_ties_at_a_boundary_by_token_id_and_keep_exactly_k():
    """bf16 logits tie often: top-k keeps exactly k, the lowest ids among the tied; top-p keeps the tied tokens up to
    the one that crosses p, in id order; every tied maximum survives min-p 1."""
    assert sampler_ops._native(torch.zeros(1, 2)) is not None, "the engine's C++ CPU kernels did not build"
    logits = torch.full((3, 1000), -5.0)
    logits[:, [900, 10, 500, 70, 300]] = 2.0  # five tied maxima, far apart
    one = torch.ones(3)
    got = filter_logits(logits.clone(), one, torch.tensor([3, -1, -1]), torch.tensor([1.0, 0.5, 1.0]),
                        torch.tensor([0.0, 0.0, 1.0]))
    kept = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in got]
    assert kept[0] == {10, 70, 300}
    # each tied token holds ~0.2 of the mass: before the third it is ~0.4 < 0.5, so three stay
    assert kept[1] == {10, 70, 300}
    assert kept[2] == {10, 70, 300, 500, 900}


def test_cpp_argmax_takes_the_first_nan_and_the_first_of_equal_maxima():
    from engine.sampler_ops import most_likely
    assert sampler_ops._native(torch.zeros(1, 2)) is not None, "the engine's C++ CPU kernels did not build"
    logits = torch.zeros(3, 49157)  # not a multiple of 16: the scalar tail too
    logits[0, [49156, 3]] = 1.0
    logits[1, [20000, 5]] = float("nan")
    logits[2] = float("-inf")
    assert most_likely(logits).tolist() == [3, 5, 0] == logits.argmax(dim=1).tolist()


def test_no_sort_when_no_row_needs_one(monkeypatch):
    """Temperature alone, top-k, min-p, and a top-p whose nucleus lies among the first candidates: none sorts the
    vocabulary (the plain way sorted every sampled row every step)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the vocabulary was sorted")
    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    monkeypatch.setattr(torch, "sort", refuse)
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0))
    logits[:, :10] += 30  # a peaked distribution: ten tokens hold nearly all the mass, as a language model's do
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    for params in (dict(temperature=1.0), dict(temperature=0.7, top_k=50), dict(temperature=1.0, min_p=0.05),
                   dict(temperature=0.7, top_p=0.95), dict(temperature=1.0, top_k=40, top_p=0.9, min_p=0.01)):
        assert all(0 <= t < 10 for t in sample(logits, [SamplingParams(**params)] * 4, gens)), params


def invert(probs: torch.Tensor, uniform: torch.Tensor, native: bool) -> torch.Tensor:
    """invert_cdf over probs, or the C++ draw_rows (which takes the exp itself) over their logs."""
    if not native:
        return invert_cdf(probs, uniform)
    ext = sampler_ops._native(torch.zeros(1, 2))
    assert ext is not None, "the engine's C++ CPU kernels did not build"
    return ext.draw_rows(probs.log().contiguous(), uniform.contiguous())


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("vocab", [1, 7, 256, 300, 49152])
def test_inverting_the_cdf_lands_on_tokens_with_mass_only(vocab, native):
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.rand(3, vocab, generator=gen)
    probs[:, ::2] = 0  # every other token removed by a filter
    probs[:, vocab // 2] = 0.5  # one token always has mass
    probs /= probs.sum(dim=1, keepdim=True)
    first = (probs > 0).float().argmax(dim=1)
    last = vocab - 1 - (probs > 0).flip(1).float().argmax(dim=1)
    edges = torch.tensor([[0.0], [1 - 2 ** -53], [1 - 2 ** -53]], dtype=torch.float64)
    tokens = invert(probs, edges, native)
    assert tokens[0] == first[0] and tokens[1] == last[1] and tokens[2] == last[2]
    uniform = torch.rand(3, 1, dtype=torch.float64, generator=gen)
    for _ in range(200):
        uniform = torch.rand(3, 1, dtype=torch.float64, generator=gen)
        tokens = invert(probs, uniform, native)
        assert (probs[torch.arange(3), tokens] > 0).all()


@pytest.mark.parametrize("native", [False, True])
def test_inverting_the_cdf_draws_each_token_with_its_probability(native):
    """Chunk boundaries included (a vocabulary of 3 chunks and a bit): counts within 5 sigma of n x p."""
    probs = torch.zeros(1, 3 * 256 + 5)
    picks = {0: 0.3, 255: 0.2, 256: 0.1, 511: 0.15, 700: 0.05, 3 * 256 + 4: 0.2}
    for token, p in picks.items():
        probs[0, token] = p
    n = 20000
    tokens = invert(probs.expand(n, -1).contiguous(),
                    torch.rand(n, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5)), native)
    counts = Counter(tokens.tolist())
    assert set(counts) == set(picks)
    for token, p in picks.items():
        assert abs(counts[token] / n - p) < 5 * math.sqrt(p * (1 - p) / n), (token, counts[token] / n, p)


def test_cpp_draw_is_the_torch_draw():
    """draw_rows (exp and inversion in one C++ call) gives the tokens shifted_exp + invert_cdf give for the same
    numbers: random rows of many sizes and sharpnesses, some with nine tokens in ten filtered out. Its chunk sums
    may round an ulp apart from torch's, which could move a number landing on a boundary: at most 2 of 1,600."""
    from engine.sampler_ops import shifted_exp
    ext = sampler_ops._native(torch.zeros(1, 2))
    assert ext is not None, "the engine's C++ CPU kernels did not build"
    gen = torch.Generator().manual_seed(3)
    differ = 0
    for trial in range(200):
        vocab = (49152, 151936, 1000, 255, 256, 1)[trial % 6]
        logits = torch.randn(8, vocab, generator=gen) * float(torch.rand(1, generator=gen) * 8 + 0.1)
        if trial % 3 == 0:
            logits[torch.rand(8, vocab, generator=gen) < 0.9] = NEG_INF
            logits[:, 0] = 0.0
        uniform = torch.rand(8, 1, dtype=torch.float64, generator=gen)
        got = ext.draw_rows(logits.clone(), uniform)
        differ += int((got != invert_cdf(shifted_exp(logits.clone()), uniform)).sum())
    assert differ <= 2


def test_plain_sampling_gives_the_draw_a_copy_and_scales_nothing():
    """Temperature 1 and no filter: the processed rows are the logits' values in a tensor of the draw's own (it
    writes its exponentials there), never the caller's, which the logprobs read after."""
    from engine.sampler import processed_logits
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    plain = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=500), SamplingParams()]
    out = processed_logits(logits, plain)  # top_k = the vocabulary keeps everything
    assert out.data_ptr() != logits.data_ptr() and torch.equal(out, logits)
    half = processed_logits(logits.bfloat16(), plain)
    assert half.dtype == torch.float32 and torch.equal(half, logits.bfloat16().float())
    mixed = processed_logits(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 1 + [
        SamplingParams(temperature=0.5)])
    assert torch.equal(mixed[:2], logits[:2]) and torch.allclose(mixed[2], logits[2] / 0.5)


def test_a_seeded_row_draws_one_number_a_step_however_the_batch_is_made():
    """The batched draw still gives each seeded request its own stream: over 30 steps of changing batches (its
    row's place, its neighbours, greedy and unseeded rows sharing one generator) a seeded row's tokens are those it
    draws alone."""
    gen = torch.Generator().manual_seed(8)
    steps = [torch.randn(1, 3000, generator=gen) for _ in range(30)]
    p = SamplingParams(temperature=1.0, top_k=500, seed=3)
    alone_gen = torch.Generator().manual_seed(3)
    alone = [sample(row, [p], [alone_gen])[0] for row in steps]
    mixed_gen, shared = torch.Generator().manual_seed(3), torch.Generator().manual_seed(99)
    mixed = []
    for i, row in enumerate(steps):
        others = torch.randn(i % 5, 3000, generator=gen)
        place = i % (len(others) + 1)
        batch = torch.cat([others[:place], row, others[place:]])
        params = [SamplingParams(temperature=(0 if j % 2 else 0.9)) for j in range(len(others))]
        params.insert(place, p)
        gens = [shared] * len(others)
        gens.insert(place, mixed_gen)
        mixed.append(sample(batch, params, gens)[place])
    assert mixed == alone


# ---- seeded requests through the engine ---------------------------------------------------------------

SEEDED = dict(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True)
PROMPT = [345, 9876, 2222, 31000, 17, 4242, 808, 12000]
OTHERS = [[100 + i for i in range(n)] for n in (5, 11, 23, 3)]


@pytest.fixture(scope="module")
def llm(tiny_models):
    folder, _ = tiny_models["llama"]
    return LLM(folder, num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def alone(llm):
    out = llm.generate([PROMPT], SamplingParams(**SEEDED, seed=1234))[0]
    assert len(out.token_ids) == 24
    assert len(set(out.token_ids)) > 5, "the tiny model samples almost deterministically: the test would be weak"
    return out.token_ids


def test_same_seed_reproduces(llm, alone):
    again = llm.generate([PROMPT], SamplingParams(**SEEDED, seed=1234))[0].token_ids
    assert again == alone


def test_seeded_request_is_independent_of_its_batch(llm, alone):
    params = [SamplingParams(**SEEDED), SamplingParams(**SEEDED, seed=1234), SamplingParams(**SEEDED, seed=99),
              SamplingParams(temperature=0, max_tokens=10), SamplingParams(temperature=1.2, top_k=50, max_tokens=30)]
    outs = llm.generate([OTHERS[0], PROMPT, OTHERS[1], OTHERS[2], OTHERS[3]], params)
    assert outs[1].token_ids == alone
    assert outs[2].token_ids != alone


def test_seeded_request_joining_a_running_batch(llm, alone):
    eng = llm.engine
    others = [eng.add_request(p, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)) for p in OTHERS]
    for _ in range(3):
        eng.step()
    rid = eng.add_request(PROMPT, SamplingParams(**SEEDED, seed=1234))
    finals = {}
    while eng.has_unfinished():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert set(finals) == {rid, *others}
    assert finals[rid].token_ids == alone
    assert_all_blocks_free(eng)


def test_seeded_request_is_reproduced_through_preemption(llm, alone):
    """A tiny pool preempts and recomputes it: each generated token still takes one draw of its generator."""
    cfg = EngineConfig.from_kwargs(model=str(llm.model_path), dtype="float32", block_size=4, num_kv_blocks=12,
                                   max_num_seqs=4, max_model_len=256)
    eng = LLMEngine(cfg, llm.engine.model, llm.tokenizer, llm.engine.hf_config)
    rids = [eng.add_request(p, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)) for p in OTHERS[:2]]
    rid = eng.add_request(PROMPT, SamplingParams(**SEEDED, seed=1234))
    finals = {}
    while eng.has_unfinished():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.num_preemptions > 0
    assert set(finals) == {rid, *rids}
    assert finals[rid].token_ids == alone
    assert_all_blocks_free(eng)


def test_different_seeds_give_different_outputs(llm, alone):
    outs = llm.generate([PROMPT] * 4, [SamplingParams(**SEEDED, seed=s) for s in (1, 2, 3, 1234)])
    seqs = [tuple(o.token_ids) for o in outs]
    assert len(set(seqs[:3])) == 3 and alone not in [list(s) for s in seqs[:3]]
    assert list(seqs[3]) == alone


# ---- logprobs ------------------------------------------------------------------------------------------

def hf_logits_after(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits at each position that predicted a generated token: [len(generated), vocab]."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(generated)]


def test_greedy_logprobs_equal_transformers_log_softmax(tiny_models, llm):
    _, hf_model = tiny_models["llama"]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    expected = hf_logits_after(hf_model, PROMPT, out.token_ids).log_softmax(dim=1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == token and lp.logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
        values, ids = expected[i].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert lp.top[0][0] == token  # greedy: the chosen token is the most likely one
    assert out.logprobs[0].logprob != pytest.approx(out.logprobs[1].logprob, abs=1e-6)  # not one number repeated


def test_sampled_logprobs_are_the_models_own_before_temperature_and_filters(tiny_models, llm):
    """temperature 0.8 and top_k 3: the token is drawn from the three kept tokens, but its reported log
    probability, and the top 5's, are log_softmax of the model's own logits (vLLM's raw logprobs), in vLLM's
    form: a dict {token_id: logprob} holding the chosen token and the top ones."""
    _, hf_model = tiny_models["llama"]
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=6, seed=7, ignore_eos=True, logprobs=5)
    out = llm.generate([PROMPT], params)[0]
    logits = hf_logits_after(hf_model, PROMPT, out.token_ids)
    kept = logits.topk(3, dim=1).indices
    expected = logits.log_softmax(dim=1)
    values, ids = expected.topk(5, dim=1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token in kept[i].tolist()
        assert lp[token] == lp.logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ids[i].tolist()
        assert [v for _, v in lp.top] == pytest.approx(values[i].tolist(), abs=1e-4)
        assert set(lp) == {token, *ids[i].tolist()}
    assert NEG_INF not in [v for lp in out.logprobs for _, v in lp.top]  # no filter's -inf
    assert math.fsum(math.exp(v) for _, v in out.logprobs[0].top) < 1.0  # five of the whole vocabulary


def test_logprobs_only_when_asked(llm):
    none, zero = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                                logprobs=0)])
    assert none.logprobs is None
    assert len(zero.logprobs) == 3 and all(lp.top == () and lp.logprob <= 0 for lp in zero.logprobs)


def test_speculative_decoding_reports_the_same_logprobs(tiny_models, monkeypatch):
    """Verified drafts get the logprobs of the rows that verified them: the same numbers as without drafts, for
    accepted drafts and for the token that corrects a rejected one."""
    import engine.scheduler as scheduler_module
    folder, _ = tiny_models["llama"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    plain = LLM(folder, max_model_len=256).generate([PROMPT], params)[0]

    def propose(token_ids, k, min_n, max_n):  # the true continuation, its third draft wrong
        done = len(token_ids) - len(PROMPT)
        drafts = plain.token_ids[done:done + k]
        return drafts[:2] + [(t + 1) % 1000 for t in drafts[2:3]] + drafts[3:]
    monkeypatch.setattr(scheduler_module, "propose_ngram", propose)
    spec_llm = LLM(folder, max_model_len=256, speculative_decoding=True)
    spec = spec_llm.generate([PROMPT], params)[0]
    stats = spec_llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", True), ("temperature", float("inf")), ("top_p", float("nan")),
    ("min_p", True), ("top_k", 2.0), ("max_tokens", 1.5), ("seed", 2**64), ("seed", "1"), ("logprobs", 21),
    ("logprobs", -1), ("logprobs", True), ("stop", {"a": 1}), ("stop", [""]),
])
def test_bad_sampling_params_name_their_field(field, value):
    from engine.sampling_params import InvalidSamplingParam
    with pytest.raises(InvalidSamplingParam, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_a_vanishing_temperature_is_greedy(llm):
    """Dividing logits by 1e-40 would overflow to inf and NaN probabilities: such a temperature means greedy."""
    tiny = llm.generate([PROMPT], SamplingParams(temperature=1e-40, max_tokens=5, ignore_eos=True))[0]
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert tiny.token_ids == greedy.token_ids


@pytest.mark.parametrize("native", [True, False])
def test_the_draws_exponentials_are_zero_for_dropped_tokens_and_exp_elsewhere(monkeypatch, native):
    """exp(x - max) as the draw takes it: exactly 0 for a token a filter dropped (-inf), the float exp in range, and
    the far tail (where float32's exp underflows, and torch's exp_ is slow) at most the floor's ~1e-38."""
    use_native(monkeypatch, native)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 49157, generator=gen) * 3
    x[:, 1::11] = -500.0
    x[:, ::7] = float("-inf")
    x[:, 3] = 20.0  # a finite top in every row
    want = torch.exp(x - x.amax(dim=1, keepdim=True))
    got = sampler_ops.shifted_exp(x.clone())
    assert torch.equal(got[:, ::7], torch.zeros_like(got[:, ::7]))
    tail = x == -500.0
    assert (got[tail] <= 2e-38).all() and (got >= 0).all()
    normal = want > 1e-30
    torch.testing.assert_close(got[normal], want[normal], rtol=2e-6, atol=0)
