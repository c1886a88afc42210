"""What every attention backend is to the runner (as mini-sglang's build their own metadata): made once from a
`BackendSetup`, asked each step to `build` that step's metadata; the runner has no branch on which backend runs."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..scheduler import ScheduledRequest

ToDevice = Callable[[list, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class BackendSetup:
    block_size: int
    device: torch.device
    dtype: torch.dtype  # the model's (its weights' and activations')
    use_kv_cache: bool
    kv_int8: bool
    key_scales: list | None  # per layer, an int8 cache's key smoothing (KeyScale); None: none
    to_device: ToDevice  # a (nested) list to a tensor on the device (paged.host_to_device)


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The pool slots of positions start .. end - 1 of a request with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class AttentionBackend(ABC):
    # the C++ kernels this backend calls, if any; tests and `bench kernel-worth` set them to None for the torch path
    decode_attention: Callable | None = None
    write_kv: Callable | None = None

    def __init__(self, setup: BackendSetup) -> None:
        self.setup = setup

    @classmethod
    def create(cls, setup: BackendSetup) -> AttentionBackend:
        """The backend for this setup (a backend may hand over to a variant of itself that fits it better)."""
        return cls(setup)

    @property
    @abstractmethod
    def kernel(self) -> str:
        """What attends a decode step here, in words."""

    @abstractmethod
    def build(self, ordered: list[ScheduledRequest], decodes: list[ScheduledRequest], slots: list[int],
              positions: torch.Tensor) -> Any:
        """This step's metadata, read by every layer's attention (and by CUDA graphs). ordered: the scheduled
        requests in row order, the decodes (one row each) first; decodes: those decodes; slots: each new token's
        pool slot, row by row (empty without a KV cache); positions: each row's position, on the device."""
