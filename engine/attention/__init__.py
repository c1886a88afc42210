"""Attention over the paged KV cache. `sdpa` is the reference path (CPU and GPU); `triton` the paged kernels
(triton_paged.py, imported only when used, so triton is never needed on CPU)."""
from .paged import PagedMetadata
from .sdpa import AttentionMetadata, LayerKV, PrefillSeq
from .sdpa import attention as sdpa_attention


def attention(q, k, v, cache: LayerKV | None, meta):
    """Dispatch on the metadata the runner built for this step's backend. `cache`: this layer's slice of the pool
    (an int8 pool's scales included: the SDPA path's only; the config refuses int8 KV with the triton backend)."""
    if isinstance(meta, PagedMetadata):
        from .triton_paged import attention as paged_attention
        return paged_attention(q, k, v, None if cache is None else cache.k, None if cache is None else cache.v,
                               meta)
    return sdpa_attention(q, k, v, cache, meta)


__all__ = ["AttentionMetadata", "LayerKV", "PagedMetadata", "PrefillSeq", "attention"]
