"""SamplingParams.prompt_logprobs, with vLLM's meaning: per prompt position a dict {token_id: logprob} of the given
token and the N most likely, from the model's own logits; None at the first position. Checked against
transformers' logits, and unchanged by chunked prefill, the prefix cache, preemption, the naive loop and sampling
filters (which change what is drawn, not the model's distribution)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import InvalidSamplingParam
from tests.conftest import assert_all_blocks_free
from tests.test_features import engine_like, shared_prefix_prompts
from tests.test_parity import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"][0], max_model_len=256)


def prompt_logprobs(engine, prompts, params) -> list[list]:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.prompt_logprobs
    assert_all_blocks_free(engine)
    return [done[i] for i in ids]


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)


def test_prompt_logprobs_are_the_models_own(llm, tiny_models):
    hf = tiny_models["llama"][1]
    prompts = random_prompts(4, seed=21)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = prompt_logprobs(engine_like(llm, num_kv_blocks=128, max_num_batched_tokens=16), prompts, params)
    for prompt, plp in zip(prompts, outs, strict=True):
        ref = hf_prompt_logprobs(hf, prompt)
        assert len(plp) == len(prompt) and plp[0] is None
        for p in range(1, len(prompt)):
            entry = plp[p]
            assert next(iter(entry)) == prompt[p]  # the given token first
            assert entry[prompt[p]] == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
            top = ref[p - 1].topk(3)
            for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert entry[token] == pytest.approx(value, abs=1e-4)
            assert len(entry) in (3, 4)  # the top 3, plus the given token when it is not among them


def test_prompt_logprobs_do_not_depend_on_how_the_prompt_is_computed(llm):
    prompts = shared_prefix_prompts(4, 40) + random_prompts(3, seed=8)
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2)
    base = prompt_logprobs(engine_like(llm, num_kv_blocks=256), prompts, params)
    warm = engine_like(llm, num_kv_blocks=256, max_num_batched_tokens=16)  # chunked, and a warm prefix cache
    prompt_logprobs(warm, prompts, SamplingParams(temperature=0, max_tokens=8))
    small = engine_like(llm, block_size=4, num_kv_blocks=40)
    filtered = SamplingParams(temperature=0.8, top_k=2, top_p=0.5, seed=1, max_tokens=8, prompt_logprobs=2)
    runs = {"chunked, warm prefix cache": prompt_logprobs(warm, prompts, params),
            "preemption": prompt_logprobs(small, prompts, params),
            "naive loop": prompt_logprobs(engine_like(llm, kv_cache=False), prompts, params),
            "sampling filters": prompt_logprobs(engine_like(llm, num_kv_blocks=256), prompts, filtered)}
    assert small.scheduler.num_preemptions > 0
    for what, outs in runs.items():
        for a, b in zip(outs, base, strict=True):
            assert len(a) == len(b) and a[0] is None
            for x, y in zip(a[1:], b[1:], strict=True):
                assert x.keys() == y.keys(), what
                assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-4), what


def test_no_prompt_logprobs_unless_asked(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0]
    assert out.prompt_logprobs is None
    out = llm.generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == [None]
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None and list(out.prompt_logprobs[1]) == [6]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(InvalidSamplingParam, match="prompt_logprobs must be None or an integer in") as info:
        SamplingParams(prompt_logprobs=value)
    assert info.value.param == "prompt_logprobs"
