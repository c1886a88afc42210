"""Chunked prefill: a prompt longer than a step's token budget is computed over several steps, beside the
running decodes, with greedy output identical to an unchunked run and cached chunks skipped, not recomputed."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.reconfigure import Reconfiguration
from tests.conftest import assert_all_blocks_free
from tests.test_features import GREEDY, engine_like, run
from tests.test_parity import TEXT_PROMPTS, random_prompts


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return LLM(tiny_models["llama"][0], max_model_len=512)


def long_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [(p * (length // len(p) + 1))[:length] for p in random_prompts(n, seed=seed)]


def drain(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert_all_blocks_free(engine)
    return done


@pytest.mark.parametrize("budget", [16, 37, 100])
def test_greedy_output_is_identical_with_and_without_chunks(tiny, budget):
    prompts = long_prompts(3, 150, seed=1) + random_prompts(4, seed=2)
    expected = run(engine_like(tiny, chunked_prefill=False), prompts)
    engine = engine_like(tiny, max_num_batched_tokens=budget, block_size=8)
    assert run(engine, prompts) == expected
    steps = list(engine.steps)
    assert all(s.num_batched_tokens <= budget for s in steps)
    assert any(e.num_tokens < 150 and e.phase == "prefill" for s in steps for e in s.prefills)


@pytest.mark.slow
def test_default_model_chunked_prefill_matches_unchunked(default_llm):
    prompts = [default_llm.tokenizer(p).input_ids for p in TEXT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = run(engine_like(default_llm, chunked_prefill=False, max_model_len=256), prompts, params)
    engine = engine_like(default_llm, max_num_batched_tokens=16, max_model_len=256)
    assert run(engine, prompts, params) == expected


def test_decodes_go_first_and_a_long_prompt_is_chunked_beside_them(tiny):
    engine = engine_like(tiny, max_num_batched_tokens=32, block_size=8)
    chats = [engine.add_request(p[:6], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
             for p in random_prompts(4, seed=3)]  # short prompts: all four decode from the second step on
    for _ in range(3):
        engine.step()
    doc = engine.add_request(long_prompts(1, 200, seed=4)[0], GREEDY)
    chunks = []
    while (view := engine.snapshot().requests.get(doc)) is None or view.num_output_tokens == 0:
        engine.step()
        rec = engine.steps[-1]
        assert [e.request_id for e in rec.decodes] == chats  # every stream advances in every step
        (entry,) = rec.prefills
        chunks.append((entry.num_tokens, entry.num_computed_after))
        progress = engine.snapshot().requests[doc]
        assert (progress.num_computed_tokens, progress.num_prompt_tokens) == (entry.num_computed_after, 200)
    # 4 decodes leave 28 tokens: chunks end on block boundaries (24, then 24 ...) and the last is what is left
    assert chunks[0] == (24, 24) and all(n <= 28 for n, _ in chunks) and chunks[-1][1] == 200
    assert sum(n for n, _ in chunks) == 200
    drain(engine)


def test_a_warm_prefix_cache_skips_whole_chunks_counted_exactly(tiny):
    bs, budget = 8, 24
    prompt = long_prompts(1, 120, seed=5)[0]
    engine = engine_like(tiny, max_num_batched_tokens=budget, block_size=bs)
    cold = run(engine, [prompt])
    hits_before = engine.kv.prefix_cache_hits
    engine.add_request(prompt[:100] + [9, 9, 9], GREEDY)  # shares 12 full blocks (96 tokens)
    computed = []
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        computed += [(e.num_tokens, e.prefix_hit_tokens) for e in engine.steps[-1].prefills]
    assert computed[0] == (7, 96)  # only the 7 uncached prompt tokens are computed
    assert engine.kv.prefix_cache_hits - hits_before == 96
    assert run(engine, [prompt]) == cold


def test_identical_long_prompts_in_one_step_share_their_chunks(tiny):
    """Two users send the same long document: each chunk is computed once, by whichever request gets to it
    first; the other finds its blocks in the prefix cache and skips them."""
    bs = 8
    prompt = long_prompts(1, 160, seed=6)[0]
    expected = run(engine_like(tiny, chunked_prefill=False, prefix_caching=False), [prompt, prompt])
    engine = engine_like(tiny, max_num_batched_tokens=48, block_size=bs)
    ids = [engine.add_request(prompt, GREEDY) for _ in range(2)]
    computed = {rid: 0 for rid in ids}
    skipped = {rid: 0 for rid in ids}
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        for e in engine.steps[-1].prefills:
            computed[e.request_id] += e.num_tokens
            skipped[e.request_id] += e.prefix_hit_tokens
    assert [done[i] for i in ids] == expected
    assert sum(computed.values()) < 2 * 160 - 100  # most of the document was computed only once
    assert all(computed[i] + skipped[i] == 160 for i in ids)
    assert engine.kv.prefix_cache_hits == sum(skipped.values())
    assert_all_blocks_free(engine)


def test_preemption_in_the_middle_of_a_prefill(tiny):
    prompts = long_prompts(2, 96, seed=7) + random_prompts(3, seed=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = run(engine_like(tiny, chunked_prefill=False), prompts, params)
    engine = engine_like(tiny, max_num_batched_tokens=16, block_size=4, num_kv_blocks=40)
    ids = [engine.add_request(p, params) for p in prompts]
    preempted_mid_prefill = False
    done = {}
    while engine.has_unfinished():
        before = {r.request_id: (r.num_computed_tokens, r.num_prompt_tokens) for r in engine.scheduler.running}
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        for rid in engine.steps[-1].preempted:
            computed, prompt_len = before.get(rid, (0, 0))
            preempted_mid_prefill |= 0 < computed < prompt_len
    assert preempted_mid_prefill
    assert [done[i] for i in ids] == expected
    assert_all_blocks_free(engine)


def test_chunked_prefill_switch_changes_live(tiny):
    prompts = long_prompts(2, 120, seed=9) + random_prompts(3, seed=10)
    expected = run(engine_like(tiny, chunked_prefill=False), prompts)
    engine = engine_like(tiny, max_num_batched_tokens=32)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    reconfig = Reconfiguration.of(engine)
    reconfig.update({"chunked_prefill": False, "max_num_batched_tokens": None}, engine)  # mid-prefill: rest at once
    assert reconfig.apply(engine)["action"] == "applied in place"
    engine.step()
    assert engine.config.max_num_batched_tokens >= engine.config.max_model_len
    assert max(e.num_tokens for e in engine.steps[-1].prefills) > 32
    done = drain(engine)
    assert [done[i] for i in ids] == expected


def test_chunked_prefill_needs_a_kv_cache(tiny):
    engine = engine_like(tiny, kv_cache=False)  # chunking is inactive: the default budget holds a whole prompt
    assert not engine.config.chunked_prefill_active
    assert engine.config.max_num_batched_tokens >= engine.config.max_model_len
    assert run(engine, long_prompts(1, 100, seed=11)) == run(engine_like(tiny), long_prompts(1, 100, seed=11))
