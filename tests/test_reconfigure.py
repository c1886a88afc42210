"""engine/reconfigure.py: a running engine's configuration resolved, checked, built beside the old pool and handed to
the engine at a step boundary by its owner, with nothing in flight lost and nothing changed by a change that fails."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.blocks import ContiguousKVCache, KVCacheManager, NoKVCache, PagedKVCache
from engine.measure.runs import random_prompts
from engine.reconfigure import Reconfiguration
from tests.conftest import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"][0], num_kv_blocks=32, max_model_len=128)


def run_all(engine, reconfig: Reconfiguration | None = None) -> dict[str, list[int]]:
    """Every request to its end, a waiting change handed in at the step boundary as an owner (service, LLM) does."""
    out = {}
    while engine.has_unfinished():
        if reconfig is not None:
            reconfig.apply(engine)
        out.update((o.request_id, list(o.token_ids)) for o in engine.step() if o.finished)
    return out


def test_resolve_fills_what_is_left_automatic_and_refuses_what_cannot_fit(llm):
    engine = llm.build_engine({"num_kv_blocks": None, "max_model_len": None})
    r = Reconfiguration.of(engine)
    assert r.requested.num_kv_blocks is None and r.current.num_kv_blocks == r.automatic_sizes(r.requested)[
        "num_kv_blocks"] > 0
    assert r.current is engine.config and r.current.max_model_len == engine.model.max_len
    with pytest.raises(ValueError, match="exceeds the loaded model's limit"):
        r.resolve(r.requested.replace(max_model_len=engine.model.max_len + 1))
    with pytest.raises(ValueError, match="contiguous KV reserves max_model_len=128 tokens .* only 4 blocks"):
        r.resolve(r.requested.replace(paged_kv=False, num_kv_blocks=4, max_model_len=128))


def test_each_layout_gets_its_own_manager(llm):
    assert isinstance(llm.build_engine({}).kv, PagedKVCache)
    assert isinstance(llm.build_engine({"paged_kv": False}).kv, ContiguousKVCache)
    assert isinstance(llm.build_engine({"kv_cache": False}).kv, NoKVCache)


def test_a_bad_change_is_refused_at_once_and_nothing_waits(llm):
    engine = llm.build_engine({})
    r, before = Reconfiguration.of(engine), engine.config
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        r.update({"block_size": 3}, engine)
    with pytest.raises(ValueError, match="quantization cannot change while serving"):
        r.update({"quantization": "int8"}, engine)
    assert not r.pending and engine.config == before and r.apply(engine) is None


def test_a_structural_change_rebuilds_the_pool_and_re_prefills_without_changing_a_token(llm):
    prompts = random_prompts(3, 20, seed=5)
    alone = llm.build_engine({})
    for p in prompts:
        alone.add_request(p, GREEDY)
    expected = run_all(alone)

    engine = llm.build_engine({"num_kv_blocks": 32})
    r = Reconfiguration.of(engine)
    for p in prompts:
        engine.add_request(p, GREEDY)
    for _ in range(3):
        engine.step()
    old_kv, old_runner = engine.kv, engine.runner
    r.update({"num_kv_blocks": 24, "block_size": 8}, engine)
    assert engine.config.num_kv_blocks == 32 and r.pending  # waits for the step boundary
    assert r.pending_view()[1].num_kv_blocks == 24
    got = run_all(engine, r)
    record = engine.last_reconfig
    assert record["action"] == "re-prefill running requests" and len(record["requests_re_prefilled"]) == 3
    assert record is r.last and engine.snapshot().last_reconfig == record  # the snapshot reports the owner's record
    assert engine.requested.block_size == 8 and r.current is engine.config
    assert engine.kv is not old_kv and engine.runner is not old_runner and engine.scheduler.kv is engine.kv
    assert engine.config.block_size == 8 and engine.kv.num_blocks == 24 and engine.scheduler.config is engine.config
    assert got == expected
    assert_all_blocks_free(engine)


def test_an_in_place_change_keeps_the_pool_and_its_counters(llm):
    engine = llm.build_engine({"prefix_caching": True})
    r = Reconfiguration.of(engine)
    shared = random_prompts(1, 40, seed=7)[0]
    for _ in range(2):
        engine.add_request(shared, GREEDY)
        run_all(engine)
    hits = engine.kv.prefix_cache_hits
    assert hits > 0
    kv = engine.kv
    r.update({"prefix_caching": False}, engine)
    assert r.apply(engine)["action"] == "applied in place"
    assert engine.kv is kv and not engine.kv.prefix_caching and engine.kv.prefix_cache_hits == hits
    assert not engine.snapshot().features["prefix_caching"].active


def test_a_change_that_can_no_longer_be_built_leaves_the_old_configuration_serving(llm, monkeypatch):
    engine = llm.build_engine({})
    r = Reconfiguration.of(engine)
    rid = engine.add_request(random_prompts(1, 20, seed=9)[0], GREEDY)
    engine.step()
    old = engine.config
    r.update({"num_kv_blocks": 16}, engine)

    def no_memory(config):
        raise MemoryError("simulated: the allocator said no")
    monkeypatch.setattr(r, "build", no_memory)
    out = run_all(engine, r)
    record = engine.last_reconfig
    assert record["action"].startswith("not applied") and "MemoryError" in record["error"]
    assert engine.config == old and r.pending_view()[1] == old and len(out[rid]) == 12
    assert_all_blocks_free(engine)


def test_a_change_is_planned_beside_the_engine_which_changes_only_when_handed_the_new_core(llm):
    """reconfigure.py plans a change outside the engine: it validates it against the requests the engine holds and
    the ones that come, builds the new pool for a structural one, and the engine changes only through swap_core."""
    engine = llm.build_engine({})
    r, before = Reconfiguration.of(engine), engine.config
    assert r.take() is None and r.apply(engine) is None  # nothing waits
    rid = engine.add_request(random_prompts(1, 20, seed=3)[0], GREEDY)  # 32 tokens at most: 2 blocks of 16
    engine.step()
    with pytest.raises(ValueError, match="needs 2 KV blocks but the pool has only 1"):
        r.update({"num_kv_blocks": 1}, engine)
    assert not r.pending and r.pending_view()[1] == r.current  # refused: nothing waits
    r.update({"num_kv_blocks": 4}, engine)
    long_prompt = random_prompts(1, 100, seed=4)[0]  # fits the 32 blocks that run, not the 4 that wait
    with pytest.raises(ValueError, match="needs 7 KV blocks but the pool has only 4"):
        r.check_request(long_prompt, GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):  # the engine's own checks come first, as before
        r.check_request([], GREEDY)
    r.check_request(random_prompts(1, 20, seed=5)[0], GREEDY)

    change = r.take()
    kv, runner = change.built  # the pool's structure changed: a new pool, the engine's untouched
    assert isinstance(kv, KVCacheManager) and kv.num_blocks == 4 and change.config.num_kv_blocks == 4
    assert r.current.num_kv_blocks == 4 and engine.config == before and engine.kv is not kv
    assert engine.swap_core(change.config, kv, runner) == [rid]  # re-prefilled into the new pool
    assert engine.config is change.config and engine.kv is kv and engine.runner is runner
    assert not engine.scheduler.running and [q.request_id for q in engine.scheduler.waiting] == [rid]
    assert r.record(change, 7, [rid]) == {"step": 7, "changes": {"num_kv_blocks": 4}, "action":
                                          "re-prefill running requests", "requests_re_prefilled": [rid]}
    r.update({"prefix_caching": False}, engine)
    change = r.take()
    assert change.built is None and not change.config.prefix_caching  # applies in place
    assert engine.swap_core(change.config) == [] and engine.kv is kv and not kv.prefix_caching
    assert r.record(change, 8, [])["action"] == "applied in place"
    alone = llm.build_engine({})
    alone.add_request(random_prompts(1, 20, seed=3)[0], GREEDY)
    assert run_all(engine)[rid] == next(iter(run_all(alone).values()))  # not a token changed
    assert_all_blocks_free(engine)
