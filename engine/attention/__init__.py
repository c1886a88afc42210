"""Attention over the paged KV cache. `sdpa` is the reference path (CPU and GPU); `triton` the paged kernels
(triton_paged.py, imported only when used, so triton is never needed on CPU)."""
from .paged import PagedMetadata
from .sdpa import AttentionMetadata, KeyScale, LayerKV, PrefillSeq
from .sdpa import attention as sdpa_attention


def attention(q, k, v, cache: LayerKV | None, meta):
    """Dispatch on the metadata the runner built for this step's backend. `cache`: this layer's slice of the pool
    (an int8 pool's scales included: the SDPA path's only; the config refuses int8 KV with the triton backend)."""
    if isinstance(meta, PagedMetadata):
        from .triton_paged import attention as paged_attention
        k_cache, v_cache = (None, None) if cache is None else (cache.k, cache.v)
        # the kernels index q and k as dense rows; the model hands them over as views of one q|k tensor
        return paged_attention(q.contiguous(), k.contiguous(), v, k_cache, v_cache, meta)
    return sdpa_attention(q, k, v, cache, meta)


__all__ = ["AttentionMetadata", "KeyScale", "LayerKV", "PagedMetadata", "PrefillSeq", "attention"]
