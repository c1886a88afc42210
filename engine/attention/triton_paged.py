"""Paged attention in Triton: the GPU path (`attention_backend="triton"`), over the scheduler's block tables.

- `_store_kv`: each new token's K and V into its slot (a negative slot is skipped).
- `_decode`: a program per (sequence, KV head) walks the block table in tiles with an online softmax, the KV head's
  query group folded into the tile's rows (each K/V tile read once for the group); no gathered copy, no mask.
- `_prefill`: a prefill chunk (or verify) causally over the cache, its own K/V stored first.

On CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported): for tests.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .paged import PagedMetadata

# "minus infinity" that stays finite: a fully masked tile gives exp(NEG - m) = 0, never NaN. A constexpr: compiled
# Triton refuses a plain global inside a kernel (the interpreter did not, so only the first GPU run caught it)
NEG = tl.constexpr(-1.0e30)


def require_triton(device: torch.device) -> None:
    """ValueError saying why the triton backend cannot run on this device."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' runs Triton GPU kernels: on CPU they run only in Triton's "
                         "interpreter (set TRITON_INTERPRET=1 before starting; slow, meant for tests). "
                         "Use attention_backend='sdpa' on CPU")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention_backend='triton' needs a CUDA device, got {device}")


@triton.jit
def _store_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v, stride_cache,
              N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
        tl.store(k_cache_ptr + slot * stride_cache + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * stride_cache + offs, v, mask=mask)


@triton.jit
def _decode(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, table_ptr, ctx_ptr, scale,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_table,
            GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    m = tl.full([G_PAD], NEG, dtype=tl.float32)
    denom = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for start in range(0, ctx, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < ctx
        block = tl.load(table_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, NEG)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


@triton.jit
def _prefill(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, table_ptr, q_start_ptr, q_len_ptr, ctx_ptr, scale,
             stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_table,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq)
    if tile * BLOCK_M < q_len:
        q_start = tl.load(q_start_ptr + seq)
        ctx = tl.load(ctx_ptr + seq)
        kv_head = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        q_mask = (rows[:, None] < q_len) & (d[None, :] < HEAD_DIM)
        q_pos = ctx - q_len + rows  # absolute position of each query row
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask,
                    other=0.0)
        m = tl.full([BLOCK_M], NEG, dtype=tl.float32)
        denom = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)  # the tile's last row sees no further
        for start in range(0, end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < ctx
            block = tl.load(table_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
            kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, NEG)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    # fp32 stays fp32 (no TF32 rounding), so an fp32 model matches the SDPA path and HF token for token
    return "ieee" if dtype == torch.float32 else "tf32"


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim]; caches: [slots, kv_heads, head_dim] (each slot's row contiguous)."""
    k, v = k.contiguous(), v.contiguous()
    n = k.shape[1] * k.shape[2]
    assert k_cache.stride(1) == k.shape[2] and k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    if k.shape[0]:
        _store_kv[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(0),
                                 N=n, BLOCK=_pow2(n))


BLOCK_N = 32  # keys per tile
BLOCK_M = 16  # query rows per prefill tile


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """q: [B, heads, head_dim] (one token per sequence); out: [B, heads, head_dim], written in place."""
    b, num_heads, head_dim = q.shape
    if b == 0:
        return
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    _decode[(b, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens, head_dim ** -0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), GROUP=group, G_PAD=_pow2(group, 16), HEAD_DIM=head_dim, D_PAD=_pow2(head_dim, 16),
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, PRECISION=_precision(q.dtype))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                      max_query_len: int, block_size: int, out: torch.Tensor) -> None:
    """q, out: [T, heads, head_dim] (rows of all sequences, located by query_starts); causal over the cache."""
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, BLOCK_M))
    _prefill[grid](
        q, k_cache, v_cache, out, block_tables, query_starts, query_lens, context_lens, head_dim ** -0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), GROUP=group, HEAD_DIM=head_dim, D_PAD=_pow2(head_dim, 16), BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=_precision(q.dtype))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: PagedMetadata) -> torch.Tensor:
    """The triton backend behind `engine.attention.attention`: same arguments and result as the SDPA path."""
    if k_cache is None:
        raise ValueError("attention_backend='triton' reads K/V from the paged cache: it needs kv_cache=True")
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    b = meta.num_decode
    if b:
        decode_attention(q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                         meta.block_size, out[:b])
    if meta.num_prefill:
        prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_starts,
                          meta.prefill_query_lens, meta.prefill_context_lens, meta.max_prefill_query_len,
                          meta.block_size, out)
    return out.view(num_tokens, num_heads * head_dim)
