"""Attention over the paged KV cache. `sdpa` is the reference path (CPU and GPU)."""
from .sdpa import AttentionMetadata, LayerKV, PrefillSeq, attention

__all__ = ["AttentionMetadata", "LayerKV", "PrefillSeq", "attention"]
