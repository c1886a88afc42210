"""Changing a running engine's configuration from outside it: validate, build the new KV pool beside the old one,
hand it to the engine at a step boundary, record what was done. An engine does not know how it is replaced: its owner
(EngineService, or LLM offline) keeps a Reconfiguration beside it; docs/engine.md walks through update and apply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .blocks import KVCache
from .config import LOAD_TIME_FIELDS, STRUCTURAL_FIELDS, EngineConfig
from .factory import CoreBuilder, Resolved, decoder_in_features
from .gpu import GpuMemoryPlan
from .inputs import check_fits, checked_inputs
from .runner import ModelRunner
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .engine import LLMEngine


@dataclass
class Change:
    """The waiting changes, taken at a step boundary: the configuration they make, and the new pool and runner when
    the pool's structure changes (None: they apply in place). `error`: why they cannot be made (nothing changes)."""
    changes: dict
    config: EngineConfig | None = None
    built: tuple[KVCache, ModelRunner] | None = None
    error: str = ""


class Reconfiguration(CoreBuilder):
    """One engine's configuration life (`of(engine)`). `current` given: it runs already (not resolved again)."""

    def __init__(self, model, tokenizer, requested: EngineConfig, current: EngineConfig | None = None,
                 gpu_memory: GpuMemoryPlan | None = None, pool_bytes=lambda: 0) -> None:
        super().__init__(model, tokenizer, pool_bytes, gpu_memory)
        self.requested = requested  # with None for the sizes left automatic
        self.current = current if current is not None else self.resolve(requested)
        self.pending: dict = {}  # changes waiting for the next step boundary
        self.pending_config = self.current  # what the engine will run with once they apply
        self.last: dict | None = None  # the last change's record: what changed, what was done, who re-prefilled

    @classmethod
    def of(cls, engine: LLMEngine) -> Reconfiguration:
        """The configuration life of an engine built already, from what it reports of itself."""
        r = cls(engine.model, engine.tokenizer, engine.requested, engine.config, engine.gpu_memory,
                lambda: engine.runner.kv_cache_bytes)
        r.last = engine.last_reconfig
        return r

    @property
    def resolved(self) -> Resolved:
        """What was asked and what runs: resolved.chosen() says what each "auto" came to."""
        return Resolved(self.requested, self.current, decoder_in_features(self.model))

    # ---- changing -----------------------------------------------------------------------------------------
    def update(self, changes: dict, engine: LLMEngine | None = None) -> None:
        """Validate now (ValueError leaves everything as it was); the change waits for apply() (or take()). Every
        request `engine` holds (running or waiting) must fit the new configuration."""
        if bad := [k for k in changes if k in LOAD_TIME_FIELDS]:
            raise ValueError(f"{', '.join(bad)} cannot change while serving (the weights are loaded with it): "
                             f"create a new LLM")
        requested = self.requested.replace(**{**self.pending, **changes})
        resolved = self.resolve(requested, self.current)
        if engine is not None:
            for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
                check_fits(req.num_prompt_tokens, req.params, resolved)
        self.pending.update(changes)
        self.pending_config = resolved

    def check_request(self, prompt: str | list[int], params: SamplingParams | None, priority: int = 0) -> None:
        """A new request must also fit the configuration about to apply, if a change waits (the engine checks it
        against the one that runs): the same ValueError, in the same order, as the engine's own checks."""
        if self.pending:
            _, token_ids, params = checked_inputs(prompt, params, priority, self.tokenizer,
                                                  self.model.shape.vocab_size)
            for config in (self.current, self.pending_config):
                check_fits(len(token_ids), params, config)

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
            new = self.resolve(requested, old)
            structural = any(getattr(old, f) != getattr(new, f) for f in STRUCTURAL_FIELDS)
            built = self.build(new) if structural else None
        except (ValueError, MemoryError, RuntimeError) as exc:  # torch's out-of-memory is a RuntimeError
            self.pending_config = old
            return Change(changes, error=f"{type(exc).__name__}: {exc}")
        self.requested, self.current, self.pending_config = requested, new, new
        return Change(changes, new, built)

    def record(self, change: Change, step: int, re_prefilled: list[str]) -> dict:
        """What was done, kept as the last change's record."""
        action = ("not applied: the previous configuration keeps serving" if change.error else
                  "re-prefill running requests" if change.built else "applied in place")
        self.last = {"step": step, "changes": change.changes, "action": action,
                     "requests_re_prefilled": [] if change.error else re_prefilled}
        if change.error:
            self.last["error"] = change.error
        return self.last

    def apply(self, engine: LLMEngine) -> dict | None:
        """Carry out the waiting changes on `engine` now; only between two of its steps (an owner calls it before
        each step, and at once when the engine is idle, so a change does not wait for a step that may never come).
        Returns the change's record (None if nothing waited), which the engine's snapshot reports too."""
        change = self.take()
        if change is None:
            return None
        moved = [] if change.error else engine.swap_core(change.config, *(change.built or ()))
        engine.requested, engine.gpu_memory = self.requested, self.gpu_memory
        engine.last_reconfig = self.record(change, engine.step_count, moved)
        return engine.last_reconfig
