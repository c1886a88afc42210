"""Lessons: the course taught live on the real engine. The content is data (presets/lessons/*.toml, one lesson a
file, in the course's order), which course.py loads and checks; this file runs a lesson on the live engine;
lesson_numbers.py measures its before and after from the engine's own time series; lesson_record.py keeps the
session's record (HTML and JSON).

A lesson run: the engine is set to the lesson's configuration (the defaults, its feature preset and its own fields;
the weights stay as they are unless the lesson names them), its simulated users start, "before" runs for
`before_s`, then the switch flips (on time, or when the presenter presses Flip), "after" runs for `after_s`, and
the numbers of both phases (each phase's first quarter left out: the engine settling) are set side by side with
the direction the lesson expected. Leaving a lesson (Stop, Next, Previous, another lesson) stops its users and
puts the engine back as it was before the lesson began. No gradio here: lessons_tab.py lays it out.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import LOAD_TIME_FIELDS, EngineConfig

from .course import METRICS, Lesson, format_value, from_toml, load_lessons, verdict
from .lesson_numbers import series, window_metrics
from .room import plain

if TYPE_CHECKING:
    from .handlers import Playground

SETTLE = 0.25  # share of each phase left out of its numbers: the engine filling up, or just rebuilt


@dataclass
class LessonRun:
    run_id: int
    lesson: Lesson
    started: float  # wall time the run began (setting up)
    phase: str = "setting up"  # setting up, before, flipping, after, done, stopped, unavailable, failed
    note: str = ""  # the latest line the run has to say (a refusal, a rebuild)
    t_before: float | None = None
    t_flip: float | None = None  # the switch asked to flip
    t_after: float | None = None  # the switch applied (after a rebuild, later than t_flip)
    t_end: float | None = None
    flip_now: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None

    @property
    def active(self) -> bool:
        return self.phase in ("setting up", "before", "flipping", "after")


class LessonRunner:
    """The lessons, and the one run at a time on the page's engine. Every visitor reads it; only the presenter's
    handlers call start / flip / leave (access.py guards them)."""

    def __init__(self, pg: Playground, lessons: list[Lesson] | None = None, seconds: float | None = None,
                 device_type: str | None = None) -> None:
        """`seconds`: every phase this long instead of the lesson's own (a rehearsal, a short workshop, tests)."""
        self.pg = pg
        self.lessons = lessons if lessons is not None else load_lessons()
        self.seconds = seconds
        self.device_type = device_type or pg.llm.engine.model.device.type
        self.run: LessonRun | None = None
        self.records: list[dict] = []  # every finished lesson's numbers, in the order they ran
        self._ids = 0
        self._lock = threading.Lock()  # one start / leave at a time
        self._saved: dict | None = None  # the engine's settings before the lesson: put back on leaving
        self._thread: threading.Thread | None = None

    def index(self, slug: str) -> int:
        for i, lesson in enumerate(self.lessons):
            if lesson.slug == slug:
                return i
        raise ValueError(f"no lesson {slug!r}; lessons: {', '.join(x.slug for x in self.lessons)}")

    def durations(self, lesson: Lesson) -> tuple[float, float]:
        return (self.seconds, self.seconds) if self.seconds else (lesson.before_s, lesson.after_s)

    # ---- the presenter's -------------------------------------------------------------------------------
    def start(self, slug: str) -> str:
        lesson = self.lessons[self.index(slug)]
        with self._lock:
            self._leave()
            if why := self._cannot_run():
                return f"⚠️ Lesson not started: {why}."
            self._ids += 1
            run = LessonRun(self._ids, lesson, time.time())
            self.run = run
            if lesson.needs == "cuda" and self.device_type != "cuda":
                run.phase = "unavailable"
                self.pg.room.note(f"opened the lesson {lesson.title!r}")
                return (f"{lesson.title}: this lesson needs a CUDA GPU and this engine runs on "
                        f"{self.device_type}; the last measured result is shown instead.")
            self._saved = self._current()
            self._thread = threading.Thread(target=self._drive, args=(run,), name=f"lesson-{lesson.slug}",
                                            daemon=True)
            self._thread.start()
        self.pg.room.note(f"started the lesson {lesson.title!r}")
        return f"Started: {lesson.title}."

    def flip(self) -> str:
        run = self.run
        if run is None or run.phase not in ("setting up", "before"):
            return "Nothing to flip: no lesson is in its 'before' phase."
        run.flip_now.set()
        return f"Flipping {run.lesson.describe_switch()} now."

    def leave(self) -> str:
        """Stop the lesson (if one runs) and put the engine back as it was before it."""
        with self._lock:
            run = self.run
            said = self._leave()
        if run is not None:
            self.pg.room.note(f"left the lesson {run.lesson.title!r}")
        return said

    def step(self, offset: int) -> str:
        """Next (+1) or Previous (-1): leave the lesson and start the one beside it."""
        current = self.index(self.run.lesson.slug) if self.run else (-1 if offset > 0 else len(self.lessons))
        target = current + offset
        if not 0 <= target < len(self.lessons):
            return "That was the last lesson." if offset > 0 else "This is the first lesson."
        return self.start(self.lessons[target].slug)

    # ---- inside ----------------------------------------------------------------------------------------
    def _cannot_run(self) -> str | None:
        pg = self.pg
        if pg.remote is not None:
            return f"the page is attached to {plain(pg.remote.url)}: lessons drive this process's engine (detach first)"
        if pg.measurement is not None or pg.rebuilding:
            return pg._busy()
        traffic = pg.traffic.status()
        if traffic is not None and traffic.running:
            return "simulated users are running: stop them on the Dashboard first (a lesson brings its own)"
        return None

    def _current(self) -> dict:
        """The configuration the engine runs once pending changes apply, less what only a new load changes."""
        requested = self.pg.service.config_view().requested
        return {k: v for k, v in requested.items() if k not in ("model", "device")}

    def _leave(self) -> str:
        run, thread = self.run, self._thread
        if run is None:
            return "No lesson is open."
        run.stop.set()
        run.flip_now.set()
        if thread is not None:
            thread.join(timeout=120)
        self._thread = None
        if run.active:
            run.phase = "stopped"
        if self.pg.traffic.status() is not None and self.pg.traffic.status().running:
            self.pg.stop_traffic()
        said = f"Left {run.lesson.title}."
        if self._saved is not None:
            now = self._current()
            back = {k: v for k, v in self._saved.items() if now.get(k) != v}
            self._saved = None
            if back:
                outcome = self.pg._update(back)
                said += (f" The engine is back as it was ({', '.join(back)})." if not outcome.startswith("⚠️")
                         else f" {outcome}")
        self.run = None
        return said

    def _apply(self, run: LessonRun, changes: dict) -> bool:
        changes = {k: self.pg._config_value(k, v) for k, v in from_toml(changes).items()}
        now = self._current()
        changes = {k: v for k, v in changes.items() if now.get(k) != v}
        if not changes:
            return True
        outcome = self.pg._update(changes)
        if outcome.startswith("⚠️"):
            run.phase, run.note = "failed", outcome
            return False
        run.note = outcome
        return True

    def _wait_for_traffic(self, run: LessonRun, since: float, timeout_s: float = 30.0) -> None:
        """Until the engine has stepped on the lesson's traffic, so that the before phase's clock measures an engine
        at work rather than how long its first step took to come (a busy machine; a cold start). Bounded: a lesson
        whose traffic never runs still ends, with no number to show."""
        deadline = time.time() + timeout_s
        while not run.stop.is_set() and time.time() < deadline:
            history = self.pg.service.history
            if history and history[-1].time >= since and history[-1].num_running > 0:
                return
            time.sleep(0.05)

    def _wait(self, run: LessonRun, seconds: float, flip_ends_it: bool = False) -> None:
        deadline = time.time() + seconds
        while not run.stop.is_set() and time.time() < deadline:
            if flip_ends_it and run.flip_now.is_set():
                return
            time.sleep(0.1)

    def _drive(self, run: LessonRun) -> None:
        lesson = run.lesson
        before_s, after_s = self.durations(lesson)
        try:
            # the defaults, but the weights stay as they are unless the lesson names them (a rebuild is slow)
            start = {k: v for k, v in EngineConfig().to_dict().items() if k not in LOAD_TIME_FIELDS}
            start.update(lesson.configuration())
            if not self._apply(run, start) or run.stop.is_set():
                return
            traffic_at = time.time()
            note = self.pg.start_traffic(lesson.workload, lesson.users, before_s + after_s + 60)
            if note:
                run.phase, run.note = "failed", note
                return
            self._wait_for_traffic(run, traffic_at)
            if run.stop.is_set():
                return
            run.phase, run.t_before = "before", time.time()
            self._wait(run, before_s, flip_ends_it=True)
            if run.stop.is_set():
                return
            run.phase, run.t_flip = "flipping", time.time()
            if not self._apply(run, lesson.switch):
                return
            self.pg.room.note(f"lesson {lesson.title!r}: flipped {lesson.describe_switch()}")
            run.phase, run.t_after = "after", time.time()
            self._wait(run, after_s)
            if run.stop.is_set():
                return
            run.t_end = time.time()
            run.result = self.measure(run)
            self.records.append(run.result)
            run.phase = "done"
            self.pg.stop_traffic()
        except Exception as exc:  # noqa: BLE001 - a lesson that breaks says why; the engine carries on
            run.phase, run.note = "failed", f"⚠️ the lesson stopped: {exc}"

    def measure(self, run: LessonRun) -> dict:
        """Before and after, each phase's settled part, from the engine's own history; and the record's chart."""
        history = list(self.pg.service.history)
        b0, b1 = run.t_before, run.t_flip
        a0, a1 = run.t_after, run.t_end
        before = window_metrics(history, b0 + SETTLE * (b1 - b0), b1)
        after = window_metrics(history, a0 + SETTLE * (a1 - a0), a1)
        lesson = run.lesson
        x, y = before[lesson.metric], after[lesson.metric]
        moved = None if x is None or y is None or x == y else ("up" if y > x else "down")
        return {"lesson": lesson.slug, "title": lesson.title, "switch": lesson.switch, "workload": lesson.workload,
                "users": lesson.users, "metric": lesson.metric, "expect": lesson.expect, "moved": moved,
                "as_expected": None if moved is None else moved == lesson.expect,
                "before": before, "after": after, "seconds": {"before": b1 - b0, "after": a1 - a0},
                "flip_at_s": a0 - b0, "started": run.started, "device": self.device_type,
                "precision": self.pg.service.snapshot().precision,
                "chart": series(history, lesson.metric, b0, a1)}

    # ---- what every visitor sees ------------------------------------------------------------------------
    def phase_line(self) -> str:
        run = self.run
        if run is None:
            return "No lesson is running. The presenter starts one; everyone's page follows."
        before_s, after_s = self.durations(run.lesson)
        now = time.time()
        line = {
            "setting up": "setting up the engine for this lesson",
            "before": f"**before** the switch: {now - (run.t_before or now):.0f}/{before_s:.0f} s, then "
                      f"{run.lesson.describe_switch()}",
            "flipping": f"flipping {run.lesson.describe_switch()}",
            "after": f"**after** {run.lesson.describe_switch()}: {now - (run.t_after or now):.0f}/{after_s:.0f} s",
            "done": "done: the numbers below were measured just now, on this engine",
            "stopped": "stopped",
            "unavailable": "not on this machine: below, the last measured result",
            "failed": "could not run",
        }[run.phase]
        return f"Lesson **{plain(run.lesson.title)}**: {line}" + (f"  \n{plain(run.note)}" if run.note else "")

    def result_table(self, result: dict | None) -> str:
        if not result:
            return ""
        rows = ["| | before | after |", "|---|---:|---:|"]
        for name, metric in METRICS.items():
            b, a = result["before"][name], result["after"][name]
            mark = " ◀" if name == result["metric"] else ""
            rows.append(f"| {metric.label}{mark} | {format_value(metric, b)} | {format_value(metric, a)} |")
        return "\n".join(rows) + "\n\n" + verdict(result)
