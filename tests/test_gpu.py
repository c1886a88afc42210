"""GPU-marked tests: compiled Triton kernels, CUDA graphs, bf16 and the memory-sized pool, on a real CUDA device.

`python -m engine.bench gpu-check` runs them in their own process (`pytest -m gpu tests/test_gpu.py`), where the
kernels are compiled. Without CUDA (every CPU run, CI included) the CUDA-only ones are skipped and the two that
only need the kernels run on CPU in Triton's interpreter, so that this file cannot drift from the engine's API
unnoticed between GPU runs.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: on CPU its kernels run only interpreted

pytestmark = pytest.mark.gpu
# the half-precision dtype the kernels are checked in: bf16 on CUDA (the engine's default there); on CPU fp16, since
# Triton 3.9's interpreter computes bf16 wrongly (the fp32 and fp16 kernels matched a reference to 5e-4 there, the
# same bf16 kernel returned values of 8e8)
HALF = torch.bfloat16 if CUDA else torch.float16
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _compiled_on_cuda():
    if CUDA and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter is on in this session: run `pytest -m gpu tests/test_gpu.py` alone")


TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16, vocab_size=32768)
FIELDS = dict(max_model_len=128, block_size=16, num_kv_blocks=64, max_num_seqs=8)
PROMPTS = [[3, 17, 100, 42, 7, 250, 11], [5, 6, 300, 301, 9] * 5, [1000], list(range(2000, 2040))]


def _engine(dtype="float32", overrides=TINY, **fields):
    from engine.bench.gpu_check import random_engine
    return random_engine("random:qwen3-0.6b", dtype, DEVICE, overrides, {**FIELDS, **fields})


def _greedy(engine, n=24):
    from engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


@pytest.mark.slow
def test_triton_backend_matches_sdpa_in_fp32():
    sdpa = _greedy(_engine(attention_backend="sdpa"))
    triton = _greedy(_engine(attention_backend="triton", max_num_batched_tokens=32))  # chunked prefills too
    assert triton == sdpa


@needs_cuda
def test_cuda_graphs_replay_decodes_and_match_eager():
    eager = _engine(attention_backend="triton")
    graphed = _engine(attention_backend="triton", cuda_graphs=True)
    assert graphed.runner.graphs.buckets == [1, 2, 4, 8]
    replays = {"n": 0}
    real = graphed.runner.graphs.run

    def counting(*args):
        replays["n"] += 1
        return real(*args)

    graphed.runner.graphs.run = counting
    assert _greedy(graphed) == _greedy(eager)
    assert replays["n"] >= 20  # the decode steps went through the graphs, not the eager path


@needs_cuda
def test_bf16_is_the_default_dtype_on_cuda():
    from engine import LLM
    llm = LLM("random:smollm2-135m", device=DEVICE, max_model_len=64, num_kv_blocks=16)
    assert llm.config.dtype == "bfloat16" and llm.engine.model.dtype == torch.bfloat16
    assert llm.engine.config.attention_backend == "triton"


@needs_cuda
def test_kv_pool_is_sized_from_gpu_memory_utilization():
    # the full Qwen3-0.6B shape, so the pool is bounded by memory, not by max_num_seqs * max_model_len
    engine = _engine(dtype="bfloat16", overrides={}, num_kv_blocks=None, gpu_memory_utilization=0.3,
                     max_num_seqs=256, max_model_len=2048)
    plan = engine.snapshot().gpu_memory
    assert plan is not None and plan["utilization"] == 0.3
    budget = int(plan["total_bytes"] * 0.3 - plan["used_before_bytes"] - plan["activation_peak_bytes"])
    assert plan["kv_budget_bytes"] == budget > 0 and plan["activation_peak_bytes"] > 0
    per_block = engine.model.kv_bytes_per_token() * engine.config.block_size
    assert engine.config.num_kv_blocks == budget // per_block < 256 * 2048 // engine.config.block_size
    assert engine.runner.kv_cache_bytes == engine.config.num_kv_blocks * per_block
    free, total = torch.cuda.mem_get_info()
    assert total - free <= 0.3 * total + 2**30  # the card holds what the plan allowed (a GB of slack)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_kernel_matches_sdpa_in_half_precision(group):
    from engine.attention import sdpa as sdpa_mod
    from engine.attention import triton_paged as tp
    from engine.attention.paged import build_paged_metadata, host_to_device
    gen = torch.Generator(device=DEVICE).manual_seed(group)
    bs, kv_heads, d, lens = 16, 2, 128, [1, 17, 100, 300]
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    kc = torch.randn(num_blocks * bs, kv_heads, d, device=DEVICE, generator=gen).to(HALF)
    vc = torch.randn(num_blocks * bs, kv_heads, d, device=DEVICE, generator=gen).to(HALF)
    order = torch.randperm(num_blocks, device=DEVICE, generator=gen).tolist()
    tables, i = [], 0
    for n in lens:
        tables.append(order[i:i + -(-n // bs)])
        i += -(-n // bs)
    q = torch.randn(len(lens), kv_heads * group, d, device=DEVICE, generator=gen).to(HALF)
    meta = build_paged_metadata(list(zip(tables, lens)), [], [], bs, host_to_device(torch.device(DEVICE)))
    out = torch.empty_like(q)
    tp.decode_attention(q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, bs, out)
    width = max(lens)
    slots = torch.tensor([[t[p // bs] * bs + p % bs for p in range(n)] + [0] * (width - n)
                          for t, n in zip(tables, lens)], device=DEVICE)
    allowed = (torch.arange(width, device=DEVICE)[None] < torch.tensor(lens, device=DEVICE)[:, None])
    mask = torch.zeros(allowed.shape, device=DEVICE, dtype=HALF).masked_fill_(~allowed, float("-inf"))
    ref_meta = sdpa_mod.AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long, device=DEVICE),
                                          num_decode=len(lens), decode_slots=slots,
                                          decode_mask=mask.view(len(lens), 1, 1, width))
    same = ref_meta.slot_mapping  # the SDPA path's cache write made a no-op: slot 0 rewritten with itself
    ref = sdpa_mod.attention(q, kc[same].clone(), vc[same].clone(), sdpa_mod.LayerKV(kc, vc), ref_meta).view_as(q)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < 3e-2, err  # half precision: measured against the fp32-accumulating SDPA reference, not asserted equal


@needs_cuda
@pytest.mark.parametrize("group", [32, 128])
def test_int4_kernel_matches_the_dequantized_weights_on_cuda(group):
    from engine.quant import dequantize_int4, quantize_int4
    from engine.quant.linear import Int4Linear
    gen = torch.Generator(device="cuda").manual_seed(group)
    w = torch.randn(512, 1024, device="cuda", generator=gen) * 0.05
    x = torch.randn(5, 1024, device="cuda", generator=gen).bfloat16()
    layer = Int4Linear(w.bfloat16(), group)
    assert layer.kernel == "_weight_int4pack_mm" and layer.nbytes < w.numel() * 2 / 3
    q, scale, mid = quantize_int4(w.bfloat16(), group, torch.bfloat16)
    ref = x.float() @ dequantize_int4(q, scale, mid, torch.float32).t()
    err = ((layer(x).float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err  # bf16 activations and outputs: close, not equal


@needs_cuda
def test_int4_on_cuda_graphs_replay_as_eager_runs():
    eager = _greedy(_engine("bfloat16", quantization="int4", attention_backend="triton"))
    graphed = _engine("bfloat16", quantization="int4", attention_backend="triton", cuda_graphs=True)
    assert graphed.model.layers[0].qkv.kernel == "_weight_int4pack_mm"
    assert _greedy(graphed) == eager
