"""Changing a running engine's configuration: validate, build the new KV pool beside the old one, re-prefill, swap.

LLMEngine runs one resolved configuration; this module is everything about getting from one to the next:
- resolve: the sizes left automatic (None) filled from the model and the memory budget, and every check that the
  sizes fit together and in the memory free now (every way in passes here: LLM(...), update_config, the page);
- build: the KV manager and the model runner for a configuration, changing nothing in the engine, so a failure
  (no memory for the pool, a calibration that cannot run) leaves it serving;
- update / apply: a change is validated at once (a ValueError leaves everything as it was) and applied at the next
  step boundary. A change to the pool's structure (STRUCTURAL_FIELDS) builds the new pool first, then frees every
  running request's blocks in the old one and requeues them oldest first: they are re-prefilled, nothing in flight
  is lost. Other changes apply in place.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .blocks import KVCacheManager, NoKVCache, kv_cache_for
from .config import LOAD_TIME_FIELDS, STRUCTURAL_FIELDS, EngineConfig
from .cuda_graphs import DecodeGraphs, check_cuda_graphs
from .gpu import GpuMemoryPlan, kv_budget_bytes, profile_gpu_memory, resolve_attention_backend
from .memory import check_kv_pool_fits
from .quant.calibrate import key_scales_for
from .runner import ModelRunner
from .utils import cdiv

if TYPE_CHECKING:
    from .engine import LLMEngine


class Reconfiguration:
    """One engine's configuration life: what it asked for, what that resolved to, what waits to apply."""

    def __init__(self, engine: LLMEngine, requested: EngineConfig) -> None:
        self.engine = engine
        self.model = engine.model
        self.gpu_memory: GpuMemoryPlan | None = None  # CUDA: how the pool was sized (gpu.py)
        self.current: EngineConfig | None = None  # None until the first configuration is resolved
        self.requested = requested  # with None for the sizes left automatic
        self.current = self.resolve(requested)
        self.pending: dict = {}  # changes waiting for the next step boundary
        self.pending_config = self.current  # what the engine will run with once they apply
        self.last: dict | None = None  # the last change's record: what changed, what was done, who re-prefilled

    # ---- sizing and checks -------------------------------------------------------------------------------
    def automatic_sizes(self, config: EngineConfig) -> dict[str, int]:
        """What each size left empty (None) comes to, given config's other fields (the settings form says it)."""
        max_len = config.max_model_len or self.model.max_len
        device = self.model.device
        per_block = self.kv_bytes_per_block(config)
        budget_tokens = config.max_num_batched_tokens or config.default_max_num_batched_tokens(max_len, device.type)
        if (device.type == "cuda" and config.kv_cache_memory_gb is None and config.num_kv_blocks is None
                and config.kv_cache):
            self._plan_gpu_memory(config, max_len, budget_tokens)
        num_blocks = max(1, kv_budget_bytes(config, device, self.gpu_memory) // per_block)
        # never more than every seat filled to max_model_len: beyond that the memory would sit idle
        num_blocks = min(num_blocks, config.max_num_seqs * cdiv(max_len, config.block_size))
        return {"max_model_len": self.model.max_len,
                "max_num_batched_tokens": config.default_max_num_batched_tokens(max_len, device.type),
                "num_kv_blocks": num_blocks, "attention_backend": resolve_attention_backend(config, device)}

    def _plan_gpu_memory(self, config: EngineConfig, max_len: int, budget_tokens: int) -> None:
        """Profile once per (utilization, step size); a settings change that keeps both reuses the plan."""
        plan = self.gpu_memory
        if plan is None or (plan.utilization, plan.profile_tokens) != (config.gpu_memory_utilization, budget_tokens):
            runner = getattr(self.engine, "runner", None)
            pool = runner.kv_cache_bytes if runner is not None else 0
            self.gpu_memory = profile_gpu_memory(self.model, config, max_len, budget_tokens, pool)

    def kv_bytes_per_block(self, config: EngineConfig) -> int:
        return self.model.kv_bytes_per_token(config.kv_cache_dtype) * config.block_size

    def resolve(self, config: EngineConfig) -> EngineConfig:
        """Fill the sizes left as None from the model and the memory budget, and check they fit together and
        in the memory free now."""
        auto = self.automatic_sizes(config)
        max_len = config.max_model_len or auto["max_model_len"]
        if max_len > self.model.max_len:
            raise ValueError(f"max_model_len {max_len} exceeds the loaded model's limit ({self.model.max_len})")
        budget = config.max_num_batched_tokens or auto["max_num_batched_tokens"]
        num_blocks = config.num_kv_blocks or auto["num_kv_blocks"]
        resolved = config.replace(max_model_len=max_len, max_num_batched_tokens=budget, num_kv_blocks=num_blocks,
                                  attention_backend=auto["attention_backend"])
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
    def build(self, c: EngineConfig) -> tuple[KVCacheManager | NoKVCache, ModelRunner]:
        """A KV manager and runner for config c. Changes nothing in the engine, so a failure here leaves it serving."""
        kv = kv_cache_for(c.kv_cache, c.paged_kv, c.prefix_caching_active, c.num_kv_blocks, c.block_size,
                          c.max_model_len)
        key_scales = key_scales_for(self.model, self.engine.tokenizer) if c.key_smoothing_active else None
        runner = ModelRunner(self.model, c.block_size, c.num_kv_blocks, c.kv_cache, c.kv_cache_dtype,
                             c.attention_backend, scratch_block=c.cuda_graphs, key_scales=key_scales)
        if c.cuda_graphs:
            runner.graphs = DecodeGraphs(self.model, runner.kv_layers, c.block_size, runner.scratch_block,
                                         c.max_num_seqs, c.max_model_len)
        return kv, runner

    # ---- changing -----------------------------------------------------------------------------------------
    def update(self, **changes) -> None:
        """Validate now (ValueError leaves everything as it was); apply at the next step boundary."""
        if bad := [k for k in changes if k in LOAD_TIME_FIELDS]:
            raise ValueError(f"{', '.join(bad)} cannot change while serving (the weights are loaded with it): "
                             f"create a new LLM")
        requested = self.requested.replace(**{**self.pending, **changes})
        resolved = self.resolve(requested)
        scheduler = self.engine.scheduler
        for req in list(scheduler.running) + list(scheduler.waiting):
            self.engine.check_fits(req.num_prompt_tokens, req.params, resolved)
        self.pending.update(changes)
        self.pending_config = resolved

    def pending_view(self) -> tuple[EngineConfig, EngineConfig]:
        """(requested, resolved): what the engine runs once the pending changes apply (what it runs now if none
        wait). Requested keeps None for the sizes left automatic; resolved has the numbers they come to."""
        return self.requested.replace(**self.pending), self.pending_config

    def apply(self) -> dict | None:
        """Apply the waiting changes now, between two steps; the record of what was done, or None if nothing
        waited. A change that can no longer be made (free memory shrank since it was checked) is recorded as not
        applied, and the previous configuration keeps serving."""
        if not self.pending:
            return None
        engine = self.engine
        changes, self.pending = self.pending, {}
        old = self.current
        try:
            requested = self.requested.replace(**changes)
            new = self.resolve(requested)  # checked again: free memory may have shrunk since update()
            structural = any(getattr(old, f) != getattr(new, f) for f in STRUCTURAL_FIELDS)
            # The new pool is built while the old one still serves: if memory runs out, nothing has changed.
            built = self.build(new) if structural else None
        except (ValueError, MemoryError, RuntimeError) as exc:  # torch's out-of-memory is a RuntimeError
            self.pending_config = old
            self.last = {"step": engine.step_count, "changes": changes,
                         "action": "not applied: the previous configuration keeps serving",
                         "requests_re_prefilled": [], "error": f"{type(exc).__name__}: {exc}"}
            return self.last
        self.requested, self.current, self.pending_config = requested, new, new
        moved = []
        if built is not None:
            # Re-prefill: free every running request's blocks in the old pool and requeue them, oldest first.
            for req in reversed(list(engine.scheduler.running)):
                engine.scheduler.preempt(req, count=False)
                moved.append(req.request_id)
            engine.use(new, *built)
        else:
            engine.use(new, engine.kv, engine.runner)
            engine.kv.set_prefix_caching(new.prefix_caching_active)
        self.last = {"step": engine.step_count, "changes": changes,
                     "action": "re-prefill running requests" if structural else "applied in place",
                     "requests_re_prefilled": moved[::-1]}
        return self.last
