"""Paged attention with torch's scaled_dot_product_attention, or on CPU the engine's C++ kernel (CppPoolBackend).
Without it, decode rows are batched over gathered K/V under a mask (GQA folded into the query axis, so K/V are
never repeated) and each prefill runs on its own, causally. An int8 cache is quantized as written.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import cpu_kernels
from ..quant import dequantize_int8, quantize_int8
from ..scheduler import Phase, ScheduledRequest
from ..utils import cdiv
from .backend import AttentionBackend, BackendSetup, slots_of


@dataclass
class PrefillSeq:
    start: int  # first row of this sequence in the flattened batch
    num_tokens: int  # query length
    context_slots: torch.Tensor | None = None  # [context_len] when earlier tokens sit in the cache
    mask: torch.Tensor | None = None  # [num_tokens, context_len] additive: 0 may attend, -inf may not


class KeyScale(NamedTuple):
    """One layer's key smoothing for an int8 KV cache, after RoPE: q * s and k / s (engine/quant/calibrate.py)."""
    query: torch.Tensor  # [num_heads, head_dim]: s of each query head's KV head
    key_inverse: torch.Tensor  # [num_kv_heads, head_dim]: 1 / s

    @classmethod
    def of(cls, scale: torch.Tensor, num_heads: int, dtype: torch.dtype) -> KeyScale:
        """scale: [num_kv_heads, head_dim]; both kept in the model's dtype (so a bf16 query stays bf16)."""
        query = scale.repeat_interleave(num_heads // scale.shape[0], dim=0)
        return cls(query.to(dtype), scale.reciprocal().to(dtype))

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q * self.query, k * self.key_inverse


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [num_tokens] cache slot of each new token; None: no KV cache
    num_decode: int = 0  # the first num_decode rows are single-token decodes
    decode_slots: torch.Tensor | None = None  # [num_decode, max_context] gather index (padding -> slot 0)
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_context] additive (0 / -inf); None: none hidden
    # the C++ decode attention over the pool: each row reads the first decode_lens[row] of its decode_slots, no mask
    decode_attention: Callable | None = None
    # C++ too: this step's K and V into the pool in one call (an int8 pool's only where every row reads the pool)
    write_kv: Callable | None = None
    decode_lens: torch.Tensor | None = None  # [num_decode] int64
    # [num_tokens] int64, when the C++ kernel attends every row of the step (CppPoolBackend): row t reads the first
    # decode_lens[t] slots of list decode_slots[decode_lists[t]] (its request's context, up to its own position)
    decode_lists: torch.Tensor | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)
    # K/V at int8 precision: stored so when there is a cache, and rounded so even when there is none (the naive
    # loop), so that turning a cache feature off never changes what attention sees
    kv_int8: bool = False
    # per layer, an int8 cache's key smoothing (KeyScale) the model applies before attention; None: none
    key_scales: list[Callable] | None = None
    # the gather index of each slot list read this step, over a pool's K|V pair (LayerKV.pair_index): built once,
    # read by every layer; keyed by the list's storage, which this metadata keeps alive for the step
    _pair_indices: dict = field(default_factory=dict, repr=False)

    def pair_index(self, slots: torch.Tensor, cache: LayerKV) -> torch.Tensor | None:
        if cache.pair is None:
            return None
        key = (slots.data_ptr(), slots.numel(), cache.pool_slots)
        if key not in self._pair_indices:
            self._pair_indices[key] = cache.pair_index(slots)
        return self._pair_indices[key]


class LayerKV(NamedTuple):
    """One layer's slice of the pool: k, v [slots, kv_heads, head_dim]; an int8 pool's scales [slots, kv_heads].
    pair (and scale_pair): k and v as one [2 * slots, ...] tensor, so that a read gathers both in one call
    (docs/measurements.md, "Reading K and V for SDPA")."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    pair: torch.Tensor | None = None
    scale_pair: torch.Tensor | None = None

    @classmethod
    def of(cls, pair: torch.Tensor, scale_pair: torch.Tensor | None = None) -> LayerKV:
        """pair: [2, slots, kv_heads, head_dim], contiguous (scale_pair: [2, slots, kv_heads])."""
        scales = () if scale_pair is None else (scale_pair[0], scale_pair[1])
        return cls(pair[0], pair[1], *scales, pair=pair.flatten(0, 1),
                   scale_pair=None if scale_pair is None else scale_pair.flatten(0, 1))

    @property
    def pool_slots(self) -> int:
        return self.k.shape[0]

    def pair_index(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of `pair` holding K, then V, of slots."""
        return torch.cat((slots, slots + self.pool_slots))

    def read(self, slots: torch.Tensor, dtype: torch.dtype,
             pair_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots, dequantized to dtype from an int8 pool."""
        if self.pair is not None:
            index = self.pair_index(slots) if pair_index is None else pair_index
            k, v = self.pair.index_select(0, index).chunk(2)
        else:
            k, v = self.k.index_select(0, slots), self.v.index_select(0, slots)
        if self.k_scale is None:
            return k, v
        if self.scale_pair is not None:
            k_scale, v_scale = self.scale_pair.index_select(0, index).chunk(2)
        else:
            k_scale, v_scale = self.k_scale.index_select(0, slots), self.v_scale.index_select(0, slots)
        return dequantize_int8(k, k_scale, dtype), dequantize_int8(v, v_scale, dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV | None,
              meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (into the cache if any) -> [T, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if cache is not None and meta.write_kv is not None and not (meta.kv_int8 and meta.prefills):
        # an int8 pool's only where every row reads K and V from it: the same integers as quantize_int8's
        meta.write_kv(k, v, meta.slot_mapping, cache.k, cache.v, cache.k_scale, cache.v_scale)
    elif meta.kv_int8:
        (kq, k_scale), (vq, v_scale) = quantize_int8(k), quantize_int8(v)
        if cache is not None:
            for dst, src in ((cache.k, kq), (cache.v, vq), (cache.k_scale, k_scale), (cache.v_scale, v_scale)):
                dst.index_copy_(0, meta.slot_mapping, src)
        k, v = dequantize_int8(kq, k_scale, q.dtype), dequantize_int8(vq, v_scale, q.dtype)
    elif cache is not None:
        cache.k.index_copy_(0, meta.slot_mapping, k)
        cache.v.index_copy_(0, meta.slot_mapping, v)
    if meta.decode_lists is not None:  # every row, prefill chunks too, reads its own slots of the pool
        return meta.decode_attention(q, cache.k, cache.v, meta.decode_slots, meta.decode_lens, cache.k_scale,
                                     cache.v_scale, meta.decode_lists)
    b = meta.num_decode
    out = None if 0 < b == num_tokens else torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if b and meta.decode_attention is not None:
        od = meta.decode_attention(q[:b], cache.k, cache.v, meta.decode_slots, meta.decode_lens, cache.k_scale,
                                   cache.v_scale)
        if out is None:
            return od
        out[:b] = od
    elif b:
        max_ctx = meta.decode_slots.shape[1]
        slots = meta.decode_slots.view(-1)
        kd, vd = cache.read(slots, q.dtype, meta.pair_index(slots, cache))
        kd = kd.view(b, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        vd = vd.view(b, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[:b].view(b, num_kv_heads, group, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        if out is None:  # a step of decodes only: their result is the whole output
            return od.reshape(b, num_heads * head_dim)
        out[:b] = od.reshape(b, num_heads * head_dim)

    for seq in meta.prefills:
        rows = slice(seq.start, seq.start + seq.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if seq.context_slots is None:
            kp, vp = k[rows], v[rows]
            causal, mask = True, None
        else:
            kp, vp = cache.read(seq.context_slots, q.dtype, meta.pair_index(seq.context_slots, cache))
            causal, mask = False, seq.mask
        op = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                                            attn_mask=mask, is_causal=causal, enable_gqa=group > 1)
        out[rows] = op[0].transpose(0, 1).reshape(seq.num_tokens, num_heads * head_dim)
    return out


class SdpaBackend(AttentionBackend):
    kernel = "torch SDPA over gathered K/V"
    _offsets: torch.Tensor | None = None  # [block_size] 0..block_size-1, made once: each slot's place in its block

    @classmethod
    def create(cls, setup: BackendSetup) -> AttentionBackend:
        """CppPoolBackend on CPU where it applies, its functions looked up at load rather than in the first step."""
        if (setup.use_kv_cache and setup.device.type == "cpu" and setup.dtype in (torch.float32, torch.bfloat16)
                and (ext := cpu_kernels.compiled()) is not None):
            return CppPoolBackend(setup, ext.decode_attention, ext.write_kv)
        return cls(setup)

    def _metadata(self, decodes: list[ScheduledRequest], slots: list[int]) -> AttentionMetadata:
        s = self.setup
        return AttentionMetadata(slot_mapping=s.to_device(slots, torch.long) if s.use_kv_cache else None,
                                 num_decode=len(decodes), kv_int8=s.kv_int8, key_scales=s.key_scales,
                                 write_kv=self.write_kv)

    def build(self, ordered: list[ScheduledRequest], decodes: list[ScheduledRequest], slots: list[int],
              positions: torch.Tensor) -> AttentionMetadata:
        bs, dev = self.setup.block_size, self.setup.device
        meta = self._metadata(decodes, slots)
        row = len(decodes)
        for s in ordered:
            if s.phase is Phase.DECODE:
                continue
            start, n = s.start, s.num_tokens
            seq = PrefillSeq(row, n)
            if start > 0:  # earlier tokens come from the cache: attend to all of them
                seq.context_slots = torch.tensor(slots_of(s.block_ids, 0, start + n, bs), device=dev)
                allowed = torch.ones(n, start + n, dtype=torch.bool, device=dev).tril(diagonal=start)
                seq.mask = self._additive(allowed)
            meta.prefills.append(seq)
            row += n
        if decodes:  # gathered for SDPA, under a mask where they are not all as long
            meta.decode_slots = self._slot_lists(decodes)
            ctx = torch.tensor([s.end for s in decodes], device=dev)
            max_ctx = meta.decode_slots.shape[1]
            if int(ctx.min()) < max_ctx:  # all as long (one request, say): nothing to hide, and SDPA without a
                # mask was several times faster here (adding a mask of zeros changes no float)
                pos = torch.arange(max_ctx, device=dev)
                allowed = (pos.unsqueeze(0) < ctx.unsqueeze(1)).view(len(decodes), 1, 1, max_ctx)
                meta.decode_mask = self._additive(allowed)
        return meta

    def _slot_lists(self, seqs: list[ScheduledRequest], whole_blocks: bool = False) -> torch.Tensor:
        """[len(seqs), longest end] each request's slots up to its end after this step, padded with slot 0's (never
        read: every reader stops at its own length); whole_blocks: as wide as its blocks, in fewer torch calls (each
        costs microseconds on a cache a step's weights have just streamed through)."""
        bs, dev, max_ctx = self.setup.block_size, self.setup.device, max(s.end for s in seqs)
        width = cdiv(max_ctx, bs)
        tables = torch.tensor([s.block_ids[:width] + [0] * (width - len(s.block_ids[:width]))
                               for s in seqs], dtype=torch.long, device=dev)
        if whole_blocks:
            if self._offsets is None:
                self._offsets = torch.arange(bs, device=dev)
            return (tables.unsqueeze(2) * bs + self._offsets).view(len(seqs), width * bs)
        pos = torch.arange(max_ctx, device=dev)
        return tables[:, pos // bs] * bs + pos % bs

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A float mask (0 / -inf) built once per step; a bool mask would be converted again in every layer."""
        mask = torch.zeros(allowed.shape, dtype=self.setup.dtype, device=self.setup.device)
        return mask.masked_fill_(~allowed, float("-inf"))


class CppPoolBackend(SdpaBackend):
    """The sdpa backend with the C++ kernels: every row of a step, prefill chunks' too, attended over the pool in one
    call a layer, each up to its own position (docs/measurements.md, "On a faster AMD EPYC, with every row's
    attention in C++"). With decode_attention None it builds SdpaBackend's gathered metadata."""

    def __init__(self, setup: BackendSetup, decode_attention: Callable, write_kv: Callable) -> None:
        super().__init__(setup)
        self.decode_attention, self.write_kv = decode_attention, write_kv

    @property
    def kernel(self) -> str:
        return "C++ over the paged pool" if self.decode_attention is not None else SdpaBackend.kernel

    def build(self, ordered: list[ScheduledRequest], decodes: list[ScheduledRequest], slots: list[int],
              positions: torch.Tensor) -> AttentionMetadata:
        """Each request's slot list, and for each row which list it reads and how far: up to its own position, so a
        prefill chunk's rows attend causally over the pool (its own new K/V, written first)."""
        if self.decode_attention is None:
            return super().build(ordered, decodes, slots, positions)
        meta = self._metadata(decodes, slots)
        meta.decode_slots = self._slot_lists(ordered, whole_blocks=True)
        meta.decode_attention, meta.decode_lens = self.decode_attention, positions + 1
        if meta.num_decode < len(ordered):  # else row b reads list b: the decode step's own call (its decode rows)
            dev = self.setup.device
            counts = torch.tensor([s.num_tokens for s in ordered], device=dev)
            meta.decode_lists = torch.repeat_interleave(torch.arange(len(ordered), device=dev), counts)
        return meta
