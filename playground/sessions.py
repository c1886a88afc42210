"""gradio's per-session state, made cheap to open: one place that adjusts gradio's internals for a shared page.

gradio opens a SessionState for every new session hash it sees, and its constructor computes every component's
configuration (docs/measurements.md, "One engine, many people", has its cost). A client that sends a
fresh session hash with every call (the hostile suite's flooder) had the server do that a few times a second, each
time holding the lock the engine's step and every page's stream need. The copy is only read whole for a deep link
(which this page does not offer) and one entry at a time when an event updates a component, so it is computed per
component when first asked. Applied only to the gradio release whose constructor it replaces (checked by its
source), so a gradio upgrade falls back to gradio's own behaviour rather than to a wrong one.
"""
from __future__ import annotations

import hashlib
import inspect
import os
from copy import copy

KNOWN_INIT = "1b2ea21dc42c45da"  # sha256 of gradio 6's SessionState.__init__ source, first 16 hex digits
gradio_init = None  # gradio's own constructor, once replaced


class LazyConfigs(dict):
    """gradio's `config_values`: a component's configuration computed when first asked for, all of them (in the
    page's order, as gradio's own dict has them) when all are read."""

    def __init__(self, config, ids) -> None:
        super().__init__()
        self._config, self._order = config, tuple(ids)
        self._ids = frozenset(self._order)

    def _compute(self, key):
        value = self._config.config_for_block(key, [], self._config.blocks[key])
        dict.__setitem__(self, key, value)
        return value

    def __missing__(self, key):
        if key in self._ids:
            return self._compute(key)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or key in self._ids

    def keys(self) -> list:
        return list(self._order) + [k for k in dict.keys(self) if k not in self._ids]

    def items(self) -> list:
        return [(k, self[k]) for k in self.keys()]

    def values(self) -> list:
        return [self[k] for k in self.keys()]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())


def _light_init(self, blocks) -> None:
    """gradio 6's SessionState.__init__, with the components' configurations computed lazily."""
    self.blocks_config = copy(blocks.default_config)
    self.config_values = LazyConfigs(self.blocks_config, [k for k in self.blocks_config.blocks if k in blocks.blocks])
    self.state_data = {}
    self._state_ttl = {}
    self.is_closed = False
    self.STATE_TTL_WHEN_CLOSED = 1 if os.getenv("GRADIO_IS_E2E_TEST", None) else 3600


def lighten_sessions() -> bool:
    """Open gradio's sessions lazily (see the module's docstring); False where this gradio is not the one checked."""
    global gradio_init
    from gradio import state_holder
    cls = state_holder.SessionState
    if cls.__init__ is _light_init:
        return True
    source = inspect.getsource(cls.__init__)
    if hashlib.sha256(source.encode()).hexdigest()[:16] != KNOWN_INIT:
        return False
    gradio_init, cls.__init__ = cls.__init__, _light_init
    return True
