"""Turns a scheduled batch into tensors and runs the model over the paged KV cache.

The KV cache is one preallocated tensor [layers, 2, num_kv_blocks * block_size, kv_heads, head_dim] (an int8 one
has its scales beside it, [layers, 2, slots, kv_heads]); a token at position p of a request lives in slot
block_table[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_kernels
from .attention import AttentionMetadata, KeyScale, LayerKV, PagedMetadata, PrefillSeq
from .attention.paged import build_paged_metadata, host_to_device
from .models import LlamaFamilyModel
from .quant import SCALE_DTYPE
from .scheduler import Phase, ScheduledRequest
from .utils import cdiv


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
        self.graphs = None  # DecodeGraphs, set by the engine when cuda_graphs=True
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
        # attention over the pool and the KV write in C++ (cpu_kernels.py) where they apply: the sdpa backend on CPU,
        # a model in fp32 or bf16 (its pool in the same dtype or int8); built here, at load, rather than in the first
        # step
        self.decode_attention = self.write_kv = None
        if (use_kv_cache and attention_backend != "triton" and self.device.type == "cpu"
                and model.dtype in (torch.float32, torch.bfloat16)
                and (ext := cpu_kernels.compiled()) is not None):
            self.decode_attention, self.write_kv = ext.decode_attention, ext.write_kv

    @property
    def attention_kernel(self) -> str:
        """What attends a decode step here, in words."""
        if self.attention_backend == "triton":
            return "Triton paged kernels"
        return "C++ over the paged pool" if self.decode_attention is not None else "torch SDPA over gathered K/V"

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv_cache, self.kv_scales) if t is not None)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, scheduled: list[ScheduledRequest]) -> Batch:
        """Rows for every scheduled request, by the phase the scheduler gave it: decodes are batched into one
        attention call; each prefill chunk or verify attends causally over its cached context plus its new rows."""
        use_cache = self.kv_cache is not None
        decodes = [s for s in scheduled if s.phase is Phase.DECODE]
        ordered = decodes + [s for s in scheduled if s.phase is not Phase.DECODE]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        paged = self.attention_backend == "triton"
        # the C++ kernel attends every row of the step over the pool, a prefill chunk's rows as well as decodes
        every_row = use_cache and not paged and self.decode_attention is not None
        meta = AttentionMetadata(slot_mapping=None, num_decode=len(decodes), kv_int8=self.kv_int8,
                                 key_scales=self.key_scales, write_kv=self.write_kv)
        paged_prefills: list[tuple[list[int], int, int, int]] = []
        for s in ordered:
            req, start, n = s.request, s.start, s.num_tokens
            row = len(input_ids)
            input_ids.extend(req.token_ids[start:start + n - len(s.draft_token_ids)] + s.draft_token_ids)
            positions.extend(range(start, start + n))
            if use_cache:
                slots.extend(self._slots(req.block_table, start, start + n))
            if s.phase is not Phase.DECODE and paged:
                paged_prefills.append((req.block_table, row, n, start + n))
            elif s.phase is not Phase.DECODE and not every_row:
                seq = PrefillSeq(row, n)
                if start > 0:  # earlier tokens come from the cache: attend to all of them
                    seq.context_slots = torch.tensor(self._slots(req.block_table, 0, start + n), device=self.device)
                    allowed = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(diagonal=start)
                    seq.mask = self._additive(allowed)
                meta.prefills.append(seq)
            # rows for prompt logprobs (the position before each), then the rows to sample from
            logits_rows.extend(row + p - 1 - start for p in s.prompt_logprob_positions)
            logits_rows.extend(range(row + n - s.num_logits, row + n))
        dev, to_device = self.device, self._to_device
        if paged:
            meta = build_paged_metadata([(s.request.block_table, s.end) for s in decodes], paged_prefills, slots,
                                        self.block_size, to_device)
            return Batch(ordered, to_device(input_ids, torch.long), to_device(positions, torch.long), meta,
                         to_device(logits_rows, torch.long))
        if use_cache:
            meta.slot_mapping = to_device(slots, torch.long)
        positions_t = to_device(positions, torch.long)
        if every_row:
            self._every_row_over_the_pool(meta, ordered, positions_t)
        elif decodes:  # gathered for SDPA, under a mask where they are not all as long
            meta.decode_slots = self._slot_lists(decodes)
            ctx = torch.tensor([s.end for s in decodes], device=dev)
            max_ctx = meta.decode_slots.shape[1]
            if int(ctx.min()) < max_ctx:  # all as long (one request, say): nothing to hide, and SDPA without a
                # mask was several times faster here (adding a mask of zeros changes no float)
                pos = torch.arange(max_ctx, device=dev)
                allowed = (pos.unsqueeze(0) < ctx.unsqueeze(1)).view(len(decodes), 1, 1, max_ctx)
                meta.decode_mask = self._additive(allowed)
        return Batch(ordered, to_device(input_ids, torch.long), positions_t, meta, to_device(logits_rows, torch.long))

    def _every_row_over_the_pool(self, meta: AttentionMetadata, ordered: list[ScheduledRequest],
                                 positions: torch.Tensor) -> None:
        """The C++ kernel's inputs for a whole step: each scheduled request's slot list (its context up to the end
        of this step's rows), and for each row which list it reads and how far: up to its own position, so a
        prefill chunk's rows attend causally over the pool (its own new K/V, written first, and any cached prefix),
        one call a layer for every row: it does a prefill wave's attention in a fraction of the time of torch's
        SDPA a sequence (docs/measurements.md, "On a faster AMD EPYC, with every row's attention in C++")."""
        meta.decode_slots = self._slot_lists(ordered)
        meta.decode_attention, meta.decode_lens = self.decode_attention, positions + 1
        if meta.num_decode < len(ordered):  # else row b reads list b: the decode step's own call (its decode rows)
            counts = torch.tensor([s.num_tokens for s in ordered], device=self.device)
            meta.decode_lists = torch.repeat_interleave(torch.arange(len(ordered), device=self.device), counts)

    def _slot_lists(self, seqs: list[ScheduledRequest]) -> torch.Tensor:
        """[len(seqs), longest end] each scheduled request's slots for positions 0 .. its end after this step, the
        shorter padded with slot 0's (never read: every reader stops at its own length)."""
        bs, max_ctx = self.block_size, max(s.end for s in seqs)
        width = cdiv(max_ctx, bs)
        tables = torch.tensor([s.request.block_table[:width] + [0] * (width - len(s.request.block_table[:width]))
                               for s in seqs], dtype=torch.long, device=self.device)
        pos = torch.arange(max_ctx, device=self.device)
        return tables[:, pos // bs] * bs + pos % bs

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A float mask (0 / -inf) built once per step; a bool mask would be converted again in every layer."""
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=self.device)
        return mask.masked_fill_(~allowed, float("-inf"))

    def execute(self, batch: Batch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch.meta):
            return self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        return self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_layers, batch.logits_rows)
