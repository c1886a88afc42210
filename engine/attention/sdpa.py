"""Paged attention with torch's scaled_dot_product_attention.

Decode rows (one query each) are batched: their keys are gathered from the cache through a padded slot
index and a mask hides the padding; GQA is handled by folding each KV head's query group into the query
axis, so K/V are never repeated. Each prefill runs on its own: causally on its fresh K/V when nothing was
cached before it, or against its gathered context (prefix-cache hits) with an offset causal mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    start: int  # first row of this sequence in the flattened batch
    num_tokens: int  # query length
    context_slots: torch.Tensor | None = None  # [context_len] when earlier tokens sit in the cache
    mask: torch.Tensor | None = None  # [num_tokens, context_len] additive: 0 may attend, -inf may not


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [num_tokens] cache slot of each new token; None: no KV cache
    num_decode: int = 0  # the first num_decode rows are single-token decodes
    decode_slots: torch.Tensor | None = None  # [num_decode, max_context] gather index (padding -> slot 0)
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_context] additive (0 / -inf)
    prefills: list[PrefillSeq] = field(default_factory=list)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
              v_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for this step's tokens.

    Writes k, v into the cache (when there is one) and returns [T, num_heads * head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if k_cache is not None:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)

    b = meta.num_decode
    if b:
        max_ctx = meta.decode_slots.shape[1]
        flat = meta.decode_slots.view(-1)
        kd = k_cache.index_select(0, flat).view(b, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache.index_select(0, flat).view(b, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[:b].view(b, num_kv_heads, group, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        out[:b] = od.reshape(b, num_heads * head_dim)

    for seq in meta.prefills:
        rows = slice(seq.start, seq.start + seq.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if seq.context_slots is None:
            kp, vp = k[rows], v[rows]
            causal, mask = True, None
        else:
            kp, vp = k_cache.index_select(0, seq.context_slots), v_cache.index_select(0, seq.context_slots)
            causal, mask = False, seq.mask
        op = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                                            attn_mask=mask, is_causal=causal, enable_gqa=group > 1)
        out[rows] = op[0].transpose(0, 1).reshape(seq.num_tokens, num_heads * head_dim)
    return out
