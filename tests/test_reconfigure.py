"""engine/reconfigure.py: a running engine's configuration resolved, checked, built beside the old pool and swapped
at a step boundary, with nothing in flight lost and nothing changed by a change that fails."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.blocks import ContiguousKVCache, NoKVCache, PagedKVCache
from engine.measure.runs import random_prompts
from tests.conftest import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"][0], num_kv_blocks=32, max_model_len=128)


def run_all(engine) -> dict[str, list[int]]:
    out = {}
    while engine.has_unfinished():
        out.update((o.request_id, list(o.token_ids)) for o in engine.step() if o.finished)
    return out


def test_resolve_fills_what_is_left_automatic_and_refuses_what_cannot_fit(llm):
    engine = llm.build_engine({"num_kv_blocks": None, "max_model_len": None})
    r = engine.reconfig
    assert r.requested.num_kv_blocks is None and r.current.num_kv_blocks == r.automatic_sizes(r.requested)[
        "num_kv_blocks"] > 0
    assert r.current.max_model_len == engine.model.max_len
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
    before = engine.config
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        engine.update_config(block_size=3)
    with pytest.raises(ValueError, match="quantization cannot change while serving"):
        engine.update_config(quantization="int8")
    assert not engine.reconfig.pending and engine.config == before and engine.apply_pending() is None


def test_a_structural_change_rebuilds_the_pool_and_re_prefills_without_changing_a_token(llm):
    prompts = random_prompts(3, 20, seed=5)
    alone = llm.build_engine({})
    for p in prompts:
        alone.add_request(p, GREEDY)
    expected = run_all(alone)

    engine = llm.build_engine({"num_kv_blocks": 32})
    for p in prompts:
        engine.add_request(p, GREEDY)
    for _ in range(3):
        engine.step()
    old_kv, old_runner = engine.kv, engine.runner
    engine.update_config(num_kv_blocks=24, block_size=8)
    assert engine.config.num_kv_blocks == 32 and engine.reconfig.pending  # waits for the step boundary
    assert engine.reconfig.pending_view()[1].num_kv_blocks == 24
    got = run_all(engine)
    record = engine.reconfig.last
    assert record["action"] == "re-prefill running requests" and len(record["requests_re_prefilled"]) == 3
    assert engine.kv is not old_kv and engine.runner is not old_runner and engine.scheduler.kv is engine.kv
    assert engine.config.block_size == 8 and engine.kv.num_blocks == 24 and engine.scheduler.config is engine.config
    assert got == expected
    assert_all_blocks_free(engine)


def test_an_in_place_change_keeps_the_pool_and_its_counters(llm):
    engine = llm.build_engine({"prefix_caching": True})
    shared = random_prompts(1, 40, seed=7)[0]
    for _ in range(2):
        engine.add_request(shared, GREEDY)
        run_all(engine)
    hits = engine.kv.prefix_cache_hits
    assert hits > 0
    kv = engine.kv
    engine.update_config(prefix_caching=False)
    assert engine.apply_pending()["action"] == "applied in place"
    assert engine.kv is kv and not engine.kv.prefix_caching and engine.kv.prefix_cache_hits == hits
    assert not engine.snapshot().features["prefix_caching"].active


def test_a_change_that_can_no_longer_be_built_leaves_the_old_configuration_serving(llm, monkeypatch):
    engine = llm.build_engine({})
    rid = engine.add_request(random_prompts(1, 20, seed=9)[0], GREEDY)
    engine.step()
    old = engine.config
    engine.update_config(num_kv_blocks=16)

    def no_memory(config):
        raise MemoryError("simulated: the allocator said no")
    monkeypatch.setattr(engine.reconfig, "build", no_memory)
    out = run_all(engine)
    record = engine.reconfig.last
    assert record["action"].startswith("not applied") and "MemoryError" in record["error"]
    assert engine.config == old and engine.reconfig.pending_view()[1] == old and len(out[rid]) == 12
    assert_all_blocks_free(engine)


def test_a_change_is_planned_without_an_engine(llm):
    """reconfigure.py knows nothing of the engine: given the model, it validates a change (with the caller's own
    check of what it holds), builds the new pool for a structural one, and records what the caller did."""
    from engine.blocks import KVCacheManager
    from engine.reconfigure import Reconfiguration
    engine = llm.build_engine({})
    r, before = Reconfiguration(engine.model, engine.tokenizer, engine.reconfig.requested), engine.config
    assert r.take() is None  # nothing waits

    def refuse(resolved):
        raise ValueError(f"a request in flight needs more than {resolved.num_kv_blocks} blocks")
    with pytest.raises(ValueError, match="needs more than 8 blocks"):
        r.update({"num_kv_blocks": 8}, refuse)
    assert not r.pending and r.pending_view()[1] == r.current  # refused: nothing waits
    r.update({"num_kv_blocks": 16}, lambda resolved: None)
    change = r.take()
    kv, runner = change.built  # the pool's structure changed: a new pool, the old one untouched
    assert isinstance(kv, KVCacheManager) and kv.num_blocks == 16 and change.config.num_kv_blocks == 16
    assert r.current.num_kv_blocks == 16 and engine.config == before  # the engine carries it out, not this
    assert r.record(change, 7, ["a"]) == {"step": 7, "changes": {"num_kv_blocks": 16},
                                          "action": "re-prefill running requests", "requests_re_prefilled": ["a"]}
    r.update({"prefix_caching": False}, lambda resolved: None)
    change = r.take()
    assert change.built is None and not change.config.prefix_caching  # applies in place
    assert r.record(change, 8, [])["action"] == "applied in place"
