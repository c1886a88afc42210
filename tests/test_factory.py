"""engine/factory.py: every automatic setting decided in one place, what was asked kept beside what was chosen, and
an engine that runs only a decided configuration."""
from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, factory
from engine.factory import resolve, resolve_attention_backend, resolve_dtype, resolve_weights
from engine.llm import engine_for
from engine.models.random_models import load_random_model
from engine.quant.format import WeightFormat
from engine.quant.kernels import choose_kernel
from engine.reconfigure import Reconfiguration
from engine.service import EngineService

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The paged KV cache", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"][0], num_kv_blocks=32, max_model_len=128)


def greedy(engine) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, list(o.token_ids)) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def test_dtype_auto_on_cpu_is_float32_and_the_request_keeps_auto(llm):
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert llm.config.dtype == "float32" and llm.engine.config.dtype == "float32"
    assert llm.engine.requested.dtype == llm.reconfig.requested.dtype == "auto"
    assert llm.reconfig.resolved.chosen()["dtype"] == "float32"
    # the service's view (what the settings form reads): an engine of its own, as asked
    service = EngineService(engine_for(llm.reconfig.requested, llm.engine.model, llm.tokenizer,
                                       llm.engine.hf_config))
    try:
        view = service.config_view()
        assert view.requested["dtype"] == "auto" and view.resolved["dtype"] == "float32"
    finally:
        service.shutdown()


def test_an_explicit_dtype_is_kept_and_not_reported_as_chosen(llm):
    assert resolve_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    engine = llm.build_engine({"dtype": "float32"})
    assert engine.requested.dtype == engine.config.dtype == "float32"
    assert "dtype" not in Reconfiguration.of(engine).resolved.chosen()


def test_sizes_left_none_are_filled_and_reported(llm):
    requested = EngineConfig.from_kwargs(model=llm.config.model, max_model_len=None, num_kv_blocks=None)
    r = resolve(requested, llm.engine.model)
    assert r.requested.num_kv_blocks is None and r.requested.max_model_len is None
    assert r.config.max_model_len == llm.engine.model.max_len and r.config.num_kv_blocks > 0
    assert r.config.max_num_batched_tokens > 0
    chosen = r.chosen()
    assert {k: chosen[k] for k in ("max_model_len", "num_kv_blocks", "max_num_batched_tokens", "attention_backend",
                                   "dtype")} == {
        "max_model_len": r.config.max_model_len, "num_kv_blocks": r.config.num_kv_blocks,
        "max_num_batched_tokens": r.config.max_num_batched_tokens, "attention_backend": "sdpa", "dtype": "float32"}
    assert chosen["weights_kernel"].split(":")[0] in ("dense_matmul (C++)", "oneDNN", "x @ W")
    # a size given is kept, and not reported as chosen
    fixed = resolve(requested.replace(num_kv_blocks=7), llm.engine.model)
    assert fixed.config.num_kv_blocks == 7 and "num_kv_blocks" not in fixed.chosen()


def test_the_engine_reports_what_its_automatic_sizes_came_to(llm):
    engine = llm.build_engine({"num_kv_blocks": None})
    assert engine.requested.num_kv_blocks is None
    assert Reconfiguration.of(engine).resolved.chosen()["num_kv_blocks"] == engine.config.num_kv_blocks > 0


def test_attention_backend_none_is_sdpa_on_cpu_and_a_bad_one_is_refused(llm, monkeypatch):
    # tests/test_triton_attention.py sets Triton's CPU interpreter on for the whole session when it is collected
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert resolve_attention_backend(EngineConfig(), cpu) == "sdpa"
    assert llm.engine.requested.attention_backend is None and llm.engine.config.attention_backend == "sdpa"
    with pytest.raises(ValueError, match="triton"):
        resolve_attention_backend(EngineConfig(attention_backend="triton"), cpu)
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        llm.build_engine({"attention_backend": "triton"})


def test_the_engine_refuses_an_undecided_dtype(llm):
    config = llm.config.replace(dtype="auto")
    with pytest.raises(ValueError, match="dtype='auto'.*engine/factory.py"):
        LLMEngine(config, llm.engine.model, llm.tokenizer, llm.engine.hf_config)
    with pytest.raises(ValueError, match="only in its dtype.*num_kv_blocks"):
        LLMEngine(llm.config, llm.engine.model, llm.tokenizer, requested=config.replace(num_kv_blocks=8))


def test_an_engine_built_through_the_factory_answers_as_one_built_with_the_decided_config(llm):
    requested = llm.config.replace(dtype="auto")
    through_factory = engine_for(requested, llm.engine.model, llm.tokenizer, llm.engine.hf_config)
    concrete = resolve_weights(requested, llm.engine.model.device)
    assert concrete.dtype == "float32"
    direct = LLMEngine(concrete, llm.engine.model, llm.tokenizer, llm.engine.hf_config)
    assert through_factory.requested.dtype == "auto" and direct.requested.dtype == "float32"
    assert through_factory.config == direct.config
    assert greedy(through_factory) == greedy(direct) == [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def test_the_weights_kernel_reported_is_the_one_each_projection_runs(monkeypatch):
    # down's K (48, the MLP's width) is not a multiple of 32 where qkv's, o's and gate|up's (64) are: on a CPU with
    # AVX-512 VNNI and the C++ kernels built, down runs int8_matmul and the others int8_matmul_vnni
    requested = EngineConfig(model="random:smollm2-135m", quantization="int8", max_model_len=64, num_kv_blocks=8)
    model = load_random_model(requested.model, torch.float32, torch.device("cpu"), 64,
                              weight_format=WeightFormat.of(requested), num_hidden_layers=1, hidden_size=64,
                              intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              vocab_size=300)[0]
    runs = {p.choice.kernel for w in model.layers for p in (w.qkv, w.o, w.gate_up, w.down)}
    reported = resolve(requested, model).chosen()["weights_kernel"]
    assert {k for k in runs if k in reported} == runs
    shown = model.kernels()  # the status line's and the Weights tab's words name each kernel that runs too
    shorts = {p.choice.short for w in model.layers for p in (w.qkv, w.o, w.gate_up, w.down)}
    assert all(k in shown["weights_kernel"] and k in shown["weights"] for k in shorts)
    # the same, whatever this CPU: the factory asks choose_kernel for each K, as each projection does
    with_vnni = type("WithVnni", (), {"vnni_available": staticmethod(lambda: True),
                                       "weight_only_available": staticmethod(lambda: True)})
    monkeypatch.setattr(factory, "choose_kernel", functools.partial(
        choose_kernel, features=frozenset({"avx512f", "avx512_vnni"}), extension=with_vnni))
    reported = resolve(requested, model).chosen()["weights_kernel"]
    assert reported.startswith("int8_matmul (C++) for K=48: 48 input features, not a multiple of 32")
    assert "; int8_matmul_vnni (C++) for K=64: " in reported
