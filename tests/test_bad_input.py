"""Bad input gets a clear ValueError that names the problem, and never disturbs a request already in flight.

Each engine-level case first starts a good request and runs one step, then tries the bad input, then
drains the engine: the good request must finish with exactly its greedy tokens and every block is free.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from engine import LLM, EngineConfig, SamplingParams
from tests.conftest import assert_all_blocks_free

GOOD_PROMPT = [101, 2002, 303, 4004, 505, 6006, 707]
GOOD_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MAX_MODEL_LEN = 128
VOCAB = 49152  # the tiny model's vocabulary


@pytest.fixture(scope="module")
def llm(tiny_models):
    folder, _ = tiny_models["llama"]
    return LLM(folder, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def expected(llm):
    """The good request's output when nothing else happens."""
    out = llm.generate([GOOD_PROMPT], GOOD_PARAMS)[0]
    assert len(out.token_ids) == GOOD_PARAMS.max_tokens
    return out.token_ids


def start_good(engine) -> str:
    rid = engine.add_request(GOOD_PROMPT, GOOD_PARAMS)
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].token_ids) == 1
    return rid


def drain(engine, max_steps: int = 200) -> dict:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
    assert not engine.has_unfinished(), "the engine did not drain"
    return finals


def finish_good(engine, rid: str, expected_tokens: list[int]) -> None:
    state = (len(engine.scheduler.running), len(engine.scheduler.waiting), set(engine.requests))
    assert state == (1, 0, {rid}), "the bad input left something behind in the engine"
    finals = drain(engine)
    assert set(finals) == {rid}
    assert finals[rid].finish_reason == "length"
    assert finals[rid].token_ids == expected_tokens
    assert_all_blocks_free(engine)


def raises_while_serving(llm, expected_tokens, match: str, fn) -> None:
    rid = start_good(llm.engine)
    with pytest.raises(ValueError, match=match):
        fn()
    finish_good(llm.engine, rid, expected_tokens)


# ---- prompts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", []], ids=["empty-text", "empty-ids"])
def test_empty_prompt(llm, expected, prompt):
    raises_while_serving(llm, expected, "empty prompt", lambda: llm.engine.add_request(prompt, GOOD_PARAMS))


@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 50])
def test_prompt_longer_than_max_model_len(llm, expected, length):
    prompt = [7] * length
    raises_while_serving(llm, expected, f"prompt has {length} tokens but max_model_len is {MAX_MODEL_LEN}",
                         lambda: llm.engine.add_request(prompt, GOOD_PARAMS))


@pytest.mark.parametrize("bad_id", [-1, VOCAB, VOCAB + 1000])
def test_token_ids_outside_vocabulary(llm, expected, bad_id):
    raises_while_serving(llm, expected, rf"outside the vocabulary \[0, {VOCAB}\).*{bad_id}",
                         lambda: llm.engine.add_request([5, bad_id, 6], GOOD_PARAMS))


@pytest.mark.parametrize("prompt", [[1.5, 2], [True, 3], ["a"], 42, None], ids=["float", "bool", "str", "int", "none"])
def test_prompt_of_the_wrong_type(llm, expected, prompt):
    raises_while_serving(llm, expected, "prompt", lambda: llm.engine.add_request(prompt, GOOD_PARAMS))


def test_duplicate_request_id(llm, expected):
    rid = start_good(llm.engine)
    with pytest.raises(ValueError, match=f"request id '{rid}' is already in use"):
        llm.engine.add_request([5, 6], GOOD_PARAMS, request_id=rid)
    finish_good(llm.engine, rid, expected)


def test_params_must_be_sampling_params(llm, expected):
    raises_while_serving(llm, expected, "params must be a SamplingParams",
                         lambda: llm.engine.add_request([5, 6], {"temperature": 0}))


# ---- sampling parameters ------------------------------------------------------------------------------

BAD_PARAMS = [
    ("temperature", -0.5, "temperature must be >= 0"),
    ("temperature", "hot", "temperature must be >= 0"),
    ("top_p", 0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", 0, "top_k must be -1"),
    ("top_k", -2, "top_k must be -1"),
    ("top_k", 2.5, "top_k must be -1"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("max_tokens", -3, "max_tokens must be an integer >= 1"),
    ("max_tokens", True, "max_tokens must be an integer >= 1"),
    ("seed", 1.5, "seed must be an integer"),
    ("stop", [""], "stop must be a list of non-empty strings"),
    ("stop_token_ids", ["x"], "stop_token_ids must be integers"),
]


@pytest.mark.parametrize("field,value,match", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v, _ in BAD_PARAMS])
def test_bad_sampling_params_are_rejected_when_built(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value,match", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v, _ in BAD_PARAMS])
def test_bad_sampling_params_are_rejected_by_the_engine(llm, expected, field, value, match):
    """Params changed after construction are validated again when the request is added."""
    params = SamplingParams(temperature=0, max_tokens=4)
    setattr(params, field, value)
    raises_while_serving(llm, expected, match, lambda: llm.engine.add_request([5, 6, 7], params))


# ---- configuration ------------------------------------------------------------------------------------

def test_unknown_config_field(tiny_models):
    folder, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="unknown config field.*not_a_field"):
        LLM(folder, not_a_field=1)
    with pytest.raises(ValueError, match="unknown config field.*not_a_field"):
        EngineConfig.from_kwargs(not_a_field=1, block_size=16)
    with pytest.raises(ValueError, match="unknown config field.*not_a_field"):
        EngineConfig().replace(not_a_field=1)


@pytest.mark.parametrize("block_size", [3, 6, 12, 0, -4, 2048, 16.0])
def test_block_size_not_a_power_of_two(tiny_models, block_size):
    folder, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match=f"block_size must be a power of two.*{block_size!r}"):
        EngineConfig.from_kwargs(block_size=block_size)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        LLM(folder, block_size=block_size)


@pytest.mark.parametrize("field,value,match", [
    ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"),
    ("num_kv_blocks", 0, "num_kv_blocks must be an integer >= 1"),
    ("max_model_len", -1, "max_model_len must be an integer >= 1"),
    ("dtype", "int4", "dtype must be one of"),
    ("device", "tpu", "device must be"),
    ("kv_cache_memory_gb", 0, "kv_cache_memory_gb must be > 0"),
    ("prefix_caching", "yes", "prefix_caching must be True or False"),
])
def test_bad_config_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**{field: value})


def test_batched_token_budget_smaller_than_max_model_len():
    """Only chunked prefill can run a prompt longer than a step's budget (and it needs a KV cache)."""
    EngineConfig.from_kwargs(max_num_batched_tokens=64, max_model_len=128)  # chunked prefill is on by default
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) is smaller than max_model_len \(128\) "
                                         r"and chunked prefill is off"):
        EngineConfig.from_kwargs(max_num_batched_tokens=64, max_model_len=128, chunked_prefill=False)
    with pytest.raises(ValueError, match="without a KV cache prompts cannot be chunked"):
        EngineConfig.from_kwargs(max_num_batched_tokens=64, max_model_len=128, kv_cache=False)


# ---- models -------------------------------------------------------------------------------------------

def test_model_path_that_does_not_exist(tmp_path, monkeypatch):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=f"model path does not exist: {re.escape(str(missing))}"):
        LLM(str(missing))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="model path does not exist: nothing-here"):
        LLM("nothing-here")


def test_model_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path))


def test_model_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither a folder nor a .gguf file"):
        LLM(str(f))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_config_without_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))


def test_max_model_len_beyond_the_models_context(tiny_models):
    folder, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's context"):
        LLM(folder, max_model_len=4096)


@pytest.mark.parametrize("kwargs,match", [
    ({"not_a_field": 1}, "unknown config field.*not_a_field"),
    ({"block_size": 12}, "block_size must be a power of two"),
    ({"cuda_graphs": True}, "cuda_graphs=True captures CUDA graphs: it needs a CUDA GPU"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min \\(5\\) must be <= prompt_lookup_max"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"model": "/no/such/model/dir"}, "model path does not exist"),
    ({"model": "GPT2"}, "unsupported architecture"),
])
def test_a_failed_construction_leaves_a_serving_engine_alone(llm, expected, tiny_models, tmp_path, kwargs, match):
    folder, _ = tiny_models["llama"]
    if kwargs.get("model") == "GPT2":
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
        kwargs = {"model": str(tmp_path)}
    kwargs = {"model": folder, **kwargs}
    raises_while_serving(llm, expected, match, lambda: LLM(**kwargs))


# ---- KV pool too small --------------------------------------------------------------------------------

def test_request_needing_more_kv_blocks_than_the_pool(tiny_models):
    folder, _ = tiny_models["llama"]
    small = LLM(folder, block_size=4, num_kv_blocks=4, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rid = small.engine.add_request([5, 6, 7, 8], params)  # 12 tokens: 3 blocks
    small.engine.step()
    with pytest.raises(ValueError, match="this request needs 5 KV blocks but the pool has only 4"):
        small.engine.add_request([5] * 10, SamplingParams(max_tokens=10))  # 20 tokens: 5 blocks
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        small.generate([[5, 6], [5] * 19], SamplingParams(max_tokens=1))  # one bad prompt rejects the whole call
    finals = drain(small.engine)
    assert rid in finals and len(finals[rid].token_ids) == 8
    # the call's good prompt was withdrawn: it ends as an abort, with its blocks freed
    assert all(out.finish_reason == "abort" and out.token_ids == [] for r, out in finals.items() if r != rid)
    assert_all_blocks_free(small.engine)
    # exactly the pool's size is fine
    out = small.generate([[5] * 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    assert_all_blocks_free(small.engine)


def test_contiguous_kv_that_cannot_hold_one_request(tiny_models):
    folder, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="contiguous KV reserves max_model_len=128 tokens"):
        LLM(folder, paged_kv=False, block_size=16, num_kv_blocks=4, max_model_len=128)


# ---- update_config ------------------------------------------------------------------------------------

BAD_UPDATES = [
    ({"block_size": 3}, "block_size must be a power of two"),
    ({"not_a_field": 1}, "unknown config field"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    ({"attention_backend": "flash"}, "attention_backend must be one of"),
    ({"cuda_graphs": True}, "cuda_graphs=True captures CUDA graphs: it needs a CUDA GPU"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min \\(5\\) must be <= prompt_lookup_max"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"chunked_prefill": False, "max_num_batched_tokens": 16}, "chunked prefill is off"),
    ({"quantization": "int8"}, "quantization cannot change while serving"),
    ({"dtype": "float16"}, "dtype cannot change while serving"),
    ({"model": "other"}, "model cannot change while serving"),
    ({"max_model_len": 100_000}, "max_model_len 100000 exceeds the loaded model's limit"),
    ({"block_size": 1, "num_kv_blocks": 4}, "this request needs 15 KV blocks but the pool has only 4"),
    ({"max_model_len": 5}, "prompt has 7 tokens but max_model_len is 5"),
]


@pytest.mark.parametrize("changes,match", BAD_UPDATES, ids=[next(iter(c)) + "=" + repr(next(iter(c.values())))
                                                            for c, _ in BAD_UPDATES])
def test_bad_update_config_leaves_the_config_unchanged(llm, expected, changes, match):
    engine = llm.engine
    rid = start_good(engine)
    before, requested, last = engine.config.to_dict(), llm.reconfig.requested.to_dict(), engine.last_reconfig
    with pytest.raises(ValueError, match=match):
        llm.update_config(**changes)
    assert engine.config.to_dict() == before and llm.reconfig.requested.to_dict() == requested
    llm.step()  # a step boundary: nothing was left pending
    assert engine.config.to_dict() == before and engine.last_reconfig == last
    finish_good(engine, rid, expected)


def test_a_bad_update_does_not_drop_a_good_one_pending(llm, expected):
    engine = llm.engine
    rid = start_good(engine)
    llm.update_config(max_num_seqs=3)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        llm.update_config(block_size=5)
    llm.step()
    assert engine.config.max_num_seqs == 3 and engine.config.block_size == 16
    finish_good(engine, rid, expected)
    llm.update_config(max_num_seqs=64)
    llm.step()
    assert engine.config.max_num_seqs == 64


# ---- memory: a pool that cannot fit is refused before anything is allocated ---------------------------

HUGE_POOL = r"num_kv_blocks=50000000 needs [\d.]+ GB of KV cache but only [\d.]+ [GM]B of RAM is available"


def test_a_pool_larger_than_memory_is_refused_before_anything_is_allocated(tiny_models):
    folder, _ = tiny_models["llama"]
    start = time.perf_counter()
    with pytest.raises(ValueError, match=HUGE_POOL + r".*at most \d+ blocks of this size fit"):
        LLM(folder, num_kv_blocks=50_000_000, max_model_len=MAX_MODEL_LEN)
    assert time.perf_counter() - start < 15  # refused by arithmetic, not after building 16 GB of block objects


def test_update_config_to_a_pool_larger_than_memory_is_refused(llm, expected):
    raises_while_serving(llm, expected, HUGE_POOL, lambda: llm.update_config(num_kv_blocks=50_000_000))


def test_the_memory_check_counts_what_is_free_now_and_spares_the_pool_in_use(llm, expected, monkeypatch):
    from engine import memory
    monkeypatch.setattr(memory, "free_ram", lambda: memory.FreeMemory(usable=0, reserve=2**30, where="RAM"))
    engine = llm.engine
    rid = start_good(engine)
    with pytest.raises(ValueError, match="num_kv_blocks=32 needs 0 MB of KV cache but only 0 MB of RAM"):
        llm.update_config(num_kv_blocks=32)  # even a smaller pool is built beside the old one
    llm.update_config(max_num_seqs=4)  # keeps the pool: nothing new to allocate
    llm.step()
    assert engine.config.max_num_seqs == 4
    finish_good(engine, rid, expected)
    llm.update_config(max_num_seqs=64)
    llm.step()


def test_a_pool_that_cannot_be_built_leaves_the_old_one_serving(llm, expected, monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError("simulated: the allocator said no")
    engine = llm.engine
    rid = start_good(engine)
    before = engine.config.to_dict()
    monkeypatch.setattr("engine.factory.ModelRunner", no_memory)
    llm.update_config(num_kv_blocks=32, max_num_seqs=4)  # validated: it fits the memory free now
    llm.step()  # the step boundary: building the new pool fails
    assert engine.config.to_dict() == before and llm.reconfig.requested.num_kv_blocks == 64
    assert engine.last_reconfig["changes"] == {"num_kv_blocks": 32, "max_num_seqs": 4}
    assert "MemoryError: simulated" in engine.last_reconfig["error"]
    assert engine.snapshot().last_reconfig == engine.last_reconfig == llm.reconfig.last
    assert llm.reconfig.pending_view()[1].to_dict() == before  # nothing left pending to fail again
    finish_good(engine, rid, expected)
    monkeypatch.undo()
    llm.update_config(num_kv_blocks=32)  # a later change builds normally
    record = llm.reconfig.apply(engine)  # idle: carried out at once, no step needed
    assert record["action"] == "re-prefill running requests" and engine.config.num_kv_blocks == 32
    llm.update_config(num_kv_blocks=64)
    llm.reconfig.apply(engine)


# ---- regressions: bugs these tests found, now fixed ---------------------------------------------------

def test_generate_with_a_bad_prompt_does_not_swallow_an_in_flight_request(llm, expected):
    engine = llm.engine
    rid = engine.add_request(GOOD_PROMPT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[5, 6, 7], []], SamplingParams(max_tokens=3))
    finals = drain(engine)
    assert_all_blocks_free(engine)
    assert rid in finals and finals[rid].token_ids == expected[:2]


def test_request_added_before_a_pending_pool_shrink_is_checked_against_it(tiny_models):
    folder, _ = tiny_models["llama"]
    small = LLM(folder, block_size=16, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    small.update_config(num_kv_blocks=4)  # applies at the next step: 64 tokens
    try:
        with pytest.raises(ValueError, match="KV blocks"):
            small.add_request([5] * 100, SamplingParams(max_tokens=4))  # 7 blocks of 16
    finally:
        for _ in range(20):
            small.step()
        stuck = small.engine.has_unfinished()
        for rid in list(small.engine.requests):
            small.engine.abort(rid)
        small.engine.step()
    assert not stuck, "the request can never be scheduled: the engine never drains"


def test_block_size_true_is_not_taken_for_one():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_kwargs(block_size=True)
