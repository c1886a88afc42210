"""Each switch is real: greedy output is the same with it on or off, and its mechanism is visible."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.reconfigure import Reconfiguration
from tests.conftest import assert_all_blocks_free
from tests.test_parity import TEXT_PROMPTS, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SWITCHES_OFF = [{"kv_cache": False}, {"paged_kv": False}, {"continuous_batching": False},
                {"prefix_caching": False}]


def engine_like(llm: LLM, **changes) -> LLMEngine:
    """A fresh engine over the same loaded weights, with other settings."""
    return LLMEngine(EngineConfig.from_kwargs(**{**llm.config.to_dict(), **changes}), llm.engine.model,
                     llm.tokenizer, llm.engine.hf_config)


def run(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "finished twice"
                done[out.request_id] = out.token_ids
    assert_all_blocks_free(engine)
    return [done[i] for i in ids]


def shared_prefix_prompts(n: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    prefix = random_prompts(1, seed=seed)[0] * 4
    prefix = prefix[:prefix_len]
    return [prefix + p[:8] for p in random_prompts(n, seed=seed + 1)]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return LLM(tiny_models["llama"][0], max_model_len=256)


TINY_PROMPTS = random_prompts(8, seed=3) + shared_prefix_prompts(4, 40)


@pytest.fixture(scope="module")
def tiny_baseline(tiny):
    """Every switch on: what each switch-off run must give (computed once for all of them)."""
    return run(engine_like(tiny), TINY_PROMPTS)


@pytest.fixture(scope="module")
def default_prompts(default_llm):
    return [default_llm.tokenizer(p).input_ids for p in TEXT_PROMPTS]


@pytest.fixture(scope="module")
def default_baseline(default_llm, default_prompts):
    return run(engine_like(default_llm), default_prompts)


@pytest.mark.parametrize("off", SWITCHES_OFF, ids=lambda d: next(iter(d)))
def test_tiny_greedy_invariant_to_each_switch(tiny, tiny_baseline, off):
    assert run(engine_like(tiny, **off), TINY_PROMPTS) == tiny_baseline


@pytest.mark.slow
@pytest.mark.parametrize("off", SWITCHES_OFF, ids=lambda d: next(iter(d)))
def test_default_model_greedy_invariant_to_each_switch(default_llm, default_prompts, default_baseline, off):
    assert run(engine_like(default_llm, **off, max_model_len=256), default_prompts) == default_baseline


def test_warm_prefix_cache_gives_the_same_tokens(tiny):
    engine = engine_like(tiny)
    prompts = shared_prefix_prompts(6, 48)
    cold = run(engine, prompts)
    hits_before = engine.kv.prefix_cache_hits
    warm = run(engine, prompts)
    assert warm == cold
    assert engine.kv.prefix_cache_hits > hits_before


def test_prefix_hits_are_exact_and_shared_blocks_are_ref_counted(tiny):
    bs, prefix_len = 8, 43  # 5 full shared blocks; the rest of each prompt differs
    engine = engine_like(tiny, block_size=bs)
    prompts = shared_prefix_prompts(4, prefix_len)
    first = engine.add_request(prompts[0], GREEDY)
    engine.step()  # the first request's prefill fills and registers its blocks
    second = engine.add_request(prompts[1], GREEDY)
    engine.step()
    snap = engine.snapshot()
    shared = set(snap.block_tables[first]) & set(snap.block_tables[second])
    assert len(shared) == prefix_len // bs
    assert all(snap.block_ref_counts[b] == 2 for b in shared)
    assert snap.requests[second].num_cached_tokens == (prefix_len // bs) * bs
    for p in prompts[2:]:
        engine.add_request(p, GREEDY)
    while engine.has_unfinished():
        engine.step()
    expected = sum(min(prefix_len // bs, (len(p) - 1) // bs) * bs for p in prompts[1:])
    assert engine.kv.prefix_cache_hits == expected
    assert engine.kv.prefix_cache_queries == sum(len(p) for p in prompts)
    assert_all_blocks_free(engine)


def test_last_prompt_token_is_always_computed(tiny):
    engine = engine_like(tiny, block_size=8)
    prompt = random_prompts(1, seed=9)[0][:32] * 2  # 64 tokens: exactly 8 full blocks
    prompt = prompt[:64]
    a = run(engine, [prompt])
    engine.add_request(prompt, GREEDY)
    engine.step()
    rec = engine.steps[-1]
    (entry,) = rec.prefills
    # 7 blocks reused, the last block recomputed for its logits
    assert entry.prefix_hit_tokens == 56 and entry.num_tokens == 8
    while engine.has_unfinished():
        engine.step()
    assert run(engine, [prompt]) == a


def test_eviction_under_pressure_keeps_outputs_correct(tiny):
    prompts = [p for i in range(4) for p in shared_prefix_prompts(3, 32, seed=10 * i)]
    expected = run(engine_like(tiny, prefix_caching=False), prompts)
    engine = engine_like(tiny, block_size=4, num_kv_blocks=40, max_num_seqs=4)
    assert run(engine, prompts) == expected
    assert engine.kv.pool.num_evictions > 0
    assert engine.kv.prefix_cache_hits > 0


def test_preemption_recompute_is_not_counted_as_prefix_hits(tiny):
    engine = engine_like(tiny, block_size=4, num_kv_blocks=30)
    prompts = random_prompts(6, seed=21)  # nothing shared: every hit would be a recompute
    run(engine, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.prefix_cache_hits == 0


def test_contiguous_kv_admits_fewer_requests_than_paged(tiny):
    prompts = random_prompts(16, seed=4)
    prompts = [p[:24] + [5] * (24 - len(p[:24])) for p in prompts]  # 24-token prompts
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # a token budget that holds every prompt: admission is limited by memory here, not by the step's budget
    common = dict(block_size=16, num_kv_blocks=64, max_model_len=256, max_num_seqs=32, max_num_batched_tokens=512)
    concurrency = {}
    for paged in (True, False):
        engine = engine_like(tiny, paged_kv=paged, **common)
        for p in prompts:
            engine.add_request(p, params)
        engine.step()
        concurrency[paged] = engine.snapshot().num_running
        while engine.has_unfinished():
            engine.step()
        assert_all_blocks_free(engine)
    assert concurrency[False] == 64 // (256 // 16) == 4  # each request reserves max_model_len up front
    assert concurrency[True] == 16  # 2 blocks each: all fit


def test_static_batching_admits_nothing_mid_batch(tiny):
    lengths = [4, 8, 12, 16]
    for continuous in (True, False):
        engine = engine_like(tiny, continuous_batching=continuous, max_num_seqs=4)
        first = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                 for p, n in zip(random_prompts(4, seed=5), lengths)]
        engine.step()
        late = engine.add_request(random_prompts(1, seed=6)[0], SamplingParams(temperature=0, max_tokens=4))
        joined_at = None
        while engine.has_unfinished():
            engine.step()
            snap = engine.snapshot()
            if joined_at is None and late in snap.running:
                joined_at = snap.step
                running_first = [r for r in first if r in snap.running]
        if continuous:
            assert joined_at == 5  # the seat freed by the 4-token request is refilled at once
            assert running_first
        else:
            assert running_first == []  # joined only once the whole first batch had finished
        assert_all_blocks_free(engine)


def test_switch_changes_apply_at_step_boundary_without_losing_requests(tiny):
    prompts = random_prompts(6, seed=8) + shared_prefix_prompts(3, 40)
    expected = run(engine_like(tiny), prompts)
    engine = engine_like(tiny)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    reconfig = Reconfiguration.of(engine)  # the engine's owner: a change waits for the next step boundary
    done = {}
    changes = [{"prefix_caching": False}, {"block_size": 8}, {"paged_kv": False}, {"kv_cache": False},
               {"continuous_batching": False}, {"kv_cache": True, "paged_kv": True, "num_kv_blocks": 128}]
    step = 0
    while engine.has_unfinished():
        if changes and step % 3 == 1:
            reconfig.update(changes.pop(0), engine)
        reconfig.apply(engine)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
    assert [done[i] for i in ids] == expected
    assert engine.last_reconfig["action"] == "re-prefill running requests"
    assert engine.config.block_size == 8 and engine.config.num_kv_blocks == 128
    assert_all_blocks_free(engine)


def test_bad_config_change_keeps_previous_config(tiny):
    engine = engine_like(tiny)
    reconfig, before = Reconfiguration.of(engine), engine.config
    with pytest.raises(ValueError, match="block_size"):
        reconfig.update({"block_size": 12}, engine)
    with pytest.raises(ValueError, match="cannot change while serving"):
        reconfig.update({"model": "other"}, engine)
    assert reconfig.apply(engine) is None
    engine.step()
    assert engine.config == before


def test_snapshot_has_the_fields_the_playground_draws(tiny):
    engine = engine_like(tiny, block_size=8)
    for p in shared_prefix_prompts(3, 24):
        engine.add_request(p, GREEDY)
    engine.step()
    snap = engine.snapshot()
    assert snap.num_running == 3 and snap.num_waiting == 0
    assert snap.kv_blocks_used == len({b for t in snap.block_tables.values() for b in t})
    assert len(snap.block_ref_counts) == snap.kv_blocks_total == engine.config.num_kv_blocks
    assert sum(1 for h in snap.block_hashes if h is not None) >= 3
    assert snap.steps[-1].prefills and snap.steps[-1].forward_ms > 0
    cached = [r.num_cached_tokens for r in snap.requests.values()]
    assert cached == [0, 24, 24]  # admitted in one step, the later two share the first one's 3 blocks
    assert snap.prefill_tokens_total == sum(len(p) for p in shared_prefix_prompts(3, 24)) - sum(cached)
    owners = {}
    for rid, table in snap.block_tables.items():
        for b in table:
            owners.setdefault(b, []).append(rid)
    assert all(len(owners[b]) == snap.block_ref_counts[b] for b in owners)


def test_requests_admitted_in_the_same_step_share_a_prefix(tiny):
    bs, prefix_len = 8, 40
    prompts = shared_prefix_prompts(4, prefix_len, seed=30)
    expected = run(engine_like(tiny, prefix_caching=False), prompts)
    engine = engine_like(tiny, block_size=bs)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # all four prefill in one forward pass; the first computes the shared blocks
    snap = engine.snapshot()
    assert [snap.requests[i].num_cached_tokens for i in ids] == [0] + [prefix_len // bs * bs] * 3
    shared = set.intersection(*(set(snap.block_tables[i]) for i in ids))
    assert len(shared) == prefix_len // bs and all(snap.block_ref_counts[b] == 4 for b in shared)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == expected


def test_the_phase_is_decided_once_and_the_log_says_what_ran(tiny):
    """Without a KV cache every step recomputes the whole sequence: the log says so (a prefill of every token),
    never "decoded". A prefix hit that leaves one prompt token is that prompt's prefill, not a decode."""
    engine = engine_like(tiny, kv_cache=False)
    prompt = random_prompts(1, seed=50)[0][:20]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    sizes = []
    while engine.has_unfinished():
        engine.step()
        (entry,) = engine.steps[-1].entries
        assert entry.phase == "prefill" and entry.num_computed_after == 0  # nothing is kept
        sizes.append(entry.num_tokens)
    assert sizes == [20, 21, 22]

    engine = engine_like(tiny, block_size=8)
    prompt = random_prompts(1, seed=51)[0][:16] + [7]  # 17 tokens: 2 full blocks, then one token
    run(engine, [prompt])
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    (entry,) = engine.steps[-1].entries
    assert (entry.phase, entry.num_tokens, entry.prefix_hit_tokens) == ("prefill", 1, 16)
    engine.step()
    assert [e.phase for e in engine.steps[-1].entries] == ["decode"]
