"""The dashboard's figures, built once per engine step and shared by every open tab (each runs its own timer),
and beside them each chat's live view, one per request per build."""
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


CHARTS = ("blocks", "queues", "prefix", "throughput", "memory")  # its figures, in the order the page refreshes them


@dataclass
class ChatView:
    """What a chat tab shows beside its conversation while its reply streams."""
    request_id: str | None
    blocks: dict  # plotly figure spec: the block table with this request highlighted
    summary: str  # markdown: running / waiting / tokens/s, as of the same snapshot
    # the request is still in the snapshot drawn (figures are rebuilt at most once a second, so the view drawn just
    # after a reply ends may still show it decoding): the tab polls on until a view shows it gone
    in_snapshot: bool = False


def since_rebuild(replaced_at: float | None, now: float | None = None) -> str:
    """How a counter that restarted with a new engine says so (" since the rebuild 12 s ago"; "" for none)."""
    if replaced_at is None:
        return ""
    return f" since the rebuild {max(0.0, (time.time() if now is None else now) - replaced_at):.0f} s ago"


def chat_summary(snapshot, tokens_per_s: float, replaced_at: float | None = None) -> str:
    return (f"step **{snapshot.step}**{since_rebuild(replaced_at)} · running **{snapshot.num_running}** · "
            f"waiting **{snapshot.num_waiting}** · "
            f"**{tokens_per_s:.1f}** tokens/s over the last 10 steps (all requests) · "
            f"KV {snapshot.kv_blocks_used}/{snapshot.kv_blocks_total} blocks")


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
    def __init__(self, history_s: float = 180.0, history_points: int = 300, min_interval_s: float = 0.9) -> None:
        self._lock = threading.Lock()
        self._cached: DashboardFigures | None = None
        self._source = None  # the snapshot the cached figures show
        self._history = None  # and the history (one per engine service) they were drawn from
        self._tokens_per_s = 0.0  # and the generation rate then
        self._views: dict[tuple[str | None, bool], ChatView] = {}  # chat views of the cached snapshot
        self._cells: list[dict] = []  # its block cells, shared by the block table and every chat's view
        self._built_at = 0.0
        self.history_s = history_s  # the time series show this much time (a change and minutes after it)
        self.history_points = history_points  # in at most this many points
        self.min_interval_s = min_interval_s
        self.builds = 0
        self.view_builds = 0

    def get(self, snapshot, history, changes=()) -> DashboardFigures:
        """Figures for this snapshot, rebuilt only for a new one, and at most once per min_interval_s: building holds
        the GIL, and the engine thread needs it to keep streaming. `changes`: ConfigChange records, drawn as markers."""
        with self._lock:
            return self._get(snapshot, history, changes)

    def _get(self, snapshot, history, changes) -> DashboardFigures:
        now = time.monotonic()
        stale = self._cached is None or snapshot is not self._source
        # a new engine (a rebuild or restart brings its own history) is drawn at once, not after the interval
        new_engine = history is not self._history
        if stale and (new_engine or self._cached is None or now - self._built_at >= self.min_interval_s):
            self._built_at, self._history = now, history
            samples = list(history)
            recent = figures.recent_samples(samples, self.history_s, self.history_points)
            marks = list(changes)
            cells = figures.block_cells(snapshot, figures.grid_columns(len(snapshot.block_ref_counts)))
            self._cached = DashboardFigures(
                snapshot.step, figures.block_table_figure(snapshot, cells=cells),
                figures.queues_figure(recent, changes=marks),
                figures.prefix_cache_figure(recent, active=snapshot.features["prefix_caching"].active,
                                            changes=marks),
                figures.throughput_figure(recent, changes=marks),
                figures.memory_figure(snapshot, system_memory()))
            self._source, self._views, self._cells = snapshot, {}, cells
            self._tokens_per_s = figures.recent_tokens_per_s(samples)
            self.builds += 1
        return self._cached

    def chat_view(self, snapshot, history, request_id: str | None, live: bool, changes=(),
                  replaced_at: float | None = None) -> ChatView:
        """The block table with one chat's request highlighted, of the same snapshot as the dashboard's figures:
        built once per (snapshot, request) however many times that chat's tab asks."""
        with self._lock:
            self._get(snapshot, history, changes)
            key = (request_id, live)
            view = self._views.get(key)
            if view is None:
                source = self._source
                view = self._views[key] = ChatView(
                    request_id, figures.highlighted_block_figure(source, request_id, live, self._cells),
                    chat_summary(source, self._tokens_per_s, replaced_at), request_id in source.requests)
                self.view_builds += 1
            return view
