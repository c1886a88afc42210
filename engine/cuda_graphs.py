"""CUDA graphs for decode steps (`cuda_graphs=True`): at small batches the launches of hundreds of tiny kernels, not
the math, set a GPU's time per token. One graph per batch-size bucket, the batch padded with harmless decodes into
static buffers; only pure-decode steps with the triton backend replay (SDPA gathers a copy whose shape changes).
"""
from __future__ import annotations

import bisect

import torch

from .attention.paged import PagedMetadata
from .utils import cdiv


def batch_buckets(max_num_seqs: int) -> list[int]:
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_seqs]


def bucket_for(num_rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding num_rows rows, or None."""
    i = bisect.bisect_left(buckets, num_rows)
    return buckets[i] if i < len(buckets) else None


def check_cuda_graphs(device: torch.device, attention_backend: str, kv_cache: bool) -> None:
    """ValueError naming why cuda_graphs=True cannot run here (never a silent fallback to eager)."""
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs=True captures CUDA graphs: it needs a CUDA GPU, and this engine runs on "
                         f"{device}; leave cuda_graphs off")
    if not kv_cache:
        raise ValueError("cuda_graphs=True replays decode steps over the KV cache: it needs kv_cache=True")
    if attention_backend != "triton":
        raise ValueError(f"cuda_graphs=True needs attention_backend='triton' (got {attention_backend!r}): the SDPA "
                         f"path gathers a context copy whose shape changes every step")


class StaticDecodeInputs:
    """The fixed buffers a graph reads, with the padding rule: rows [n, bucket) are dummy decodes."""

    def __init__(self, max_rows: int, table_width: int, block_size: int, scratch_block: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_rows,), scratch_block * block_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_rows, table_width), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(max_rows, dtype=torch.long, device=device)

    @property
    def table_width(self) -> int:
        return self.block_tables.shape[1]

    def meta(self, rows: int) -> PagedMetadata:
        return PagedMetadata(slot_mapping=self.slot_mapping[:rows], num_decode=rows, block_size=self.block_size,
                             decode_block_tables=self.block_tables[:rows], decode_context_lens=self.context_lens[:rows])

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata, bucket: int) -> None:
        n, width = input_ids.shape[0], meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)  # columns past width: never read
        if bucket > n:
            self.input_ids[n:bucket] = 0
            self.positions[n:bucket] = 0
            self.slot_mapping[n:bucket] = self.scratch_block * self.block_size
            self.context_lens[n:bucket] = 1
            self.block_tables[n:bucket, 0] = self.scratch_block


class DecodeGraphs:
    """Captures the model's decode forward for each bucket at construction; `run` replays the right one."""

    def __init__(self, model, kv_cache: list, block_size: int, scratch_block: int, max_num_seqs: int,
                 max_model_len: int) -> None:
        """kv_cache: the runner's per-layer slices of the pool (runner.kv_layers)."""
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = batch_buckets(max_num_seqs)
        self.inputs = StaticDecodeInputs(self.buckets[-1], cdiv(max_model_len, block_size), block_size,
                                         scratch_block, model.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _forward(self, rows: int) -> torch.Tensor:
        s = self.inputs
        return self.model.forward(s.input_ids[:rows], s.positions[:rows], s.meta(rows), self.kv_cache,
                                  s.logits_rows[:rows])

    def _capture(self) -> None:
        pool = None
        # largest first: the smaller graphs then fit in the memory pool the largest one reserved
        for rows in reversed(self.buckets):
            self._forward(rows)  # compiles the kernels and settles the allocator outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[rows] = self._forward(rows)
            pool = graph.pool() if pool is None else pool
            self.graphs[rows] = graph
        torch.cuda.synchronize()

    def can_run(self, meta) -> bool:
        """Pure decode (no prefill or verify rows), within the largest bucket and the static table width."""
        return (isinstance(meta, PagedMetadata) and meta.num_prefill == 0 and meta.num_decode > 0
                and bucket_for(meta.num_decode, self.buckets) is not None
                and meta.decode_block_tables.shape[1] <= self.inputs.table_width)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        n = meta.num_decode
        bucket = bucket_for(n, self.buckets)
        self.inputs.fill(input_ids, positions, meta, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]
