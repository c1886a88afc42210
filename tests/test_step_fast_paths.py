"""The decode step's shortcuts change no float: each is checked bit for bit against the longer way it replaces.

- projections hand the model their kernel's own output dtype (`raw`) where the next operation widens it anyway;
- RoPE carries rotate_half's minus sign in a signed sin, q and k rotated (and Qwen3-normed) as one tensor;
- RMSNorm's variance on CPU is mean()'s own sum-then-divide, in fewer calls;
- K and V are gathered from the pool in one call;
- a decode batch whose requests are all as long runs SDPA without a mask.
The C++ steps on CPU (decode attention over the pool, the layer's norms, RoPE and activation) are checked against
the torch calls they replace: bit for bit where they compute the same operations in the same order, to float
rounding where a sum or exp runs another way, and the greedy tokens the same with and without them.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.attention import AttentionMetadata, LayerKV, attention
from engine.models.llama import apply_rope, rms_norm
from engine.quant import linear, quantize_int8
from engine.runner import ModelRunner
from tests.test_parity import random_prompts

LOGPROBS = SamplingParams(temperature=0, max_tokens=12, logprobs=5, prompt_logprobs=3)
PRECISIONS = {"fp32": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
              "w8a8": {"quantization": "w8a8"}, "int4 in bf16": {"quantization": "int4", "dtype": "bfloat16"},
              "int8 + int8 KV": {"quantization": "int8", "kv_cache_dtype": "int8"}}


def arch_matrix(precisions) -> list:
    """(arch, precision) for every precision on both families; `make test-fast` keeps llama at each precision and
    qwen3 at fp32 (its own q/k norms and untied head), `make test` runs the whole matrix."""
    return [pytest.param(arch, precision, marks=[pytest.mark.slow] if arch == "qwen3" and precision != "fp32" else [])
            for arch in ("llama", "qwen3") for precision in precisions]


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(prompts, LOGPROBS)]


@pytest.mark.parametrize("arch,precision", arch_matrix(PRECISIONS))
def test_projections_left_in_their_kernels_dtype_change_no_float(tiny_models, monkeypatch, arch, precision):
    llm = LLM(tiny_models[arch][0], max_model_len=256, **PRECISIONS[precision])
    llm.engine.runner.model.decoder_stack = None  # the Python loop's shortcut (the C++ stack's: below)
    prompts = random_prompts(3, seed=4)
    fast = outputs(llm, prompts)
    # the longer way: every projection's result cast to the model's dtype at once, as before the shortcut
    for cls in linear.PROJECTION_TYPES:
        monkeypatch.setattr(cls, "raw", lambda self, x, raw=cls.raw: raw(self, x).to(x.dtype))
    assert outputs(llm, prompts) == fast


def test_the_weight_only_kernels_hand_back_their_own_dtype_to_an_fp32_model_and_the_models_dtype_otherwise():
    w = torch.randn(32, 64)
    for proj in (linear.Int8Linear(w), linear.Int4Linear(w, 32)):
        # torch's kernels compute in bf16; the engine's C++ ones (AVX-512) in fp32
        assert proj.raw(torch.randn(3, 64)).dtype == (torch.float32 if "C++" in proj.kernel else torch.bfloat16)
        assert proj(torch.randn(3, 64)).dtype == torch.float32
        assert proj.raw(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
        assert torch.equal(proj.raw(x := torch.randn(2, 64)).float(), proj(x))


def test_rope_matches_transformers_bit_for_bit():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(5, 4, 64, generator=g).to(dtype), torch.randn(5, 2, 64, generator=g).to(dtype)
        angles = torch.rand(5, 32, generator=g) * 100
        cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
        signed_sin = torch.cat((-sin[:, :32], sin[:, 32:]), -1)
        # transformers' [batch, heads, seq, dim]; ours [tokens, heads, dim], q and k as one tensor
        ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
        qk = apply_rope(torch.cat((q, k), 1), cos.unsqueeze(1), signed_sin.unsqueeze(1))
        assert torch.equal(qk[:, :4], ref_q[0].transpose(0, 1)) and torch.equal(qk[:, 4:], ref_k[0].transpose(0, 1))
    # a bf16 kernel's output into fp32 tables: the same floats as casting it first
    x = torch.randn(5, 6, 64, generator=g).to(torch.bfloat16)
    cos, sin = torch.randn(5, 1, 64, generator=g), torch.randn(5, 1, 64, generator=g)
    assert torch.equal(apply_rope(x, cos, sin), apply_rope(x.float(), cos, sin))


def test_rms_norm_is_transformers_formula_bit_for_bit():
    def reference(x, weight, eps):  # transformers' LlamaRMSNorm
        dtype = x.dtype
        x = x.float()
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 17):
        for dim in (64, 576, 1536, 3072):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, dim, generator=g) * torch.rand(1, generator=g) * 50).to(dtype)
                weight = torch.randn(dim, generator=g).to(dtype)
                assert torch.equal(rms_norm(x, weight, 1e-6), reference(x, weight, 1e-6))


@pytest.mark.parametrize("int8", [False, True])
def test_one_gather_of_k_and_v_reads_what_two_did(int8):
    g = torch.Generator().manual_seed(0)
    pair = torch.randn(2, 40, 3, 16, generator=g)
    scales = None
    if int8:
        pair, scales = quantize_int8(pair)
    slots = torch.randperm(40, generator=g)[:17]
    one = LayerKV.of(pair, scales).read(slots, torch.float32)
    two = LayerKV(pair[0], pair[1], *(() if scales is None else (scales[0], scales[1]))).read(slots, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_decodes_all_as_long_need_no_mask_and_get_the_same_floats():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, n = 6, 2, 32, 23
    pair = torch.randn(2, 64, kv_heads, d, generator=g)
    q, k, v = torch.randn(2, heads, d, generator=g), torch.randn(2, kv_heads, d, generator=g), torch.randn(
        2, kv_heads, d, generator=g)
    slots = torch.stack((torch.arange(n), torch.arange(n) + 30))
    meta = {mask: AttentionMetadata(slot_mapping=slots[:, -1], num_decode=2, decode_slots=slots,
                                    decode_mask=torch.zeros(2, 1, 1, n) if mask else None) for mask in (True, False)}
    with_mask = attention(q, k, v, LayerKV.of(pair.clone()), meta[True])
    assert torch.equal(attention(q, k, v, LayerKV.of(pair.clone()), meta[False]), with_mask)
    assert with_mask.shape == (2, heads * d)


def test_the_runner_masks_only_decodes_of_different_lengths(tiny_models, monkeypatch):
    """(The SDPA path, as without the C++ decode attention, which reads each row's own length instead.)"""
    llm = LLM(tiny_models["llama"][0], max_model_len=256)
    llm.engine.runner.attention.decode_attention = None
    masks = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute",
                        lambda self, batch: (masks.append((batch.meta.num_decode, batch.meta.decode_mask)),
                                             execute(self, batch))[1])
    llm.generate([list(range(5, 25))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [m for b, m in masks if b] == [None] * 3  # one request decoding: no mask
    masks.clear()
    llm.generate([list(range(5, 25)), list(range(5, 12))], SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True))
    decode_masks = [m for b, m in masks if b == 2]
    assert decode_masks and all(m is not None and torch.isinf(m).any() for m in decode_masks)


@pytest.mark.parametrize("dtype,kv_int8", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                                           (torch.bfloat16, True)])
# 16-128: the AVX-512 loops where the CPU has them (bf16 pools with an even number of 16-float vectors, 32-128, score
# with AVX-512 BF16 dot products where it has those); 40: the portable ones
@pytest.mark.parametrize("d", [16, 32, 64, 128, 40])
# query heads per KV head: 3 (SmolLM2), 1 (no grouping), 5 and 8 (the AVX-512 loops take a group in chunks of 4)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (10, 2), (8, 1)])
@pytest.mark.usefixtures("two_threads")
def test_cpp_decode_attention_over_the_pool_matches_sdpa_over_the_gathered_batch(dtype, kv_int8, d, heads, kv_heads):
    """The engine's C++ decode attention (cpu_kernels.py) reads each row's own slots of the pool; the SDPA path
    gathers them into a padded batch with a mask. Same result to float rounding, for rows of different lengths,
    grouped-query heads and q as the strided view the model passes; an int8 pool read with its scales."""
    ext = cpu_kernels.compiled()
    assert ext is not None, "the engine's C++ CPU kernels did not build"
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, 9, 40, 17])
    b, width = len(lens), 48
    pair = torch.randn(2, 256, kv_heads, d, generator=g).to(dtype)
    scale_pair = None
    if kv_int8:
        pair, scale_pair = quantize_int8(pair.float())
    qk = torch.randn(b, heads + kv_heads, d, generator=g).to(dtype)
    q, k, v = qk[:, :heads], torch.randn(b, kv_heads, d, generator=g).to(dtype), torch.randn(
        b, kv_heads, d, generator=g).to(dtype)
    slots = torch.randperm(250, generator=g)[:b * width].view(b, width)
    new = slots[torch.arange(b), lens - 1]  # each row's token of this step sits at its last slot
    allowed = (torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)).view(b, 1, 1, width)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    def pool():
        return LayerKV.of(pair.clone(), None if scale_pair is None else scale_pair.clone())
    sdpa = attention(q, k, v, pool(), AttentionMetadata(
        slot_mapping=new, num_decode=b, decode_slots=slots, decode_mask=mask, kv_int8=kv_int8))
    cpp = attention(q, k, v, pool(), AttentionMetadata(
        slot_mapping=new, num_decode=b, decode_slots=slots, decode_attention=ext.decode_attention, decode_lens=lens,
        kv_int8=kv_int8))
    assert cpp.dtype == dtype and cpp.shape == (b, heads * d)
    torch.testing.assert_close(cpp, sdpa, atol=2e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5 if
                               dtype == torch.float32 else 1e-2)
    scales = () if scale_pair is None else (scale_pair[0], scale_pair[1])
    with pytest.raises(RuntimeError, match="1..W context slots"):
        ext.decode_attention(q, pair[0], pair[1], slots, torch.tensor([0, 1, 1, 1]), *scales)
    with pytest.raises(RuntimeError, match="contiguous pools"):
        ext.decode_attention(q, pair[0].transpose(0, 1), pair[1], slots, lens, *scales)
    with pytest.raises(RuntimeError, match="only one, has scales"):
        ext.decode_attention(q, pair[0], pair[1], slots, lens, *(() if kv_int8 else (lens.float(), lens.float())))


@pytest.mark.parametrize("dtype,kv_int8", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                                           (torch.bfloat16, True)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (10, 2)])
@pytest.mark.usefixtures("two_threads")
def test_cpp_attention_of_prefill_rows_matches_causal_sdpa(dtype, kv_int8, heads, kv_heads):
    """A step's prefill rows through the C++ kernel (runner.prepare's every-row path): each row reads its request's
    slot list up to its own position. Against torch's SDPA as the SDPA path runs them: causal over a fresh chunk,
    and with a cached context (a later chunk, or a prefix-cache hit) under an offset causal mask; with a decode row
    in the same call, and an int8 pool read with its scales."""
    ext = cpu_kernels.compiled()
    assert ext is not None, "the engine's C++ CPU kernels did not build"
    g, d = torch.Generator().manual_seed(2), 64
    pair = torch.randn(2, 300, kv_heads, d, generator=g).to(dtype)
    scale_pair = None
    if kv_int8:
        pair, scale_pair = quantize_int8(pair.float())
    # (context already in the pool, new rows): a decode row, a fresh 23-token prompt, a chunk of 17 after 30
    seqs = [(40, 1), (0, 23), (30, 17)]
    lists = torch.randperm(290, generator=g)[:3 * 48].view(3, 48)
    rows = sum(n for _, n in seqs)
    q = torch.randn(rows, heads, d, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    new = torch.cat([lists[i, c:c + n] for i, (c, n) in enumerate(seqs)])
    which = torch.repeat_interleave(torch.arange(3), torch.tensor([n for _, n in seqs]))
    lens = torch.cat([torch.arange(c + 1, c + n + 1) for c, n in seqs])

    def pool():
        return LayerKV.of(pair.clone(), None if scale_pair is None else scale_pair.clone())
    cache = pool()
    cpp = attention(q, k, v, cache, AttentionMetadata(
        slot_mapping=new, num_decode=1, decode_slots=lists, decode_attention=ext.decode_attention, decode_lens=lens,
        decode_lists=which, kv_int8=kv_int8, write_kv=ext.write_kv))
    assert cpp.dtype == dtype and cpp.shape == (rows, heads * d)
    # the reference: every row's keys and values as the pool holds them after the write, attended with SDPA
    written = pool()
    attention(q, k, v, written, AttentionMetadata(slot_mapping=new, kv_int8=kv_int8))  # the SDPA path's write
    row = 0
    for i, (c, n) in enumerate(seqs):
        kc, vc = (t.float() for t in written.read(lists[i, :c + n], torch.float32))
        allowed = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
        mask = torch.zeros(n, c + n).masked_fill_(~allowed, float("-inf"))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[row:row + n].float().transpose(0, 1).unsqueeze(0), kc.transpose(0, 1).unsqueeze(0),
            vc.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=heads != kv_heads)
        ref = ref[0].transpose(0, 1).reshape(n, heads * d)
        torch.testing.assert_close(cpp[row:row + n].float(), ref, atol=2e-5 if dtype == torch.float32 else 2e-2,
                                   rtol=1e-4 if dtype == torch.float32 else 2e-2)
        row += n
    assert torch.equal(cache.k, written.k) and torch.equal(cache.v, written.v)  # the write, the same either way
    with pytest.raises(RuntimeError, match="a row's list is past slots"):
        ext.decode_attention(q, cache.k, cache.v, lists, lens, cache.k_scale, cache.v_scale, which + 1)
    with pytest.raises(RuntimeError, match="1..W context slots"):
        ext.decode_attention(q, cache.k, cache.v, lists, lens + 40, cache.k_scale, cache.v_scale, which)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("budget", [None, 16])  # 16: prompts prefilled in chunks, each after its cached context
def test_greedy_tokens_are_the_same_with_and_without_the_cpp_decode_attention(tiny_models, kv_cache_dtype, budget,
                                                                               monkeypatch):
    """With the C++ kernel every row of a step (prefill chunks, prefix-cache hits, decodes) attends over the pool;
    without it prefills run torch's SDPA. The same greedy tokens either way, and the kernel did take the prefills."""
    llm = LLM(tiny_models["llama"][0], max_model_len=256, kv_cache_dtype=kv_cache_dtype,
              max_num_batched_tokens=budget, block_size=4)
    assert llm.engine.runner.attention.decode_attention is not None
    shared = list(range(40, 52))  # three prompts share 12 tokens: three blocks of the prefix cache
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 41, 9)] + [shared + [100 + i] * (i + 2) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    every_row = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, batch: (
        every_row.append(batch.meta.decode_lists is not None), execute(self, batch))[1])
    with_cpp = [o.token_ids for o in llm.generate(prompts, params)]
    assert any(every_row), "no prefill went through the C++ kernel"
    assert llm.engine.kv.prefix_cache_hits > 0  # and the shared prompts read their prefix from the cache
    llm.engine.runner.attention.decode_attention = None
    every_row.clear()
    assert [o.token_ids for o in llm.generate(prompts, params)] == with_cpp
    assert not any(every_row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("two_threads")
def test_cpp_kv_write_stores_quantize_int8s_integers_and_scales_bit_for_bit(dtype):
    ext = cpu_kernels.compiled()
    if ext is None:
        pytest.skip("the C++ kernels did not build here")
    g = torch.Generator().manual_seed(0)
    qk = (torch.randn(5, 12, 64, generator=g) * torch.logspace(-3, 2, 12).view(1, 12, 1)).to(dtype)
    k = qk[:, 9:]  # a strided view of q|k, as the model hands it over
    v = (torch.randn(5, 3, 64, generator=g) * 3).to(dtype)
    v[2, 1] = 0  # an all-zero row: the tiny scale
    v[3, 0, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])  # scale 1: halves round to even
    slots = torch.tensor([7, 0, 3, 11, 5])
    pools = [torch.full((12, 3, 64), 99, dtype=torch.int8) for _ in range(2)]
    scales = [torch.full((12, 3), -1.0) for _ in range(2)]
    ext.write_kv(k, v, slots, *pools, *scales)
    for x, pool, scale in zip((k, v), pools, scales, strict=True):
        q, s = quantize_int8(x)
        assert torch.equal(pool[slots], q) and torch.equal(scale[slots], s)
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[slots] = False
        assert (pool[untouched] == 99).all() and (scale[untouched] == -1).all()  # only the given slots written
    with pytest.raises(RuntimeError, match="past the pool"):
        ext.write_kv(k, v, torch.tensor([0, 1, 2, 3, 12]), *pools, *scales)
    with pytest.raises(RuntimeError, match="only one, has scales"):
        ext.write_kv(k, v, slots, *pools)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_kv_write_into_a_pool_of_the_models_dtype_is_index_copy(dtype):
    """The one C++ call that replaced the two scatters writes what index_copy_ writes, where it writes it, and
    refuses what would write elsewhere."""
    ext = cpu_kernels.compiled()
    if ext is None:
        pytest.skip("the C++ kernels did not build here")
    g = torch.Generator().manual_seed(3)
    qk = torch.randn(4, 12, 64, generator=g).to(dtype)
    k, v = qk[:, 9:], torch.randn(4, 3, 64, generator=g).to(dtype)  # k: a strided view, as the model hands it over
    slots = torch.tensor([7, 0, 3, 11])
    pools = [torch.full((12, 3, 64), 5.0, dtype=dtype) for _ in range(2)]
    expected = [p.clone().index_copy_(0, slots, x) for p, x in zip(pools, (k, v), strict=True)]
    ext.write_kv(k, v, slots, *pools)
    assert all(torch.equal(p, e) for p, e in zip(pools, expected, strict=True))
    with pytest.raises(RuntimeError, match="past the pool"):
        ext.write_kv(k, v, torch.tensor([0, 1, 2, 12]), *pools)
    with pytest.raises(RuntimeError, match="k's dtype or int8"):
        ext.write_kv(k, v, slots, *(p.to(torch.float16) for p in pools))
    with pytest.raises(RuntimeError, match="only one, has scales"):
        ext.write_kv(k, v, slots, *pools, torch.ones(12, 3), torch.ones(12, 3))


@pytest.mark.parametrize("arch,dtype,kv,smoothing", [("llama", "float32", "int8", False),
                                                     ("llama", "float32", "int8", True),
                                                     ("qwen3", "bfloat16", "int8", True),
                                                     ("llama", "bfloat16", "auto", False)])
def test_greedy_tokens_are_the_same_with_and_without_the_cpp_kv_write(tiny_models, arch, dtype, kv, smoothing):
    llm = LLM(tiny_models[arch][0], max_model_len=256, dtype=dtype, kv_cache_dtype=kv,
              kv_cache_smoothing=smoothing)
    assert llm.engine.runner.attention.write_kv is not None
    if smoothing:  # the keys' scales in the model's dtype, so a bf16 query stays bf16
        assert all(s.query.dtype == s.key_inverse.dtype == llm.engine.model.dtype for s in llm.engine.runner.key_scales)
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 41, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with_cpp = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.attention.write_kv = None
    assert [o.token_ids for o in llm.generate(prompts, params)] == with_cpp


# widths the AVX-512 loops take whole (16 lanes at a time), and ones that leave a scalar tail or none for them
@pytest.mark.parametrize("hidden,inter,head", [(576, 1536, 64), (100, 1000, 40)])
@pytest.mark.usefixtures("two_threads")
def test_cpp_layer_steps_match_the_torch_formulas(hidden, inter, head):
    """The C++ layer steps the model takes on CPU (models/llama.py, cpu_kernels.py): RoPE bit for bit; the norm and
    silu(gate) * up to float rounding (a row's sum of squares and exp's last bits run another way); the residual
    added in place exactly as x + residual; a result handed over in bf16 is the bf16 cast of the other."""
    import torch.nn.functional as F
    ext = cpu_kernels.compiled()
    assert ext is not None, "the engine's C++ CPU kernels did not build"
    g = torch.Generator().manual_seed(3)
    rows = 19  # past the kernels' 8 rows a task: split between the test's two threads
    for x_dtype, r_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                             (torch.bfloat16, torch.bfloat16)):
        x = (torch.randn(rows, hidden, generator=g) * 4).to(x_dtype)
        residual = torch.randn(rows, hidden, generator=g).to(r_dtype)
        weight = torch.rand(hidden, generator=g).to(x_dtype)
        summed = x + residual
        h = ext.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(x, summed) and h.dtype == x_dtype
        torch.testing.assert_close(h, rms_norm(summed, weight, 1e-5), rtol=2e-6 if x_dtype == torch.float32 else 0,
                                   atol=1e-6 if x_dtype == torch.float32 else 1e-2)
        assert torch.equal(ext.add_rms_norm(x.clone(), None, weight, 1e-5, torch.bfloat16),
                           ext.add_rms_norm(x.clone(), None, weight, 1e-5).to(torch.bfloat16))
    for x_dtype, table_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                 (torch.bfloat16, torch.bfloat16)):
        qkv = torch.randn(rows, 15 * head, generator=g).to(x_dtype)
        qk = qkv[:, :12 * head].view(rows, 12, head)  # the strided view the model passes
        cos = torch.randn(50, head, generator=g).to(table_dtype)
        sin = torch.randn(50, head, generator=g).to(table_dtype)
        positions = torch.cat([torch.tensor([3, 7, 49, 0]), torch.randint(0, 50, (rows - 4,), generator=g)])
        assert torch.equal(ext.rope(qk, cos, sin, positions),
                           apply_rope(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)))
    for in_dtype, dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                            (torch.bfloat16, torch.bfloat16)):
        gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(in_dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        out = ext.silu_mul(gate_up, dtype)
        torch.testing.assert_close(out, F.silu(gate.to(dtype)) * up, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(ext.silu_mul(gate_up, dtype, torch.bfloat16), out.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be a contiguous"):
        ext.add_rms_norm(torch.randn(2, 3, 4), None, torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="past the table"):
        ext.rope(torch.randn(1, 2, 8), torch.ones(4, 8), torch.ones(4, 8), torch.tensor([4]))
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ext.silu_mul(torch.randn(2, 5), torch.float32)


@pytest.mark.parametrize("arch,precision", arch_matrix(["fp32", "int4", "w8a8", "int4 in bf16"]))
def test_greedy_tokens_and_logprobs_with_and_without_the_cpp_layer_steps(tiny_models, arch, precision):
    llm = LLM(tiny_models[arch][0], max_model_len=256, **PRECISIONS[precision])
    model = llm.engine.runner.model
    assert model.cpu_ops is not None
    prompts = random_prompts(4, seed=5)
    with_cpp = outputs(llm, prompts)
    model.cpu_ops = None
    without = outputs(llm, prompts)
    assert [o[0] for o in without] == [o[0] for o in with_cpp]
    # logprobs to float rounding, which the int4 kernel's bf16 activations can make a step of bf16 rounding
    tolerance = 0.1 if "int4" in precision else 1e-3
    for a, b in zip(with_cpp, without, strict=True):
        for pa, pb in zip(a[1], b[1], strict=True):
            assert pa.keys() == pb.keys() and all(abs(pa[t] - pb[t]) < tolerance for t in pa)


def test_cpp_layer_steps_take_a_batch_with_no_rows():
    """A step with nothing to sample hands the final norm no rows (an empty tensor's data pointer is null)."""
    ext = cpu_kernels.compiled()
    for dtype in (torch.float32, torch.bfloat16):
        empty = torch.empty(0, 8, dtype=dtype)
        assert ext.add_rms_norm(empty, empty.clone(), torch.ones(8, dtype=dtype), 1e-5).shape == (0, 8)
        assert ext.silu_mul(empty, dtype).shape == (0, 4)
        assert ext.rope(empty.view(0, 2, 4), torch.ones(3, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype),
                        torch.empty(0, dtype=torch.long)).shape == (0, 2, 4)


class CountingStack:
    """A model's DecoderStack that counts the steps it runs."""

    def __init__(self, stack) -> None:
        self.stack, self.runs = stack, 0

    def run(self, *args, **kwargs):
        self.runs += 1
        return self.stack.run(*args, **kwargs)


STACK_PRECISIONS = {**PRECISIONS, "bf16": {"dtype": "bfloat16"},
                    "int4 preset": {"quantization": "int4", "quantize_lm_head": "int8", "kv_cache_dtype": "int8",
                                    "kv_cache_smoothing": True},
                    "int4 preset in bf16": {"quantization": "int4", "dtype": "bfloat16", "kv_cache_dtype": "int8",
                                            "kv_cache_smoothing": True}}


@pytest.mark.parametrize("arch,precision", [("llama", p) for p in STACK_PRECISIONS] +
                         [("qwen2", p) for p in ("fp32", "int4", "bf16", "int4 in bf16")] + [("qwen3", "int4")])
def test_the_decoder_stack_gives_the_python_loops_floats(tiny_models, arch, precision):
    """Every layer of a step in one C++ call (cpu_kernels.cpp's DecoderStack) runs the loop's kernels in its order:
    the same tokens, logprobs and prompt logprobs, float for float, as the loop over the layers in Python; taken
    wherever every projection runs on the engine's own kernel and the layer has no step it lacks (Qwen3's q and k
    norms, fbgemm's w8a8)."""
    llm = LLM(tiny_models[arch][0], max_model_len=256, **STACK_PRECISIONS[precision])
    model = llm.engine.runner.model
    layer_projections = model.projections()[:-1]
    runs_here = model.cpu_ops is not None and arch != "qwen3" and all(p.cpp_plan() is not None
                                                                      for p in layer_projections)
    assert (model.decoder_stack is not None) == runs_here
    if not runs_here:
        return
    model.decoder_stack = counting = CountingStack(model.decoder_stack)
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 41, 9)]
    with_stack = outputs(llm, prompts)
    assert counting.runs >= 12  # the decode steps at least (an int8 pool's prefills take the loop)
    model.decoder_stack = None
    assert outputs(llm, prompts) == with_stack


def test_the_decoder_stack_checks_a_steps_inputs_once_and_refuses_bad_ones(tiny_models):
    """The stack hands its kernels pointers, not tensors, so it checks the step itself: a slot past the pool, a
    position past the RoPE tables, a row reading no context or past its list, a pool of another layout each raise
    an error naming the problem, before any layer runs (x, which the first norm adds into, stays as it was)."""
    llm = LLM(tiny_models["llama"][0], max_model_len=64)
    model, runner = llm.engine.runner.model, llm.engine.runner
    stack = model.decoder_stack
    if stack is None:
        pytest.skip("no C++ DecoderStack in this build")
    layers, slots = runner.kv_layers, runner.kv_layers[0].k.shape[0]
    hidden = model.embed.shape[1]

    def run(x=None, positions=(3,), slot_mapping=(5,), lens=(4,), lists=None, k_pools=None):
        x = torch.randn(1, hidden) if x is None else x
        long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        return stack.run(x, model.cos, model.signed_sin, long(positions),
                         k_pools=[c.k for c in layers] if k_pools is None else k_pools, v_pools=[c.v for c in layers],
                         k_scales=[], v_scales=[], slot_mapping=long(slot_mapping), slots=long([[0, 1, 2, 3, 4, 5]]),
                         lens=long(lens), lists=None if lists is None else long(lists), query_scales=[],
                         key_inverses=[])

    x = torch.randn(1, hidden)
    out, residual = run(x.clone())  # a good step runs
    assert out.shape == residual.shape == (1, hidden) and torch.isfinite(residual).all()
    for kwargs, message in [({"slot_mapping": (slots,)}, "past the pool"), ({"slot_mapping": (-1,)}, "past the pool"),
                            ({"positions": (model.cos.shape[0],)}, "past the table"),
                            ({"lens": (0,)}, "context slots"), ({"lens": (7,)}, "context slots"),
                            ({"lists": (1,)}, "past slots"),
                            ({"k_pools": [c.k[:, :, :-1] for c in layers]}, "pools must be")]:
        before = x.clone()
        with pytest.raises(RuntimeError, match=message):
            run(x, **kwargs)
        assert torch.equal(x, before)
