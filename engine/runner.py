"""Turns a scheduled batch into tensors and runs the model over the paged KV cache.

The KV cache is one preallocated tensor [layers, 2, num_kv_blocks * block_size, kv_heads, head_dim] (an int8 one
has its scales beside it, [layers, 2, slots, kv_heads]); a token at position p of a request lives in slot
block_table[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import BACKENDS, AttentionMetadata, BackendSetup, KeyScale, LayerKV, PagedMetadata
from .attention.backend import slots_of
from .attention.paged import host_to_device
from .models import LlamaFamilyModel
from .quant import SCALE_DTYPE
from .scheduler import Phase, ScheduledRequest


@dataclass
class Batch:
    scheduled: list[ScheduledRequest]  # in row order: decodes first, then prefills and verifies
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | PagedMetadata
    logits_rows: torch.Tensor  # rows whose logits are sampled, request by request in `scheduled` order


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, block_size: int, num_kv_blocks: int, use_kv_cache: bool,
                 kv_cache_dtype: str = "auto", attention_backend: str = "sdpa", scratch_block: bool = False,
                 key_scales: torch.Tensor | None = None) -> None:
        """scratch_block: one block after the pool where CUDA graphs' padded rows write (cuda_graphs.py).
        key_scales: [num_layers, num_kv_heads, head_dim], an int8 cache's key smoothing (calibrate.key_scales)."""
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.kv_int8 = kv_cache_dtype == "int8"
        self.attention_backend = attention_backend
        self._to_device = host_to_device(self.device)
        self.scratch_block = num_kv_blocks if scratch_block else None
        self.graphs = None  # DecodeGraphs, set by factory.CoreBuilder.build when cuda_graphs=True
        s = model.shape
        self.key_scales = None if key_scales is None else [
            KeyScale.of(scale.to(model.device), s.num_heads, model.dtype) for scale in key_scales]
        self.kv_cache = self.kv_scales = None
        self.kv_layers: list[LayerKV] | None = None
        if use_kv_cache:
            slots = (num_kv_blocks + scratch_block) * block_size
            self.kv_cache = torch.zeros(s.num_layers, 2, slots, s.num_kv_heads, s.head_dim,
                                        dtype=model.kv_dtype(kv_cache_dtype), device=model.device)
            if self.kv_int8:
                self.kv_scales = torch.zeros(s.num_layers, 2, slots, s.num_kv_heads, dtype=SCALE_DTYPE,
                                             device=model.device)
            self.kv_layers = [LayerKV.of(self.kv_cache[i], self.kv_scales[i] if self.kv_int8 else None)
                              for i in range(s.num_layers)]
        self.attention = BACKENDS[attention_backend].create(BackendSetup(
            block_size, self.device, model.dtype, use_kv_cache, self.kv_int8, self.key_scales, self._to_device))

    @property
    def attention_kernel(self) -> str:
        return self.attention.kernel

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv_cache, self.kv_scales) if t is not None)

    def prepare(self, scheduled: list[ScheduledRequest]) -> Batch:
        """The step's rows, in Batch.scheduled's order, and the attention backend's metadata over them."""
        use_cache = self.kv_cache is not None
        decodes = [s for s in scheduled if s.phase is Phase.DECODE]
        ordered = decodes + [s for s in scheduled if s.phase is not Phase.DECODE]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for s in ordered:
            req, start, n = s.request, s.start, s.num_tokens
            row = len(input_ids)
            input_ids.extend(req.token_ids[start:start + n - len(s.draft_token_ids)] + s.draft_token_ids)
            positions.extend(range(start, start + n))
            if use_cache:
                slots.extend(slots_of(s.block_ids, start, start + n, self.block_size))
            # rows for prompt logprobs (the position before each), then the rows to sample from
            logits_rows.extend(row + p - 1 - start for p in s.prompt_logprob_positions)
            logits_rows.extend(range(row + n - s.num_logits, row + n))
        to_device = self._to_device
        positions_t = to_device(positions, torch.long)
        meta = self.attention.build(ordered, decodes, slots, positions_t)
        return Batch(ordered, to_device(input_ids, torch.long), positions_t, meta, to_device(logits_rows, torch.long))

    def execute(self, batch: Batch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch.meta):
            return self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        return self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_layers, batch.logits_rows)
