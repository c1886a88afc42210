"""Attention over the paged KV cache. `sdpa` is the reference path (CPU and GPU); `triton` the paged kernels
(triton_paged.py, imported only when used, so triton is never needed on CPU)."""
from .paged import PagedMetadata
from .sdpa import AttentionMetadata, PrefillSeq
from .sdpa import attention as sdpa_attention


def attention(q, k, v, k_cache, v_cache, meta):
    """Dispatch on the metadata the runner built for this step's backend."""
    if isinstance(meta, PagedMetadata):
        from .triton_paged import attention as paged_attention
        return paged_attention(q, k, v, k_cache, v_cache, meta)
    return sdpa_attention(q, k, v, k_cache, v_cache, meta)


__all__ = ["AttentionMetadata", "PagedMetadata", "PrefillSeq", "attention"]
