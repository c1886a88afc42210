"""Speculative decoding with n-gram prompt lookup: greedy output unchanged, sampled output distributed exactly
as the target model's, drafts rolled back without leaking a block, stops honoured inside an accepted run."""
from __future__ import annotations

import pytest
import torch

import engine.scheduler as scheduler_module
from engine import LLM, SamplingParams
from engine.spec import SpecDecodeStats, adaptive_k, propose_ngram, verify
from tests.conftest import assert_all_blocks_free
from tests.test_features import engine_like, run
from tests.test_parity import TEXT_PROMPTS, random_prompts

SPEC = dict(speculative_decoding=True)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return LLM(tiny_models["llama"][0], max_model_len=512)


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase: the n-gram proposer always has something to propose."""
    return [(p[:7] * 6)[:40] for p in random_prompts(n, seed=seed)]


# ---- the proposer and the rule -------------------------------------------------------------------------
def test_propose_ngram_takes_the_most_recent_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [7, 8]  # "2 3" last occurred before 7 8 (the most recent)
    assert propose_ngram(tokens, 4, 1, 3) == [7, 8, 5, 2]
    assert propose_ngram([4, 5, 6, 4, 5], 3, 2, 2) == [6, 4, 5]
    assert propose_ngram([4, 5, 6, 4, 5], 3, 3, 3) == []  # no earlier "6 4 5"... only n >= 3 allowed
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []
    assert propose_ngram([7, 7, 7, 7], 3, 1, 2) == [7]  # what followed the latest "7 7" before the end
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == []


def test_adaptive_k_shrinks_with_the_batch_and_stops():
    assert [adaptive_k(4, b, 16) for b in range(1, 11)] == [4, 4, 4, 3, 2, 1, 1, 1, 0, 0]
    assert adaptive_k(4, 0, 16) == 4


def test_spec_stats_count_like_vllm():
    stats = SpecDecodeStats()
    stats.record(4, 3)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 3)
    assert stats.accepted_per_position == [1, 1, 1, 0] and stats.acceptance_rate == 0.5


# ---- greedy output is unchanged ----------------------------------------------------------------------
def test_greedy_output_is_identical_with_speculation(tiny):
    prompts = repetitive_prompts(4, seed=1) + random_prompts(4, seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = run(engine_like(tiny), prompts, params)
    engine = engine_like(tiny, **SPEC)
    assert run(engine, prompts, params) == expected
    spec = engine.snapshot().speculation
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    assert sum(e.num_drafts for s in engine.steps for e in s.verifies) == spec["num_draft_tokens"]


@pytest.mark.slow
def test_default_model_copies_with_speculation(default_llm):
    """A prompt whose answer copies from it: drafts are accepted, tokens identical to plain decoding."""
    text = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
            "step. All that glitters is not gold.")
    prompts = [default_llm.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {text}"}])]
    prompts += [default_llm.tokenizer(p).input_ids for p in TEXT_PROMPTS[:2]]
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = run(engine_like(default_llm, max_model_len=256), prompts, params)
    engine = engine_like(default_llm, max_model_len=256, **SPEC)
    assert run(engine, prompts, params) == expected
    spec = engine.snapshot().speculation
    assert spec["num_accepted_tokens"] >= 8 and spec["acceptance_rate"] > 0.3
    assert any(e.num_new_tokens > 1 for s in engine.steps for e in s.verifies)  # several tokens in one step


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 6])
def test_max_tokens_is_never_exceeded(tiny, max_tokens):
    prompts = repetitive_prompts(3, seed=3)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = run(engine_like(tiny), prompts, params)
    assert run(engine_like(tiny, **SPEC), prompts, params) == expected
    assert all(len(t) == max_tokens for t in expected)


def oracle(monkeypatch, references: dict[tuple, list[int]]) -> None:
    """Replace the n-gram proposer by one that proposes each request's true greedy continuation, so every
    step verifies (and accepts) k drafts: stops then fall inside accepted runs."""
    def propose(token_ids, k, min_n, max_n):
        for prompt, continuation in references.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return continuation[done:done + k]
        return []
    monkeypatch.setattr(scheduler_module, "propose_ngram", propose)


def test_stop_token_and_eos_inside_an_accepted_run(tiny, monkeypatch):
    prompts = random_prompts(3, seed=4)
    free = run(engine_like(tiny), prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    oracle(monkeypatch, {tuple(p): out for p, out in zip(prompts, free)})
    for i, out in enumerate(free):
        stop = out[5 + i]  # a token in the middle of the output, so in the middle of a drafted run
        expected = out[:out.index(stop) + 1]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
        engine = engine_like(tiny, **SPEC, num_speculative_tokens=6)
        assert run(engine, [prompts[i]], params) == [expected]
        assert engine.snapshot().speculation["acceptance_rate"] == 1.0
    # EOS: make the tiny model's eos id the token at position 7 of the first output
    engine = engine_like(tiny, **SPEC, num_speculative_tokens=6)
    engine.output.eos_token_ids = {free[0][7]}
    (got,) = run(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=30))
    assert got == free[0][:free[0].index(free[0][7]) + 1]


@pytest.mark.slow
def test_stop_string_inside_an_accepted_run(default_llm, monkeypatch):
    prompt = default_llm.tokenizer(TEXT_PROMPTS[0]).input_ids
    free_engine = engine_like(default_llm, max_model_len=256)
    (free,) = run(free_engine, [prompt], SamplingParams(temperature=0, max_tokens=24))
    text = default_llm.tokenizer.decode(free)
    stop = text.split()[4]  # a word in the middle of the reply
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    rid = free_engine.add_request(prompt, params)
    expected = None
    while free_engine.has_unfinished():
        expected = next((o for o in free_engine.step() if o.request_id == rid and o.finished), expected)
    oracle(monkeypatch, {tuple(prompt): free})
    engine = engine_like(default_llm, max_model_len=256, **SPEC)
    rid = engine.add_request(prompt, params)
    got = None
    while engine.has_unfinished():
        got = next((o for o in engine.step() if o.request_id == rid and o.finished), got)
    assert got.text == expected.text and stop not in got.text and got.finish_reason == "stop"
    assert got.token_ids == expected.token_ids
    assert_all_blocks_free(engine)


def test_speculation_under_preemption_and_prefix_caching(tiny):
    prefix = repetitive_prompts(1, seed=5)[0]
    prompts = [prefix + p[:6] for p in random_prompts(6, seed=6)] + repetitive_prompts(3, seed=7)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = run(engine_like(tiny, prefix_caching=False), prompts, params)
    engine = engine_like(tiny, block_size=4, num_kv_blocks=48, max_num_seqs=6, **SPEC)
    assert run(engine, prompts, params) == expected  # run() also checks every block is free at the end
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_cache_hits > 0
    assert engine.snapshot().speculation["num_accepted_tokens"] > 0


def test_rejected_drafts_give_their_blocks_back(tiny, monkeypatch):
    """Drafts that are always wrong: every step allocates slots for k drafts, then rolls them back."""
    monkeypatch.setattr(scheduler_module, "propose_ngram", lambda token_ids, k, *_: [3] * k)
    engine = engine_like(tiny, block_size=2, **SPEC, num_speculative_tokens=6)
    prompt = random_prompts(1, seed=8)[0]
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        req = engine.requests.get(rid)
        if req is not None:  # exactly the blocks its computed tokens need, never the drafts' extra blocks
            assert len(engine.kv.block_ids(req)) == -(-req.num_computed_tokens // 2)
            assert engine.kv.stats().kv_blocks_used == len(engine.kv.block_ids(req))
    assert_all_blocks_free(engine)
    assert engine.spec_stats.num_draft_tokens > 0


def test_speculation_backs_off_as_the_batch_grows(tiny):
    engine = engine_like(tiny, **SPEC, max_num_seqs=32)
    for p in repetitive_prompts(12, seed=9):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(20):  # the prompts' chunks first (the step's token budget), then everyone decodes
        engine.step()
        if len(engine.steps[-1].decodes) == 12:
            break
    # 12 decoding requests: above the budget's 8, no drafts
    assert len(engine.steps[-1].decodes) == 12 and not engine.steps[-1].verifies
    assert engine.snapshot().speculation["k"] == 0
    assert "none above 8" in engine.snapshot().speculation["rule"]
    run(engine, [])


# ---- sampling keeps the target distribution ---------------------------------------------------------
def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test (categories with expected count >= 5)."""
    keep = expected >= 5
    obs, exp = observed[keep].double(), expected[keep].double()
    obs = torch.cat([obs, (observed[~keep].sum()).double().view(1)])
    exp = torch.cat([exp, (expected[~keep].sum()).double().view(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(exp) - 1), dtype=torch.double)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.slow
def test_rejection_sampling_keeps_the_target_distribution():
    """Whatever the draft, the first token verify() emits is distributed as p; the second, given that the
    first draft was accepted, as the next row's p."""
    torch.manual_seed(0)
    vocab, n = 12, 10000
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=10)
    from engine.sampler_ops import filter_logits
    probs = filter_logits(logits, torch.full((3,), 0.8), torch.full((3,), 10), torch.ones(3),
                          torch.zeros(3)).softmax(dim=1)
    drafts = [int(probs[0].argmax()), int(probs[1].argsort()[-3])]  # a likely and an unlikely draft
    gen = torch.Generator().manual_seed(1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(n):
        out = verify(logits, drafts, params, gen)
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:  # accepted (a rejection never re-draws the draft)
            second[out[1]] += 1
    assert chi_square_p_value(first, probs[0] * n) > 1e-3
    assert chi_square_p_value(second, probs[1] * second.sum()) > 1e-3
    assert first[probs[0] == 0].sum() == 0  # filtered tokens (top-k) never appear


@pytest.mark.slow
def test_sampled_engine_output_has_the_same_distribution_with_speculation(tiny, monkeypatch):
    """Three sampled tokens of many seeded requests, with speculation on and off, follow the same law. The
    drafts are the greedy continuation: accepted when the sample follows it, rejected otherwise."""
    prompt = repetitive_prompts(1, seed=10)[0]
    (greedy,) = run(engine_like(tiny), [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    oracle(monkeypatch, {tuple(prompt): greedy})
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s) for s in range(900)]
    counts = {}
    for spec in (False, True):
        engine = engine_like(tiny, speculative_decoding=spec, speculative_token_budget=4096, max_num_seqs=900,
                             num_kv_blocks=2048)
        for p in params:
            engine.add_request(prompt, p)
        triples = []
        while engine.has_unfinished():
            triples += [tuple(o.token_ids) for o in engine.step() if o.finished]
        counts[spec] = triples
        assert_all_blocks_free(engine)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths were taken
    keys = sorted(set(counts[False]) | set(counts[True]))
    off = torch.tensor([counts[False].count(k) for k in keys], dtype=torch.double)
    on = torch.tensor([counts[True].count(k) for k in keys], dtype=torch.double)
    # chi-square test of homogeneity (two samples of equal size): pooled expectation per category
    pooled = (off + on) / 2
    keep = pooled >= 5
    stat = (((off - pooled) ** 2 + (on - pooled) ** 2) / pooled)[keep].sum()
    df = torch.tensor(float(int(keep.sum()) - 1), dtype=torch.double)
    assert df >= 5 and float(torch.special.gammaincc(df / 2, stat / 2)) > 1e-3
