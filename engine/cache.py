"""Where the engine keeps what it makes once and reuses (converted checkpoints, calibration scales, the compiled
C++ kernels, kernel timings), in one module so that no user of it reaches into another for it. WATCHLLM_CACHE
names the folder; else $XDG_CACHE_HOME/watch-llm (~/.cache/watch-llm)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("WATCHLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "watch-llm")
    return Path(root)
