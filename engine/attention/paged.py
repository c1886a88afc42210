"""The triton backend's metadata, built once per step without importing triton: nothing is gathered, the kernels
read the block tables themselves."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..scheduler import Phase, ScheduledRequest
from .backend import AttentionBackend, ToDevice


@dataclass
class PagedMetadata:
    """The first num_decode rows are single-token decodes, the rest prefill/verify sequences one after another.
    Block tables are padded with 0 (never read: a sequence's length stops the loop)."""
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token (negative: not stored)
    num_decode: int
    block_size: int
    decode_block_tables: torch.Tensor | None = None  # [num_decode, width] int32
    decode_context_lens: torch.Tensor | None = None  # [num_decode] int32: tokens in the cache incl. the new one
    prefill_block_tables: torch.Tensor | None = None  # [num_prefill, width] int32
    prefill_query_starts: torch.Tensor | None = None  # [num_prefill] int32: first row of each sequence
    prefill_query_lens: torch.Tensor | None = None  # [num_prefill] int32
    prefill_context_lens: torch.Tensor | None = None  # [num_prefill] int32: cached before + new tokens
    num_prefill: int = 0
    max_prefill_query_len: int = 0
    backend: str = "triton"


def host_to_device(device: torch.device) -> ToDevice:
    """A function turning a (nested) list into a tensor on `device`: on CUDA through pinned host memory and a
    non-blocking copy, so building the next inputs overlaps the GPU's work instead of waiting on it."""
    if device.type == "cuda":
        def to_device(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)
    else:
        def to_device(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype, device=device)
    return to_device


def padded_tables(tables: Sequence[Sequence[int]], lens: Sequence[int], block_size: int) -> list[list[int]]:
    """Each sequence's blocks that hold its first `len` tokens, padded with 0 to the longest."""
    used = [list(t[:-(-n // block_size)]) for t, n in zip(tables, lens)]
    width = max((len(u) for u in used), default=0) or 1
    return [u + [0] * (width - len(u)) for u in used]


def build_paged_metadata(decodes: Sequence[tuple[list[int], int]], prefills: Sequence[tuple[list[int], int, int, int]],
                         slots: list[int], block_size: int, to_device: ToDevice) -> PagedMetadata:
    """decodes: (block_table, context_len) per decode row; prefills: (block_table, first_row, query_len,
    context_len) per prefill/verify sequence, rows after the decodes; slots: every new token's slot."""
    meta = PagedMetadata(slot_mapping=to_device(slots, torch.long), num_decode=len(decodes), block_size=block_size,
                         num_prefill=len(prefills))
    if decodes:
        lens = [n for _, n in decodes]
        meta.decode_block_tables = to_device(padded_tables([t for t, _ in decodes], lens, block_size), torch.int32)
        meta.decode_context_lens = to_device(lens, torch.int32)
    if prefills:
        lens = [p[3] for p in prefills]
        meta.prefill_block_tables = to_device(padded_tables([p[0] for p in prefills], lens, block_size), torch.int32)
        meta.prefill_query_starts = to_device([p[1] for p in prefills], torch.int32)
        meta.prefill_query_lens = to_device([p[2] for p in prefills], torch.int32)
        meta.prefill_context_lens = to_device(lens, torch.int32)
        meta.max_prefill_query_len = max(p[2] for p in prefills)
    return meta


class TritonBackend(AttentionBackend):
    kernel = "Triton paged kernels"

    def build(self, ordered: list[ScheduledRequest], decodes: list[ScheduledRequest], slots: list[int],
              positions: torch.Tensor) -> PagedMetadata:
        prefills: list[tuple[list[int], int, int, int]] = []
        row = len(decodes)
        for s in ordered:
            if s.phase is not Phase.DECODE:
                prefills.append((s.block_ids, row, s.num_tokens, s.end))
                row += s.num_tokens
        return build_paged_metadata([(s.block_ids, s.end) for s in decodes], prefills, slots,
                                    self.setup.block_size, self.setup.to_device)
