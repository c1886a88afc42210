"""Changing a running engine's configuration: validate, build the new KV pool beside the old one, re-prefill, swap.

LLMEngine runs one resolved configuration; this module is everything about getting from one to the next:
- resolve and build (engine/factory.py's CoreBuilder): the fields left automatic filled, every check that the sizes
  fit together and in the memory free now (every way in passes here: LLM(...), update_config, the page), and the KV
  manager and model runner for a configuration, changing nothing in the engine, so a failure (no memory for the
  pool, a calibration that cannot run) leaves it serving;
- update / take: a change is validated at once (a ValueError leaves everything as it was) and taken at the next
  step boundary, resolved and checked again, with the new pool built beside the old one when its structure
  (STRUCTURAL_FIELDS) changes. The engine carries it out (it frees its running requests' blocks in the old pool and
  requeues them oldest first, to be re-prefilled: nothing in flight is lost; other changes apply in place) and this
  module records what was done. It knows nothing of the engine: what it needs of it comes in as arguments.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .blocks import KVCache
from .config import LOAD_TIME_FIELDS, STRUCTURAL_FIELDS, EngineConfig
from .factory import CoreBuilder, Resolved, kv_bytes_per_block
from .runner import ModelRunner


@dataclass
class Change:
    """The waiting changes, taken at a step boundary: the configuration they make, and the new pool and runner when
    the pool's structure changes (None: they apply in place). `error`: why they cannot be made (nothing changes)."""
    changes: dict
    config: EngineConfig | None = None
    built: tuple[KVCache, ModelRunner] | None = None
    error: str = ""


class Reconfiguration(CoreBuilder):
    """One engine's configuration life: what it asked for, what that resolved to, what waits to apply.
    `pool_bytes`: the bytes the engine's current KV pool holds (0 before it has one), which a GPU's memory profile
    counts as taken."""

    def __init__(self, model, tokenizer, requested: EngineConfig, pool_bytes: Callable[[], int] = lambda: 0) -> None:
        super().__init__(model, tokenizer, pool_bytes)
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

    def resolve(self, config: EngineConfig) -> EngineConfig:
        """CoreBuilder.resolve (every automatic field filled by engine/factory.py, then checked), a new pool checked
        to fit beside the current one."""
        return super().resolve(config, self.current)

    def kv_bytes_per_block(self, config: EngineConfig) -> int:
        return kv_bytes_per_block(config, self.model)

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
