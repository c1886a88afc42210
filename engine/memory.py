"""Will a KV pool fit? Its size estimated from the config, checked against the memory free now, before any allocation:
found out by the allocator instead, it kills the engine thread (CPU: OOM-killed, or swapping for minutes; GPU: a
half-built engine). Cheap by design: reads /proc and cgroup files (or asks the CUDA driver), allocates nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 2**30  # "GB" in messages means GiB, like EngineConfig.kv_cache_memory_gb
# Host memory per block of the pool's Python bookkeeping (Block object, free-queue entry, the snapshot's
# per-block lists): ~290 bytes measured with tracemalloc on CPython 3.11, rounded up.
BLOCK_OBJECT_BYTES = 320
# Kept free for everything else: activations (a forward pass needs room beside the cache), the page, other processes.
RESERVE_FRACTION = 0.10
MIN_RESERVE = 1 * GIB


@dataclass(frozen=True)
class FreeMemory:
    usable: int  # bytes a new allocation may take: free memory minus the reserve
    reserve: int  # bytes kept free
    where: str  # "RAM" or "GPU memory (cuda:0)"


def free_ram() -> FreeMemory | None:
    """Available RAM, bounded by this process's cgroup limit (a container sees the host's /proc/meminfo).
    None when this platform does not say (the check is skipped rather than guessed)."""
    available = available_bytes()
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    limit = _cgroup_free()
    if limit is not None:
        available = min(available, limit)
    reserve = max(MIN_RESERVE, int(available * RESERVE_FRACTION))
    return FreeMemory(max(0, available - reserve), reserve, "RAM")


def free_gpu(device: torch.device) -> FreeMemory:
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(MIN_RESERVE, int(total * RESERVE_FRACTION))
    return FreeMemory(max(0, free - reserve), reserve, f"GPU memory ({device})")


def check_kv_pool_fits(what: str, num_blocks: int, block_bytes: int, device: torch.device) -> None:
    """Raise ValueError naming the limit if a pool of num_blocks blocks of block_bytes each (the KV tensor) plus
    its bookkeeping cannot be allocated now. `what` names the setting that asked for it, for the message."""
    tensor, objects = num_blocks * block_bytes, num_blocks * BLOCK_OBJECT_BYTES
    ram = free_ram()
    if device.type == "cuda":  # the tensor goes to the card, the Python objects stay in RAM
        needs = [("KV cache", tensor, free_gpu(device), block_bytes),
                 ("block bookkeeping", objects, ram, BLOCK_OBJECT_BYTES)]
    else:
        needs = [("KV cache", tensor + objects, ram, block_bytes + BLOCK_OBJECT_BYTES)]
    for kind, need, free, per_block in needs:
        if free is None or need <= free.usable:
            continue
        raise ValueError(
            f"{what} needs {_size(need)} of {kind} but only {_size(free.usable)} of {free.where} is available "
            f"(keeping {_size(free.reserve)} free): at most {free.usable // per_block} blocks of this size fit now")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GB" if num_bytes >= GIB // 10 else f"{num_bytes / 2**20:.0f} MB"


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where the system does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free() -> int | None:
    """Bytes left under the cgroup's memory limit (v2, then v1); None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:  # v1 writes "no limit" as a huge number
                return None
            return max(0, int(limit) - int(Path(usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None
