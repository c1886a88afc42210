"""Attention over the paged KV cache. `sdpa` is the reference path (CPU and GPU)."""
from .sdpa import AttentionMetadata, PrefillSeq, attention

__all__ = ["AttentionMetadata", "PrefillSeq", "attention"]
