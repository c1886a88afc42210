"""Attention backends own their metadata (engine/attention/backend.py): the registry, the sdpa backend's choice of
its C++ pool variant on CPU (and of the gathered SDPA path without the C++ kernels), both greedy-identical to
transformers, and a backend registered by one line used by the runner."""
from __future__ import annotations

import pytest

from engine import LLM, cpu_kernels
from engine.attention import (
    BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    CppPoolBackend,
    PagedMetadata,
    SdpaBackend,
    TritonBackend,
)
from engine.config import ATTENTION_BACKENDS
from engine.runner import ModelRunner
from tests.test_parity import check_parity, random_prompts

# small blocks and a small token budget: prompts prefilled in chunks, each chunk after its cached context
ENGINE = dict(max_model_len=256, block_size=4, max_num_batched_tokens=24)


def test_the_registry_maps_each_backend_name_to_its_class():
    assert BACKENDS == {"sdpa": SdpaBackend, "triton": TritonBackend}
    assert set(BACKENDS) == set(ATTENTION_BACKENDS)  # every name the config accepts has a backend
    assert all(issubclass(cls, AttentionBackend) for cls in BACKENDS.values())
    assert issubclass(CppPoolBackend, SdpaBackend)


def _steps(monkeypatch) -> list:
    """The metadata of every step the runner executes, from now on."""
    metas = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, batch: (metas.append(batch.meta), execute(self, batch))[1])
    return metas


def test_sdpa_on_cpu_takes_the_cpp_pool_path_and_without_the_kernels_the_gathered_one_both_as_hf(tiny_models,
                                                                                               monkeypatch):
    if cpu_kernels.compiled() is None:
        pytest.skip("the C++ kernels did not build here")
    folder, hf_model = tiny_models["llama"]
    prompts = random_prompts(6, seed=4)
    metas = _steps(monkeypatch)
    llm = LLM(folder, **ENGINE)
    runner = llm.engine.runner
    assert type(runner.attention) is CppPoolBackend and runner.attention.decode_attention is not None
    assert runner.attention_kernel == "C++ over the paged pool"
    with_cpp = check_parity(llm, hf_model, prompts)
    assert metas and all(isinstance(m, AttentionMetadata) and not m.prefills for m in metas)
    assert any(m.decode_lists is not None for m in metas), "no prefill row went through the C++ kernel"
    assert any(m.num_decode for m in metas)

    monkeypatch.setattr(cpu_kernels, "compiled", lambda: None)
    metas.clear()
    llm = LLM(folder, **ENGINE)
    runner = llm.engine.runner
    backend = runner.attention
    assert type(backend) is SdpaBackend and backend.decode_attention is None and backend.write_kv is None
    assert runner.attention_kernel == "torch SDPA over gathered K/V"
    assert check_parity(llm, hf_model, prompts) == with_cpp
    assert all(m.decode_lists is None and m.decode_attention is None for m in metas)
    assert any(seq.context_slots is not None for m in metas for seq in m.prefills), "no chunk read its context"
    assert any(m.decode_slots is not None for m in metas)


class Counting(AttentionBackend):
    """A backend of the test's own: the sdpa one, each step's build counted."""

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.inner = SdpaBackend.create(setup)
        self.built = 0

    @property
    def kernel(self) -> str:
        return f"counted {self.inner.kernel}"

    def build(self, ordered, decodes, slots, positions):
        self.built += 1
        return self.inner.build(ordered, decodes, slots, positions)


def test_a_backend_registered_by_one_line_is_used_by_the_runner(tiny_models, monkeypatch):
    folder, hf_model = tiny_models["qwen3"]
    monkeypatch.setitem(BACKENDS, "sdpa", Counting)
    metas = _steps(monkeypatch)
    llm = LLM(folder, **ENGINE)
    backend = llm.engine.runner.attention
    assert type(backend) is Counting and backend.built == 0
    check_parity(llm, hf_model, random_prompts(4, seed=5), max_new=12)
    assert backend.built == len(metas) > 0  # every step's metadata came from it
    assert llm.engine.kernels()["attention"].startswith("counted ")

    # and under a name of its own
    monkeypatch.setitem(BACKENDS, "counting", Counting)
    runner = ModelRunner(llm.engine.model, 4, 8, True, attention_backend="counting")
    assert type(runner.attention) is Counting and runner.attention_kernel.startswith("counted ")


def test_the_triton_backend_builds_paged_metadata_without_triton(tiny_models):
    """(Its kernels need a GPU or Triton's interpreter; its metadata is plain torch: the rows of each sequence.)"""
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Phase, ScheduledRequest

    llm = LLM(tiny_models["llama"][0], **ENGINE)
    runner = ModelRunner(llm.engine.model, 4, 16, True, attention_backend="triton")
    assert type(runner.attention) is TritonBackend and runner.attention_kernel == "Triton paged kernels"

    def scheduled(blocks, phase, start, n):
        req = Request("r", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=4))
        return ScheduledRequest(req, phase, start, n, block_ids=blocks)

    batch = runner.prepare([scheduled([3, 4, 5], Phase.PREFILL, 4, 6), scheduled([1, 2], Phase.DECODE, 6, 1)])
    meta = batch.meta
    assert isinstance(meta, PagedMetadata) and meta.num_decode == 1 and meta.num_prefill == 1
    assert meta.decode_context_lens.tolist() == [7] and meta.decode_block_tables.tolist() == [[1, 2]]
    assert meta.prefill_query_starts.tolist() == [1] and meta.prefill_query_lens.tolist() == [6]
    assert meta.prefill_context_lens.tolist() == [10] and meta.prefill_block_tables.tolist() == [[3, 4, 5]]
    assert meta.slot_mapping.tolist() == [2 * 4 + 2] + [16 + p % 4 if p < 8 else 20 + p % 4 for p in range(4, 10)]
