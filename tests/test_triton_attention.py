"""The triton backend's kernels, run on CPU tensors in Triton's interpreter, against the SDPA reference path;
then the whole engine with attention_backend="triton" against "sdpa" (identical greedy tokens, fp32).

TRITON_INTERPRET must be set before triton is first imported; nothing else in the test session imports it.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.attention import LayerKV, PagedMetadata, attention  # noqa: E402
from engine.attention import sdpa as sdpa_mod  # noqa: E402
from engine.attention import triton_paged as tp  # noqa: E402
from engine.attention.paged import build_paged_metadata, host_to_device  # noqa: E402

HEAD_DIM = 16


def _pool(num_blocks: int, block_size: int, kv_heads: int, gen: torch.Generator):
    shape = (num_blocks * block_size, kv_heads, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _tables(lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> list[list[int]]:
    """Each sequence's blocks drawn from a shuffled pool: out of order, with holes (blocks nobody owns) between."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in lens:
        k = -(-n // block_size)
        tables.append(order[i:i + k])
        i += k + 1  # skip one: a hole whose garbage must never be read
    assert i <= num_blocks + 1
    return tables


def _slots(table: list[int], start: int, end: int, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


def test_store_kv_writes_each_token_into_its_slot_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(0)
    kc, vc = torch.zeros(40, 3, HEAD_DIM), torch.zeros(40, 3, HEAD_DIM)
    k, v = torch.randn(6, 3, HEAD_DIM, generator=gen), torch.randn(6, 3, HEAD_DIM, generator=gen)
    slots = torch.tensor([17, 3, -1, 39, 0, 22])
    tp.store_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    ref_k[slots[keep]], ref_v[slots[keep]] = k[keep], v[keep]
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def _sdpa_over_cache(q, kc, vc, meta):
    """The SDPA path over K/V already in the cache: its write is made a no-op (slot 0 rewritten with itself)."""
    meta.slot_mapping = torch.zeros(q.shape[0], dtype=torch.long)
    k, v = kc[meta.slot_mapping].clone(), vc[meta.slot_mapping].clone()
    return sdpa_mod.attention(q, k, v, LayerKV(kc, vc), meta).view_as(q)


def _sdpa_decode_meta(tables, lens, bs):
    width = max(lens)
    slots = torch.tensor([_slots(t, 0, n, bs) + [0] * (width - n) for t, n in zip(tables, lens)])
    allowed = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None]).view(len(lens), 1, 1, width)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    return slots, mask


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_kernel_matches_sdpa_on_shuffled_tables(group, block_size):
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    kv_heads = 2
    lens = [1, 5, block_size, 37, 70]  # one token, odd, exactly a block, several tiles with a partial last one
    num_blocks = sum(-(-n // block_size) + 1 for n in lens) + 3
    kc, vc = _pool(num_blocks, block_size, kv_heads, gen)
    tables = _tables(lens, block_size, num_blocks, gen)
    q = torch.randn(len(lens), kv_heads * group, HEAD_DIM, generator=gen)
    meta = build_paged_metadata(list(zip(tables, lens)), [], [], block_size, host_to_device(torch.device("cpu")))
    out = torch.full_like(q, float("nan"))
    tp.decode_attention(q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, block_size, out)
    slots, mask = _sdpa_decode_meta(tables, lens, block_size)
    ref_meta = sdpa_mod.AttentionMetadata(slot_mapping=None, num_decode=len(lens), decode_slots=slots,
                                          decode_mask=mask)
    ref = _sdpa_over_cache(q, kc, vc, ref_meta)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


# group 8 takes Triton's interpreter ~3 s (1 and 3 already cover one head per group and a group that is no power of
# two): `make test` runs it, `make test-fast` leaves it out
@pytest.mark.parametrize("group", [1, 3, pytest.param(8, marks=pytest.mark.slow)])
def test_prefill_kernel_matches_sdpa_over_cached_prefix_and_new_tokens(group):
    gen = torch.Generator().manual_seed(7 + group)
    block_size, kv_heads = 4, 2
    seqs = [(0, 7), (13, 5), (32, 33), (5, 1), (0, 19)]  # (tokens already cached, new tokens)
    lens = [c + n for c, n in seqs]
    num_blocks = sum(-(-n // block_size) + 1 for n in lens) + 2
    kc, vc = _pool(num_blocks, block_size, kv_heads, gen)
    tables = _tables(lens, block_size, num_blocks, gen)
    total = sum(n for _, n in seqs)
    q = torch.randn(total, kv_heads * group, HEAD_DIM, generator=gen)
    prefills, starts, row = [], [], 0
    for t, (c, n) in zip(tables, seqs):
        prefills.append((t, row, n, c + n))
        starts.append(row)
        row += n
    meta = build_paged_metadata([], prefills, [], block_size, host_to_device(torch.device("cpu")))
    out = torch.full_like(q, float("nan"))
    tp.prefill_attention(q, kc, vc, meta.prefill_block_tables, meta.prefill_query_starts, meta.prefill_query_lens,
                         meta.prefill_context_lens, meta.max_prefill_query_len, block_size, out)
    ref_meta = sdpa_mod.AttentionMetadata(slot_mapping=None)
    for t, (c, n), r in zip(tables, seqs, starts):
        seq = sdpa_mod.PrefillSeq(r, n, torch.tensor(_slots(t, 0, c + n, block_size)))
        allowed = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
        seq.mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        ref_meta.prefills.append(seq)
    ref = _sdpa_over_cache(q, kc, vc, ref_meta)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_mixed_step_stores_new_kv_then_attends_like_sdpa():
    """One call with decodes and prefills, new K/V not yet in the cache: the dispatcher's triton path writes them
    and attends; the SDPA path on a copy of the same cache must give the same output and the same cache."""
    gen = torch.Generator().manual_seed(3)
    block_size, kv_heads, group = 8, 2, 3
    decodes = [9, 24]  # context lengths including the new token
    prefills = [(0, 11), (16, 6)]  # (cached, new)
    lens = decodes + [c + n for c, n in prefills]
    num_blocks = sum(-(-n // block_size) + 1 for n in lens) + 2
    kc, vc = _pool(num_blocks, block_size, kv_heads, gen)
    tables = _tables(lens, block_size, num_blocks, gen)
    rows_new = len(decodes) + sum(n for _, n in prefills)
    q = torch.randn(rows_new, kv_heads * group, HEAD_DIM, generator=gen)
    k = torch.randn(rows_new, kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(rows_new, kv_heads, HEAD_DIM, generator=gen)
    slots = [_slots(t, n - 1, n, block_size)[0] for t, n in zip(tables, decodes)]
    paged_prefills, ref_meta, row = [], sdpa_mod.AttentionMetadata(slot_mapping=None, num_decode=len(decodes)), 2
    for t, (c, n) in zip(tables[len(decodes):], prefills):
        slots += _slots(t, c, c + n, block_size)
        paged_prefills.append((t, row, n, c + n))
        seq = sdpa_mod.PrefillSeq(row, n)
        if c:
            seq.context_slots = torch.tensor(_slots(t, 0, c + n, block_size))
            allowed = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
            seq.mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        ref_meta.prefills.append(seq)
        row += n
    meta = build_paged_metadata(list(zip(tables, decodes)), paged_prefills, slots, block_size,
                                host_to_device(torch.device("cpu")))
    ref_meta.slot_mapping = meta.slot_mapping
    ref_meta.decode_slots, ref_meta.decode_mask = _sdpa_decode_meta(tables[:len(decodes)], decodes, block_size)
    kc2, vc2 = kc.clone(), vc.clone()
    out = attention(q, k, v, LayerKV(kc, vc), meta)
    ref = attention(q, k, v, LayerKV(kc2, vc2), ref_meta)
    assert isinstance(meta, PagedMetadata) and out.shape == ref.shape
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


# ---- the whole engine ------------------------------------------------------------------------------------
ENGINE = dict(block_size=4, num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=24, dtype="float32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", ["rows", "heads", "strided heads"])
def test_fused_rms_norm_is_the_reference_formula_to_a_rounding_step(dtype, shape):
    from engine.models.llama import rms_norm
    from engine.models.triton_norm import rms_norm as fused
    gen = torch.Generator().manual_seed(0)
    if shape == "rows":  # 37 rows: not a multiple of the kernel's rows per program
        x, weight = torch.randn(37, 96, generator=gen), torch.randn(96, generator=gen)
    elif shape == "heads":  # Qwen3's q/k norm: a weight row per head
        x, weight = torch.randn(5, 6, 16, generator=gen), torch.randn(6, 16, generator=gen)
    else:  # the heads as a view into the fused qkv output: rows strided, not contiguous
        x, weight = torch.randn(5, 10 * 16, generator=gen)[:, :96].view(5, 6, 16), torch.randn(6, 16, generator=gen)
    x, weight = x.to(dtype), weight.to(dtype)
    out, ref = fused(x, weight, 1e-6), rms_norm(x, weight, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    step = torch.finfo(dtype).eps * ref.abs().max().item()  # a rounding step at the largest output
    assert (out.float() - ref.float()).abs().max().item() <= 2 * step
    assert fused(x[:0], weight, 1e-6).shape == x[:0].shape  # no rows: nothing launched


def _prompts():
    shared = [5, 17, 300, 42, 8, 99, 1000, 7, 64]  # a shared prefix: later prompts hit the prefix cache
    return [shared + [11, 12, 13], shared + [200, 3], list(range(20, 51)), [9]]


@pytest.mark.slow
@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen3", {"speculative_decoding": True})])
def test_engine_with_triton_backend_generates_exactly_what_sdpa_does(tiny_models, monkeypatch, arch, extra):
    from engine import LLM, SamplingParams
    folder, _ = tiny_models[arch]
    calls = {"n": 0}
    real = tp.attention

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tp, "attention", counting)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(folder, attention_backend=backend, **ENGINE, **extra)
        assert llm.engine.config.attention_backend == backend
        before = calls["n"]
        outs[backend] = [o.token_ids for o in llm.generate(_prompts(), params)]
        used = calls["n"] - before
        assert (used > 0) == (backend == "triton"), f"{backend}: {used} triton attention calls"
        snap = llm.engine.snapshot()
        assert snap.prefix_cache_hits > 0  # the cached-prefix case was exercised
        assert any(e.phase == "prefill" and e.num_computed_after < e.num_prompt_tokens
                   for r in snap.steps for e in r.entries)  # and a chunked prefill
    assert outs["triton"] == outs["sdpa"]
    assert all(len(o) == 10 for o in outs["triton"])


def test_triton_backend_on_cpu_without_the_interpreter_is_refused(tiny_models, monkeypatch):
    from engine import LLM
    folder, _ = tiny_models["llama"]
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(folder, attention_backend="triton", num_kv_blocks=16)


def test_triton_backend_needs_a_kv_cache(tiny_models):
    from engine import LLM
    folder, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="needs kv_cache=True"):
        LLM(folder, attention_backend="triton", kv_cache=False, num_kv_blocks=16)
