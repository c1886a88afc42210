"""Changing a running engine's configuration: validate, build the new KV pool beside the old one, re-prefill, swap.

LLMEngine runs one resolved configuration; this module is everything about getting from one to the next:
- resolve: the fields left automatic filled by engine/factory.py, and every check that the sizes fit together and
  in the memory free now (every way in passes here: LLM(...), update_config, the page);
- build: the KV manager and the model runner for a configuration, changing nothing in the engine, so a failure
  (no memory for the pool, a calibration that cannot run) leaves it serving;
- update / take: a change is validated at once (a ValueError leaves everything as it was) and taken at the next
  step boundary, resolved and checked again, with the new pool built beside the old one when its structure
  (STRUCTURAL_FIELDS) changes. The engine carries it out (it frees its running requests' blocks in the old pool and
  requeues them oldest first, to be re-prefilled: nothing in flight is lost; other changes apply in place) and this
  module records what was done. It knows nothing of the engine: what it needs of it comes in as arguments.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .blocks import ContiguousKVCache, KVCache, NoKVCache, PagedKVCache
from .config import LOAD_TIME_FIELDS, STRUCTURAL_FIELDS, EngineConfig
from .cuda_graphs import DecodeGraphs, check_cuda_graphs
from .factory import Resolved, automatic_sizes, kv_bytes_per_block, resolve
from .gpu import GpuMemoryPlan, profile_gpu_memory
from .memory import check_kv_pool_fits
from .quant.calibrate import key_scales_for
from .runner import ModelRunner
from .utils import cdiv


@dataclass
class Change:
    """The waiting changes, taken at a step boundary: the configuration they make, and the new pool and runner when
    the pool's structure changes (None: they apply in place). `error`: why they cannot be made (nothing changes)."""
    changes: dict
    config: EngineConfig | None = None
    built: tuple[KVCache, ModelRunner] | None = None
    error: str = ""


class Reconfiguration:
    """One engine's configuration life: what it asked for, what that resolved to, what waits to apply.
    `pool_bytes`: the bytes the engine's current KV pool holds (0 before it has one), which a GPU's memory profile
    counts as taken."""

    def __init__(self, model, tokenizer, requested: EngineConfig, pool_bytes: Callable[[], int] = lambda: 0) -> None:
        self.model, self.tokenizer, self.pool_bytes = model, tokenizer, pool_bytes
        self.gpu_memory: GpuMemoryPlan | None = None  # CUDA: how the pool was sized (gpu.py)
        self.current: EngineConfig | None = None  # None until the first configuration is resolved
        self.requested = requested  # with None for the sizes left automatic
        self.current = self.resolve(requested)
        self.pending: dict = {}  # changes waiting for the next step boundary
        self.pending_config = self.current  # what the engine will run with once they apply
        self.last: dict | None = None  # the last change's record: what changed, what was done, who re-prefilled

    @property
    def resolved(self) -> Resolved:
        """What was asked and what runs: resolved.chosen() says what each "auto" came to."""
        return Resolved(self.requested, self.current)

    # ---- sizing and checks -------------------------------------------------------------------------------
    def automatic_sizes(self, config: EngineConfig) -> dict:
        """What each size left empty (None) comes to, given config's other fields (the settings form says it):
        the factory decides; a GPU's memory profile is measured here once and kept."""
        return automatic_sizes(config, self.model, self._plan_gpu_memory)

    def _plan_gpu_memory(self, config: EngineConfig, max_len: int, budget_tokens: int) -> GpuMemoryPlan:
        """Profile once per (utilization, step size); a settings change that keeps both reuses the plan."""
        plan = self.gpu_memory
        if plan is None or (plan.utilization, plan.profile_tokens) != (config.gpu_memory_utilization, budget_tokens):
            self.gpu_memory = profile_gpu_memory(self.model, config, max_len, budget_tokens, self.pool_bytes())
        return self.gpu_memory

    def kv_bytes_per_block(self, config: EngineConfig) -> int:
        return kv_bytes_per_block(config, self.model)

    def resolve(self, config: EngineConfig) -> EngineConfig:
        """Every automatic field filled (engine/factory.py decides: sizes from the model and the memory budget, the
        attention backend, the dtype), then checked: the sizes fit together and in the memory free now."""
        resolved = resolve(config, self.model, self._plan_gpu_memory).config
        max_len, num_blocks = resolved.max_model_len, resolved.num_kv_blocks
        if max_len > self.model.max_len:
            raise ValueError(f"max_model_len {max_len} exceeds the loaded model's limit ({self.model.max_len})")
        if resolved.cuda_graphs:
            check_cuda_graphs(self.model.device, resolved.attention_backend, resolved.kv_cache)
        if resolved.kv_cache and not resolved.paged_kv and cdiv(max_len, config.block_size) > num_blocks:
            raise ValueError(
                f"contiguous KV reserves max_model_len={max_len} tokens "
                f"({cdiv(max_len, config.block_size)} blocks) per request, but the pool has only {num_blocks} blocks")
        self._check_memory(config, resolved)
        return resolved

    def _check_memory(self, requested: EngineConfig, resolved: EngineConfig) -> None:
        """A new pool must fit beside the current one (it is built before the old one is let go); keeping the
        current pool needs nothing new, even if free memory has shrunk since."""
        current = self.current
        rebuild = current is None or any(getattr(current, f) != getattr(resolved, f) for f in STRUCTURAL_FIELDS)
        if not (resolved.kv_cache and rebuild):
            return
        blocks = f"{resolved.num_kv_blocks} blocks"
        what = (f"num_kv_blocks={requested.num_kv_blocks}" if requested.num_kv_blocks is not None else
                f"kv_cache_memory_gb={requested.kv_cache_memory_gb} ({blocks})"
                if requested.kv_cache_memory_gb is not None else f"the automatic pool ({blocks})")
        check_kv_pool_fits(what, resolved.num_kv_blocks, self.kv_bytes_per_block(resolved), self.model.device)

    # ---- building -----------------------------------------------------------------------------------------
    def build(self, c: EngineConfig) -> tuple[KVCache, ModelRunner]:
        """A KV manager and runner for config c. Changes nothing in the engine, so a failure here leaves it serving."""
        kv = (NoKVCache(c.block_size) if not c.kv_cache else  # the naive loop's
              ContiguousKVCache(c.num_kv_blocks, c.block_size, c.max_model_len) if not c.paged_kv else
              PagedKVCache(c.num_kv_blocks, c.block_size, c.prefix_caching_active))
        key_scales = key_scales_for(self.model, self.tokenizer) if c.key_smoothing_active else None
        runner = ModelRunner(self.model, c.block_size, c.num_kv_blocks, c.kv_cache, c.kv_cache_dtype,
                             c.attention_backend, scratch_block=c.cuda_graphs, key_scales=key_scales)
        if c.cuda_graphs:
            runner.graphs = DecodeGraphs(self.model, runner.kv_layers, c.block_size, runner.scratch_block,
                                         c.max_num_seqs, c.max_model_len)
        return kv, runner

    # ---- changing -----------------------------------------------------------------------------------------
    def update(self, changes: dict, check: Callable[[EngineConfig], None]) -> None:
        """Validate now (ValueError leaves everything as it was); the change waits for take(). `check(resolved)`:
        the engine's own check that what it holds (every request in flight) fits the new configuration."""
        if bad := [k for k in changes if k in LOAD_TIME_FIELDS]:
            raise ValueError(f"{', '.join(bad)} cannot change while serving (the weights are loaded with it): "
                             f"create a new LLM")
        requested = self.requested.replace(**{**self.pending, **changes})
        resolved = self.resolve(requested)
        check(resolved)
        self.pending.update(changes)
        self.pending_config = resolved

    def pending_view(self) -> tuple[EngineConfig, EngineConfig]:
        """(requested, resolved): what the engine runs once the pending changes apply (what it runs now if none
        wait). Requested keeps None for the sizes left automatic; resolved has the numbers they come to."""
        return self.requested.replace(**self.pending), self.pending_config

    def take(self) -> Change | None:
        """The waiting changes, to be carried out now, between two steps (None if nothing waits). They are resolved
        and checked again (free memory may have shrunk since update) and a new pool is built while the old one still
        serves: a change that can no longer be made comes back with its error, and the current configuration stays."""
        if not self.pending:
            return None
        changes, self.pending = self.pending, {}
        old = self.current
        try:
            requested = self.requested.replace(**changes)
            new = self.resolve(requested)
            structural = any(getattr(old, f) != getattr(new, f) for f in STRUCTURAL_FIELDS)
            built = self.build(new) if structural else None
        except (ValueError, MemoryError, RuntimeError) as exc:  # torch's out-of-memory is a RuntimeError
            self.pending_config = old
            return Change(changes, error=f"{type(exc).__name__}: {exc}")
        self.requested, self.current, self.pending_config = requested, new, new
        return Change(changes, new, built)

    def record(self, change: Change, step: int, re_prefilled: list[str]) -> dict:
        """What was done, kept as the last change's record (the service notes each new one)."""
        if change.error:
            self.last = {"step": step, "changes": change.changes,
                         "action": "not applied: the previous configuration keeps serving",
                         "requests_re_prefilled": [], "error": change.error}
        else:
            self.last = {"step": step, "changes": change.changes,
                         "action": "re-prefill running requests" if change.built else "applied in place",
                         "requests_re_prefilled": re_prefilled}
        return self.last
