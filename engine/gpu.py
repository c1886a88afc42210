"""GPU memory planning: on CUDA the KV pool's byte budget from `gpu_memory_utilization` after a profiling forward at
the largest step (engine/factory.py decides the other automatic settings, and the pool's size from this budget).

    kv_bytes = total * gpu_memory_utilization - used_now - (peak_during_profile - allocated_after_profile)

as vLLM and nano-vllm size theirs; `used_now` is the card's memory in use by anyone less our own current KV pool.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .config import EngineConfig

GIB = 2**30
DEFAULT_CPU_KV_CACHE_GB = 0.5  # the KV pool on a CPU, when neither its size nor its memory is given


@dataclass(frozen=True)
class GpuMemoryPlan:
    total_bytes: int
    utilization: float
    used_before_bytes: int  # in use on the card before the pool (weights, context, other processes)
    activation_peak_bytes: int  # the profiling forward's peak above what it left allocated
    kv_budget_bytes: int  # total * utilization - used_before - activation_peak
    profile_tokens: int
    formula: str = "kv = total * gpu_memory_utilization - used_before - activation_peak"

    def to_dict(self) -> dict:
        return asdict(self)


def profile_gpu_memory(model, config: EngineConfig, max_model_len: int, budget_tokens: int,
                       current_pool_bytes: int = 0) -> GpuMemoryPlan:
    """One forward at the largest step (no KV cache: the activations are the same), its peak measured."""
    from .attention import AttentionMetadata, PrefillSeq
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    used_before = total - free - current_pool_bytes
    lens, left = [], budget_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    meta = AttentionMetadata(slot_mapping=None)
    row = 0
    for n in lens:
        meta.prefills.append(PrefillSeq(row, n))
        row += n
    ids = torch.zeros(budget_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    rows = torch.arange(min(budget_tokens, config.max_num_seqs), device=device)
    before = torch.cuda.memory_allocated(device)
    model.forward(ids, positions, meta, None, rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    budget = int(total * config.gpu_memory_utilization - used_before - peak)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no room for a KV cache: the card has "
            f"{total / GIB:.1f} GB, {used_before / GIB:.1f} GB are in use and a step of {budget_tokens} tokens "
            f"peaks at {peak / GIB:.2f} GB; raise it or lower max_num_batched_tokens")
    return GpuMemoryPlan(total, config.gpu_memory_utilization, used_before, peak, budget, budget_tokens)


def kv_budget_bytes(config: EngineConfig, device: torch.device, plan: GpuMemoryPlan | None) -> int:
    """The KV pool's byte budget: kv_cache_memory_gb when set; else the CUDA plan's, or the CPU default."""
    if config.kv_cache_memory_gb is not None:
        return int(config.kv_cache_memory_gb * GIB)
    if device.type == "cuda" and plan is not None:
        return plan.kv_budget_bytes
    return int(DEFAULT_CPU_KV_CACHE_GB * GIB)
