"""Greedy parity: our engine's token ids equal transformers' generate, token for token."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.conftest import TINY_ARCHS, assert_all_blocks_free, hf_greedy

MAX_NEW = 32
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a young girl who loved to",
    "List three colors:",
    "Explain gravity to a child in simple words.",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at a temperature of",
    "Write a haiku about the sea and the moon and the long nights of winter in the north.",
]


def random_prompts(n: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def check_parity(llm: LLM, hf_model, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt, max_new), f"mismatch for prompt of {len(prompt)} tokens"
    assert_all_blocks_free(llm.engine)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_random_model_matches_hf(tiny_models, arch):
    folder, hf_model = tiny_models[arch]
    llm = LLM(folder)
    outs = check_parity(llm, hf_model, random_prompts(10, seed=1))
    assert all(len(set(o)) > 3 for o in outs), "outputs degenerate to a repeated token: the test would be weak"


def test_tiny_model_matches_hf_under_preemption(tiny_models):
    folder, hf_model = tiny_models["llama"]
    llm = LLM(folder, block_size=4, num_kv_blocks=40)
    check_parity(llm, hf_model, random_prompts(10, seed=2))
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_default_model_matches_hf(default_llm, hf_default):
    prompts = [default_llm.tokenizer(p).input_ids for p in TEXT_PROMPTS]
    check_parity(default_llm, hf_default, prompts)


@pytest.mark.slow
def test_default_model_matches_hf_with_tiny_pool(hf_default, default_llm):
    llm = LLM(block_size=8, num_kv_blocks=24)
    prompts = [default_llm.tokenizer(p).input_ids for p in TEXT_PROMPTS]
    check_parity(llm, hf_default, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
