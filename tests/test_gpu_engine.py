"""The GPU engine's parts that can be checked without a GPU: the random architectures, the CUDA-graph buckets and
padding rule (run through the real model on CPU, in Triton's interpreter), and the refusals on CPU."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_triton_attention.py)

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graphs import StaticDecodeInputs, batch_buckets, bucket_for, check_cuda_graphs  # noqa: E402
from engine.factory import resolve_attention_backend, resolve_dtype  # noqa: E402
from engine.models import random_models as rm  # noqa: E402


def num_parameters(config) -> int:
    """Parameters of the architecture (a tied head counted once), from the config alone."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * inter
    if type(config).__name__.startswith("Qwen3"):
        layer += 2 * head_dim
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.vocab_size * h + config.num_hidden_layers * layer + h + head


# ---- random:NAME --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params,non_embedding", [
    ("qwen3-0.6b", 0.596e9, 0.44e9),  # the model card: 0.6B, 0.44B without embeddings
    ("smollm2-135m", 134.5e6, None),
    ("llama-1b", 1.236e9, 0.974e9),  # Llama-3.2-1B: 1.24B (1.23B), tied head
])
def test_random_architectures_have_the_published_sizes(name, params, non_embedding):
    config = rm.hf_config(name)
    n = num_parameters(config)
    assert abs(n - params) / params < 0.01, n
    if non_embedding:
        assert abs(n - config.vocab_size * config.hidden_size - non_embedding) / non_embedding < 0.02


def test_random_weights_are_seeded_and_shaped_like_the_architecture():
    config = rm.hf_config("qwen3-0.6b", num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=300,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    a = rm.random_state_dict(config, 0, torch.float32, torch.device("cpu"))
    b = rm.random_state_dict(config, 0, torch.float32, torch.device("cpu"))
    c = rm.random_state_dict(config, 1, torch.float32, torch.device("cpu"))
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["model.embed_tokens.weight"],
                                                                        c["model.embed_tokens.weight"])
    assert sum(t.numel() for t in a.values()) == num_parameters(config)
    assert a["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert "model.layers.0.self_attn.q_norm.weight" in a  # Qwen3's q/k norms


def test_random_smollm2_135m_generates_from_token_ids():
    llm = LLM("random:smollm2-135m", max_model_len=64, num_kv_blocks=16, max_num_seqs=2)
    s = llm.engine.model.shape
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.vocab_size) == (30, 576, 9, 3, 49152)
    outs = llm.generate([[1, 2, 3, 4, 5], [400, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert [len(o.token_ids) for o in outs] == [3, 3] and outs[0].finish_reason == "length"
    assert outs[0].text == "".join(f"<{t}>" for t in outs[0].token_ids)
    with pytest.raises(ValueError, match="pass the prompt as a list of token ids"):
        llm.generate("hello")


def test_unknown_random_architecture_is_refused():
    with pytest.raises(ValueError, match="unknown random architecture 'gpt-5'.*random:qwen3-0.6b"):
        LLM("random:gpt-5")


# ---- CUDA graphs: buckets, padding, refusals ---------------------------------------------------------------
def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    buckets = batch_buckets(48)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32, 48, 48]
    assert bucket_for(49, buckets) is None  # larger than any graph: runs eagerly


def test_padded_decode_rows_write_only_the_scratch_block_and_leave_real_rows_unchanged(tiny_models):
    """The graph's inputs, run eagerly on CPU: 3 real decodes padded to the 4-bucket give the real rows' logits
    of the unpadded batch, and the padding writes K/V only into the scratch block."""
    folder, _ = tiny_models["llama"]
    llm = LLM(folder, attention_backend="triton", block_size=4, num_kv_blocks=32, max_num_seqs=4, dtype="float32")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for prompt in ([5, 6, 7, 8, 9], [10, 11], list(range(30, 41))):
        engine.add_request(prompt, params)
    engine.step()  # the prefills; the next step is three decodes
    sched = engine.scheduler.schedule()
    assert [s.phase.value for s in sched.scheduled] == ["decode"] * 3
    batch = engine.runner.prepare(sched.scheduled)
    model, cache = engine.model, engine.runner.kv_cache
    scratch = 32  # the block after the pool's 32
    big = torch.zeros(cache.shape[0], cache.shape[1], (scratch + 1) * 4, *cache.shape[3:])
    big[:, :, :scratch * 4] = cache
    eager_cache = big.clone()
    eager = model.forward(batch.input_ids, batch.positions, batch.meta, _layers(eager_cache), batch.logits_rows)
    inputs = StaticDecodeInputs(max_rows=4, table_width=8, block_size=4, scratch_block=scratch,
                                device=torch.device("cpu"))
    inputs.fill(batch.input_ids, batch.positions, batch.meta, bucket=4)
    assert inputs.slot_mapping[3] == scratch * 4 and inputs.context_lens[3] == 1
    assert inputs.block_tables[3, 0] == scratch
    padded_cache = big.clone()
    padded = model.forward(inputs.input_ids, inputs.positions, inputs.meta(4), _layers(padded_cache),
                           inputs.logits_rows)
    assert padded.shape[0] == 4
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(padded_cache[:, :, :scratch * 4], eager_cache[:, :, :scratch * 4])
    assert not torch.equal(padded_cache[:, :, scratch * 4], eager_cache[:, :, scratch * 4])  # padding went there


def test_cuda_graphs_are_refused_on_cpu_never_silently_off(tiny_models):
    folder, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="cuda_graphs=True captures CUDA graphs: it needs a CUDA GPU"):
        LLM(folder, cuda_graphs=True, num_kv_blocks=16)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="needs attention_backend='triton'"):
        check_cuda_graphs(cuda, "sdpa", True)
    with pytest.raises(ValueError, match="needs kv_cache=True"):
        check_cuda_graphs(cuda, "triton", False)
    check_cuda_graphs(cuda, "triton", True)


def test_gpu_defaults_are_decided_by_the_device(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", cpu) == "float32" and resolve_dtype("auto", cuda) == "bfloat16"
    assert resolve_dtype("float16", cuda) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_dtype("auto", cuda) == "float16"  # a T4: bf16 only emulated
    assert resolve_attention_backend(EngineConfig(), cpu) == "sdpa"
    assert resolve_attention_backend(EngineConfig(), cuda) == "triton"
    assert resolve_attention_backend(EngineConfig(kv_cache=False), cuda) == "sdpa"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig.from_kwargs(attention_backend="flash")
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction"):
        EngineConfig.from_kwargs(gpu_memory_utilization=1.5)


# ---- python -m engine.bench gpu-check -------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_without_cuda(tmp_path, capsys):
    from engine.bench.cli import main
    assert main(["gpu-check", "--out", str(tmp_path)]) == 2
    assert "gpu-check needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.slow
def test_gpu_check_cpu_dry_run_runs_every_step_end_to_end(tmp_path, capsys):
    import json

    from engine.bench.cli import main
    assert main(["gpu-check", "--out", str(tmp_path), "--cpu-dry-run"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["parity"]["fp32_tiny"]["identical"]
    bf = report["parity"]["float32_random:qwen3-0.6b"]
    assert bf["top5_containment"] and all(len(r["engine"]) == 6 for r in bf["rows"])
    rows = {(r["batch"], r["attention_backend"], r["cuda_graphs"]) for r in report["sweep"]}
    assert rows == {(1, "sdpa", False), (1, "triton", False), (2, "sdpa", False), (2, "triton", False)}
    assert all(r["tps"] > 0 and r["tpot_ms"] > 0 for r in report["sweep"])
    assert report["hf"]["ratio"] > 0 and report["hf"]["batch"] == 2
    md = (tmp_path / "gpu_check.md").read_text()
    assert "CPU dry run" in md and "| Batch | Attention | CUDA graphs |" in md


def test_gpu_check_reports_a_failed_section_and_runs_the_rest(tmp_path, capsys, monkeypatch):
    import json

    from engine.bench import gpu_check
    from engine.bench.cli import main

    def broken(plan):
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(gpu_check, "parity", broken)
    assert main(["gpu-check", "--out", str(tmp_path), "--cpu-dry-run", "--only", "parity,hf"]) == 1
    assert "failed: parity" in capsys.readouterr().err
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parity"]["error"] == "RuntimeError: kernel exploded"
    assert "in broken" in report["parity"]["traceback"]
    assert report["hf"]["hf_tps"] > 0 and report["hf"]["ratio"] is None  # ran after it; no sweep to compare
    assert "sweep" not in report and "tests" not in report
    md = (tmp_path / "gpu_check.md").read_text()
    assert "Section parity FAILED: RuntimeError: kernel exploded" in md and "HF `generate` at batch 2" in md
    assert main(["gpu-check", "--out", str(tmp_path), "--cpu-dry-run", "--only", "parity,benchmarks"]) == 2
    assert "unknown gpu-check section(s) ['benchmarks']" in capsys.readouterr().err


def _layers(cache: torch.Tensor) -> list:
    """The model reads the pool as each layer's slice (what the runner hands it)."""
    from engine.attention import LayerKV
    return [LayerKV(cache[i, 0], cache[i, 1]) for i in range(cache.shape[0])]
