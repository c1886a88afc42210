"""The dashboard's figures, built once per engine step and shared by every open tab.

Each browser tab runs its own timer; without this cache, N tabs would build N copies of every figure.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from . import figures


@dataclass
class DashboardFigures:
    step: int
    blocks: dict  # plotly figure spec
    queues: dict  # plotly figure spec
    prefix: dict  # plotly figure spec
    throughput: dict  # plotly figure spec
    memory: dict  # plotly figure spec


def system_memory() -> dict:
    """GPU memory and utilisation via pynvml when a GPU is present; this process's RSS otherwise."""
    out: dict = {"gpu_used_gb": None, "gpu_total_gb": None, "gpu_util": None, "rss_gb": None, "ram_total_gb": None}
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out.update(gpu_used_gb=mem.used / 2**30, gpu_total_gb=mem.total / 2**30,
                   gpu_util=pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        return out
    except Exception:  # no NVIDIA driver or no pynvml: fall back to CPU memory
        pass
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            out["rss_gb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
        out["ram_total_gb"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        pass
    return out


class FigureCache:
    def __init__(self, history_points: int = 300, min_interval_s: float = 0.9) -> None:
        self._lock = threading.Lock()
        self._cached: DashboardFigures | None = None
        self._built_at = 0.0
        self.history_points = history_points
        self.min_interval_s = min_interval_s
        self.builds = 0

    def get(self, snapshot, history) -> DashboardFigures:
        """Figures for this snapshot, rebuilt only when the engine has stepped since the last build, and at
        most once per min_interval_s: building holds the GIL, and the engine thread needs it to keep streaming."""
        with self._lock:
            now = time.monotonic()
            stale = self._cached is None or self._cached.step != snapshot.step
            if stale and (self._cached is None or now - self._built_at >= self.min_interval_s):
                self._built_at = now
                recent = list(history)[-self.history_points:]
                self._cached = DashboardFigures(
                    snapshot.step, figures.block_table_figure(snapshot), figures.queues_figure(recent),
                    figures.prefix_cache_figure(recent, active=figures.prefix_caching_active(snapshot.config)),
                    figures.throughput_figure(recent),
                    figures.memory_figure(snapshot, system_memory()))
                self.builds += 1
            return self._cached
