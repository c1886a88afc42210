"""Attention over the paged KV cache. `sdpa` is the reference path (CPU and GPU; on CPU with the C++ kernels, its
CppPoolBackend); `triton` the paged kernels (triton_paged.py, imported only when used, so triton is never needed on
CPU). Each backend builds its own metadata (backend.py); the runner asks the one BACKENDS names."""
from .backend import AttentionBackend, BackendSetup
from .paged import PagedMetadata, TritonBackend
from .sdpa import AttentionMetadata, CppPoolBackend, KeyScale, LayerKV, PrefillSeq, SdpaBackend
from .sdpa import attention as sdpa_attention

# a backend's name (engine/factory.py resolves which) -> its class, one line a backend
BACKENDS: dict[str, type[AttentionBackend]] = {
    "sdpa": SdpaBackend,
    "triton": TritonBackend,
}


def attention(q, k, v, cache: LayerKV | None, meta):
    """Dispatch on the metadata the runner built for this step's backend; `cache`: this layer's slice of the pool."""
    if isinstance(meta, PagedMetadata):
        from .triton_paged import attention as paged_attention
        k_cache, v_cache = (None, None) if cache is None else (cache.k, cache.v)
        # the kernels index q and k as dense rows; the model hands them over as views of one q|k tensor
        return paged_attention(q.contiguous(), k.contiguous(), v, k_cache, v_cache, meta)
    return sdpa_attention(q, k, v, cache, meta)


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "BackendSetup", "CppPoolBackend", "KeyScale",
           "LayerKV", "PagedMetadata", "PrefillSeq", "SdpaBackend", "TritonBackend", "attention"]
