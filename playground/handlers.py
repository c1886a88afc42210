"""The playground: the shared state every tab's events work on, one Playground per page (docs/playground.md says
which module holds which job). No gradio layout here; functions return plain values. The live engine runs in an
EngineService thread; measurements build their own engines over the same loaded weights, the live engine paused.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from engine import LLM
from engine.host import EngineLoop, on_its_own_thread
from engine.service import DEFAULT_MAX_WAITING_REQUESTS, EngineService, IterationStats
from engine.workloads import load_workload
from viz.dashboard import DashboardFigures, FigureCache, since_rebuild

from .access import Access, Seats
from .chat import ChatHandlers, FrameRate
from .conversation import WARNING
from .lessons import LESSON_PERIOD_S, PAGE_PERIOD_S, LessonRunner
from .measurements import Measurement, MeasurementHandlers, ablation_store
from .remote import RemoteServer
from .room import Room, plain
from .settings import SettingsHandlers
from .stepmode import describe_step, plural
from .traffic import TrafficGenerator, TrafficStatus
from .watching import Watching


class Playground(Watching, ChatHandlers, SettingsHandlers, MeasurementHandlers):
    local = True  # this process's engine: every tab (a watch-only page, watching.py's Watcher, has none)

    def __init__(self, llm: LLM, store: Path | None = None,
                 max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
                 runner: Callable[[EngineLoop], None] = on_its_own_thread) -> None:
        """`max_waiting_requests`: beyond it a new request (chat, traffic, API) is refused as busy, to retry.
        `runner`: where the live engine's loop runs, this one's and each after a restart (engine/host.py)."""
        self.llm = llm
        self.max_waiting_requests = max_waiting_requests
        self.runner = runner
        # after every step (the metrics endpoint adds them up); the same list goes to the engine after a restart
        self.stat_listeners: list[Callable[[IterationStats], None]] = []
        self.service = self._new_service(llm.engine)
        self.figures = FigureCache()
        self.store = store or ablation_store()
        self._exclusive = threading.Lock()  # one ablation / comparison at a time
        self.measurement: Measurement | None = None  # the one running now, for every tab's status line
        self.replies: deque[str] = deque(maxlen=32)  # final texts of recent chat replies
        self.frames = FrameRate()  # how often each streaming reply reaches its page (chat.py)
        # the live service, even after a restart; none while one is being replaced (the users wait for it)
        self.traffic = TrafficGenerator(lambda: None if self.rebuilding else self.service)
        self.remote: RemoteServer | None = None  # attached: the dashboard and the chat show that server instead
        self.attach_error = ""  # why the last attach failed, for the status line
        self.rebuilding: str | None = None  # what a restart or a rebuild is doing now, for every tab's status line
        self._engine_up = threading.Event()  # cleared while the engine is replaced: a chat sent meanwhile waits
        self._engine_up.set()
        self.room = Room()  # who changed what, for every visitor's status line
        self.access = Access()  # who may change the engine, and who each visitor is (app.launch sets the page's)
        self.seats = Seats()  # the audience's fair shares of the engine (public and token modes)
        self.lessons = LessonRunner(self)  # the course, run live on this engine (presets/lessons/)

    # ---- another server (attach and local_only: watching.py) --------------------------------------------
    def detach(self) -> str:
        remote, self.remote, self.attach_error = self.remote, None, ""
        if remote is None:
            return "Not attached: the page shows the engine in this process."
        remote.stop()
        self.room.note(f"detached the page from {remote.url}")
        return f"Detached from {plain(remote.url)}: the page shows the engine in this process again."

    # ---- dashboard -------------------------------------------------------------------------------------
    def page_period(self) -> float:
        """How often each page asks for news, in seconds: twice a second while a lesson runs, so that every page
        agrees with a change the lesson makes within a second; once otherwise (each tick costs the server and every
        browser something, and the room is many pages)."""
        run = self.lessons.run
        return LESSON_PERIOD_S if run is not None and run.active else PAGE_PERIOD_S

    def dashboard(self) -> DashboardFigures:
        if (remote := self.remote) is not None:
            return remote.figures()
        return self.figures.get(self.service.snapshot(), self.service.history, self.service.config_changes)

    def status(self, presenter: bool = False) -> str:
        """The status line every tab shows (`presenter`: the one who may see what a remote server said)."""
        if (remote := self.remote) is not None:
            return remote.status(presenter)
        snap = self.service.snapshot()
        measuring = self.measurement
        state = (f"⟳ {self.rebuilding}" if self.rebuilding else
                 "⛔ engine thread stopped: " + self.service.error if self.service.error else
                 f"⏸ paused for a measurement ({measuring.describe()})" if measuring else
                 "⏸ paused (step mode)" if self.service.paused else "▶ running")
        traffic = self.traffic.status()
        users = (f" · traffic: {traffic.num_users} users, " + (f"{traffic.elapsed_s:.0f}/{traffic.duration_s:.0f} s"
                 if traffic.duration_s else "each once") + f", {traffic.requests_done} done"
                 if traffic is not None and traffic.running else "")
        kernel = snap.kernels.get("weights_kernel")
        shared = snap.kernels.get("threads", "")  # said only when another process has taken a core from it
        kernel = (kernel or "") + (f" on {shared}" if "other thread" in shared else "")
        return (f"**{state}** · {snap.precision}" + (f" · {kernel}" if kernel else "")
                + f" · steps done{since_rebuild(self.service.replaced_at)}: {snap.step} · running {snap.num_running} · "
                f"waiting {snap.num_waiting} · preemptions {snap.num_preemptions} · "
                f"KV {snap.kv_blocks_used}/{snap.kv_blocks_total} blocks · "
                f"prefix hits {snap.prefix_cache_hits}/{snap.prefix_cache_queries} tokens · "
                f"generated {plural(snap.generation_tokens_total, 'token')}{users}"
                + (f" · {WARNING} {self.attach_error}" if self.attach_error else "") + self.room_line())

    def _busy(self) -> str:
        running = self.measurement
        return (f"a measurement is running ({running.describe()})" if running else
                f"the engine is being rebuilt ({self.rebuilding})" if self.rebuilding else "a measurement is starting")

    def _new_service(self, engine, follows: EngineService | None = None) -> EngineService:
        return EngineService(engine, max_waiting_requests=self.max_waiting_requests,
                             stat_listeners=self.stat_listeners, follows=follows, runner=self.runner)

    # ---- traffic generator -----------------------------------------------------------------------------
    def start_traffic(self, workload_name: str, num_users: int, duration_s: float = 0.0, scale: float = 1.0,
                      who: str = "presenter") -> str:
        """N simulated users sending the workload's requests for duration_s (0: each once), in the background;
        `scale`: their replies' lengths, as a share of the workload's (a lesson on a slow machine shortens them).
        `who`: whom the room is told started them. Returns "" when started, or why not."""
        if note := self.local_only("The traffic generator (it loads this process's engine)"):
            return note
        try:
            workload = load_workload(workload_name).tokenized(self.llm.tokenizer)
            requests = workload.requests if scale >= 1 else [
                dataclasses.replace(r, params=dataclasses.replace(
                    r.params, max_tokens=max(4, round(r.params.max_tokens * scale)))) for r in workload.requests]
            self.traffic.start(workload.name, requests, int(num_users), float(duration_s or 0))
        except ValueError as exc:
            return f"⚠️ {exc}"
        self.room.note(f"started {plural(int(num_users), 'simulated user')} ({workload.name})", who)
        return ""

    def stop_traffic(self, who: str = "presenter") -> str:
        if not self.traffic.stop():
            return "No traffic is running."
        self.room.note("stopped the simulated users", who)
        status = self.traffic.wait(timeout=10)
        return status.describe() if status else ""

    def watch_traffic(self, every_s: float = 1.0) -> Iterator[TrafficStatus]:
        """The run's status now, then every `every_s` until it ends (the last one says "done")."""
        while True:
            status = self.traffic.status()
            if status is None:
                return
            yield status
            if not status.running:
                return
            time.sleep(every_s)

    # ---- step mode ---------------------------------------------------------------------------------------
    def pause(self) -> str:
        if note := self.local_only("Step mode"):
            return note
        self.service.pause()
        self.room.note("paused the engine (step mode)")
        return "Paused: the engine waits. Press Step to run exactly one step."

    def resume(self) -> str:
        if note := self.local_only("Step mode"):
            return note
        self.service.resume()
        self.room.note("resumed the engine")
        return "Running."

    def step(self) -> str:
        if note := self.local_only("Step mode"):
            return note
        if not self.service.paused:
            self.service.pause()
        snap = self.service.step_once()
        return describe_step(snap, self.llm.tokenizer)
